"""The reference trainer's configuration: nested dataclasses built from a dict or a YAML file.

Every section and key is checked (by the integrations' shared loader,
:func:`kvckpt.integrations.common.load_config`): an unknown key is an error naming it, its section,
the file and the valid ones (a typo never silently falls back to a default). Paths left empty are
placed under ``output_dir``.

Example (YAML)::

    output_dir: runs/add
    seed: 0
    generation: {backend: transformers, group_size: 8, max_tokens: 4}
    train: {steps: 60, groups_per_step: 8, lr: 2.0e-4}
    replay_buffer:
      backend: kvckpt            # or: memory
      sampler: {name: in_order, max_lookahead_versions: 1}
      max_buffered_rollouts: 16
    checkpoint: {every_steps: 10, keep: 2}
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvckpt.integrations.common import load_config

from kvckpt.errors import BadArgument


@dataclass
class ModelConfig:
    """The tiny policy and its supervised warm-up.

    Args:
        cache_dir: where :func:`~kvckpt.testing.fixtures.tiny_model.ensure_tiny_model` caches
            the model. Defaults to ``~/.cache/kvckpt/tiny-model``.
        sft_steps: supervised steps on correct answers before RL (gives GRPO a reward signal),
            skipped when resuming. Defaults to 100.
        sft_lr: Defaults to 1e-3.
        sft_batch: prompts per supervised step. Defaults to 32.
    """

    cache_dir: str | None = None
    sft_steps: int = 100
    sft_lr: float = 1e-3
    sft_batch: int = 32


@dataclass
class TaskConfig:
    """The verifiable task (see :class:`~kvckpt.testing.fixtures.tiny_model.AdditionTask`).

    Args:
        name: only ``"addition"``. Defaults to it.
        max_operand: operands range over ``0..max_operand``. Defaults to 9.
        repeat: how many times a completion writes the sum (space-separated; the reward is the
            share of them that are right): long completions whose every token is scored. Defaults to 1.
    """

    name: str = "addition"
    max_operand: int = 9
    repeat: int = 1


@dataclass
class GenerationConfig:
    """The rollout workers.

    Args:
        backend: ``"transformers"`` or ``"vllm"``. Defaults to ``"transformers"``.
        group_size: completions per prompt (n). Defaults to 8.
        max_tokens: completion length cap. Defaults to 4.
        temperature: Defaults to 1.0.
        commit: ``"group"`` or ``"sample"`` (one commit per completion). Defaults to ``"group"``.
        workers: rollout workers, each with its own pump. Defaults to 1.
        ray: host the workers (and the buffer, for ``kvckpt``) in Ray actors. Defaults to False.
        backend_options: extra keyword arguments of the backend (e.g. vLLM's ``max_model_len``).
        progress_every_tokens: the workers record each sequence's new tokens durably every this
            many tokens (see :class:`~kvckpt.integrations.vllm.RolloutWorker`). Defaults to 256.
        progress_every_seconds: and every this many seconds. Defaults to None (by count only).
    """

    backend: str = "transformers"
    group_size: int = 8
    max_tokens: int = 4
    temperature: float = 1.0
    commit: str = "group"
    workers: int = 1
    ray: bool = False
    backend_options: dict[str, Any] = field(default_factory=dict)
    progress_every_tokens: int = 256
    progress_every_seconds: float | None = None


@dataclass
class TrainConfig:
    """The GRPO update.

    Args:
        steps: the run ends when this many steps are finished (counting resumed ones). Defaults to 40.
        groups_per_step: prompts (groups) per optimizer step. Defaults to 8.
        lr: Adam's learning rate. Defaults to 2e-4.
        clip_eps: PPO clip range of the importance ratio. Defaults to 0.2.
        time_limit_seconds: stop (with a final checkpoint) once a step ends past this much wall
            time, like a scheduler's time limit. Defaults to None (no limit).
        torch_threads: torch's intra-op threads (process-wide). The pumps run in parallel, so one
            each avoids oversubscribing small machines. Defaults to 1.
    """

    steps: int = 40
    groups_per_step: int = 8
    lr: float = 2e-4
    clip_eps: float = 0.2
    time_limit_seconds: float | None = None
    torch_threads: int = 1


@dataclass
class ReplayBufferConfig:
    """The replay buffer, chosen by ``backend``.

    Args:
        backend: ``"kvckpt"`` (the crash-consistent store) or ``"memory"`` (in-process dicts,
            lost with the process). Defaults to ``"kvckpt"``.
        path: the live store file. Defaults to ``<output_dir>/buffer.kvckpt``.
        sampler: a kvckpt sampler config. Defaults to ``{name: in_order, max_lookahead_versions: 1}``.
        max_buffered_rollouts: capacity (in flight + ready groups). Defaults to 16.
        durable_checkpoints: see :class:`kvckpt.BufferConfig`. Defaults to 2.
        retain_consumed: keep trained groups' rows (``kvckpt export --sft`` of the whole run);
            otherwise they are dropped once ``durable_checkpoints`` later checkpoints cover their
            step. Defaults to False.
    """

    backend: str = "kvckpt"
    path: str | None = None
    sampler: Any = field(default_factory=lambda: {"name": "in_order", "max_lookahead_versions": 1})
    max_buffered_rollouts: int = 16
    durable_checkpoints: int = 2
    retain_consumed: bool = False


@dataclass
class CheckpointConfig:
    """Checkpoints of model, optimizer and buffer, each in ``<dir>/step_<N>/``.

    Args:
        dir: Defaults to ``<output_dir>/checkpoints``.
        every_steps: checkpoint after every this many steps (0: never). Defaults to 10.
        every_seconds: also checkpoint once this much time passed since the last one. Defaults to None.
        at_end: checkpoint when the run ends (steps done or time limit). Defaults to True.
        keep: complete checkpoints kept (older ones deleted). Defaults to 2.
        resume: ``"auto"`` (resume from the latest checkpoint and the live store if present) or
            ``"never"`` (a fresh run; refuses an existing live store). Defaults to ``"auto"``.
        resume_from: ``"live"`` (reconcile the live store to the model checkpoint: no generation
            lost) or ``"checkpoint"`` (replace it by the checkpoint's buffer file). Defaults to ``"live"``.
    """

    dir: str | None = None
    every_steps: int = 10
    every_seconds: float | None = None
    at_end: bool = True
    keep: int = 2
    resume: str = "auto"
    resume_from: str = "live"


@dataclass
class MetricsConfig:
    """Where the per-step metrics go besides ``metrics_path`` (see :mod:`kvckpt.metrics`).

    Args:
        tensorboard_dir: a TensorBoard ``SummaryWriter`` log directory (needs ``tensorboard``).
            Defaults to None.
        wandb_project: a W&B project to ``wandb.init`` a run in (needs ``wandb``). Defaults to None.
        every_steps: report every this many steps. Defaults to 1.
    """

    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    every_steps: int = 1


@dataclass
class TrainerConfig:
    """The whole configuration. Build it with :meth:`from_any`.

    Args:
        output_dir: run directory (metrics, checkpoints, live store by default).
        seed: seeds the model, the dataset order, sampling and the supervised warm-up. Defaults to 0.
        metrics_path: per-step JSONL. Defaults to ``<output_dir>/metrics.jsonl``.
        metrics: TensorBoard / W&B reporting (:class:`MetricsConfig`). Defaults to none.
    """

    output_dir: str
    seed: int = 0
    metrics_path: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    replay_buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        self.output_dir = os.path.abspath(self.output_dir)
        self.metrics_path = self.metrics_path or os.path.join(self.output_dir, "metrics.jsonl")
        self.replay_buffer.path = self.replay_buffer.path or os.path.join(self.output_dir, "buffer.kvckpt")
        self.checkpoint.dir = self.checkpoint.dir or os.path.join(self.output_dir, "checkpoints")
        choices = {("generation", "backend"): ("transformers", "vllm"), ("generation", "commit"): ("group", "sample"),
                   ("replay_buffer", "backend"): ("kvckpt", "memory"), ("checkpoint", "resume"): ("auto", "never"),
                   ("checkpoint", "resume_from"): ("live", "checkpoint"), ("task", "name"): ("addition",)}
        for (section, key), allowed in choices.items():
            value = getattr(getattr(self, section), key)
            if value not in allowed:
                raise BadArgument(f"{section}.{key} must be one of {allowed}, got {value!r}")
        if self.checkpoint.keep < 1:
            raise BadArgument("checkpoint.keep must be >= 1")

    @classmethod
    def from_any(cls, source: TrainerConfig | Mapping[str, Any] | str | os.PathLike[str]) -> TrainerConfig:
        """A config from itself, a dict, or a YAML/JSON file path.

        Raises:
            BadArgument: an unknown section or key (the message lists the valid ones), or a bad value.
        """
        if isinstance(source, TrainerConfig):
            return source
        return load_config(cls, source)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form (paths resolved)."""
        return dataclasses.asdict(self)
