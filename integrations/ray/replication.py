"""Replication between two buffer actors: the primary's shipper and the standby's side
(docs/replication.md, "On Ray"; docs/ray.md, the failure table).

* :class:`ReplicationConfig`: which actor is the standby and the acknowledgement level, one of
  :data:`LEVELS`: ``async`` (a write is acknowledged after the primary's own fsync; the standby's
  lag is measured in records and seconds, and while the standby is connected a write waits before
  it starts, and its answer waits, as long as the lag passes ``max_lag_s``), ``remote_apply`` and
  ``remote_durable`` (a write is acknowledged once the standby has applied it, durably: every apply
  is one fsynced transaction, so the two levels give the same promise, ``remote_durable``'s;
  docs/replication.md says why).
* :class:`Shipper`: the primary's background task. It asks the standby what it applied, ships
  the log from there in batches (``batch_records`` per call, one standby transaction each,
  idempotent by sequence, so a call that failed after it ran is simply sent again), trims the
  primary's log up to what was acknowledged, and when the standby is new or far behind (the log no
  longer holds its next record, or its history is another: the primary's file was restored) copies
  a snapshot to it in chunks and has it installed. Writes in
  a remote level wait for :meth:`Shipper.wait_acked`; a group of writes shares one round trip (one
  batch carries every record written meanwhile). If the standby answers that it is no longer a
  standby (it was promoted) or that the records' epoch is stale, the shipper **fences** this
  primary: every write waiting for an acknowledgement, and every later write, fails with
  :class:`~kvckpt.errors.NotPrimary`.
* :class:`StandbySide`: the standby actor's file (a :class:`~kvckpt.Standby`), the snapshot it is
  receiving, and the primary node it watches for automatic promotion.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import ray

from kvckpt import ReplayBuffer, Standby, log_since, replication_status, snapshot_for_standby, trim_log
from kvckpt.errors import BadArgument, LogGap, NotPrimary, NotStandby, StaleEpoch

log = logging.getLogger("kvckpt.replication")

ASYNC, REMOTE_APPLY, REMOTE_DURABLE = "async", "remote_apply", "remote_durable"
#: The acknowledgement levels, weakest first.
LEVELS = (ASYNC, REMOTE_APPLY, REMOTE_DURABLE)
#: Seconds between the standby's looks at the primary's node (automatic promotion).
WATCH_PERIOD_S = 0.5
#: Seconds between trims of the primary's log (each is one write transaction).
TRIM_PERIOD_S = 0.2
#: Acknowledgement lags a primary keeps until they are taken (:meth:`Shipper.take_lags`).
LAG_SAMPLES = 1 << 17


@dataclass(frozen=True)
class ReplicationConfig:
    """How a primary buffer actor replicates (see the module docstring).

    Args:
        standby: the standby actor's name (:func:`~kvckpt.integrations.ray.start_standby_actor`).
        ack: the acknowledgement level, one of :data:`LEVELS`. Defaults to ``remote_durable``.
        max_lag_s: in ``async``, the lag in seconds past which writes wait before they start.
            Defaults to 1.0.
        namespace: the standby's namespace. Defaults to the primary's.
        batch_records: log records per shipped call. Defaults to 1024.
        snapshot_chunk_bytes: bytes per call of a snapshot copied to the standby. Defaults to 8 MiB.

    Raises:
        BadArgument: an unknown level, or a bound or size below its minimum.
    """

    standby: str
    ack: str = REMOTE_DURABLE
    max_lag_s: float = 1.0
    namespace: str | None = None
    batch_records: int = 1024
    snapshot_chunk_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if self.ack not in LEVELS:
            raise BadArgument(f"unknown acknowledgement level {self.ack!r}; one of {', '.join(LEVELS)}")
        if not self.max_lag_s > 0 or self.batch_records < 1 or self.snapshot_chunk_bytes < 1:
            raise BadArgument("max_lag_s must be > 0, batch_records and snapshot_chunk_bytes >= 1")

    @classmethod
    def of(cls, value: ReplicationConfig | dict[str, Any] | None) -> ReplicationConfig | None:
        """``value`` as a config (a dict is its fields), ``None`` for none."""
        return value if value is None or isinstance(value, cls) else cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (what crosses the wire)."""
        return asdict(self)


def superseded(exc: BaseException) -> bool:
    """Whether a standby's refusal says this primary was replaced (its standby was promoted, or it
    holds a newer epoch): the primary must acknowledge nothing more."""
    return isinstance(exc, (NotStandby, StaleEpoch))


class Shipper:
    """The primary's side: ships the log to the standby, tracks what it acknowledged, fences (see
    the module docstring). Runs as one task on the actor's event loop, started by :meth:`start`."""

    def __init__(self, buffer: ReplayBuffer, config: ReplicationConfig, node_id: str) -> None:
        self.buffer, self.config, self.node_id = buffer, config, node_id
        #: The last sequence the standby acknowledged (``None`` until it answered).
        self.acked: int | None = None
        #: The error this primary is fenced with, once its standby refused it as replaced.
        self.fenced: BaseException | None = None
        self.connected = False
        self.snapshots = 0
        self.batches = 0
        self._standby: Any = None
        self._changed = asyncio.Condition()
        self._wake = asyncio.Event()
        self._written: deque[tuple[int, float]] = deque()  # (sequence, when written) not yet acknowledged
        #: Seconds from each write's return to the standby's acknowledgement of it (:meth:`take_lags`).
        self._lags: deque[float] = deque(maxlen=LAG_SAMPLES)
        #: In ``async``: writes held before they started (the lag was past the bound), and seconds held in all.
        self.held_writes = 0
        self.held_s = 0.0
        self._trimmed_at = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the shipping task on the running loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop the shipping task (what it shipped stays acknowledged)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    def last(self) -> int:
        """The primary's last sequence written."""
        status = replication_status(self.buffer)
        return 0 if status is None else status["last"]

    def written(self) -> int:
        """Note a write that returned (its record is at or before the last sequence) and wake the
        shipper; returns that sequence."""
        seq = self.last()
        if seq and (not self._written or self._written[-1][0] < seq) and seq > (self.acked or 0):
            self._written.append((seq, time.monotonic()))
        self._wake.set()
        return seq

    def lag(self) -> dict[str, Any]:
        """``lag_records`` (written, not acknowledged) and ``lag_s`` (how long the oldest of them
        has waited), ``acked``, ``connected``, ``fenced``."""
        last, acked = self.last(), self.acked or 0
        oldest = next((t for s, t in self._written if s > acked), None)
        return {"acked": self.acked, "lag_records": max(last - acked, 0),
                "lag_s": 0.0 if oldest is None else time.monotonic() - oldest, "connected": self.connected,
                "fenced": None if self.fenced is None else str(self.fenced), "snapshots": self.snapshots,
                "batches": self.batches, "ack": self.config.ack, "standby_name": self.config.standby,
                "max_lag_s": self.config.max_lag_s, "held_writes": self.held_writes, "held_s": self.held_s}

    def take_lags(self) -> list[float]:
        """The acknowledgement lags (seconds from a write's return to the standby's acknowledgement
        of its record) since the last call, at most :data:`LAG_SAMPLES` of the newest."""
        lags = list(self._lags)
        self._lags.clear()
        return lags

    def check(self) -> None:
        """Raise the fence, if this primary is fenced."""
        if self.fenced is not None:
            raise NotPrimary(f"this primary was replaced: {self.fenced}; it acknowledges nothing more")

    async def before_write(self) -> None:
        """Refuse when fenced; in ``async``, wait while the connected standby lags past the bound."""
        self.check()
        if self.config.ack != ASYNC:
            return
        await self._hold()
        self.check()

    async def after_write(self) -> None:
        """Note the write; in ``async``, hold its answer while the connected standby lags past the
        bound (what a loss of this node costs then spans at most ``max_lag_s`` of writes, however
        long the writes in progress take); in a remote level, wait until the standby acknowledged it."""
        seq = self.written()
        if self.config.ack == ASYNC:
            await self._hold()
            return
        await self.wait_acked(seq)

    async def _hold(self) -> None:
        """Wait while the connected standby lags past ``max_lag_s`` (counted in ``held_writes``, ``held_s``)."""
        held_since = None
        async with self._changed:
            while self.connected and self.fenced is None and self.lag()["lag_s"] > self.config.max_lag_s:
                if held_since is None:
                    held_since = time.monotonic()
                    self.held_writes += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 0.05)
        if held_since is not None:
            self.held_s += time.monotonic() - held_since

    async def wait_acked(self, seq: int) -> None:
        """Wait until the standby acknowledged ``seq``.

        Raises:
            NotPrimary: this primary was fenced meanwhile (nothing more is acknowledged).
        """
        async with self._changed:
            await self._changed.wait_for(lambda: self.fenced is not None or (self.acked or 0) >= seq)
        self.check()

    async def _acknowledged(self, applied: int) -> None:
        self.acked = max(self.acked or 0, applied)
        now = time.monotonic()
        while self._written and self._written[0][0] <= self.acked:
            self._lags.append(now - self._written.popleft()[1])
        async with self._changed:
            self._changed.notify_all()
        if now - self._trimmed_at >= TRIM_PERIOD_S:
            self._trimmed_at = now
            await asyncio.to_thread(trim_log, self.buffer, min(self.acked, self.last()))

    async def _fence(self, exc: BaseException) -> None:
        self.fenced = exc
        log.error("%s: the standby refused this primary as replaced (%s); fenced: it acknowledges nothing more",
                  self.buffer.store.path, exc)
        async with self._changed:
            self._changed.notify_all()

    async def _run(self) -> None:
        backoff = 0.05
        while self.fenced is None:
            try:
                await self._step()
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                if superseded(exc):
                    await self._fence(exc)
                    return
                if self.connected:
                    log.warning("%s: shipping to standby %r failed (%r); retrying", self.buffer.store.path,
                                self.config.standby, exc)
                self.connected, self.acked, self._standby = False, None, None
                async with self._changed:
                    self._changed.notify_all()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    async def _step(self) -> None:
        if self._standby is None:
            self._standby = await asyncio.to_thread(ray.get_actor, self.config.standby,
                                                    namespace=self.config.namespace)
            await self._standby.watch_primary.remote(self.node_id)
        if self.acked is None:
            status = await self._standby.replica_status.remote()
            mine = replication_status(self.buffer)
            if status is not None and status["role"] != "standby":
                raise NotStandby(f"the standby actor {self.config.standby!r} is a {status['role']} at epoch "
                                 f"{status['epoch']}")
            if status is not None and status["epoch"] > mine["epoch"]:
                raise StaleEpoch(f"the standby {self.config.standby!r} is at epoch {status['epoch']}, past this "
                                 f"primary's {mine['epoch']}")
            if status is None or status["store_tag"] != mine["store_tag"]:
                await self._snapshot()
                return
            await self._acknowledged(status["applied"])
            self.connected = True
        try:
            records = await asyncio.to_thread(log_since, self.buffer, self.acked, self.config.batch_records)
        except LogGap:
            await self._snapshot()
            return
        if not records:
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)
            return
        applied = await self._standby.apply_log.remote(records)
        self.batches += 1
        self.connected = True
        await self._acknowledged(applied)

    async def _snapshot(self) -> None:
        """Copy a snapshot to the standby (in chunks) and have it installed; producers keep writing."""
        path = f"{self.buffer.store.path}.standby-snapshot"
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        handle = await asyncio.to_thread(snapshot_for_standby, self.buffer, path)
        await asyncio.to_thread(handle.wait)
        token, size = uuid.uuid4().hex, os.path.getsize(path)
        try:
            with open(path, "rb") as f:
                for offset in range(0, size, self.config.snapshot_chunk_bytes):
                    data = await asyncio.to_thread(f.read, self.config.snapshot_chunk_bytes)
                    await self._standby.receive_snapshot.remote(token, offset, data)
            applied = await self._standby.install_snapshot.remote(token, size)
        finally:
            os.remove(path)
        self.snapshots += 1
        log.warning("%s: standby %r installed a snapshot at sequence %d", self.buffer.store.path,
                    self.config.standby, applied)
        await self._acknowledged(applied)
        self.connected = True  # it answered: a lag past the bound holds writes from now on


class StandbySide:
    """The standby actor's file and what it is receiving (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.standby: Standby | None = Standby(path) if os.path.exists(path) else None
        self.primary_node: str | None = None
        self._incoming: dict[str, str] = {}

    def status(self) -> dict[str, Any] | None:
        """The standby's replication status (role, epoch, ``applied``, ``store_tag``), ``None``
        before its first snapshot."""
        return None if self.standby is None else self.standby.status()

    def apply(self, records: Sequence[bytes]) -> int:
        """Apply a shipped batch (see :meth:`kvckpt.Standby.apply`).

        Raises:
            LogGap: no snapshot installed yet (the primary sends one first).
        """
        if self.standby is None:
            raise LogGap(f"{self.path!r} holds no standby yet: it catches up from a snapshot first")
        return self.standby.apply(records)

    def receive(self, token: str, offset: int, data: bytes) -> None:
        """Write one chunk of an incoming snapshot at ``offset`` (a resend writes the same bytes)."""
        part = self._incoming.setdefault(token, f"{self.path}.incoming-{token}")
        mode = "r+b" if os.path.exists(part) else "wb"
        with open(part, mode) as f:
            f.seek(offset)
            f.write(data)

    def install(self, token: str, size: int) -> int:
        """Install the snapshot received under ``token`` (checked: untrusted) and return the sequence it holds.

        Raises:
            BadArgument: no such snapshot, or it is not ``size`` bytes. FormatError: the file is not
                a replicated primary's snapshot (the standby is untouched).
        """
        part = self._incoming.pop(token, None)
        if part is None or os.path.getsize(part) != size:
            raise BadArgument(f"snapshot {token!r} is incomplete or unknown; send it again")
        try:
            with open(part, "rb") as f:
                os.fsync(f.fileno())
            if self.standby is not None:
                self.standby.close()
                self.standby = None
            self.standby = Standby.install(part, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(part)
        return self.standby.applied

    def promote(self, resume_version: int | None) -> tuple[ReplayBuffer, Any]:
        """Promote the file (see :meth:`kvckpt.Standby.promote`).

        Raises:
            NotStandby: no standby file (nothing was ever installed).
        """
        if self.standby is None:
            raise NotStandby(f"{self.path!r} holds no standby: nothing to promote")
        standby, self.standby = self.standby, None
        return standby.promote(resume_version)

    def close(self) -> None:
        """Close the file."""
        if self.standby is not None:
            self.standby.close()
            self.standby = None


def node_alive(node_id: str) -> bool:
    """Whether Ray still counts the node ``node_id`` alive (a dead node is declared so by the GCS
    after its missed health checks)."""
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
