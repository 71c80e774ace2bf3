"""Exactly-once on a real run: two training processes of the reference GRPO trainer, real
transformers generation, real kvckpt stores.

Run 1 parks one rollout just before its commit (the trainer's test-only hooks, passed on the child's
command line by this test) and is then cut while that rollout is parked: by a time-limited final
checkpoint (a clean stop) or by SIGKILL mid-step. Run 2 resumes in a fresh process, from the
checkpoint file or from the live store. For THAT group: redispatched once, committed once, trained
at its saved target step, absent from later checkpoints' ledgers. For the dataset: every prompt up
to the dataloader cursor accounted for exactly once (store group records, the children's commit
logs, the metrics log). After the SIGKILL: every group committed after the last checkpoint is
reused, byte for byte (same digest, same attempt), never regenerated.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvckpt.integrations.vllm import AdditionTask
from kvckpt.integrations.vllm.stream import SequenceState
from kvckpt.reference.demo import (
    PROGRESS_EVERY_TOKENS,
    DemoFailed,
    DemoHooks,
    ParkedCommitDropped,
    demo_config,
    demo_preset,
    read_events,
    run_demo,
    spawn_child,
    wait_event,
)
from kvckpt.reference.grpo import BUFFER_FILE, checkpoint_steps
from kvckpt.reference.report import (
    audit,
    learning,
    reward_trend,
    store_view,
    token_account,
    work_after_checkpoint,
)

from kvckpt.errors import BadArgument
from kvckpt.tables.records import CONSUMED, EVICTED, Lease

GPS, N = 2, 2
SAMPLERS = {
    "in_order": {"name": "in_order", "max_lookahead_versions": 1},
    "weight_fifo": {"name": "weight_fifo", "max_staleness_versions": 1},
    "windowed": {"name": "windowed", "max_staleness_versions": 2},
    "ready_first": {"name": "ready_first", "max_staleness_versions": 2},
}
CI_SAMPLERS = [pytest.param(s, marks=[] if s in ("in_order", "weight_fifo") else [pytest.mark.slow])
               for s in SAMPLERS]
TIMEOUT = 240


class Run:
    """The two processes of one scenario, sharing one output directory."""

    def __init__(self, tmp_path: Any, tiny_model_cache: str, sampler: str, *, steps: int, every: int,
                 resume_from: str, workers: int = 1) -> None:
        self.dir = str(tmp_path / "run")
        self.window = window = max(SAMPLERS[sampler].get("max_lookahead_versions", 0), SAMPLERS[sampler].get(
            "max_staleness_versions", 0))
        self.config = {
            "output_dir": self.dir, "seed": 0, "model": {"cache_dir": tiny_model_cache, "sft_steps": 0},
            "generation": {"group_size": N, "max_tokens": 3, "workers": workers},
            "train": {"steps": steps, "groups_per_step": GPS, "lr": 1e-3},
            "replay_buffer": {"sampler": SAMPLERS[sampler], "max_buffered_rollouts": GPS * (1 + window)},
            "checkpoint": {"every_steps": every, "keep": 2, "resume_from": resume_from}}
        self.config_path = str(tmp_path / "config.json")
        with open(self.config_path, "w") as fh:
            json.dump(self.config, fh)
        self.live = os.path.join(self.dir, "buffer.kvckpt")
        self.ckpt_dir = os.path.join(self.dir, "checkpoints")
        self.sampler = sampler

    def events(self, run: int) -> str:
        return str(os.path.join(os.path.dirname(self.dir), f"events-{run}.jsonl"))

    def spawn(self, run: int, **hooks: Any) -> Any:
        os.makedirs(self.dir, exist_ok=True)
        return spawn_child(self.config_path, self.events(run), summary=self.summary_path(run),
                           stderr=os.path.join(os.path.dirname(self.dir), f"run-{run}.stderr"), **hooks)

    def summary_path(self, run: int) -> str:
        return os.path.join(os.path.dirname(self.dir), f"summary-{run}.json")

    def finish(self, proc: Any, run: int, expect: int = 0) -> None:
        rc = proc.wait(TIMEOUT)
        assert rc == expect, self.stderr(run)

    def stderr(self, run: int) -> str:
        with open(os.path.join(os.path.dirname(self.dir), f"run-{run}.stderr")) as fh:
            return fh.read()[-3000:]

    def summary(self, run: int) -> dict[str, Any]:
        with open(self.summary_path(run)) as fh:
            return json.load(fh)

    def checkpoint(self, step: int) -> dict[str, Any]:
        return store_view(os.path.join(self.ckpt_dir, f"step_{step}", BUFFER_FILE))

    def metric_steps(self) -> list[int]:
        with open(os.path.join(self.dir, "metrics.jsonl")) as fh:
            rows = [json.loads(line) for line in fh]
        assert all(r["groups"] == GPS and r["rows"] == GPS * N for r in rows)
        return [r["step"] for r in rows]


def _commits(run: Run) -> list[dict[str, Any]]:
    return read_events(run.events(1), "commit") + read_events(run.events(2), "commit")


def _assert_parked_group_once(run: Run, parked: dict[str, Any], saved: Any, resumed_at: int) -> Any:
    """THAT group: redispatched (attempt bumped) and committed exactly once, by run 2, and trained
    at the target step saved with it; returns its final record."""
    gid = parked["group_id"]
    assert saved.prompt_idx == parked["prompt_idx"] and saved.attempt == parked["attempt"]
    assert [e for e in read_events(run.events(1), "commit") if e["group_id"] == gid] == []
    mine = [e for e in read_events(run.events(2), "commit") if e["prompt_idx"] == parked["prompt_idx"]]
    assert [(e["group_id"], e["attempt"]) for e in mine] == [(gid, parked["attempt"] + 1)]
    records = [g for g in store_view(run.live)["groups"] if g.prompt_idx == parked["prompt_idx"]]
    assert [(g.group_id, g.attempt) for g in records] == [(gid, parked["attempt"] + 1)]
    final = records[0]
    if saved.start_weight > resumed_at:
        # Dispatched after the checkpoint with the weights the crash destroyed: run 2 generated it
        # with the resumed ones, and its stamp says so (a stamp never outlives the rollback).
        assert final.start_weight == resumed_at and final.lineage_fork is None
    if final.state == EVICTED:
        # Truly stamped, it can fall out of a discarding sampler's window before its turn.
        assert run.sampler != "in_order" and final.reason.startswith("outside")
        return final
    assert final.state == CONSUMED
    if saved.target_step is not None:
        assert final.consumed_step == saved.target_step
    else:
        assert final.consumed_step >= resumed_at
    return final


def _assert_every_prompt_once(run: Run, steps: int) -> None:
    """Every prompt the dataloader served is one record; consumed ones trained once; with
    in_order each step trained exactly its own batch."""
    check = audit(run.live)
    assert check["lost"] == [] and check["doubled"] == []
    assert check["trained_once"] == steps * GPS
    assert check["trained_once"] + check["discarded"] + check["pending"] == check["prompts"]
    commits = Counter(e["group_id"] for e in _commits(run))
    assert max(commits.values()) == 1  # no group committed twice over both runs
    if run.sampler == "in_order":
        assert check["trained_by_step"] == {s: [GPS * s + i for i in range(GPS)] for s in range(steps)}


@pytest.mark.parametrize("sampler", CI_SAMPLERS)
def test_clean_stop_while_parked_then_resume_from_the_checkpoint(tmp_path, tiny_model_cache, sampler):
    """Run 1 trains steps 0-1 and parks prompt 5 (step 2's batch); its time limit ends the run with
    the final checkpoint step_2 taken while prompt 5 is in flight, then exits. Run 2 restores
    step_2's buffer file and trains to step 4."""
    run = Run(tmp_path, tiny_model_cache, sampler, steps=4, every=0, resume_from="checkpoint")
    proc = run.spawn(1, park_prompt=2 * GPS + 1, stop_step=1)
    run.finish(proc, 1)
    first = run.summary(1)
    assert first["time_limited"] is True and first["steps_done"] == 2
    assert checkpoint_steps(run.ckpt_dir) == [2]
    [parked] = read_events(run.events(1), "parked")
    assert parked["prompt_idx"] == 2 * GPS + 1
    saved = run.checkpoint(2)
    assert [e.group_id for e in saved["ledger"]] == [parked["group_id"]]  # one worker: it was parked

    proc = run.spawn(2)
    run.finish(proc, 2)
    second = run.summary(2)
    assert second["resumed_from"] == 2 and second["steps_done"] == 4
    assert second["recovery"]["groups_redispatched"] == 1
    final = _assert_parked_group_once(run, parked, saved["ledger"][0], resumed_at=2)
    nxt = run.checkpoint(4)  # the next checkpoint: the group is consumed, not in flight
    assert parked["group_id"] not in {e.group_id for e in nxt["ledger"]}
    assert {g.group_id: g.state for g in nxt["groups"]}[final.group_id] == CONSUMED
    assert run.metric_steps() == [0, 1, 2, 3]
    _assert_every_prompt_once(run, steps=4)


@pytest.mark.parametrize("sampler", CI_SAMPLERS)
def test_sigkill_mid_step_then_resume_from_the_live_store(tmp_path, tiny_model_cache, sampler):
    """Run 1 checkpoints step_2, parks the second prompt of the first admission that can only open
    after that checkpoint, and is SIGKILLed with step 3's groups claimed. Run 2 reconciles the live
    store to step 2 and trains to step 6: THAT group is redispatched once, and every group committed
    after step_2 (at least the parked prompt's batch-mate) is reused, not regenerated. A second
    rollout worker keeps generating while the first is parked (a sampler that discards stale
    groups would otherwise starve step 3).

    Which admission: capacity is ``GPS * (1 + W)`` ready or in flight, so admission ``k`` opens at
    the earliest when step ``k - 1 - W`` claims its groups (nothing is discarded before step 2: no
    group is stale yet); step_2 is written before step 2 selects, so admission ``3 + W`` (prompt 9
    for W = 1, prompt 11 for W = 2) is admitted, generated and its first prompt committed after
    step_2, whatever the timing. An earlier admission (prompt 9 with W = 2) can commit before the
    checkpoint copy and leave nothing committed after it."""
    every = 2
    run = Run(tmp_path, tiny_model_cache, sampler, steps=6, every=every, resume_from="live", workers=2)
    admission = every + 1 + run.window  # the first one step 2's select (after the step_2 checkpoint) lets through
    proc = run.spawn(1, park_prompt=admission * GPS + 1, crash_step=3)
    try:
        wait_event(run.events(1), "crash-point", proc, TIMEOUT)
    finally:
        proc.kill()
    run.finish(proc, 1, expect=-9)
    assert checkpoint_steps(run.ckpt_dir) == [2]
    [parked] = read_events(run.events(1), "parked")
    assert parked["prompt_idx"] == admission * GPS + 1
    at_kill = store_view(run.live)
    assert at_kill["state"]["trainer_version"] == 3 and at_kill["state"]["claimed"] == GPS
    [saved] = [e for e in at_kill["ledger"] if e.group_id == parked["group_id"]]
    after = work_after_checkpoint(at_kill, run.checkpoint(2))
    before = {g.group_id: (g.digest, g.attempt) for g in at_kill["groups"] if g.group_id in after["group_ids"]}
    mate = {g.prompt_idx: g.group_id for g in at_kill["groups"]}.get(admission * GPS)
    assert mate in before  # the parked prompt's batch-mate: committed (lease by lease) after step_2

    proc = run.spawn(2)
    run.finish(proc, 2)
    second = run.summary(2)
    assert second["resumed_from"] == 2 and second["steps_done"] == 6
    assert second["recovery"]["groups_redispatched"] == len(at_kill["ledger"])
    trained = _assert_parked_group_once(run, parked, saved, resumed_at=2)
    final = {g.group_id: (g.digest, g.attempt) for g in store_view(run.live)["groups"]}
    assert {gid: final[gid] for gid in before} == before  # reused byte for byte
    regenerated = {e["group_id"] for e in read_events(run.events(2), "commit")} & set(before)
    assert regenerated == set()
    assert Counter(e["prompt_idx"] for e in _commits(run)).most_common(1)[0][1] == 1  # nothing generated twice
    later = [s for s in checkpoint_steps(run.ckpt_dir) if s > (trained.consumed_step or 0)]
    assert later  # run 2's checkpoints after THAT group was trained (or discarded): out of the ledger
    for step in later:
        view = run.checkpoint(step)
        assert parked["group_id"] not in {e.group_id for e in view["ledger"]}
        if trained.state == CONSUMED:
            assert {g.group_id: g.state for g in view["groups"]}[parked["group_id"]] == CONSUMED
    steps = run.metric_steps()
    assert steps[-4:] == [2, 3, 4, 5] and steps[:-4] == [0, 1, 2]  # step 2 retrained: its model was lost
    _assert_every_prompt_once(run, steps=6)


@pytest.mark.slow
def test_kvckpt_demo_fast_reports_exactly_once_and_writes_the_learning_curve(tmp_path):
    """The real ``kvckpt demo --fast`` end to end (slow: two trainer processes with a warm-up).
    Without ``--out`` it leaves the working directory alone: the PNG and the metrics stay in its
    own run directory, everything else is removed."""
    proc = subprocess.run([sys.executable, "-m", "kvckpt.tools.cli", "demo", "--fast", "--backend", "transformers",
                           "--json"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    out = Path(doc["out"])
    assert list(tmp_path.iterdir()) == [] and out != tmp_path
    assert sorted(p.name for p in out.iterdir()) == ["kvckpt-demo-learning-curve.png", "metrics.jsonl"]
    check, rec = doc["check"], doc["recovery"]
    assert doc["ok"] is True and check["lost"] == [] and check["doubled"] == [] and check["verify_ok"] is True
    assert check["trained_once"] == 12 * 4 and doc["run"]["killed_mid_step"] == 8
    assert rec["mode"] == "live" and rec["resume_step"] == 5 and rec["work_lost"]["rows"] == 0
    assert rec["groups_after_checkpoint_recommitted"] == 0 and rec["work_after_checkpoint"]["groups"] >= 1
    assert len(rec["prompts_redispatched"]) == rec["groups_redispatched"] >= 1
    tokens = rec["tokens"]  # the kill finds long completions mid-generation; their durable tokens are resumed
    assert tokens["max_tokens"] == 64 and tokens["progress_every_tokens"] == 16
    low, high = tokens["generated_range"]
    assert 0 < low <= 40 <= high <= tokens["max_tokens"]  # the parked completions: 40 tokens in, 24 to go
    assert tokens["resumed"] == tokens["durable_at_kill"] > 0 and tokens["within_bound"] is True
    assert 0 <= tokens["regenerated"] <= tokens["progress_every_tokens"] * tokens["inflight_sequences"]
    assert tokens["completion_level_regenerated"] == tokens["inflight_at_kill"] >= tokens["resumed"]
    assert doc["learning_curve"] == str(out / "kvckpt-demo-learning-curve.png")
    with open(doc["learning_curve"], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    curve = doc["learning"]
    assert curve["steps"] == 12 and len(curve["curve"]) == 12 and curve["slope"] is not None
    assert curve["before_checkpoint_steps"] == [0, 4] and curve["after_resume_steps"] == [5, 11]
    shutil.rmtree(out)


# -- the demo's pieces ----------------------------------------------------------------------------
def test_reward_trend_is_the_least_squares_line_with_its_t_value():
    rewards = [0.1, 0.3, 0.2, 0.5, 0.4, 0.6, 0.5, 0.8]
    trend = reward_trend(rewards, window=3)
    slope, intercept = np.polyfit(np.arange(8), rewards, 1)
    residual = np.asarray(rewards) - (intercept + slope * np.arange(8))
    se = np.sqrt(residual @ residual / 6 / ((np.arange(8) - 3.5) ** 2).sum())
    assert trend["slope"] == pytest.approx(slope) and trend["intercept"] == pytest.approx(intercept)
    assert trend["t"] == pytest.approx(slope / se)
    assert (trend["first_mean"], trend["last_mean"]) == (pytest.approx(0.2), pytest.approx(0.63333333))
    assert reward_trend([0.5] * 5)["t"] is None and reward_trend([0.5] * 5)["slope"] == 0.0  # no spread
    assert reward_trend([1.0, 0.0])["slope"] is None  # too few points for a line and its error
    assert reward_trend([1.0, 2.0, 3.0])["t"] is None  # on the line: no error to divide by
    assert reward_trend([0.3, 0.1, 0.2, 0.0])["t"] < 0


def test_learning_keeps_the_curve_of_the_model_that_survived():
    """Run 1 trained steps 0-6 and died; run 2 resumed from step_4 and trained 4-7: the kept
    curve is run 1's 0-3 then run 2's 4-7 (run 1's 4-6 died with it)."""
    run1 = [{"step": s, "reward_mean": s / 10} for s in range(7)]
    run2 = [{"step": s, "reward_mean": 1.0 + s} for s in range(4, 8)]
    curve = learning(run1 + run2, len(run1), resume_step=4, window=2)
    assert curve["curve"] == [0.0, 0.1, 0.2, 0.3, 5.0, 6.0, 7.0, 8.0]
    assert curve["before_checkpoint_steps"] == [2, 3] and curve["before_checkpoint_mean"] == pytest.approx(0.25)
    assert curve["after_resume_steps"] == [4, 5] and curve["after_resume_mean"] == pytest.approx(5.5)


def test_token_account_counts_what_durable_progress_saved():
    """640 tokens in flight over 16 sequences at the kill (each 40 of its 64), 512 durable and
    resumed: 128 regenerated, within 16 tokens per sequence; recovering whole completions would
    have regenerated all 640."""
    crash = {"inflight_tokens": 640, "inflight_sequences": 16, "sequences": [[40, 32]] * 16}
    account = token_account(crash, {"progress_tokens": {"samples": 16, "tokens": 512}}, {"tokens_resumed": 512},
                            16, 64)
    assert account == {"inflight_at_kill": 640, "inflight_sequences": 16, "generated_range": [40, 40],
                       "max_tokens": 64, "durable_at_kill": 512, "resumed": 512, "regenerated": 128,
                       "completion_level_regenerated": 640, "progress_every_tokens": 16, "within_bound": True}
    lost = token_account(crash, {"progress_tokens": {"samples": 0, "tokens": 0}}, {}, 16, 64)
    assert lost["within_bound"] is False and lost["regenerated"] == 640  # 40 per sequence: over one interval


def test_the_default_demo_generates_long_completions_with_progress_well_inside_them(tmp_path):
    """The demo's run: 64-token completions (the sum of two digits, written 32 times), durable every
    16 tokens, the transformers engine stepping 8 at a time (so a step can end between appends)."""
    cfg = demo_config(str(tmp_path), demo_preset(), "in_order", "live", "transformers")
    gen = cfg["generation"]
    assert gen["max_tokens"] == 2 * cfg["task"]["repeat"] == 64
    assert gen["progress_every_tokens"] == PROGRESS_EVERY_TOKENS == 16 and gen["backend_options"] == {"step_tokens": 8}
    assert demo_config(str(tmp_path), demo_preset(), "in_order", "live", "vllm")["generation"]["backend_options"] == {}
    task = AdditionTask(cfg["task"]["max_operand"], 0, cfg["task"]["repeat"])
    a, b = task.operands(7)
    assert task.completion(7) == " ".join([str(a + b)] * 32) and task.reward(7, task.completion(7)) == 1.0
    assert task.reward(7, " ".join([str(a + b)] * 16)) == 0.5  # half of the 32 answers written
    assert task.reward(7, task.completion(7) + f" {a + b}") == 0.0  # more words than asked for
    one = AdditionTask(4, 0)  # repeat=1: the answer exactly, surrounding space ignored
    assert one.reward(7, f" {a + b} ") == 1.0 and one.reward(7, f"{a + b} {a + b}") == 0.0


def _states(lease: Lease, generated: int, durable: int) -> list[SequenceState]:
    return [SequenceState(lease, index, generated, durable) for index in range(lease.group_size)]


def test_the_demo_parks_its_rollout_mid_way_through_generation(tmp_path):
    """``park_at="generation"`` parks the first lease at or after ``park_prompt`` once its
    completions have ``park_tokens`` tokens, some durable: not before (a lease below
    ``park_prompt``, or one 32 tokens in), and only one lease."""
    hooks = DemoHooks(str(tmp_path / "events.jsonl"), park_prompt=5, park_at="generation", park_tokens=40)
    early, lease, later = (Lease(f"g{p}", 0, 8, 3, 0, p, "add", "a", tuple(range(8))) for p in (4, 5, 6))
    hooks.park.release()  # a park returns at once (its commit refused), as when the run stops: nothing blocks
    hooks.after_generation_step(_states(early, 48, 48))  # below park_prompt
    hooks.after_generation_step(_states(lease, 32, 32))  # not yet mid-way
    hooks.after_generation_step(_states(lease, 40, 0))  # nothing durable yet
    assert not hooks.park.parked.is_set() and read_events(hooks.events) == []
    with pytest.raises(ParkedCommitDropped):
        hooks.after_generation_step(_states(lease, 40, 32))
    [parked] = read_events(hooks.events, "parked")
    assert parked["prompt_idx"] == 5 and hooks.park.parked.is_set()
    hooks.after_generation_step(_states(later, 48, 48))  # one park per run
    assert hooks.generating[("g6", 0)] == [48, 48] and hooks.generating[("g5", 7)] == [40, 32]


def test_demo_presets_scale_with_steps():
    assert demo_preset()["steps"] == 60 and demo_preset()["crash_step"] == 47
    # 64 completions a step spread over 16 prompts (a step's mean reward is mostly which prompts it drew)
    assert (demo_preset()["groups_per_step"], demo_preset()["group_size"]) == (16, 4)
    long = demo_preset(steps=200)
    assert (long["steps"], long["every_steps"], long["crash_step"]) == (200, 66, 155)
    assert 2 * long["every_steps"] < long["crash_step"] < min(3 * long["every_steps"], 200)
    with pytest.raises(BadArgument, match="at least 6"):
        demo_preset(steps=5)


def test_a_child_that_dies_is_reported_with_its_own_last_words(tmp_path):
    stderr = str(tmp_path / "child.stderr")
    proc = spawn_child(str(tmp_path / "no-such-config.yaml"), str(tmp_path / "events.jsonl"), stderr=stderr)
    with pytest.raises(DemoFailed) as caught:
        wait_event(str(tmp_path / "events.jsonl"), "crash-point", proc, TIMEOUT, stderr=stderr)
    message = str(caught.value)
    assert "exited (1) before 'crash-point'" in message and "FileNotFoundError" in message
    assert f"(full output in {stderr})" in message and os.path.exists(stderr)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_demo_without_vllm_says_how_to_get_it_in_one_line(tmp_path):
    with pytest.raises(BadArgument, match=r"setup_peer_env\.sh vllm.*\.venv-vllm/bin/kvckpt demo --backend vllm"):
        run_demo(str(tmp_path / "demo"), backend="vllm", log=lambda line: None)
    assert not (tmp_path / "demo").exists()  # refused before anything ran
    proc = subprocess.run([sys.executable, "-m", "kvckpt.tools.cli", "demo", "--backend", "vllm"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("kvckpt demo: error: --backend vllm needs vLLM")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM not installed (run in .venv-vllm: scripts/setup_peer_env.sh vllm)")
def test_kvckpt_demo_with_vllm_gives_the_recovery_report(tmp_path):
    """``kvckpt demo --backend vllm`` in the vLLM environment: trained, killed, resumed, audited, plotted."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "kvckpt.tools.cli", "demo", "--fast", "--backend", "vllm",
                           "--out", str(out), "--json"], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and doc["backend"] == "vllm" and doc["check"]["lost"] == [] == doc["check"]["doubled"]
    assert doc["recovery"]["work_lost"]["rows"] == 0 and doc["learning"]["steps"] == 12
    assert doc["learning_curve"] == str(out / "kvckpt-demo-learning-curve.png")
