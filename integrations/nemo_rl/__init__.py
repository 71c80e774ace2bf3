"""A NeMo-RL-shaped replay buffer backed by kvckpt: swap the buffer by configuration.

:func:`create_replay_buffer` takes NeMo-RL's config keys (``max_buffered_rollouts``, a ``sampler``
section with ``name`` and ``max_lookahead_versions`` / ``max_staleness_versions`` /
``sample_freshest_first``, ``num_generations_per_prompt``, ``num_prompts_per_step``) plus ``path``
and returns a :class:`KvckptReplayBuffer` with NeMo-RL's buffer surface, its ``.sampler``
(:class:`KvckptSampler`) and its ``.ledger`` (:class:`KvckptLedger`). Only kvckpt is needed:
nothing here imports NeMo-RL. ``docs/integrations.md`` maps each call to its transaction.
"""

from .adapter import KvckptReplayBuffer, create_replay_buffer, restore_replay_buffer
from .config import GRPO_SCHEMA, AdapterConfig, parse_config
from .ledger import KvckptLedger
from .meta import ReplayMeta
from .sampler import KvckptSampler

__all__ = [
    "GRPO_SCHEMA", "AdapterConfig", "KvckptLedger", "KvckptReplayBuffer", "KvckptSampler", "ReplayMeta",
    "create_replay_buffer", "parse_config", "restore_replay_buffer",
]
