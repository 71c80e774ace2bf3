"""A value store replicated through Ray: the verl ledger's and TransferQueue's store kind with a
standby (docs/replication.md, "The value store on Ray").

:class:`ReplicatedValueStore` has :class:`~kvckpt.ValueStore`'s methods and the replication calls
a buffer actor answers (``replica_status``, ``apply_log``, ``receive_snapshot``,
``install_snapshot``, ``watch_primary``, ``promote``), so it serves either side of a pair:

* **as a primary** (``replication=`` a :class:`~kvckpt.integrations.ray.replication.ReplicationConfig`
  or its dict) its file is a replicated primary (every write transaction appends one log record, in
  it) and the buffer actor's :class:`~kvckpt.integrations.ray.replication.Shipper` ships the log to
  the standby actor named there, on an event loop of its own (a value-store actor is a threaded
  actor: its calls run on threads, not on a loop). Every write method runs under the level as a
  buffer actor's does: refused with :class:`~kvckpt.errors.NotPrimary` once the standby refused
  this primary as replaced (fenced), held in ``async`` while a connected standby lags past
  ``max_lag_s``, and in a remote level answered only once the standby acknowledged the sequence it
  wrote. A :meth:`load` starts a new history (:meth:`kvckpt.ValueStore.load`), so the shipper is
  started again: the standby takes a snapshot;
* **as a standby** (``standby=True``) it holds a :class:`~kvckpt.Standby` of the file (empty until
  the primary's first snapshot), applies shipped batches (one durable transaction each, idempotent
  by sequence), refuses every data call with :class:`~kvckpt.errors.NotPrimary`, and :meth:`promote`
  makes it the primary (:func:`kvckpt.promote_value_store`: a new epoch in one transaction, then the
  file opened as a value store). A restart of a promoted one opens its file as the primary it became.

Without ``replication`` and ``standby`` it is a plain value store (every call goes straight through).
Automatic promotion is the buffer actor's only (``auto_promote``); a value store's standby is
promoted by calling :meth:`promote`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import ray
from kvckpt.integrations.ray.replication import ReplicationConfig, Shipper, StandbySide

from kvckpt import KvckptError, ValueStore, ValueView, enable_replication, replication_status
from kvckpt.errors import NotPrimary, NotStandby

T = TypeVar("T")


class ReplicatedValueStore:
    """One value store file, a replicated primary or its standby (see the module docstring).

    Args:
        path: the live file, on a local disk of the node the process runs on.
        replication: as a primary, the standby actor's name and the level
            (:class:`~kvckpt.integrations.ray.replication.ReplicationConfig` or its dict). Defaults to none.
        standby: hold ``path`` as a standby's file. Defaults to False.
        node_id: the node reported to the standby (a primary's). Defaults to this process's Ray node.

    Raises:
        FormatError: the file is a kvckpt store of another kind. StoreLocked: another process holds it.
    """

    def __init__(self, path: str, *, replication: ReplicationConfig | Mapping[str, Any] | None = None,
                 standby: bool = False, node_id: str | None = None) -> None:
        self.path = os.path.abspath(path)
        self._config = ReplicationConfig.of(replication)
        self._node_id = node_id
        self._values: ValueStore | None = None
        self._side: StandbySide | None = None
        self._shipper: Shipper | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self.promoted_from: int | None = None
        if standby:
            with contextlib.suppress(NotStandby):  # a promoted standby's restart: it is the primary now
                self._side = StandbySide(self.path)
                return
        self._open_primary(ValueStore(self.path))

    def _open_primary(self, values: ValueStore) -> None:
        self._values = values
        if self._config is not None:
            enable_replication(values)
            node = self._node_id or ray.get_runtime_context().get_node_id()
            self._shipper = Shipper(values, self._config, node)  # type: ignore[arg-type]  # either store kind

    @property
    def role(self) -> str:
        """``"primary"`` or ``"standby"`` (what this process holds now)."""
        return "standby" if self._values is None else "primary"

    # -- the shipper's loop ------------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the shipper's event loop (started on first use, a daemon thread) and wait for it."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name=f"kvckpt-shipper {self.path}",
                                 daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _primary(self) -> ValueStore:
        if self._values is None:
            raise NotPrimary(f"{self.path!r} is a standby: it serves the value store once promoted")
        return self._values

    def _write(self, fn: Callable[[ValueStore], T]) -> T:
        """``fn`` (one write of the value store) under the replication level (see the module docstring)."""
        values, shipper = self._primary(), self._shipper
        if shipper is None:
            return fn(values)

        async def before() -> None:
            shipper.start()
            await shipper.before_write()

        self._run(before())
        try:
            return fn(values)
        finally:
            self._run(shipper.after_write())

    # -- writes (each under the level) -------------------------------------------------------------
    def put(self, keys: list[str], values: list[bytes]) -> None:
        """:meth:`kvckpt.ValueStore.put`, under the replication level."""
        self._write(lambda v: v.put(keys, values))

    def write(self, keys: list[str], values: list[bytes], deletes: list[str], *,
              fence: tuple[str, str] | None = None) -> None:
        """:meth:`kvckpt.ValueStore.write`, under the replication level."""
        self._write(lambda v: v.write(keys, values, deletes, fence=fence))

    def update(self, plan: Callable[[ValueView], tuple[list[str], list[bytes], list[str]]], *,
               fence: tuple[str, str] | None = None) -> None:
        """:meth:`kvckpt.ValueStore.update`, under the replication level."""
        self._write(lambda v: v.update(plan, fence=fence))

    def record_progress(self, items: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int | KvckptError]:
        """:meth:`kvckpt.ValueStore.record_progress`, under the replication level."""
        return self._write(lambda v: v.record_progress(items, **kwargs))

    def clear(self, keys: list[str], write_ids: list[str | None] | None = None) -> int:
        """:meth:`kvckpt.ValueStore.clear`, under the replication level."""
        return self._write(lambda v: v.clear(keys, write_ids))

    def merge_checkpoint(self, source: str, choose: Callable[..., list[str]], **kwargs: Any) -> dict[str, Any]:
        """:meth:`kvckpt.ValueStore.merge_checkpoint`, under the replication level."""
        return self._write(lambda v: v.merge_checkpoint(source, choose, **kwargs))

    def checkpoint(self, dest: str, *, fence: tuple[str, str] | None = None) -> dict[str, Any]:
        """:meth:`kvckpt.ValueStore.checkpoint` (its stamp is a write), under the replication level."""
        return self._write(lambda v: v.checkpoint(dest, fence=fence))

    def load(self, source: str, *, checkpoint_id: str | None = None) -> dict[str, Any]:
        """:meth:`kvckpt.ValueStore.load`: the file rewound to a checkpoint starts a new replication
        history, so the shipper starts again and the standby takes a snapshot of it.

        Raises:
            NotPrimary: this is a standby, or a fenced primary. As :meth:`kvckpt.ValueStore.load` otherwise.
        """
        values, shipper = self._primary(), self._shipper
        if shipper is not None:
            shipper.check()
            self._run(shipper.stop())
        try:
            return values.load(source, checkpoint_id=checkpoint_id)
        finally:
            if shipper is not None:  # a new history, or the old one when the load was refused: ask the standby
                self._open_primary(values)

    # -- reads -------------------------------------------------------------------------------------
    def get(self, keys: list[str]) -> list[bytes | None]:
        """:meth:`kvckpt.ValueStore.get`."""
        return self._primary().get(keys)

    def keys(self, prefix: str = "") -> list[str]:
        """:meth:`kvckpt.ValueStore.keys`."""
        return self._primary().keys(prefix)

    def progress(self, group: str, index: int, **kwargs: Any) -> Any:
        """:meth:`kvckpt.ValueStore.progress`."""
        return self._primary().progress(group, index, **kwargs)

    def stamp_id(self) -> str | None:
        """:meth:`kvckpt.ValueStore.stamp_id`."""
        return self._primary().stamp_id()

    def count(self) -> int:
        """:meth:`kvckpt.ValueStore.count`."""
        return self._primary().count()

    def info(self) -> dict[str, Any]:
        """:meth:`kvckpt.ValueStore.info` as a primary; ``{"path", "role": "standby"}`` as a standby."""
        if self._values is None:
            return {"path": self.path, "role": self.role}
        return {**self._values.info(), "role": self.role}

    # -- replication -------------------------------------------------------------------------------
    def replica_status(self) -> dict[str, Any] | None:
        """As a standby: role, epoch, ``applied`` and ``store_tag`` (``None`` before its first
        snapshot). As a primary: :func:`kvckpt.replication_status`, with the shipper's view
        (``acked``, ``lag_records``, ``lag_s``, ``connected``, ``fenced``, ``ack``) when it replicates."""
        if self._side is not None:
            return self._side.status()
        status = replication_status(self._primary())
        if status is not None and self._shipper is not None:
            shipper = self._shipper

            async def lag() -> dict[str, Any]:
                return shipper.lag()

            status = {**status, **self._run(lag())}
        return status

    def _standby_side(self) -> StandbySide:
        if self._side is None:
            raise NotStandby(f"{self.path!r} is a primary: it applies no shipped log (a sender of one is an old "
                             "primary)")
        return self._side

    def apply_log(self, records: Sequence[bytes]) -> int:
        """As a standby: apply a shipped batch in one durable transaction (:meth:`kvckpt.Standby.apply`).

        Raises:
            NotStandby: this is a primary (promoted: the sender is an old primary).
            LogGap, CorruptLogRecord, ForeignStore, StaleEpoch, RepeatedSequence: the batch is refused.
        """
        return self._standby_side().apply(records)

    def receive_snapshot(self, token: str, offset: int, data: bytes) -> None:
        """As a standby: one chunk of a snapshot the primary is copying here."""
        self._standby_side().receive(token, offset, data)

    def install_snapshot(self, token: str, size: int) -> int:
        """As a standby: install the snapshot received under ``token``; returns the sequence it holds."""
        return self._standby_side().install(token, size)

    def watch_primary(self, node_id: str) -> None:
        """As a standby: the primary's node (kept for :meth:`info`; promotion is by :meth:`promote`)."""
        self._standby_side().primary_node = node_id

    def promote(self) -> dict[str, Any]:
        """As a standby: become the primary (:func:`kvckpt.promote_value_store`: a new epoch in one
        transaction; the old primary's shipments are refused from then on). Returns the new
        :func:`kvckpt.replication_status` and ``promoted_from``, the sequence it had applied. It ships
        to no standby until one is configured for it.

        Raises:
            NotStandby: this is a primary already, or nothing was ever installed.
        """
        side = self._standby_side()
        standby = side.standby
        if standby is None:
            raise NotStandby(f"{self.path!r} holds no standby: nothing to promote")
        self.promoted_from = standby.applied
        side.standby = None
        try:
            self._values = standby.promote_values()
        except BaseException:
            with contextlib.suppress(KvckptError):
                side.standby = type(standby)(self.path)  # still a standby if the promotion did not commit
            raise
        self._side = None
        return {**(replication_status(self._values) or {}), "promoted_from": self.promoted_from}

    def close(self) -> None:
        """Stop the shipper and close the file (idempotent)."""
        if self._shipper is not None and self._loop is not None:
            self._run(self._shipper.stop())
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        if self._side is not None:
            self._side.close()
        if self._values is not None:
            self._values.close()


#: :class:`ReplicatedValueStore` as a Ray actor (TransferQueue's value store with a standby, or the
#: standby of one): calls one at a time, checkpoints in a group of their own, as
#: :data:`kvckpt.integrations.transferqueue.ValueStoreActor`.
ReplicatedValueStoreActor = ray.remote(num_cpus=0, concurrency_groups={"checkpoint": 1})(ReplicatedValueStore)
