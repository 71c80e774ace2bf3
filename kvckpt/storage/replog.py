"""The replication log: one record per write transaction, in that transaction (docs/replication.md).

A replicated store's file holds the ``replog`` table: its state record (``replog/s``: the role,
``primary`` or ``standby``, the epoch, the acknowledged and applied sequences, the bound) and, on
a primary, the log records not yet trimmed (``replog/r`` + the sequence, 8 bytes big-endian). The
:class:`~kvckpt.storage.store.Store` of a replicated file runs every write transaction through
:meth:`ReplicationLog.run`, which guarantees:

* **one record per transaction, in it**: the put and delete set the transaction made through
  :class:`~kvckpt.storage.txn.Txn` (captured there, stored keys and exact values, in order) is
  appended as one record under the next sequence number before the commit, so the record is
  durable exactly when the state it describes is; a transaction that wrote nothing appends nothing;
* **no gap**: sequence numbers are consecutive; the in-memory counters move only after a commit
  (a replayed or failed transaction leaves them);
* **bounded**: past ``max_records`` kept records the oldest is dropped in the same transaction, and
  dropping one the standby has not acknowledged marks it ``standby: snapshot`` (a warning on
  ``kvckpt.replication``), so a dead standby never fills the disk;
* **a standby is written only by applies**: a transaction on a standby's file that captured any
  write is refused (:class:`~kvckpt.errors.NotPrimary`); the log's own bookkeeping (and
  :mod:`kvckpt.storage.replica`'s applies) switch the capture off first.

The record's byte layout is :func:`encode_record`'s (docs/replication.md, "The log record").
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvckpt.errors import BadArgument, CorruptLogRecord, FormatError, LogGap, NotPrimary, ReadOnlyStore
from kvckpt.storage.layout import PREFIXES, OneTree
from kvckpt.storage.txn import MAX_KEY_BYTES, Txn

log = logging.getLogger("kvckpt.replication")
T = TypeVar("T")

PRIMARY, STANDBY = "primary", "standby"
#: The primary's view of its standby: ``streaming`` (the log holds every record it has not
#: acknowledged) or ``snapshot`` (the bound dropped one: it must catch up from a snapshot).
STREAMING, SNAPSHOT = "streaming", "snapshot"
#: Log records a primary keeps at most by default (each is one write transaction's changes).
DEFAULT_MAX_RECORDS = 100_000
STATE_KEY = b"s"
RECORD_PREFIX = b"r"

MAGIC = b"KVRL"
VERSION = 1
_HEADER = struct.Struct(">4sBQQ16sI")  # magic, version, epoch, sequence, store id, operation count
_OP = struct.Struct(">BH")  # kind, key length
_VLEN = struct.Struct(">I")
_CRC = struct.Struct(">I")
_PUT, _DELETE = 1, 2
_LOG_TABLE = PREFIXES["replog"]


@dataclass(frozen=True)
class LogRecord:
    """One decoded log record: a write transaction's changes as stored keys and values (``None``
    for a delete), in the order it made them."""

    epoch: int
    seq: int
    store: bytes
    ops: tuple[tuple[bytes, bytes | None], ...]


def store_tag(store_id: str) -> bytes:
    """The 16 bytes a record carries for ``store_id`` (``meta/format``'s id; copies keep it)."""
    return hashlib.blake2b(store_id.encode(), digest_size=16).digest()


def history_tag(store_id: str, history: str | None) -> bytes:
    """The store tag records of ``store_id``'s log in ``history`` carry (:func:`store_tag` of both)."""
    return store_tag(store_id if history is None else f"{store_id}/{history}")


def new_history() -> str:
    """A fresh random history id (16 hex digits)."""
    return os.urandom(8).hex()


def record_key(seq: int) -> bytes:
    """The ``replog`` key of the record with sequence ``seq`` (keys sort as sequences do)."""
    return RECORD_PREFIX + seq.to_bytes(8, "big")


def encode_record(epoch: int, seq: int, store: bytes, ops: Sequence[tuple[bytes, bytes | None]]) -> bytes:
    """The record's bytes: header (``KVRL``, version, epoch, sequence, store id, operation count),
    each operation (kind, key length, key, and for a put the value's length and value), CRC-32."""
    parts = [_HEADER.pack(MAGIC, VERSION, epoch, seq, store, len(ops))]
    for key, value in ops:
        if value is None:
            parts += (_OP.pack(_DELETE, len(key)), key)
        else:
            parts += (_OP.pack(_PUT, len(key)), key, _VLEN.pack(len(value)), value)
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def decode_record(data: bytes) -> LogRecord:
    """Parse and check one record (untrusted bytes: it came over the network).

    Raises:
        CorruptLogRecord: the checksum does not match, the header or an operation does not parse,
            a key is empty, too long or names the log's own table.
    """
    data = bytes(data)
    if len(data) < _HEADER.size + _CRC.size:
        raise CorruptLogRecord(f"a log record of {len(data)} bytes is shorter than its header")
    body = data[:-_CRC.size]
    if zlib.crc32(body) != _CRC.unpack_from(data, len(body))[0]:
        raise CorruptLogRecord("a log record failed its checksum (damaged in transit or crafted); nothing applied")
    magic, version, epoch, seq, store, count = _HEADER.unpack_from(body)
    if magic != MAGIC or version != VERSION:
        raise CorruptLogRecord(f"not a kvckpt log record of version {VERSION} (magic {magic!r}, version {version})")
    if seq < 1 or epoch < 1:
        raise CorruptLogRecord(f"log record with sequence {seq} and epoch {epoch}: both start at 1")
    pos, ops = _HEADER.size, []
    try:
        for _ in range(count):
            kind, klen = _OP.unpack_from(body, pos)
            key = body[pos + _OP.size:pos + _OP.size + klen]
            pos += _OP.size + klen
            if kind not in (_PUT, _DELETE) or len(key) != klen or not 0 < klen <= MAX_KEY_BYTES:
                raise CorruptLogRecord(f"log record {seq}: a malformed operation at byte {pos}")
            if key[:1] == _LOG_TABLE:
                raise CorruptLogRecord(f"log record {seq} writes the replication log's own table")
            if kind == _DELETE:
                ops.append((key, None))
                continue
            (vlen,) = _VLEN.unpack_from(body, pos)
            value = body[pos + _VLEN.size:pos + _VLEN.size + vlen]
            pos += _VLEN.size + vlen
            if len(value) != vlen:
                raise CorruptLogRecord(f"log record {seq}: a value runs past the record's end")
            ops.append((key, value))
    except struct.error:
        raise CorruptLogRecord(f"log record {seq}: its operations run past the record's end") from None
    if pos != len(body):
        raise CorruptLogRecord(f"log record {seq}: {len(body) - pos} bytes after its last operation")
    return LogRecord(epoch, seq, store, tuple(ops))


def read_state(txn: Txn) -> dict[str, Any] | None:
    """The replication state record of the store ``txn`` reads, or ``None`` if it is not replicated."""
    return txn.get_json("replog", STATE_KEY)


def read_log(txn: Txn) -> tuple[dict[str, Any] | None, int, int]:
    """``(state record, first, last)`` of the store ``txn`` reads: the oldest record kept (``last + 1``
    when none) and the last sequence (a primary's last record or what it trimmed through, a
    standby's applied sequence); ``(None, 1, 0)`` for a store not replicated."""
    state = read_state(txn)
    if state is None:
        return None, 1, 0
    first = next(txn.iter_keys("replog", RECORD_PREFIX), None)
    newest = txn.last("replog", RECORD_PREFIX)
    last = max(state["applied"] if state["role"] == STANDBY else state["trimmed"],
               int.from_bytes(newest[0][1:], "big") if newest is not None else 0)
    return state, int.from_bytes(first[1:], "big") if first is not None else last + 1, last


def status_of(state: dict[str, Any], first: int, last: int) -> dict[str, Any]:
    """What ``kvckpt inspect`` and :meth:`ReplicationLog.status` report: the state record's fields,
    ``last`` (sequence), ``records`` kept, and ``lag_records`` (a primary's records its standby has
    not acknowledged)."""
    return {**state, "last": last, "records": last - first + 1,
            "lag_records": last - state["acked"] if state["role"] == PRIMARY else 0}


def describe(txn: Txn) -> dict[str, Any] | None:
    """:func:`status_of` the store ``txn`` reads, or ``None`` if it is not replicated."""
    state, first, last = read_log(txn)
    return None if state is None else status_of(state, first, last)


def bookkeeping(txn: Txn) -> Txn:
    """``txn`` with its capture switched off: what is written through it is replication bookkeeping
    (the log's own records and state, an apply's writes), never logged and allowed on a standby."""
    txn.capture = None
    return txn


class ReplicationLog:
    """The replication log of one writable handle of a replicated store (see the module docstring).

    Attributes mirror the state record and move only after a commit: ``role``, ``epoch``,
    ``last`` (the last sequence written, on a standby the last applied), ``first`` (the oldest
    record kept; ``last + 1`` when none), ``acked`` (what the standby acknowledged), ``standby``
    (:data:`STREAMING` or :data:`SNAPSHOT`), ``max_records``.
    """

    def __init__(self, store: Any, state: dict[str, Any], first: int, last: int) -> None:
        self.store = store
        #: The history this file's log continues (drawn when replication is enabled, and again when a
        #: restore rewinds the file): records carry it in their store tag, so a standby of another
        #: history refuses them (``ForeignStore``). ``None`` on a file from before histories.
        self.history: str | None = state.get("history")
        self.tag = history_tag(store.store_id, self.history)
        self.role: str = state["role"]
        self.epoch: int = state["epoch"]
        self.acked: int = state["acked"]
        self.standby: str = state["standby"]
        self.max_records: int = state["max_records"]
        self.last, self.first = last, first
        self._pending: dict[str, Any] | None = None

    @classmethod
    def load(cls, store: Any) -> ReplicationLog | None:
        """The log of ``store``'s file, or ``None`` if the file is not replicated."""
        state, first, last = store.read(read_log)
        return None if state is None else cls(store, state, first, last)

    @classmethod
    def enable(cls, store: Any, *, max_records: int = DEFAULT_MAX_RECORDS) -> ReplicationLog:
        """Make ``store`` a replicated primary at epoch 1 (one transaction) and return its log; the
        log of a store that already is a primary is returned as it is.

        Raises:
            ReadOnlyStore: the handle is read-only. FormatError: the file is not in the one-tree
            layout (formats 1 and 2: upgrade it first). NotPrimary: the store is a standby.
            BadArgument: ``max_records`` is below 1.
        """
        if store.readonly:
            raise ReadOnlyStore(f"{store.path!r} is open read-only; replication needs the writer")
        if not isinstance(store.layout, OneTree):
            raise FormatError(f"{store.path!r} is in kvckpt's format-1/2 layout; replication needs format 3 or "
                              "later (open it as a ReplayBuffer once to upgrade it)")
        if type(max_records) is not int or max_records < 1:
            raise BadArgument(f"max_records must be a positive int, not {max_records!r}")
        current = store.replication
        if current is not None:
            if current.role != PRIMARY:
                raise NotPrimary(f"{store.path!r} is a standby; promote it to make it a primary")
            return current
        state = {"role": PRIMARY, "epoch": 1, "acked": 0, "trimmed": 0, "applied": 0, "standby": STREAMING,
                 "max_records": max_records, "history": new_history()}
        store.write(lambda txn: txn.put_json("replog", STATE_KEY, state))
        store.replication = cls(store, state, 1, 0)
        return store.replication

    @classmethod
    def restart_history(cls, store: Any) -> ReplicationLog | None:
        """Start a new history on the replicated ``store`` (what a restore does to the file it
        installs, before anything else writes to it): in one transaction every log record and the
        state record are dropped and the store becomes a primary at epoch 1 with an empty log and a
        new history id, keeping its bound. A standby of the old history then refuses its records
        (``ForeignStore``) and must take a snapshot. Returns the new log, ``None`` (nothing done)
        for a store that is not replicated."""
        old = store.replication
        if old is None:
            return None
        bound = old.max_records if type(old.max_records) is int and old.max_records >= 1 else DEFAULT_MAX_RECORDS
        state = {"role": PRIMARY, "epoch": 1, "acked": 0, "trimmed": 0, "applied": 0, "standby": STREAMING,
                 "max_records": bound, "history": new_history()}

        def fn(txn: Txn) -> None:
            bookkeeping(txn).delete_prefix("replog", b"")
            txn.put_json("replog", STATE_KEY, state)

        store.replication = None  # the drop is the history's end, not a write to log
        store.write(fn)
        store.replication = cls(store, state, 1, 0)
        return store.replication

    def state(self, **changes: Any) -> dict[str, Any]:
        """The state record as it stands, or as it will with ``changes`` (attribute names) made."""
        a = {"role": self.role, "epoch": self.epoch, "acked": self.acked, "standby": self.standby,
             "max_records": self.max_records, "first": self.first, "last": self.last, **changes}
        out = {"role": a["role"], "epoch": a["epoch"], "acked": a["acked"], "trimmed": a["first"] - 1,
               "applied": a["last"] if a["role"] == STANDBY else a["acked"], "standby": a["standby"],
               "max_records": a["max_records"]}
        if self.history is not None:
            out["history"] = self.history
        return out

    def status(self) -> dict[str, Any]:
        """Role, epoch, last sequence, the standby's acknowledged sequence and its lag in records,
        the records kept and the bound (``kvckpt inspect`` shows it)."""
        return status_of(self.state(), self.first, self.last)

    def stage(self, txn: Txn, **changes: Any) -> None:
        """Make ``changes`` (attribute names) in ``txn``: the state record is rewritten there
        (bookkeeping, not logged) and the attributes take them when the transaction commits."""
        self._pending = {**(self._pending or {}), **changes}
        bookkeeping(txn).put_json("replog", STATE_KEY, self.state(**self._pending))

    def run(self, fn: Callable[[Txn], T], txn: Txn) -> T:
        """Run ``fn`` in the write transaction ``txn`` with its writes captured, append their log
        record, commit, then move the counters (the store's write lock is held throughout)."""
        self._pending = None
        txn.capture = []
        result = fn(txn)
        ops = txn.capture
        warn = None
        if ops and self.role != PRIMARY:
            raise NotPrimary(f"{self.store.path!r} is a standby: it changes only by applying its primary's "
                             "log; promote it to write to it")
        if ops:
            bookkeeping(txn)
            seq = self.last + 1
            txn.put("replog", record_key(seq), encode_record(self.epoch, seq, self.tag, ops))
            first = self.first
            while seq - first + 1 > self.max_records:
                txn.delete("replog", record_key(first))
                first += 1
            self._pending = {"last": seq, "first": first}
            if first - 1 > self.acked and self.standby != SNAPSHOT:
                warn = first - 1
                self.stage(txn, standby=SNAPSHOT)
        txn.raw.commit()
        if self._pending:
            self.__dict__.update(self._pending)
        if warn is not None:
            log.warning("%s: the replication log passed its bound of %d records and dropped record %d, which the "
                        "standby has not acknowledged (it acknowledged %d): the standby must catch up from a "
                        "snapshot", self.store.path, self.max_records, warn, self.acked)
        return result

    def read_since(self, after: int, limit: int = 1024) -> list[bytes]:
        """Up to ``limit`` records after sequence ``after``, in order (what is shipped to a standby).

        Raises:
            LogGap: the log no longer holds record ``after + 1`` (trimmed or dropped by the
                bound): the standby must catch up from a snapshot.
        """
        def read(txn: Txn) -> list[bytes]:
            out = []
            for key, value in txn.iter_prefix("replog", RECORD_PREFIX, record_key(after + 1)):
                if not out and key != record_key(after + 1):
                    break
                out.append(value)
                if len(out) == limit:
                    break
            return out

        out = self.store.read(read)
        if not out and after < self.last:
            raise LogGap(f"{self.store.path!r}: the log no longer holds record {after + 1} (it keeps {self.first} to "
                         f"{self.last}); the standby must catch up from a snapshot")
        return out

    def trim(self, acked: int) -> None:
        """Record that the standby holds every record up to ``acked`` and delete them, in one
        transaction; a standby marked :data:`SNAPSHOT` that acknowledges a sequence the log
        continues from is :data:`STREAMING` again.

        Raises:
            BadArgument: ``acked`` is past the last record written (the standby cannot hold it).
        """
        if acked > self.last:
            raise BadArgument(f"acknowledged sequence {acked} is past the last record written, {self.last}")

        def fn(txn: Txn) -> None:
            upto = max(self.acked, acked)
            first = self.first
            while first <= upto:
                bookkeeping(txn).delete("replog", record_key(first))
                first += 1
            changes: dict[str, Any] = {"acked": upto, "first": first}
            if self.standby == SNAPSHOT and acked >= self.first - 1:
                changes["standby"] = STREAMING
            self.stage(txn, **changes)

        self.store.write(fn)
