"""The standby's apply (issue 44, stage 2, docs/replication.md "Apply rules"): shipped batches applied
in one durable transaction each, idempotent by sequence, checked whole first; both store kinds."""

from __future__ import annotations

import hashlib

import pytest
from _fresh import run_fresh
from _replication import drive_buffer, main_db

from kvckpt import ValueStore
from kvckpt.errors import (
    CorruptLogRecord,
    ForeignStore,
    LogGap,
    NotPrimary,
    NotStandby,
    RepeatedSequence,
    StaleEpoch,
)
from kvckpt.storage import replog
from kvckpt.storage.replica import apply_batch, make_standby
from kvckpt.storage.store import Store


def standby_of(primary: Store, path: str, epoch: int = 1) -> Store:
    """A standby at ``path`` made from a copy of ``primary``'s current snapshot (no write running)."""
    with primary.reader() as txn:
        primary.copy_snapshot(path, txn)
    standby = Store(path)
    make_standby(standby, primary.replication.last, epoch)
    return standby


def ship(primary: Store, standby: Store, batch: int = 2) -> int:
    """Ship the primary's log to the standby in batches of ``batch`` records; the applied sequence."""
    applied = standby.replication.last
    while True:
        records = primary.replication.read_since(applied, batch)
        if not records:
            return applied
        applied = apply_batch(standby, records)


def digest(store: Store) -> str:
    return hashlib.sha256(repr(sorted(main_db(store).items())).encode()).hexdigest()


@pytest.mark.parametrize("kind", ["replay-buffer", "value-store"])
def test_a_standby_applies_shipped_batches_to_the_primarys_exact_state_durably(buffer_factory, tmp_path, kind):
    if kind == "replay-buffer":
        buf = buffer_factory()
        primary = buf.store
        replog.ReplicationLog.enable(primary)
        standby = standby_of(primary, str(tmp_path / "standby.kv"))
        drive_buffer(buf)
    else:
        vs = ValueStore(str(tmp_path / "values.kv"))
        primary = vs._store
        replog.ReplicationLog.enable(primary)
        standby = standby_of(primary, str(tmp_path / "standby.kv"))
        vs.put(["a", "b"], [b"x" * 10, b"y" * 20])
        vs.write(["c"], [b"z"], ["a"])
        vs.clear(["b"], [None])
    try:
        assert main_db(standby) != main_db(primary)
        assert ship(primary, standby) == primary.replication.last > 2
        assert main_db(standby) == main_db(primary)
        standby.close()
        out = run_fresh("""
            import hashlib
            from kvckpt.storage.store import Store
            with Store(ARGS["path"], readonly=True) as store:
                state = store.read(lambda t: t.get_json("replog", b"s"))
                rows = store.read(lambda t: sorted((k, v) for k, v in t.raw.cursor(db=t.layout.main).iternext()
                                                   if k[:1] != b"l"))
            print(json.dumps({"applied": state["applied"], "role": state["role"],
                              "digest": hashlib.sha256(repr(rows).encode()).hexdigest()}))
        """, path=str(tmp_path / "standby.kv"))
        assert out["rc"] == 0, out["err"]
        assert out["out"] == {"applied": primary.replication.last, "role": "standby", "digest": digest(primary)}
    finally:
        if kind == "value-store":
            vs.close()
        standby.close()


def five_records(tmp_path) -> tuple[Store, Store]:
    """A primary whose log holds 1: put x, 2: put a, 3: delete a, 4: put y, 5: put z (re-applying 2
    after 3 would bring ``a`` back), and its standby at 0."""
    primary = Store(str(tmp_path / "p.kv"), create=True)
    replog.ReplicationLog.enable(primary)
    standby = standby_of(primary, str(tmp_path / "s.kv"))
    for op in (("x", b"1"), ("a", b"2"), ("a", None), ("y", b"4"), ("z", b"5")):
        primary.write(lambda t, op=op: t.put("meta", op[0].encode(), op[1]) if op[1] else t.delete("meta", b"a"))
    return primary, standby


def test_a_resend_is_answered_not_reapplied_and_an_overlap_applies_only_what_is_new(tmp_path):
    primary, standby = five_records(tmp_path)
    with primary, standby:
        records = primary.replication.read_since(0, 10)
        assert apply_batch(standby, records[:3]) == 3
        assert apply_batch(standby, records[1:]) == 5  # 2 and 3 again: skipped, so `a` stays deleted
        assert main_db(standby) == main_db(primary)
        txnid = standby.env.info()["last_txnid"]
        assert apply_batch(standby, records[:3]) == 5  # a resend of applied records: answered
        assert apply_batch(standby, []) == 5
        assert standby.env.info()["last_txnid"] == txnid and main_db(standby) == main_db(primary)
        assert standby.replication.status()["applied"] == 5


def corrupted(records: list[bytes]) -> list[bytes]:
    bad = bytearray(records[1])
    bad[-5] ^= 0x40  # the value's one byte (the record still parses: only its checksum tells)
    return [records[0], bytes(bad), records[2]]


BAD_BATCHES = {
    "gap-inside": (lambda rs, other: [rs[0], rs[2]], LogGap),
    "repeated-sequence": (lambda rs, other: [rs[0], rs[1], rs[1]], RepeatedSequence),
    "repeated-out-of-order": (lambda rs, other: [rs[0], rs[1], rs[0]], RepeatedSequence),
    "gap-after-applied": (lambda rs, other: rs[1:3], LogGap),
    "corrupted-record": (lambda rs, other: corrupted(rs), CorruptLogRecord),
    "another-stores-id": (lambda rs, other: other, ForeignStore),
    "older-epoch": (lambda rs, other: [replog.encode_record(1, r.seq, r.store, r.ops)
                                       for r in map(replog.decode_record, rs[:2])], StaleEpoch),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_a_bad_batch_is_refused_with_its_own_error_and_applies_nothing(tmp_path, case):
    primary, standby = five_records(tmp_path)
    other = Store(str(tmp_path / "other.kv"), create=True)
    replog.ReplicationLog.enable(other)
    other.write(lambda t: t.put("meta", b"x", b"other"))
    with primary, standby, other:
        records = [replog.encode_record(2, r.seq, r.store, r.ops)  # the primary was promoted once: epoch 2
                   for r in map(replog.decode_record, primary.replication.read_since(0, 10))]
        standby.replication.epoch = 2
        standby.write(lambda t: replog.bookkeeping(t).put_json("replog", replog.STATE_KEY,
                                                              standby.replication.state()))
        make, error = BAD_BATCHES[case]
        before = standby.read(lambda t: list(t.raw.cursor(db=t.layout.main).iternext()))
        with pytest.raises(error):
            apply_batch(standby, make(records, other.replication.read_since(0)))
        assert standby.read(lambda t: list(t.raw.cursor(db=t.layout.main).iternext())) == before
        assert apply_batch(standby, records) == 5 and main_db(standby) == main_db(primary)


def test_a_standby_refuses_writes_and_a_primary_refuses_batches(tmp_path):
    primary, standby = five_records(tmp_path)
    with primary, standby:
        with pytest.raises(NotPrimary):
            standby.write(lambda t: t.put("meta", b"k", b"v"))
        standby.write(lambda t: t.get("meta", b"k"))  # reading in a write transaction is not a write
        with pytest.raises(NotStandby):
            apply_batch(primary, primary.replication.read_since(0))
        assert main_db(standby) != main_db(primary)


def test_the_primary_trims_what_the_standby_acknowledged_and_ships_the_rest(tmp_path):
    primary, standby = five_records(tmp_path)
    with primary, standby:
        applied = apply_batch(standby, primary.replication.read_since(0, 3))
        primary.replication.trim(applied)
        assert primary.replication.status() == {**primary.replication.status(), "records": 2, "lag_records": 2}
        assert ship(primary, standby) == 5 and main_db(standby) == main_db(primary)
