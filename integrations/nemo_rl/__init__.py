"""NeMo-RL's replay buffer, staleness samplers, recovery ledger and data plane, backed by kvckpt.

``TQReplayBuffer(dp_client, partition_id=..., pad_value_dict=...)`` has NeMo-RL's constructor
and surface; :func:`create_sampler` is NeMo-RL's factory (same classes, same keyword-only,
awaited calls); ``buffer.ledger`` is the ownership ledger; :class:`KvckptDataPlane` answers the
controller's ``get_samples`` / ``put_samples`` / ``clear_samples`` from the same store.
:func:`configure` (or ``config=``) says which store to open: an ``async_rl.replay_buffer``
section with ``backend: kvckpt`` in the master config. Nothing here imports NeMo-RL;
``docs/integrations.md`` lists every member.
"""

from kvckpt.integrations.nemo_rl.adapter import TQReplayBuffer
from kvckpt.integrations.nemo_rl.config import GRPO_SCHEMA, AdapterConfig, configure, from_master_config, parse_config
from kvckpt.integrations.nemo_rl.dataplane import KvckptDataPlane
from kvckpt.integrations.nemo_rl.factories import create_replay_buffer, restore_replay_buffer
from kvckpt.integrations.nemo_rl.handle import open_store
from kvckpt.integrations.nemo_rl.ledger import KvckptLedger
from kvckpt.integrations.nemo_rl.meta import ReplayMeta
from kvckpt.integrations.nemo_rl.records import record_to_rows
from kvckpt.integrations.nemo_rl.sampler import (
    InOrderSampler,
    KvckptSampler,
    ReadyFirstSampler,
    WeightFifoSampler,
    WindowedSampler,
    create_sampler,
)

__all__ = [
    "GRPO_SCHEMA", "AdapterConfig", "InOrderSampler", "KvckptDataPlane", "KvckptLedger", "KvckptSampler",
    "ReadyFirstSampler", "ReplayMeta", "TQReplayBuffer", "WeightFifoSampler", "WindowedSampler", "configure",
    "create_replay_buffer", "create_sampler", "from_master_config", "open_store", "parse_config", "record_to_rows",
    "restore_replay_buffer",
]
