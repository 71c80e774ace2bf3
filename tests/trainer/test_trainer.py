"""The reference async GRPO trainer end to end: every sampler, both buffer backends, crash and
resume in fresh processes, Ray-hosted workers (marker ``ray``) and vLLM generation (marker ``vllm``).

Runs are tiny (2 prompts x 2 completions per step, a few steps): they check what the trainer does
with the buffer (exact accounting of prompts), that the loss is finite and the policy moves, and,
deterministically, that the GRPO update moves log-probabilities the right way.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from kvckpt.integrations.vllm import ensure_tiny_model
from kvckpt.reference import GRPOTrainer, Hooks, ParkRollout, grpo_loss
from kvckpt.reference.grpo import BUFFER_FILE, MODEL_FILE, checkpoint_steps

from kvckpt import ReplayBuffer
from kvckpt.buffer import Batch
from kvckpt.tables.records import CONSUMED

GPS, N = 2, 2
SAMPLERS = {
    "in_order": {"name": "in_order", "max_lookahead_versions": 1},
    "weight_fifo": {"name": "weight_fifo", "max_staleness_versions": 1},
    "windowed": {"name": "windowed", "max_staleness_versions": 1},
    "ready_first": {"name": "ready_first", "max_staleness_versions": 1},
}


def _config(tmp_path: Any, tiny_model_cache: str, **sections: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "output_dir": str(tmp_path / "run"), "seed": 0,
        "model": {"cache_dir": tiny_model_cache, "sft_steps": 0},
        "generation": {"group_size": N, "max_tokens": 3},
        "train": {"steps": 3, "groups_per_step": GPS, "lr": 1e-3},
        "replay_buffer": {"sampler": SAMPLERS["in_order"], "max_buffered_rollouts": 2 * GPS},
        "checkpoint": {"every_steps": 2, "keep": 2},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values} if isinstance(values, dict) else values
    return cfg


def _metrics(summary: dict[str, Any]) -> list[dict[str, Any]]:
    with open(summary["metrics_path"]) as fh:
        return [json.loads(line) for line in fh]


def _initial_weights(tiny_model_cache: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_tiny_model(tiny_model_cache), dtype=torch.float32).state_dict()


def _consumed_prompts(path: str) -> list[int]:
    with ReplayBuffer.open(path, readonly=True) as buf:
        return sorted(g.prompt_idx for g in buf.groups([CONSUMED]))


def _assert_accounts_for_every_prompt(path: str, admitted: int) -> None:
    """Every prompt that left the dataloader is exactly one group record or one ledger entry."""
    with ReplayBuffer.open(path, readonly=True) as buf:
        seen = [g.prompt_idx for g in buf.groups()] + [e.prompt_idx for e in buf.ledger()]
        cursor = json.loads(buf.dataloader_state())["cursor"]
    assert cursor == admitted
    assert sorted(seen) == list(range(admitted))


def test_grpo_update_raises_rewarded_and_lowers_unrewarded_completions(tiny_model_cache):
    """One on-policy SGD step on a hand-built batch: sequence log-probs of the completions with
    reward 1 go up, those with reward 0 go down (no sampling involved: deterministic)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(tiny_model_cache), dtype=torch.float32).eval()
    prompt, width = [20, 12, 22, 30], 7
    completions = [[25, 0], [24, 0], [26, 27, 0], [25, 0]]
    rewards = [1.0, 0.0, 0.0, 1.0]
    ids = torch.zeros(4, width, dtype=torch.int64)
    mask = torch.zeros(4, width, dtype=torch.int64)
    for i, c in enumerate(completions):
        ids[i, :len(prompt) + len(c)] = torch.tensor(prompt + c)
        mask[i, len(prompt):len(prompt) + len(c)] = 1
    lengths = torch.tensor([len(prompt) + len(c) for c in completions])

    def seq_logprobs() -> torch.Tensor:
        with torch.no_grad():
            logits = policy(input_ids=ids).logits[:, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return logp

    old = seq_logprobs()
    gen = torch.zeros(4, width)
    gen[:, 1:] = old * mask[:, 1:]
    batch = Batch(["g0", "g0", "g1", "g1"], [0, 1, 0, 1], lengths, tensors={
        "input_ids": ids, "token_mask": mask, "generation_logprobs": gen,
        "sample_mask": torch.ones(4), "total_reward": torch.tensor(rewards)})
    loss, stats = grpo_loss(policy, batch, clip_eps=0.2)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: importance weights are 1
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    opt.zero_grad()
    loss.backward()
    opt.step()
    delta = ((seq_logprobs() - old) * mask[:, 1:]).sum(1)
    assert delta[0] > 0 and delta[3] > 0
    assert delta[1] < 0 and delta[2] < 0


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_trainer_runs_each_sampler(tmp_path, tiny_model_cache, sampler):
    cfg = _config(tmp_path, tiny_model_cache, replay_buffer={"sampler": SAMPLERS[sampler]})
    summary = GRPOTrainer(cfg).run()
    assert summary["steps_done"] == 3 and summary["start_step"] == 0 and summary["resumed_from"] is None
    rows = _metrics(summary)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(r["loss"]) and r["groups"] == GPS and r["rows"] == GPS * N for r in rows)
    assert all(0 <= r["staleness"] <= 1 for r in rows)  # every sampler here has a window of 1
    assert checkpoint_steps(os.path.join(cfg["output_dir"], "checkpoints")) == [2, 3]
    final = os.path.join(cfg["output_dir"], "checkpoints", "step_3")
    state = torch.load(os.path.join(final, MODEL_FILE), weights_only=True)
    assert state["step"] == 3
    initial = _initial_weights(tiny_model_cache)
    assert any(not torch.equal(initial[k], v) for k, v in state["model"].items())  # the policy moved
    path = os.path.join(cfg["output_dir"], "buffer.kvckpt")
    with ReplayBuffer.open(path, readonly=True) as buf:
        assert buf.trainer_version == 3
        assert len(buf.groups([CONSUMED])) == 3 * GPS
        admitted = buf.state()["counters"]["admitted"]
    _assert_accounts_for_every_prompt(path, admitted)
    if sampler == "in_order":  # each step trains exactly the batch admitted for it
        assert _consumed_prompts(path) == list(range(3 * GPS))


def test_memory_backend_trains_with_the_same_samplers(tmp_path, tiny_model_cache):
    cfg = _config(tmp_path, tiny_model_cache, replay_buffer={"backend": "memory"})
    summary = GRPOTrainer(cfg).run()
    assert summary["steps_done"] == 3
    assert [r["groups"] for r in _metrics(summary)] == [GPS] * 3
    assert not os.path.exists(os.path.join(cfg["output_dir"], "buffer.kvckpt"))
    assert not os.path.exists(os.path.join(cfg["output_dir"], "checkpoints", "step_3", BUFFER_FILE))
    assert os.path.isfile(os.path.join(cfg["output_dir"], "checkpoints", "step_3", MODEL_FILE))


def test_time_limit_ends_the_run_with_a_checkpoint(tmp_path, tiny_model_cache):
    cfg = _config(tmp_path, tiny_model_cache, train={"steps": 50, "time_limit_seconds": 0},
                  checkpoint={"every_steps": 0})
    summary = GRPOTrainer(cfg).run()
    assert summary["time_limited"] and summary["steps_done"] == 1
    assert checkpoint_steps(os.path.join(cfg["output_dir"], "checkpoints")) == [1]


def test_a_parked_rollout_stays_in_flight_until_released(tmp_path, tiny_model_cache):
    """A worker parked before committing prompt 0 holds the in_order step 0 back; the ledger shows
    it in flight, and once released the run finishes with every prompt trained once."""
    import threading

    hooks = ParkRollout(prompt_idx=0)
    cfg = _config(tmp_path, tiny_model_cache, train={"steps": 2})
    trainer = GRPOTrainer(cfg, hooks=hooks)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(trainer.run()))
    thread.start()
    assert hooks.parked.wait(120)
    in_flight = [e.prompt_idx for e in trainer.buffer.ledger()]
    hooks.release()
    thread.join(120)
    assert 0 in in_flight and hooks.lease.prompt_idx == 0
    assert result["steps_done"] == 2
    assert _consumed_prompts(os.path.join(cfg["output_dir"], "buffer.kvckpt")) == list(range(2 * GPS))


@pytest.mark.parametrize("resume_from", ["live", "checkpoint"])
def test_crash_then_resume_in_a_fresh_process_trains_every_prompt_once(tmp_path, tiny_model_cache, resume_from):
    cfg = _config(tmp_path, tiny_model_cache, train={"steps": 6}, checkpoint={"resume_from": resume_from})
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    module = "kvckpt.reference.grpo"
    crashed = subprocess.run([sys.executable, "-m", module, str(cfg_path), "--crash-at", "after_finish_step:4"],
                             capture_output=True, text=True, timeout=300)
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    ckpt_dir = os.path.join(cfg["output_dir"], "checkpoints")
    assert checkpoint_steps(ckpt_dir) == [2]  # step 4 finished durably, its checkpoint never came
    live = os.path.join(cfg["output_dir"], "buffer.kvckpt")
    with ReplayBuffer.open(live, readonly=True) as buf:
        assert buf.trainer_version == 4

    resumed = subprocess.run([sys.executable, "-m", module, str(cfg_path)], capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)  # the trainer prints its summary, as indented JSON, and nothing else
    assert summary["resumed_from"] == 2 and summary["steps_done"] == 6
    recovery = summary["recovery"]
    if resume_from == "live":  # steps 2 and 3 were consumed after the checkpoint: back to ready
        assert recovery["groups_returned_to_ready"] == 2 * GPS
        assert recovery["resume_version"] == 2
    else:  # the checkpoint file knows nothing after step 2
        assert recovery["groups_returned_to_ready"] == 0
    steps = [r["step"] for r in _metrics(summary)]
    # The first run died inside step 3, before its metrics line; steps 2-3 are trained again after
    # the resume (their model was never checkpointed), on the very same groups.
    assert steps == [0, 1, 2, 2, 3, 4, 5]
    assert _consumed_prompts(live) == list(range(6 * GPS))  # in_order: each step's own batch, once
    with ReplayBuffer.open(live, readonly=True) as buf:
        admitted = json.loads(buf.dataloader_state())["cursor"]
    _assert_accounts_for_every_prompt(live, admitted)


@pytest.mark.ray
class _HeldBy(Hooks):
    """Before each commit (in the rollout pump, before the worker's remote call): which workers the store lists
    the lease under (``leases_held_by`` of each worker's holder, one read each)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.seen: list[tuple[str | None, list[str]]] = []

    def before_commit(self, lease: Any) -> None:
        workers = self.trainer.workers
        listed = [w.holder for w in workers if lease.group_id in
                  {held.group_id for held in self.trainer.buffer.leases_held_by(w.holder)}]
        self.seen.append((lease.holder, listed))


def test_ray_hosted_buffer_and_workers(tmp_path, tiny_model_cache):
    """The Ray fleet: buffer actor and worker actors. Each worker is named after its actor (issue 45), every lease
    the pump admits for it records that name, and the store lists the lease under that worker, and no other,
    while it is in flight (``leases_held_by``: what a dead worker held, in one read)."""
    pytest.importorskip("ray")
    cfg = _config(tmp_path, tiny_model_cache, generation={"ray": True, "workers": 2}, train={"steps": 2})
    hooks = _HeldBy()
    trainer = hooks.trainer = GRPOTrainer(cfg, hooks=hooks)
    summary = trainer.run()
    holders = [w.holder for w in trainer.workers]
    assert len(set(holders)) == 2 and all(h.startswith("actor:") for h in holders), holders
    assert hooks.seen and all(listed == [holder] and holder in holders for holder, listed in hooks.seen), hooks.seen
    assert summary["steps_done"] == 2
    assert [r["groups"] for r in _metrics(summary)] == [GPS, GPS]
    live = os.path.join(cfg["output_dir"], "buffer.kvckpt")
    assert _consumed_prompts(live) == list(range(2 * GPS))
    with ReplayBuffer.open(live, readonly=True) as buf:
        admitted = json.loads(buf.dataloader_state())["cursor"]
    _assert_accounts_for_every_prompt(live, admitted)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM not installed (run in .venv-vllm: scripts/setup_peer_env.sh vllm)")
def test_vllm_generation_backend(tmp_path, tiny_model_cache):
    cfg = _config(tmp_path, tiny_model_cache, generation={"backend": "vllm", "group_size": N, "max_tokens": 3},
                  train={"steps": 2})
    summary = GRPOTrainer(copy.deepcopy(cfg)).run()
    assert summary["steps_done"] == 2
    rows = _metrics(summary)
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert all(r["ratio_mean"] == pytest.approx(1.0, abs=0.05) for r in rows)  # engine logprobs ~ policy's
    assert _consumed_prompts(os.path.join(cfg["output_dir"], "buffer.kvckpt")) == list(range(2 * GPS))


def test_metrics_hook_gets_buffer_stats_and_the_step_record_every_step(tmp_path, tiny_model_cache, caplog):
    """The hook sees the store's counters as they are after each step (one consumed batch more
    each time) and the step's own numbers; the trainer logs on its library logger, handler-free."""
    import logging

    from kvckpt.metrics import MetricsHook

    seen: list[tuple[int, dict[str, float]]] = []
    cfg = _config(tmp_path, tiny_model_cache, replay_buffer={"retain_consumed": True})
    with caplog.at_level(logging.INFO, logger="kvckpt.reference.grpo"):
        summary = GRPOTrainer(cfg, metrics=MetricsHook(lambda m, step: seen.append((step, dict(m))))).run()
    assert summary["steps_done"] == 3
    assert [step for step, _ in seen] == [0, 1, 2]
    assert [m["kvckpt/consumed"] for _, m in seen] == [GPS, 2 * GPS, 3 * GPS]
    assert [m["kvckpt/trainer_version"] for _, m in seen] == [1, 2, 3]
    rows = _metrics(summary)
    assert [m["train/reward_mean"] for _, m in seen] == [r["reward_mean"] for r in rows]
    messages = [r.getMessage() for r in caplog.records if r.name == "kvckpt.reference.grpo"]
    assert any(m.startswith("checkpoint step_2 written") for m in messages)
    assert any(m.startswith("run ended at step 3") for m in messages)
    assert logging.getLogger("kvckpt.reference.grpo").handlers == []
    with ReplayBuffer.open(os.path.join(cfg["output_dir"], "buffer.kvckpt"), readonly=True) as buf:
        assert buf.config.retain_consumed is True  # the trainer config reaches the store
        assert all(g.rows_stored for g in buf.groups([CONSUMED]))


def test_metrics_config_names_a_sink_that_must_be_installed(tmp_path, tiny_model_cache):
    from kvckpt.errors import BadArgument

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed: nothing to refuse")
    cfg = _config(tmp_path, tiny_model_cache, metrics={"tensorboard_dir": str(tmp_path / "tb")})
    with pytest.raises(BadArgument, match="pip install tensorboard"):
        GRPOTrainer(cfg)
