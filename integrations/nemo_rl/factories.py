"""The two other ways to build NeMo-RL's replay buffer: from a kvckpt config dict, or restored.

NeMo-RL's own ``TQReplayBuffer(dp_client, partition_id=..., pad_value_dict=...)`` reads the config
:func:`~.config.configure` set; these take it as an argument and build the buffer without a
data-plane client (``dp_client=None``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvckpt.integrations.nemo_rl.adapter import TQReplayBuffer
from kvckpt.integrations.nemo_rl.config import AdapterConfig, parse_config

from kvckpt import RecoveryPlan, restore


def create_replay_buffer(config: Mapping[str, Any] | AdapterConfig, *, pad_value_dict: Mapping[str, int] | None = None,
                         ) -> TQReplayBuffer:
    """The replay buffer a kvckpt config dict describes (see :func:`~.config.parse_config`),
    without a data-plane client: ``TQReplayBuffer(None, cfg.partition_id, config=cfg)``.

    Examples:
        >>> import tempfile
        >>> buf = create_replay_buffer({"path": tempfile.mkdtemp() + "/replay.kv",
        ...                             "num_generations_per_prompt": 4, "num_prompts_per_step": 2,
        ...                             "max_buffered_rollouts": 4,
        ...                             "sampler": {"name": "in_order", "max_lookahead_versions": 1}})
        >>> buf.sampler.name, buf.sampler.required_buffer_capacity(2), buf.sampler.dispatch_index
        ('in_order', 4, -1)
        >>> buf.close()

    Raises:
        BadArgument: an invalid config, or an existing store configured differently.
    """
    cfg = config if isinstance(config, AdapterConfig) else parse_config(config)
    return TQReplayBuffer(None, cfg.partition_id, pad_value_dict=pad_value_dict, config=cfg)


def restore_replay_buffer(config: Mapping[str, Any] | AdapterConfig,
                          checkpoint_file: str) -> tuple[TQReplayBuffer, RecoveryPlan]:
    """Restore the live store at ``config``'s ``path`` from a checkpoint file, in a fresh handle.

    The file is validated, copied over the live path and recovered at its stamped step (claims
    made after it return to ready; every in-flight prompt is fenced). The buffer's ledger owns
    the plan's leases: ``reserve(group_id=lease.group_id, target_step=lease.target_step, ...)``
    redispatches each exactly once, without a new admission. A sampler or capacity other than the
    checkpoint's is applied and reported in ``plan.changes``. Restore never evicts.

    Raises:
        FormatError / CorruptRecord / RecoveryError: the file is not a valid checkpoint (the live
            store is left untouched), or it holds more ready groups than ``max_buffered_rollouts``.
    """
    cfg = config if isinstance(config, AdapterConfig) else parse_config(config)
    core, plan = restore(checkpoint_file, cfg.path, overwrite=True, sampler=cfg.buffer.sampler.config(),
                         max_buffered_rollouts=cfg.buffer.max_buffered_rollouts)
    return TQReplayBuffer(None, cfg.partition_id, config=cfg, store=core, leases=plan.leases), plan
