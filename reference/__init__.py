"""The reference asynchronous GRPO trainer: a small but real RL loop with kvckpt as its replay buffer.

* :class:`GRPOTrainer` — rollout pump and train pump over one buffer, checkpoints of model,
  optimizer and buffer in one ``step_N/`` directory, resume from the live store or a checkpoint.
* :class:`TrainerConfig` — the configuration (dict or YAML); ``replay_buffer.backend`` picks
  ``kvckpt`` or the in-memory :class:`MemoryReplayBuffer`.
* :mod:`.faults` — test-only fault injection hooks (crash points, parked rollouts).

See docs/trainer.md.
"""

from kvckpt.reference.config import TrainerConfig
from kvckpt.reference.faults import CrashAt, Hooks, ParkRollout
from kvckpt.reference.grpo import GRPOTrainer, group_advantages, grpo_loss, sft_warmup

from kvckpt.testing.fixtures.memory_buffer import MemoryReplayBuffer

__all__ = ["CrashAt", "GRPOTrainer", "Hooks", "MemoryReplayBuffer", "ParkRollout", "TrainerConfig",
           "group_advantages", "grpo_loss", "sft_warmup"]
