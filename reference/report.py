"""The account of a demo run both demos print: what a store holds (:func:`store_view`), the work a
checkpoint-only recovery would lose (:func:`work_after_checkpoint`), the exactly-once audit of every
prompt (:func:`audit`), the reward curve of the model that survived (:func:`learning`,
:func:`plot_learning_curve`) and the recovery report (:func:`render`).

:mod:`kvckpt.reference.demo` (the reference-trainer demo) and
:mod:`kvckpt.reference.model_free_demo` (``kvckpt demo --no-model``) both report in the
shape :func:`render` reads; the model-free one has no learning curve (``learning`` is ``None``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvckpt import ABORTED, CONSUMED, EVICTED, ReplayBuffer


# -- reading the stores ---------------------------------------------------------------------------
def store_view(path: str) -> dict[str, Any]:
    """A store's group records, ledger, state, dataloader cursor and the durable token progress
    of every prompt in flight (``progress_tokens``: samples with progress, and their tokens), read-only."""
    with ReplayBuffer.open(path, readonly=True) as buf:
        dl = buf.dataloader_state()
        ledger = buf.ledger()
        prefixes = [p for e in ledger for p in buf.progress(e.group_id).values()]
        return {"groups": buf.groups(), "ledger": ledger, "state": buf.state(),
                "cursor": json.loads(dl)["cursor"] if dl else 0,
                "progress_tokens": {"samples": len(prefixes), "tokens": sum(p.length for p in prefixes)}}


def token_account(crash_point: dict[str, Any], source: dict[str, Any], resumed_run: dict[str, Any],
                  every_tokens: int, max_tokens: int) -> dict[str, Any]:
    """The generation work in flight at the kill, in tokens: ``inflight_at_kill`` (generated for
    uncommitted completions, as the workers last reported them before the SIGKILL), the fewest and
    most any of them had (``generated_range``, of ``max_tokens`` each), ``durable_at_kill`` (their
    durable progress in the store the run resumed from), ``resumed`` (what the resumed run's
    workers continued from instead of regenerating), ``regenerated`` (in flight but lost: generated
    again), ``completion_level_regenerated`` (what recovering whole completions would regenerate:
    everything in flight), and whether ``regenerated`` stays within one progress interval
    (``every_tokens``) per in-flight sequence."""
    inflight = int(crash_point.get("inflight_tokens", 0))
    sequences = int(crash_point.get("inflight_sequences", 0))
    generated = [int(g) for g, _ in crash_point.get("sequences", [])]
    resumed = int(resumed_run.get("tokens_resumed", 0))
    regenerated = max(0, inflight - resumed)
    return {"inflight_at_kill": inflight, "inflight_sequences": sequences,
            "generated_range": [min(generated), max(generated)] if generated else None, "max_tokens": max_tokens,
            "durable_at_kill": source["progress_tokens"]["tokens"], "resumed": resumed,
            "regenerated": regenerated, "completion_level_regenerated": inflight,
            "progress_every_tokens": every_tokens, "within_bound": regenerated <= every_tokens * sequences}


def work_after_checkpoint(live: dict[str, Any], ckpt: dict[str, Any] | None) -> dict[str, Any]:
    """Groups the live store committed after the checkpoint (a checkpoint-only recovery regenerates
    them) and the prompts admitted after it (re-admitted by the rewound dataloader)."""
    old = {g.group_id for g in ckpt["groups"]} if ckpt else set()
    new = [g for g in live["groups"] if g.group_id not in old and g.state not in (EVICTED, ABORTED)]
    return {"groups": len(new), "group_ids": [g.group_id for g in new], "rows": sum(g.group_size for g in new),
            "raw_bytes": sum(g.raw_bytes for g in new),
            "prompts_admitted": live["cursor"] - (ckpt["cursor"] if ckpt else 0)}


def audit(path: str) -> dict[str, Any]:
    """Every prompt the dataloader served (``0..cursor``) accounted for exactly once in the store:
    trained once (one consumed group), discarded by the sampler (evicted/aborted), still buffered
    or in flight; ``lost`` (no record) and ``doubled`` (several records) must be empty."""
    view = store_view(path)
    records = Counter(g.prompt_idx for g in view["groups"]) + Counter(e.prompt_idx for e in view["ledger"])
    states = Counter(g.state for g in view["groups"])
    cursor = view["cursor"]
    consumed = [g.prompt_idx for g in view["groups"] if g.state == CONSUMED]
    return {"prompts": cursor, "trained_once": sum(1 for c in Counter(consumed).values() if c == 1),
            "discarded": states[EVICTED] + states[ABORTED],
            "pending": cursor - len(consumed) - states[EVICTED] - states[ABORTED],
            "lost": [p for p in range(cursor) if records[p] == 0],
            "doubled": sorted(p for p, c in records.items() if c > 1),
            "trained_by_step": _by_step(view["groups"])}


def _by_step(groups: Sequence[Any]) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for g in groups:
        if g.state == CONSUMED:
            steps.setdefault(g.consumed_step, []).append(g.prompt_idx)
    return {k: sorted(v) for k, v in sorted(steps.items())}


# -- the reward curve -----------------------------------------------------------------------------
def reward_trend(rewards: Sequence[float], window: int = 10) -> dict[str, Any]:
    """The least-squares line through one reward per step, and the means of the first and last
    ``window`` steps.

    ``slope`` is the fitted change per step (``intercept`` the fitted value at step 0); ``t`` is
    the slope over its standard error (``|t| > 3``: a trend that noise around a flat line
    practically never makes); ``None`` where undefined (under 3 steps, or every point on the line).
    """
    n, k = len(rewards), min(window, len(rewards))
    doc: dict[str, Any] = {"steps": n, "window": k, "slope": None, "intercept": None, "t": None,
                           "first_mean": sum(rewards[:k]) / k if k else None,
                           "last_mean": sum(rewards[-k:]) / k if k else None}
    if n < 3:
        return doc
    mx, my = (n - 1) / 2, sum(rewards) / n
    sxx = sum((x - mx) ** 2 for x in range(n))
    slope = sum((x - mx) * (y - my) for x, y in enumerate(rewards)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in enumerate(rewards))
    se = (residual / (n - 2) / sxx) ** 0.5
    doc.update(slope=slope, intercept=my - slope * mx, t=slope / se if se > 0 else None)
    return doc


def learning(metrics: Sequence[dict[str, Any]], first_run_lines: int, resume_step: int,
             window: int = 10) -> dict[str, Any]:
    """The reward curve of the model that survived: run 1's steps before the checkpoint it resumed
    from, then run 2's (run 1's steps after that checkpoint died with its process). Its
    :func:`reward_trend` (with the ``curve`` itself), and the mean of the ``window`` steps before
    the checkpoint and after the resume, with their step ranges (a resumed run continues the
    curve when they are close)."""
    before = [m["reward_mean"] for m in metrics[:first_run_lines] if m["step"] < resume_step]
    after = [m["reward_mean"] for m in metrics[first_run_lines:]]
    k_before, k_after = min(window, len(before)), min(window, len(after))
    return {**reward_trend(before + after, window), "curve": before + after,
            "before_checkpoint_steps": [resume_step - k_before, resume_step - 1],
            "before_checkpoint_mean": sum(before[-k_before:]) / k_before if k_before else None,
            "after_resume_steps": [resume_step, resume_step + k_after - 1],
            "after_resume_mean": sum(after[:k_after]) / k_after if k_after else None}


def plot_learning_curve(metrics: Sequence[dict[str, Any]], first_run_lines: int, crash_step: int,
                        resume_step: int, path: str, trend: dict[str, Any] | None = None,
                        tokens: dict[str, Any] | None = None) -> str | None:
    """Mean reward per step of both runs, the crash and the retrained steps marked, and the
    fitted line of ``trend`` (see :func:`learning`) over steps ``0..trend["steps"]-1``; with
    ``tokens`` (see :func:`token_account`), a second panel: the tokens in flight at the kill that
    recovery kept (resumed) and regenerated, beside what a completion-level recovery regenerates.
    Returns ``path``, or ``None`` (nothing drawn) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if tokens:
        fig, (ax, bars) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2, 1]})
        _plot_tokens(bars, tokens)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.2))
    for rows, label, color in ((metrics[:first_run_lines], "run 1 (killed)", "tab:blue"),
                               (metrics[first_run_lines:], "run 2 (resumed)", "tab:orange")):
        ax.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], "o-", ms=3, label=label, color=color)
    if trend and trend["slope"] is not None:
        curve, k = trend["curve"], trend["window"]
        ax.plot(range(k - 1, len(curve)), [sum(curve[i - k + 1:i + 1]) / k for i in range(k - 1, len(curve))],
                color="black", lw=2, alpha=0.6, label=f"mean of the last {k} kept steps")
        xs = [0, trend["steps"] - 1]
        t_text = "" if trend["t"] is None else f", t = {trend['t']:.1f}"
        ax.plot(xs, [trend["intercept"] + trend["slope"] * x for x in xs], "k--", lw=1.2,
                label=f"linear fit of the kept steps: {trend['slope']:+.4f}/step{t_text}")
    ax.axvline(crash_step, color="tab:red", ls="--", label=f"SIGKILL (mid-step {crash_step})")
    ax.axvspan(resume_step - 0.5, crash_step - 0.5, color="grey", alpha=0.15,
               label=f"trained again from checkpoint step_{resume_step}")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward (share of right answers)")
    ax.set_title("kvckpt demo: GRPO across a SIGKILL")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_tokens(ax: Any, tokens: dict[str, Any]) -> None:
    """Two stacked bars of the tokens in flight at the kill: kept and regenerated, by token
    progress (this run) and by a completion-level recovery."""
    rows = ("token progress\n(this run)", "completion-level\nrecovery")
    kept = (tokens["resumed"], 0)
    lost = (tokens["regenerated"], tokens["completion_level_regenerated"])
    ax.barh(rows, kept, color="tab:green", label="kept (resumed from durable progress)")
    ax.barh(rows, lost, left=kept, color="tab:red", label="regenerated")
    for y, (k, r) in enumerate(zip(kept, lost, strict=True)):
        ax.text(k + r, y, f" {k} kept, {r} regenerated", va="center", fontsize=8)
    ax.set_xlim(0, tokens["inflight_at_kill"] * 1.9)
    ax.invert_yaxis()
    ax.set_xlabel("tokens")
    ax.set_title(f"{tokens['inflight_at_kill']} tokens in flight at the kill\n({tokens['inflight_sequences']} "
                 f"completions, durable every {tokens['progress_every_tokens']} tokens)", fontsize=10)
    ax.legend(loc="center right", fontsize=8)


# -- the report -----------------------------------------------------------------------------------
def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def render(doc: dict[str, Any]) -> list[str]:
    """The report a person reads at a glance, as lines: of this demo's :func:`run_demo`, or of the
    model-free one's (:func:`kvckpt.reference.model_free_demo.run_demo`, ``backend``
    ``"model-free"``), which reports in the same shape."""
    run, rec, check, fin = doc["run"], doc["recovery"], doc["check"], doc["finish"]
    work, kill = rec["work_after_checkpoint"], run["at_kill"]
    ids = [str(p["prompt_idx"]) for p in rec["prompts_redispatched"]]
    committed = f"{work['groups']} groups ({work['rows']} completions, {_size(work['raw_bytes'])})"
    if rec["mode"] == "live":
        lost = [f"0 completions: the {committed} committed after step_{run['checkpoint_step']} were reused",
                f"({rec['groups_after_checkpoint_recommitted']} regenerated); a checkpoint-only recovery would "
                f"regenerate all {work['rows']}"]
    else:
        lost = [f"{rec['work_lost']['rows']} completions: the {committed} committed after "
                f"step_{run['checkpoint_step']}", f"are regenerated; {work['prompts_admitted']} prompts re-admitted"]
    first = rec["time_to_first_batch_seconds"]
    recover_ms = rec.get("recover_seconds", 0) * 1000
    model_free = doc["backend"] == "model-free"
    if first is None:
        first_text = "-"
    elif model_free:  # in-process: the restart is the recovery itself
        first_text = f"{first * 1000:.0f} ms after the restart (recover {recover_ms:.0f} ms)"
    else:
        first_text = f"{first:.1f} s after the restart (process start, model load, recover {recover_ms:.0f} ms)"
    partial = f" ({kill['partial']} with finished siblings)" if "partial" in kill else ""
    pairs = [
        ("run", f"{'model-free producer/consumer' if model_free else doc['backend'] + ' GRPO'}, sampler "
                f"{doc['sampler']}, {run['groups_per_step']} prompts x {run['group_size']} completions per step, "
                f"{run['steps']} steps"),
        ("at the kill", f"mid-step {run['killed_mid_step']}: {kill['claimed']} groups claimed, {kill['ready']} "
                        f"buffered, {kill['inflight']} rollouts in flight{partial}"),
        ("resumed from", f"step_{rec['resume_step']} + " + ("the live store" if rec["mode"] == "live"
                                                             else "its buffer file")),
        ("groups restored", f"{rec['groups_complete_restored']} ready ({rec['groups_returned_to_ready']} claimed or "
                            f"consumed at steps >= {rec['resume_step']} returned to ready)"),
        ("prompts redispatched", f"{len(ids)}" + (f": prompt_idx {', '.join(ids)}" if ids else "")),
        ("siblings reused", f"{rec['siblings_reused']} rows ({rec['siblings_rerun']} left to generate)"),
        *(_token_lines(rec["tokens"]) if rec.get("tokens") else []),
        ("generation work lost", lost[0]), ("", lost[1]),
        ("time to first batch", first_text),
        ("finished", f"to step {fin['final_step']} ({fin['steps_trained']} steps after the resume)"),
        *(_learning_lines(doc["learning"]) if doc["learning"] else []),
        ("exactly once", f"{check['prompts']} prompts served: {check['trained_once']} trained once, "
                         f"{check['discarded']} discarded by the sampler, {check['pending']} buffered, "
                         f"{len(check['lost'])} lost, {len(check['doubled'])} doubled"),
        ("final store", "verifies clean" if check["verify_ok"] else "; ".join(check["verify_problems"])),
    ]
    if check.get("model_agrees") is False:
        pairs.append(("saved model", "DISAGREES with the store about which prompts each step trained"))
    if not model_free:
        pairs.append(("learning curve", doc["learning_curve"] or "not drawn: matplotlib is not installed "
                                                                 "(pip install matplotlib)"))
    width = max(len(k) for k, _ in pairs)
    lines = ["", "recovery report", *[f"  {k:<{width}}  {v}" for k, v in pairs]]
    lines += ["", f"result: {'ok' if doc['ok'] else 'FAILED'}"]
    if doc.get("out"):
        lines.append(f"  files kept in {doc['out']}" + ("" if doc.get("kept", "all") == "all"
                                                       else f" ({doc['kept']}; --out DIR keeps them all)"))
    return lines


def _token_lines(tokens: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's lines on the tokens in flight at the kill (see :func:`token_account`)."""
    bound = tokens["progress_every_tokens"] * tokens["inflight_sequences"]
    span = tokens.get("generated_range")
    each = f" ({span[0]}-{span[1]} of {tokens['max_tokens']} tokens each)" if span else ""
    return [("tokens in flight", f"{tokens['inflight_at_kill']} generated for {tokens['inflight_sequences']} "
                                 f"uncommitted completions at the kill{each}, {tokens['durable_at_kill']} of them "
                                 "durable"),
            ("tokens resumed", f"{tokens['resumed']} (continued from durable progress, not regenerated)"),
            ("tokens regenerated", f"{tokens['regenerated']} (bound: {tokens['progress_every_tokens']} per in-flight "
                                   f"sequence = {bound}; {'within' if tokens['within_bound'] else 'OVER'} it); "
                                   f"a completion-level recovery would regenerate "
                                   f"{tokens['completion_level_regenerated']}")]


def _learning_lines(curve: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's lines on the reward curve of the model that survived (see :func:`learning`)."""
    if curve["slope"] is None:
        return [("mean reward", f"{curve['steps']} steps: too few for a trend")]
    t = "-" if curve["t"] is None else f"{curve['t']:.1f}"
    k = curve["window"]
    return [("mean reward", f"{curve['first_mean']:.2f} (first {k} steps) -> {curve['last_mean']:.2f} (last {k}); "
                            f"linear trend {curve['slope']:+.4f}/step, t = {t}, over {curve['steps']} steps"),
            ("", "the resume continues it: {:.2f} over steps {}-{} (before the checkpoint), {:.2f} over steps {}-{} "
                 "(after the resume)".format(curve["before_checkpoint_mean"], *curve["before_checkpoint_steps"],
                                             curve["after_resume_mean"], *curve["after_resume_steps"]))]
