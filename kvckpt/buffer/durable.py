"""The buffer-level entry points of durability: checkpoint a buffer, restore a checkpoint file
into an open buffer, recover a buffer. The work is done by :mod:`kvckpt.durability`, on the store."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from kvckpt.buffer.replay_buffer import ReplayBuffer
from kvckpt.durability.checkpoint import CheckpointHandle, restore_file
from kvckpt.durability.recovery import RecoveryPlan


def checkpoint(buffer: ReplayBuffer, dest: str | os.PathLike[str], trainer_state: Mapping[str, Any] | None = None,
               *, overwrite: bool = False, background: bool = True) -> CheckpointHandle:
    """Stamp ``buffer`` and copy it to ``dest`` as one file without stopping producers.

    The caller blocks only for the stamp transaction; the copy runs on a background thread
    (``background=False`` copies before returning). See
    :func:`kvckpt.durability.checkpoint.checkpoint_store` for the whole contract.

    Raises:
        CheckpointError: ``dest`` exists (without ``overwrite``), another checkpoint to ``dest``
            is still being written, or its directory is missing or not writable; checked before
            anything is stamped.
        BadArgument: ``trainer_state`` is not JSON-serialisable.
    """
    return buffer.checkpoint(dest, trainer_state, overwrite=overwrite, background=background)


def restore(checkpoint_file: str, live_path: str, *, sampler: Any = None,
            max_buffered_rollouts: int | None = None, overwrite: bool = False,
            trusted: bool = False, deep: bool = False) -> tuple[ReplayBuffer, RecoveryPlan]:
    """Restore a checkpoint file into ``live_path`` and return the open buffer and its plan.

    The checkpoint file is only read; its copy is checked, recovered at the stamped version and
    made durable under ``live_path`` before a fresh handle opens it (see
    :func:`kvckpt.durability.checkpoint.restore_file` for every check and argument). The live
    store is left untouched whenever ``restore`` raises.
    """
    t0 = time.perf_counter()
    plan = restore_file(checkpoint_file, live_path, sampler=sampler, max_buffered_rollouts=max_buffered_rollouts,
                        overwrite=overwrite, trusted=trusted, deep=deep)
    t1 = time.perf_counter()
    buffer = ReplayBuffer.open(os.path.abspath(live_path))
    plan.timings.update(open=time.perf_counter() - t1, restore_total=time.perf_counter() - t0)
    return buffer, plan


def recover(buffer: ReplayBuffer, resume_version: int | None = None, *, sampler: Any = None,
            max_buffered_rollouts: int | None = None, checksums: bool = False, deep: bool = False) -> RecoveryPlan:
    """Reconcile ``buffer`` to ``resume_version`` in one transaction and plan the redispatch
    (:meth:`ReplayBuffer.recover`; the contract is :func:`kvckpt.durability.recovery.recover_store`'s)."""
    return buffer.recover(resume_version, sampler=sampler, max_buffered_rollouts=max_buffered_rollouts,
                          checksums=checksums, deep=deep)
