"""Failover: promote a replay buffer's standby to primary and recover it as a restart does
(docs/replication.md, "Epochs and promotion").

:func:`promote` is two steps, each one transaction: the role and epoch change
(:func:`kvckpt.storage.replica.promote_store`), then :meth:`kvckpt.ReplayBuffer.recover`, exactly
as a restart after a crash runs it (every lease fenced onto a new timeline, the plan lists the
in-flight prompts to redispatch once each). A crash between the two leaves a promoted primary not
yet recovered, which the next open and recover (what a restart does) finishes.
"""

from __future__ import annotations

import os

from kvckpt.buffer.replay_buffer import ReplayBuffer
from kvckpt.durability.recovery import RecoveryPlan
from kvckpt.storage.replica import promote_store
from kvckpt.storage.store import Store


def promote(path: str, resume_version: int | None = None) -> tuple[ReplayBuffer, RecoveryPlan]:
    """Promote the standby replay buffer at ``path`` (closed) and recover it to ``resume_version``
    (the trainer version of the model checkpoint the run resumes from; ``None`` as
    :meth:`~kvckpt.ReplayBuffer.recover` takes it); the open buffer, now the primary, and its plan.

    Raises:
        NotStandby: the store is not a standby. RecoveryError: as :meth:`~kvckpt.ReplayBuffer.recover`.
    """
    path = os.path.abspath(path)
    with Store(path) as store:
        promote_store(store)
    buffer = ReplayBuffer.open(path)
    try:
        return buffer, buffer.recover(resume_version)
    except BaseException:
        buffer.close()
        raise
