"""What the NeMo-RL adapter's tests share: NeMo-RL's record types and its buffer tests' helpers
(``_add_group``, ``_run``), the kvckpt config they build, and the samplers they run."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch
from kvckpt.integrations.nemo_rl import KvckptSampler, TQReplayBuffer

N_GENS = 2  # rows per group, as NeMo-RL's buffer tests
#: The fields NeMo-RL's buffer tests commit (their stubbed ``record_to_train_batch`` output).
SCHEMA = {"input_ids": ("int64", "token"), "input_lengths": ("int64", "row"), "total_reward": ("float32", "row")}
#: NeMo-RL's GRPO rollout fields, for records tensorised from message logs.
GRPO = {"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"), "token_mask": ("int64", "token"),
        "sample_mask": ("float32", "row"), "total_reward": ("float32", "row"), "input_lengths": ("int64", "row")}
SAMPLERS = {
    "in_order": {"name": "in_order", "max_lookahead_versions": 1},
    "weight_fifo": {"name": "weight_fifo", "max_staleness_versions": 1},
    "windowed": {"name": "windowed", "max_staleness_versions": 1, "sample_freshest_first": False},
    "ready_first": {"name": "ready_first", "max_staleness_versions": 1},
}


@dataclass
class Completion:
    """NeMo-RL's ``Completion``: one generation's message log and reward."""

    message_log: list[dict[str, Any]]
    reward: float


@dataclass
class PromptGroupRecord:
    """NeMo-RL's ``PromptGroupRecord`` (same fields): what a rollout hands ``commit``."""

    prompt_idx: int
    prompt: list[dict[str, Any]]
    extra_env_info: dict[str, Any] | None
    metadata: dict[str, Any]
    completions: list[Completion]
    rollout_metrics: dict[str, Any] = field(default_factory=dict)


def grpo_record(prompt_idx: int, answer_tokens: tuple[int, ...] = (7, 8, 9)) -> PromptGroupRecord:
    """A two-completion record: a 2-token user prompt and an assistant answer per completion."""
    prompt = [{"role": "user", "token_ids": torch.tensor([1, 2])}]
    completions = [Completion([prompt[0], {"role": "assistant", "token_ids": torch.tensor(answer_tokens[:k + 2]),
                                           "generation_logprobs": torch.full((k + 2,), -0.5)}], float(k))
                   for k in range(N_GENS)]
    return PromptGroupRecord(prompt_idx, prompt, None, {}, completions)


def batch() -> dict[str, torch.Tensor]:
    """What NeMo-RL's buffer tests commit: their stubbed converter's two rows of 3 tokens."""
    return {"input_ids": torch.ones((N_GENS, 3), dtype=torch.long),
            "input_lengths": torch.full((N_GENS,), 3, dtype=torch.long),
            "total_reward": torch.zeros(N_GENS, dtype=torch.float32)}


def run(coro: Any) -> Any:
    """NeMo-RL's tests' ``_run``."""
    return asyncio.run(coro)


def store_config(path: str, sampler: Any, *, capacity: int = 16, per_step: int = 2,
                 schema: dict[str, Any] = SCHEMA) -> dict[str, Any]:
    """An ``async_rl.replay_buffer``-style kvckpt config."""
    return {"backend": "kvckpt", "path": path, "num_generations_per_prompt": N_GENS, "num_prompts_per_step": per_step,
            "max_buffered_rollouts": capacity, "sampler": sampler, "schema": schema}


def add_group(buf: TQReplayBuffer, weight: int, end_weight: int | None = None,
              target_step: int | None = None) -> Any:
    """NeMo-RL's ``_add_group``: reserve then commit one group."""
    group_id = buf.reserve(weight_version=weight, target_step=target_step)
    return run(buf.commit(group_id, batch(), start_weight_version=weight,
                          end_weight_version=weight if end_weight is None else end_weight))


def stamp(buf: TQReplayBuffer, sampler: KvckptSampler, step: int) -> None:
    """Admit in_order batches until one is stamped ``step`` (the trainer follows at the lookahead)."""
    window = sampler.max_lookahead_versions
    while sampler.dispatch_index < step:
        version = max(buf.core.trainer_version, sampler.dispatch_index + 1 - window)
        run(sampler.admit(trainer_version_fn=lambda version=version: version))
