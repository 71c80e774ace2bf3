"""The demo (``kvckpt demo``): the reference GRPO trainer, SIGKILLed mid-step, resumed, audited.

1. **Run.** A child process trains the reference async GRPO setup (tiny model, addition task
   whose completions write the sum 32 times: 64 tokens, durable every 16; transformers or vLLM
   generation, two rollout workers) on a kvckpt live store, checkpointing every few steps.
2. **Crash.** Mid-step (its groups claimed), with groups buffered and rollouts in flight — one
   of them parked by a test hook 40 tokens into its completions, so the crash always finds long
   completions mid-way — the parent SIGKILLs the child.
3. **Resume** in a new child process, from the live store (``recovery="live"``: nothing generated
   is lost) or from the checkpoint file (``"checkpoint"``: work after it is regenerated), and
   train to the end.
4. **Report** what recovery restored, redispatched and reused, the generation work lost (and what
   a checkpoint-only recovery loses), the tokens in flight at the kill (durable, resumed,
   regenerated), the time to the first batch after the restart, an exactly-once audit of every
   prompt over both runs, and a PNG: the learning curve beside the tokens kept and regenerated.

The children run :func:`child_main` (``python -m kvckpt.reference.demo child ...``),
whose :class:`DemoHooks` are the trainer's test-only hooks (:mod:`.faults`), passed in by the
parent on the command line, never through environment variables. tests/trainer/test_functional_recovery.py
drives the same children.

Why this module is long (about 500 lines): it is the whole demo, the parent (:func:`run_demo`) and
its children (:class:`DemoHooks`, :func:`child_main`, the events protocol of :func:`spawn_child` and
:func:`wait_event`); the account of the run it prints is :mod:`.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvckpt.reference.faults import Hooks, ParkRollout
from kvckpt.reference.report import (
    audit,
    learning,
    plot_learning_curve,
    store_view,
    token_account,
    work_after_checkpoint,
)

from kvckpt import Lease, verify_path
from kvckpt.errors import BadArgument, KvckptError, LeaseError

logger = logging.getLogger(__name__)

SAMPLERS = {
    "in_order": {"name": "in_order", "max_lookahead_versions": 1},
    "weight_fifo": {"name": "weight_fifo", "max_staleness_versions": 1},
    "windowed": {"name": "windowed", "max_staleness_versions": 1},
    "ready_first": {"name": "ready_first", "max_staleness_versions": 1},
}
RECOVERY_MODES = ("live", "checkpoint")
BACKENDS = ("transformers", "vllm")
#: The two sizes: steps, groups per step, completions per group, checkpoint period, crash step, and
#: the learning set-up: supervised warm-up steps and learning rate, the task's largest operand and
#: how many times a completion writes the sum, Adam's learning rate. A warm-up of 60 steps on the
#: 25 sums of 0..4, each written 32 times (64-token completions), leaves the policy right about
#: 40% of the time, so GRPO has both signal (groups with right and wrong answers) and room to improve.
#: A step's mean reward is mostly which prompts it drew (a prompt's completions tend to agree: all
#: right or all wrong), so the full run trains 16 prompts of 4 completions per step. Five runs of
#: 4 x 8 gave t = 2.6 to 4.9 over 60 steps and five of 8 x 4 (the same 32 completions) 2.1 to 5.8:
#: not above 3 in every run. 16 x 4 costs about 1.7x the CPU of 4 x 8 (docs/cli.md has the runs).
PRESETS = {
    "full": {"steps": 60, "groups_per_step": 16, "group_size": 4, "every_steps": 20, "crash_step": 47,
             "sft_steps": 60, "sft_lr": 2e-3, "max_operand": 4, "repeat": 32, "lr": 4e-4},
    "fast": {"steps": 12, "groups_per_step": 4, "group_size": 8, "every_steps": 5, "crash_step": 8,
             "sft_steps": 60, "sft_lr": 2e-3, "max_operand": 4, "repeat": 32, "lr": 4e-4},
}
PARK_WAIT_SECONDS = 60.0
#: The demo's progress interval: every sequence's new tokens are made durable every 16 tokens of
#: its 64 (a long-reasoning run would use hundreds: the worker's default is 256).
PROGRESS_EVERY_TOKENS = 16
#: The transformers engine's step (tokens between two progress checks; vLLM's is one token): half
#: the interval, so an engine step can end between two durable appends and the kill find tokens
#: past the last one, which recovery regenerates.
ENGINE_STEP_TOKENS = 8
#: The kill lands when the parked rollout's completions have this many of their 64 tokens: mid-way.
PARK_AFTER_TOKENS = 40


class DemoFailed(KvckptError):
    """A training process of the demo ended before it should have; the message carries the last
    line of its stderr and the path of the whole file (kept)."""


class ParkedCommitDropped(LeaseError):
    """The parked commit of a run that stopped meanwhile: refused, nothing written (as if its
    worker had died with the process)."""


class DemoHooks(Hooks):
    """The demo's (and the functional test's) fault injection, one event log line per fact.

    Args:
        events: a JSON-lines file this process appends ``{"event": ...}`` records to: ``commit``
            (each successful commit: prompt_idx, group_id, attempt), ``parked`` (the parked lease),
            ``first-batch`` (the first selection, with ``time.time()``), ``crash-point``.
        park_prompt: park the first lease with ``prompt_idx >=`` this: block before committing it
            (``park_at="commit"``) or after the first engine step that made some of its tokens
            durable and brought its completions to ``park_tokens`` tokens (``"generation"``: the
            kill then finds its completions mid-generation).
        crash_step: at ``after_select`` of this step, wait for the park (up to
            :data:`PARK_WAIT_SECONDS`), log ``crash-point`` and wait to be SIGKILLed by the parent
            (or kill this process itself if the parent is gone).
        stop_step: at ``after_finish_step`` of this step, wait for the park and then set the
            trainer's time limit to 0: the run ends with its final checkpoint taken while the
            rollout is parked; the parked commit is then refused (:class:`ParkedCommitDropped`).
        park_tokens: with ``park_at="generation"``, how many tokens the parked lease's longest
            completion has when it parks. Defaults to 1 (right after its first durable tokens).
    """

    def __init__(self, events: str, *, park_prompt: int | None = None, crash_step: int | None = None,
                 stop_step: int | None = None, park_at: str = "commit", park_tokens: int = 1) -> None:
        if park_at not in ("commit", "generation"):
            raise BadArgument(f"park_at must be 'commit' or 'generation', got {park_at!r}")
        self.events, self.crash_step, self.stop_step = events, crash_step, stop_step
        self.park_prompt, self.park_at, self.park_tokens = park_prompt, park_at, park_tokens
        #: (group id, row index) -> [tokens generated, tokens durable] of every uncommitted sample,
        #: as the streaming workers last reported them.
        self.generating: dict[tuple[str, int], list[int]] = {}
        self.park = ParkRollout()
        self.trainer: Any = None
        self._lock = threading.Lock()
        self._selected = False
        self._stopping = False
        self._crashing = False
        self._parent = os.getppid()

    def log(self, event: str, **fields: Any) -> None:
        """Append one event line (one ``write``: it survives a SIGKILL right after), then ring the
        parent's doorbell (a byte on stdout, which :func:`spawn_child` makes a pipe) so that
        :func:`wait_event` wakes up at once."""
        line = json.dumps({"event": event, "time": time.time(), **fields}) + "\n"
        with self._lock:
            fd = os.open(self.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
            with contextlib.suppress(OSError):  # no parent listening (stdout closed or not a pipe)
                os.write(sys.stdout.fileno(), b"\n")

    def before_commit(self, lease: Lease) -> None:
        self._freeze_if_crashing()
        if self.park_at == "commit" and self._parks(lease):
            self._park(lease)

    def after_generation_step(self, states: Sequence[Any]) -> None:
        with self._lock:  # before freezing: a step's appends are durable, so its tokens count
            for s in states:
                self.generating[(s.lease.group_id, s.index)] = [s.generated, s.durable]
        self._freeze_if_crashing()
        if self.park_at != "generation":
            return
        for lease in {s.lease.group_id: s.lease for s in states}.values():
            # mid-way: some of the lease's tokens durable, its completions park_tokens long, the rest to come
            mine = [s for s in states if s.lease.group_id == lease.group_id]
            midway = any(s.durable for s in mine) and max(s.generated for s in mine) >= self.park_tokens
            if self._parks(lease) and midway:
                self._park(lease)

    def _parks(self, lease: Lease) -> bool:
        return not (self.park_prompt is None or lease.prompt_idx < self.park_prompt or self.park.parked.is_set())

    def _park(self, lease: Lease) -> None:
        self.log("parked", prompt_idx=lease.prompt_idx, group_id=lease.group_id, attempt=lease.attempt,
                 target_step=lease.target_step)
        if self.crash_step is not None:
            threading.Thread(target=self._watchdog, name="demo-watchdog", daemon=True).start()
        self.park.before_commit(lease)
        raise ParkedCommitDropped(f"{lease.group_id}: the run stopped while its commit was parked")

    def _freeze_if_crashing(self) -> None:
        """Past the crash point, no worker generates or commits more (the SIGKILL is coming): the
        in-flight tokens logged with ``crash-point`` are what the kill finds."""
        while self._crashing:
            time.sleep(0.2)

    def _crash(self, step: int | None) -> None:
        with self._lock:
            first, self._crashing = not self._crashing, True
            sequences = sorted(self.generating.values())
        if first:
            self.log("crash-point", step=step, inflight_tokens=sum(g for g, _ in sequences),
                     durable_tokens=sum(d for _, d in sequences), inflight_sequences=len(sequences),
                     sequences=sequences)
        while os.getppid() == self._parent:  # the parent SIGKILLs this process now
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    def _watchdog(self) -> None:
        """A sampler that discarded groups the crash step needed starves the trainer while the
        rollout is parked: crash anyway (``step: null``) after :data:`PARK_WAIT_SECONDS`."""
        time.sleep(PARK_WAIT_SECONDS)
        self._crash(None)

    def at(self, point: str, **info: Any) -> None:
        if point == "after_commit":
            for lease, result in zip(info["leases"], info["results"], strict=True):
                with self._lock:
                    for index in lease.missing:
                        self.generating.pop((lease.group_id, index), None)
                if not isinstance(result, BaseException):
                    self.log("commit", prompt_idx=lease.prompt_idx, group_id=lease.group_id, attempt=lease.attempt)
        elif point == "after_select":
            if not self._selected:
                self._selected = True
                self.log("first-batch", step=info["step"])
            if info["step"] == self.crash_step:
                self.park.parked.wait(PARK_WAIT_SECONDS)
                self._crash(info["step"])
        elif point == "after_finish_step" and info["step"] == self.stop_step:
            self.park.parked.wait(PARK_WAIT_SECONDS)
            self._stopping = True
            self.trainer.config.train.time_limit_seconds = 0.0
        elif point == "after_checkpoint" and self._stopping:
            self.log("stopped", step=info["step"])
            self.park.release()


# -- child processes ------------------------------------------------------------------------------
def child_main(argv: Sequence[str]) -> int:
    """One training process: the trainer with :class:`DemoHooks`; writes its summary as JSON."""
    parser = argparse.ArgumentParser(prog="kvckpt.reference.demo child")
    parser.add_argument("config")
    parser.add_argument("events")
    parser.add_argument("--summary")
    parser.add_argument("--park-prompt", type=int)
    parser.add_argument("--crash-step", type=int)
    parser.add_argument("--stop-step", type=int)
    parser.add_argument("--park-at", choices=("commit", "generation"), default="commit")
    parser.add_argument("--park-tokens", type=int, default=1)
    args = parser.parse_args(argv)
    from kvckpt.reference.grpo import GRPOTrainer

    hooks = DemoHooks(args.events, park_prompt=args.park_prompt, crash_step=args.crash_step,
                      stop_step=args.stop_step, park_at=args.park_at, park_tokens=args.park_tokens)
    trainer = GRPOTrainer(args.config, hooks=hooks)
    hooks.trainer = trainer
    summary = trainer.run()
    if args.summary:
        with open(args.summary, "w") as fh:
            json.dump(summary, fh, sort_keys=True, default=str)
    return 0


def spawn_child(config_path: str, events: str, *, summary: str | None = None, park_prompt: int | None = None,
                crash_step: int | None = None, stop_step: int | None = None, park_at: str | None = None,
                park_tokens: int | None = None, stderr: str | None = None) -> subprocess.Popen[bytes]:
    """Start a training process running :func:`child_main` (its stderr to the file ``stderr``; its
    stdout a pipe carrying one byte per logged event, the doorbell :func:`wait_event` waits on)."""
    cmd = [sys.executable, "-m", "kvckpt.reference.demo", "child", config_path, events]
    for flag, value in (("--summary", summary), ("--park-prompt", park_prompt), ("--crash-step", crash_step),
                        ("--stop-step", stop_step), ("--park-at", park_at), ("--park-tokens", park_tokens)):
        if value is not None:
            cmd += [flag, str(value)]
    err = open(stderr or os.devnull, "wb")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
    finally:
        err.close()


def read_events(path: str, event: str | None = None) -> list[dict[str, Any]]:
    """The events logged so far (only those named ``event`` if given)."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        docs = [json.loads(line) for line in fh if line.endswith("\n")]
    return [d for d in docs if event is None or d["event"] == event]


def wait_event(path: str, event: str, proc: subprocess.Popen[bytes], timeout: float,
               stderr: str | None = None) -> dict[str, Any]:
    """Wait for the first ``event`` in ``path``, logged by ``proc`` (from :func:`spawn_child`): the
    file is read again each time the child rings its doorbell (a byte on its stdout pipe) and
    once more when the pipe closes (the child exited); nothing is polled on a timer.

    Raises:
        DemoFailed: the process exited first (with the last line of its ``stderr`` file) or
            ``timeout`` seconds passed.
    """
    deadline = time.monotonic() + timeout
    bell = proc.stdout.fileno()
    while not (found := read_events(path, event)):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([bell], [], [], left)[0]:
            raise DemoFailed(f"no {event!r} from the training process within {timeout:.0f} s")
        if os.read(bell, 65536):
            continue  # rung: read the events again
        proc.wait()  # the pipe closed: the child exited
        if found := read_events(path, event):
            break
        logger.error("training process %d exited (%s) before %r; its stderr: %s", proc.pid, proc.returncode,
                     event, stderr)
        raise DemoFailed(f"the training process exited ({proc.returncode}) before {event!r}: "
                         f"{last_error_line(stderr)}")
    return found[0]


def last_error_line(stderr: str | None) -> str:
    """The last non-empty line of a child's stderr file and where the whole file is."""
    lines: list[str] = []
    if stderr and os.path.exists(stderr):
        with open(stderr, errors="replace") as fh:
            lines = [line.strip() for line in fh if line.strip()]
    where = f" (full output in {stderr})" if stderr else ""
    return (lines[-1] if lines else "no output") + where


# -- the demo -------------------------------------------------------------------------------------
def demo_preset(fast: bool = False, steps: int | None = None) -> dict[str, Any]:
    """The run's shape: the ``fast`` or the default preset, ``steps`` overriding its length (the
    checkpoint period, a third of it, and the crash step, a third of a period after the second
    checkpoint, scale with it).

    Raises:
        BadArgument: ``steps`` below 6 (two checkpoints and a crash need that many).
    """
    preset = dict(PRESETS["fast" if fast else "full"])
    if steps is not None:
        if steps < 6:
            raise BadArgument(f"steps must be at least 6 (two checkpoints before the crash), got {steps}")
        every = steps // 3
        preset.update(steps=steps, every_steps=every, crash_step=2 * every + max(1, every * 7 // 20))
    return preset


def demo_config(out: str, preset: dict[str, Any], sampler: str, recovery: str, backend: str,
                cache_dir: str | None = None) -> dict[str, Any]:
    """The trainer config of a demo run in ``out``."""
    gps, repeat = preset["groups_per_step"], preset["repeat"]
    # vLLM engines share process-wide state: two of them generating at once in one process race
    # (seen: "Cannot copy out of meta tensor", and a hang), so the vLLM run has one worker.
    workers = 1 if backend == "vllm" else 2
    return {"output_dir": out, "seed": 0,
            "model": {"cache_dir": cache_dir, "sft_steps": preset["sft_steps"], "sft_lr": preset["sft_lr"]},
            "task": {"max_operand": preset["max_operand"], "repeat": repeat},
            # single-digit sums, space-separated, then end-of-text: 2 * repeat tokens
            "generation": {"backend": backend, "group_size": preset["group_size"], "max_tokens": 2 * repeat,
                           "workers": workers, "progress_every_tokens": PROGRESS_EVERY_TOKENS,
                           "backend_options": {"step_tokens": ENGINE_STEP_TOKENS} if backend == "transformers" else {}},
            "train": {"steps": preset["steps"], "groups_per_step": gps, "lr": preset["lr"]},
            "replay_buffer": {"sampler": SAMPLERS[sampler], "max_buffered_rollouts": 3 * gps},
            "checkpoint": {"every_steps": preset["every_steps"], "keep": 2, "resume_from": recovery}}


def run_demo(out: str | None = None, *, fast: bool = False, steps: int | None = None, sampler: str = "in_order",
             recovery: str = "live", backend: str | None = None,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, SIGKILL mid-step, resume in a new process, audit; returns the report (see :func:`render`).

    ``out`` keeps every file (config, live store, checkpoints, metrics, events, children's stderr,
    the learning-curve PNG). Without it the run goes to a new temporary directory, which keeps only
    the PNG and ``metrics.jsonl`` once the demo succeeded (everything, when it failed). ``steps``
    overrides the preset's length (see :func:`demo_preset`). ``backend`` defaults to ``"vllm"``
    when vLLM is importable, else ``"transformers"``.

    Raises:
        BadArgument: an unknown sampler or recovery mode, ``steps`` below 6, ``out`` not empty, or
            ``backend="vllm"`` without vLLM installed (the message says how to get it).
        DemoFailed: a training process ended early (the message quotes its stderr).
    """
    from kvckpt.reference.grpo import BUFFER_FILE, checkpoint_steps

    if sampler not in SAMPLERS or recovery not in RECOVERY_MODES:
        raise BadArgument(f"sampler must be one of {sorted(SAMPLERS)}, recovery one of {RECOVERY_MODES}")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if backend == "vllm" and not has_vllm:
        raise BadArgument("--backend vllm needs vLLM, which this Python environment lacks: run "
                          "`bash scripts/setup_peer_env.sh vllm`, then `.venv-vllm/bin/kvckpt demo --backend vllm`")
    backend = backend or ("vllm" if has_vllm else "transformers")
    preset = demo_preset(fast, steps)
    keep = out is not None
    if keep and os.path.isdir(out) and os.listdir(out):
        raise BadArgument(f"{out!r} is not empty (a run there would resume it); choose an empty or new directory")
    out = os.path.abspath(out) if out else tempfile.mkdtemp(prefix="kvckpt-demo-")
    os.makedirs(out, exist_ok=True)
    cfg = demo_config(out, preset, sampler, recovery, backend)
    config_path = os.path.join(out, "config.json")
    with open(config_path, "w") as fh:
        json.dump(cfg, fh, indent=1)
    gps, crash = preset["groups_per_step"], preset["crash_step"]
    live, ckpt_dir = os.path.join(out, "buffer.kvckpt"), os.path.join(out, "checkpoints")
    succeeded = False
    try:
        log(f"run 1: {backend} GRPO, {sampler}, {gps} prompts x {preset['group_size']} completions per step, "
            f"checkpoint every {preset['every_steps']} steps; SIGKILL in step {crash}")
        t0 = time.monotonic()
        stderr1 = os.path.join(out, "run-1.stderr")
        proc = spawn_child(config_path, os.path.join(out, "events-1.jsonl"), park_prompt=(crash + 1) * gps + 1,
                           crash_step=crash, park_at="generation", park_tokens=PARK_AFTER_TOKENS, stderr=stderr1)
        try:
            crash_point = wait_event(os.path.join(out, "events-1.jsonl"), "crash-point", proc, timeout=900,
                                     stderr=stderr1)
            killed_in = crash_point["step"]
        finally:
            proc.kill()
            proc.wait()
        at_kill = store_view(live)
        killed_in = at_kill["state"]["trainer_version"] if killed_in is None else killed_in
        log(f"  killed (SIGKILL) in step {killed_in} after {time.monotonic() - t0:.0f} s")
        logger.info("demo in %s: run 1 SIGKILLed in step %s", out, killed_in)
        ckpt_step = checkpoint_steps(ckpt_dir)[-1]
        ckpt = store_view(os.path.join(ckpt_dir, f"step_{ckpt_step}", BUFFER_FILE))
        after = work_after_checkpoint(at_kill, ckpt)
        metrics_before = _metrics(out)
        source = at_kill if recovery == "live" else ckpt
        redispatch = [{"prompt_idx": e.prompt_idx, "group_id": e.group_id} for e in source["ledger"]]

        log(f"run 2: resume from step_{ckpt_step} and the {'live store' if recovery == 'live' else 'checkpoint file'}")
        events2, summary_path = os.path.join(out, "events-2.jsonl"), os.path.join(out, "summary-2.json")
        stderr2 = os.path.join(out, "run-2.stderr")
        t_restart = time.time()
        proc = spawn_child(config_path, events2, summary=summary_path, stderr=stderr2)
        proc.communicate()  # drains the doorbell pipe until the run ends
        if proc.returncode != 0:
            raise DemoFailed(f"the resumed run failed ({proc.returncode}): {last_error_line(stderr2)}")
        with open(summary_path) as fh:
            summary = json.load(fh)
        first = read_events(events2, "first-batch")
        commits2 = {e["group_id"] for e in read_events(events2, "commit")}
        check = audit(live)
        verify = verify_path(live)
        metrics = _metrics(out)
        curve = learning(metrics, len(metrics_before), ckpt_step)
        rec = summary["recovery"]
        tokens = token_account(crash_point, source, summary.get("progress", {}), PROGRESS_EVERY_TOKENS,
                               cfg["generation"]["max_tokens"])
        png = plot_learning_curve(metrics, len(metrics_before), killed_in, ckpt_step,
                                  os.path.join(out, "kvckpt-demo-learning-curve.png"), curve, tokens)
        report = {
            "backend": backend, "sampler": sampler, "out": out, "kept": "all" if keep else "plot and metrics",
            "learning_curve": png,
            "run": {"steps": preset["steps"], "groups_per_step": gps, "group_size": preset["group_size"],
                    "killed_mid_step": killed_in, "checkpoint_step": ckpt_step,
                    "at_kill": {"claimed": at_kill["state"]["claimed"], "ready": at_kill["state"]["ready"],
                                "inflight": at_kill["state"]["inflight"]}},
            "recovery": {"mode": recovery, "resume_step": summary["resumed_from"], **rec,
                         "prompts_redispatched": redispatch,
                         "work_after_checkpoint": {k: after[k] for k in ("groups", "rows", "raw_bytes",
                                                                         "prompts_admitted")},
                         "work_lost": {"groups": 0 if recovery == "live" else after["groups"],
                                       "rows": 0 if recovery == "live" else after["rows"],
                                       "raw_bytes": 0 if recovery == "live" else after["raw_bytes"]},
                         "groups_after_checkpoint_recommitted": len(set(after["group_ids"]) & commits2),
                         "time_to_first_batch_seconds": first[0]["time"] - t_restart if first else None,
                         "tokens": tokens},
            "finish": {"final_step": summary["steps_done"], "steps_trained": summary["steps_done"] - ckpt_step},
            "learning": curve,
            "check": {**{k: v for k, v in check.items() if k != "trained_by_step"},
                      "verify_ok": verify.ok, "verify_problems": [str(p) for p in verify.problems]},
        }
        report["ok"] = bool(not check["lost"] and not check["doubled"] and verify.ok
                            and len(redispatch) == rec["groups_redispatched"] and tokens["within_bound"])
        succeeded = report["ok"]
        logger.info("demo in %s: %s; reward trend %s/step, t = %s", out, "ok" if succeeded else "FAILED",
                    curve["slope"], curve["t"])
        return report
    finally:
        if not keep and succeeded:
            _tidy(out, keep=("kvckpt-demo-learning-curve.png", "metrics.jsonl"))


def _tidy(directory: str, keep: Sequence[str]) -> None:
    """Remove everything in ``directory`` but the names in ``keep``."""
    for name in os.listdir(directory):
        if name not in keep:
            path = os.path.join(directory, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)


def _metrics(out: str) -> list[dict[str, Any]]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvckpt.reference.demo child ...``: one training process of the demo."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["child"]:
        print("usage: python -m kvckpt.reference.demo child CONFIG EVENTS [options]; "
              "run the demo with `kvckpt demo`", file=sys.stderr)
        return 2
    return child_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
