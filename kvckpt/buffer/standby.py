"""Replication through a buffer's handle: a primary's log, a standby, and failover
(docs/replication.md). What the Ray actors (:mod:`kvckpt.integrations.ray`) and other transports
use, as the public API (``from kvckpt import Standby, enable_replication, ...``).

* the primary's side works on an open :class:`~kvckpt.ReplayBuffer` or :class:`~kvckpt.ValueStore`
  (both store kinds replicate through the same log): :func:`enable_replication`,
  :func:`replication_status`, :func:`log_since` (the records to ship), :func:`trim_log` (what the
  standby acknowledged), :func:`snapshot_for_standby` (a snapshot for catch-up);
* :class:`Standby` holds a standby's file: it installs a shipped snapshot (:meth:`Standby.install`),
  applies shipped batches (:meth:`Standby.apply`: one durable transaction each, idempotent by
  sequence) and is promoted (:meth:`Standby.promote`);
* :func:`promote` is two steps, each one transaction: the role and epoch change
  (:func:`kvckpt.storage.replica.promote_store`), then :meth:`kvckpt.ReplayBuffer.recover`, exactly
  as a restart after a crash runs it (every lease fenced onto a new timeline, the plan lists the
  in-flight prompts to redispatch once each). A crash between the two leaves a promoted primary
  not yet recovered, which the next open and recover (what a restart does) finishes;
* :func:`promote_value_store` is the value store's: the role and epoch change, then the file is
  opened as a :class:`~kvckpt.ValueStore` (a value store holds no leases or steps: opening it is
  all a restart does).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kvckpt.buffer.replay_buffer import ReplayBuffer
from kvckpt.buffer.values import ValueStore
from kvckpt.durability import replication
from kvckpt.durability.checkpoint import CheckpointHandle
from kvckpt.durability.recovery import RecoveryPlan
from kvckpt.errors import FormatError, NotPrimary, NotStandby
from kvckpt.storage.replica import apply_batch, promote_store
from kvckpt.storage.replog import DEFAULT_MAX_RECORDS, PRIMARY, STANDBY, ReplicationLog
from kvckpt.storage.store import Store
from kvckpt.values import records as value_records

#: What the primary's side works on: either store kind's open handle.
Replicated = ReplayBuffer | ValueStore


def _primary_log(buffer: Replicated) -> ReplicationLog:
    log = buffer.store.replication
    if log is None or log.role != PRIMARY:
        raise NotPrimary(f"{buffer.store.path!r} is not a replicated primary (enable_replication makes it one)")
    return log


def enable_replication(buffer: Replicated, *, max_records: int = DEFAULT_MAX_RECORDS) -> dict[str, Any]:
    """Make the open ``buffer``'s file (a replay buffer's or a value store's) a replicated primary
    (one transaction; a primary stays as it is) and return :func:`replication_status`. From then on
    every write transaction appends one log record, whoever opens the file.

    Raises:
        NotPrimary: the file is a standby. FormatError, ReadOnlyStore, BadArgument: as
            :meth:`kvckpt.storage.replog.ReplicationLog.enable`.
    """
    return ReplicationLog.enable(buffer.store, max_records=max_records).status()


def replication_status(buffer: Replicated) -> dict[str, Any] | None:
    """The replication state of ``buffer``'s file (role, epoch, ``last`` sequence, ``acked``,
    ``lag_records``, ``standby``: ``streaming`` or ``snapshot``; ``store_tag``: the hex of the store
    id its records carry), ``None`` if not replicated."""
    log = buffer.store.replication
    return None if log is None else {**log.status(), "store_tag": log.tag.hex()}


def log_since(buffer: Replicated, after: int, limit: int = 1024) -> list[bytes]:
    """Up to ``limit`` log records after sequence ``after``, in order (what is shipped).

    Raises:
        NotPrimary: not a replicated primary. LogGap: the log no longer holds record ``after + 1``
            (the standby must catch up from a snapshot).
    """
    return _primary_log(buffer).read_since(after, limit)


def trim_log(buffer: Replicated, acked: int) -> None:
    """Record that the standby holds every record through ``acked`` and delete them (one transaction).

    Raises:
        NotPrimary: not a replicated primary. BadArgument: ``acked`` is past the last record.
    """
    _primary_log(buffer).trim(acked)


def snapshot_for_standby(buffer: Replicated, dest: str | os.PathLike[str]) -> CheckpointHandle:
    """Copy the primary's state to ``dest`` for a standby (producers keep writing meanwhile); the
    handle's ``wait().trainer_version`` is the log sequence the snapshot holds exactly.

    Raises:
        NotPrimary: not a replicated primary. CheckpointError: as :func:`kvckpt.checkpoint`.
    """
    _primary_log(buffer)
    return replication.snapshot_for_standby(buffer.store, dest)


class Standby:
    """The writable handle of a standby's file: it changes only by :meth:`apply` (and
    :meth:`install`, :meth:`promote`). One per file; close it before another process opens the file.

    Raises (on open):
        NotStandby: the file is not a standby's (not replicated, or a primary).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(path)
        self._store: Store | None = Store(self.path)
        log = self._store.replication
        if log is None or log.role != STANDBY:
            self._store.close()
            self._store = None
            raise NotStandby(f"{self.path!r} is not a standby's file")

    @classmethod
    def install(cls, snapshot_file: str, path: str | os.PathLike[str]) -> Standby:
        """Install ``snapshot_file`` (:func:`snapshot_for_standby`'s, untrusted: proven first) at
        ``path`` as a standby, replacing whatever is there (closed), and open it.

        Raises:
            FormatError: the file is damaged or not a replicated primary's snapshot (``path`` is
                untouched).
        """
        replication.install_standby(snapshot_file, os.path.abspath(path))
        return cls(path)

    def _open(self) -> Store:
        if self._store is None:
            raise NotStandby(f"the standby handle of {self.path!r} is closed (or promoted)")
        return self._store

    @property
    def applied(self) -> int:
        """The last sequence applied (durable)."""
        return self._open().replication.last

    @property
    def epoch(self) -> int:
        """The epoch of the last primary whose records it applied."""
        return self._open().replication.epoch

    def status(self) -> dict[str, Any]:
        """Role, epoch, ``applied`` (and ``last``, the same) and the store id tag (hex)."""
        log = self._open().replication
        return {**log.status(), "applied": log.last, "store_tag": log.tag.hex()}

    def apply(self, records: Sequence[bytes]) -> int:
        """Apply a shipped batch (one durable transaction) and return the sequence applied through;
        a resend of what is applied is answered, not applied again.

        Raises:
            NotStandby, CorruptLogRecord, ForeignStore, StaleEpoch, RepeatedSequence, LogGap: as
                :func:`kvckpt.storage.replica.apply_batch`: nothing was applied.
        """
        return apply_batch(self._open(), records)

    def promote(self, resume_version: int | None = None) -> tuple[ReplayBuffer, RecoveryPlan]:
        """Close this handle and :func:`promote` the file: the open buffer, now the primary, and its
        recovery plan. The handle is closed afterwards whatever happens."""
        self.close()
        return promote(self.path, resume_version)

    def promote_values(self) -> ValueStore:
        """Close this handle and :func:`promote_value_store` the file: the open value store, now the
        primary. The handle is closed afterwards whatever happens."""
        self.close()
        return promote_value_store(self.path)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> Standby:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def promote(path: str, resume_version: int | None = None) -> tuple[ReplayBuffer, RecoveryPlan]:
    """Promote the standby replay buffer at ``path`` (closed) and recover it to ``resume_version``
    (the trainer version of the model checkpoint the run resumes from; ``None`` as
    :meth:`~kvckpt.ReplayBuffer.recover` takes it); the open buffer, now the primary, and its plan.

    Raises:
        NotStandby: the store is not a standby. FormatError: it is a value store's file (nothing is
            changed). RecoveryError: as :meth:`~kvckpt.ReplayBuffer.recover`.
    """
    path = os.path.abspath(path)
    with Store(path) as store:
        if store.read(value_records.kind_of) is not None:
            raise FormatError(f"{path!r} is a value store's file; promote it with kvckpt.promote_value_store")
        promote_store(store)
    buffer = ReplayBuffer.open(path)
    try:
        return buffer, buffer.recover(resume_version)
    except BaseException:
        buffer.close()
        raise


def promote_value_store(path: str | os.PathLike[str]) -> ValueStore:
    """Promote the standby value store at ``path`` (closed) and open it: its epoch goes up by one in
    one transaction (:func:`kvckpt.storage.replica.promote_store`), so its old primary's shipments
    are refused from then on, and it is opened as the primary :class:`~kvckpt.ValueStore`. Its log
    starts after the sequence it applied; a standby of it starts from a snapshot.

    Raises:
        NotStandby: the store is not a standby. FormatError: it is not a value store's file (nothing
            is changed).
    """
    path = os.path.abspath(path)
    with Store(path) as store:
        if store.read(value_records.kind_of) is None:
            raise FormatError(f"{path!r} is not a value store's file; promote a replay buffer's with kvckpt.promote")
        promote_store(store)
    return ValueStore(path)
