"""The standby's side of replication: making a store a standby, and applying shipped log batches
(docs/replication.md, "Apply rules").

:func:`apply_batch` guarantees, for a batch of records shipped from the primary:

* **checked whole, then applied whole**: every record's checksum and layout
  (:class:`~kvckpt.errors.CorruptLogRecord`), store id (:class:`~kvckpt.errors.ForeignStore`),
  epoch (:class:`~kvckpt.errors.StaleEpoch`) and sequence (:class:`~kvckpt.errors.RepeatedSequence`,
  :class:`~kvckpt.errors.LogGap`) are checked before anything is written; a refused batch applies
  nothing;
* **one durable transaction**: the records' operations and the standby's new applied sequence and
  epoch commit together (fsync), so a crash leaves the standby at a batch boundary it knows;
* **idempotent by sequence**: a resend of records already applied is answered with the applied
  sequence and not applied again (a Ray call can fail after it ran); an overlapping batch applies
  only its records past the applied sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from kvckpt.errors import ForeignStore, LogGap, NotStandby, RepeatedSequence, StaleEpoch
from kvckpt.storage.replog import (
    DEFAULT_MAX_RECORDS,
    PRIMARY,
    RECORD_PREFIX,
    SNAPSHOT,
    STANDBY,
    STATE_KEY,
    STREAMING,
    LogRecord,
    ReplicationLog,
    bookkeeping,
    decode_record,
    read_state,
)
from kvckpt.storage.txn import Txn


def make_standby(store: Any, applied: int, epoch: int) -> ReplicationLog:
    """Make ``store`` (a byte-identical copy of a primary's state at sequence ``applied``, taken
    at ``epoch``) a standby, in one transaction: its log records are dropped and its state record
    says ``standby``, ``applied``, ``epoch``, and keeps the copy's history (the primary's). Returns
    its log."""
    def fn(txn: Txn) -> None:
        txn = bookkeeping(txn)
        copied = read_state(txn) or {}
        state = {"role": STANDBY, "epoch": epoch, "acked": applied, "trimmed": applied, "applied": applied,
                 "standby": STREAMING, "max_records": 1}
        if copied.get("history") is not None:
            state["history"] = copied["history"]
        txn.delete_prefix("replog", RECORD_PREFIX)
        txn.put_json("replog", STATE_KEY, state)

    store.replication = None  # the copy may say "primary": these writes are not the primary's to log
    store.write(fn)
    store.replication = ReplicationLog.load(store)
    return store.replication


def promote_store(store: Any, *, max_records: int = DEFAULT_MAX_RECORDS) -> int:
    """Turn the standby ``store`` into a primary, in one transaction: its epoch goes up by one and
    its log starts after the sequence it applied (every standby of it starts from a snapshot).
    Returns the new epoch. Anything still shipped by the old primary is refused from then on
    (:class:`~kvckpt.errors.NotStandby`; a standby of the new primary refuses it as
    :class:`~kvckpt.errors.StaleEpoch`).

    Raises:
        NotStandby: ``store`` is not a standby.
    """
    log = store.replication
    if log is None or log.role != STANDBY:
        raise NotStandby(f"{store.path!r} is not a standby; only a standby is promoted")

    def fn(txn: Txn) -> int:
        state = read_state(bookkeeping(txn))
        if state is None or state["role"] != STANDBY:
            raise NotStandby(f"{store.path!r} is no longer a standby")
        epoch = state["epoch"] + 1
        log.stage(txn, role=PRIMARY, epoch=epoch, acked=state["applied"], first=state["applied"] + 1,
                  standby=SNAPSHOT, max_records=max_records)
        return epoch

    return store.write(fn)


def check_batch(log: ReplicationLog, records: Sequence[bytes]) -> list[LogRecord]:
    """Decode ``records`` and check what can be checked without the store: checksums, store id,
    and that the sequences run consecutively and epochs never decrease."""
    decoded = [decode_record(r) for r in records]
    for rec in decoded:
        if rec.store != log.tag:
            raise ForeignStore(f"log record {rec.seq} belongs to another store than {log.store.path!r}, or to "
                               "another history of it (a restore of the primary starts a new one: take a "
                               "snapshot); nothing applied")
    seqs = [rec.seq for rec in decoded]
    if len(set(seqs)) != len(seqs):
        twice = next(seq for i, seq in enumerate(seqs) if seq in seqs[:i])
        raise RepeatedSequence(f"the batch holds log record {twice} twice; nothing applied")
    for prev, rec in pairwise(decoded):
        if rec.seq != prev.seq + 1:
            raise LogGap(f"the batch jumps from log record {prev.seq} to {rec.seq}; nothing applied")
        if rec.epoch < prev.epoch:
            raise StaleEpoch(f"log record {rec.seq} has epoch {rec.epoch} after one of epoch {prev.epoch}; "
                             "nothing applied")
    return decoded


def apply_batch(store: Any, records: Sequence[bytes]) -> int:
    """Apply a shipped batch of log records on the standby ``store`` in one durable transaction and
    return the sequence it has applied through (see the module docstring).

    Raises:
        NotStandby: ``store`` is not a standby (a primary, or a promoted standby).
        CorruptLogRecord, ForeignStore, StaleEpoch, RepeatedSequence, LogGap: the batch is refused
            (each says why); nothing was applied.
    """
    log = store.replication
    if log is None or log.role != STANDBY:
        raise NotStandby(f"{store.path!r} is not a standby; it applies no shipped log (a sender of one is an old "
                         "primary)")
    decoded = check_batch(log, records)

    def fn(txn: Txn) -> int:
        state = read_state(bookkeeping(txn))
        if state is None or state["role"] != STANDBY:
            raise NotStandby(f"{store.path!r} is no longer a standby")
        applied, epoch = state["applied"], state["epoch"]
        if not decoded:
            return applied
        if decoded[0].epoch < epoch:
            raise StaleEpoch(f"log record {decoded[0].seq} has epoch {decoded[0].epoch}, the standby is at epoch "
                             f"{epoch}: it comes from a replaced primary; nothing applied")
        if decoded[-1].seq <= applied:
            return applied  # a resend of what is applied: answered, not applied again
        if decoded[0].seq > applied + 1:
            raise LogGap(f"the batch starts at log record {decoded[0].seq}, the standby applied up to {applied}; "
                         "nothing applied")
        main = txn.layout.main
        for rec in decoded:
            if rec.seq <= applied:
                continue
            for key, value in rec.ops:
                if value is None:
                    txn.raw.delete(key, db=main)
                else:
                    txn.raw.put(key, value, db=main)
        log.stage(txn, last=decoded[-1].seq, epoch=decoded[-1].epoch)
        return decoded[-1].seq

    return store.write(fn)

