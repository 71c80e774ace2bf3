"""TRL integration: ``AsyncGRPOTrainer``'s rollout worker and rollout queue on a kvckpt store.

* :class:`KvckptRolloutWorker` — TRL's ``RolloutWorkerProtocol``: prompts leave the dataset through
  kvckpt's admission (the ledger owns the cursor and every in-flight prompt), groups are generated
  in process and committed durably, and its ``rollout_buffer`` serves the trainer from the store
  with TRL's ``max_staleness`` rule (a stale group is evicted in a transaction).
* :class:`InProcessWeightTransfer` — TRL's ``WeightTransferProtocol`` for the worker's own engine.
* :class:`ServerWeightSync` — TRL's ``WeightTransferProtocol`` on the server path: TRL's own transfer,
  which also tells the worker's stream when the server's weights changed (each token's stamp).
* :class:`KvckptCallback` — the ``TrainerCallback`` that closes a kvckpt step per optimizer step,
  writes the buffer's checkpoint into TRL's ``checkpoint-N/`` and, on ``resume_from_checkpoint``,
  recovers the live store (or restores that file) at step N.

TRL itself is imported only where its own types are needed; a missing TRL (or transformers) raises
``PeerMissing`` (``kvckpt.integrations.common``) naming ``pip install 'kvckpt[trl]'``.
"""

from kvckpt.integrations.trl.callback import BUFFER_FILE, KvckptCallback
from kvckpt.integrations.trl.queue import BufferQueue
from kvckpt.integrations.trl.sync import ServerWeightSync
from kvckpt.integrations.trl.worker import InProcessWeightTransfer, KvckptRolloutWorker, trl_schema

__all__ = ["BUFFER_FILE", "BufferQueue", "InProcessWeightTransfer", "KvckptCallback", "KvckptRolloutWorker",
           "ServerWeightSync", "trl_schema"]
