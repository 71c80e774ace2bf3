"""The replication log (issue 44, docs/replication.md): one record per write transaction, captured at
the Txn layer in that same transaction, for both store kinds; off by default; bounded."""

from __future__ import annotations

import logging

import pytest
from _buffers import make_group
from _fresh import run_fresh
from _old_format import rewrite_as_named_tables
from _replication import drive_buffer, main_db, records, replay

from kvckpt import BadArgument, FormatError, Prompt, ValueStore
from kvckpt.errors import CorruptLogRecord, LogGap, NotPrimary
from kvckpt.storage import replog
from kvckpt.storage.store import Store


def test_off_by_default_a_store_logs_nothing_and_txns_capture_nothing(buffer_factory):
    buf = buffer_factory()
    assert buf.store.replication is None
    seen = []
    buf.store.write(lambda t: seen.append(t.capture))
    drive_buffer(buf)
    assert seen == [None]
    assert buf.store.read(lambda t: list(t.iter_prefix("replog", b""))) == []


def test_every_write_transaction_appends_one_record_that_replays_to_the_same_state(buffer_factory):
    buf = buffer_factory()
    log = replog.ReplicationLog.enable(buf.store)
    base = main_db(buf.store)
    txn_before = buf.store.env.info()["last_txnid"]
    drive_buffer(buf)
    writes = buf.store.env.info()["last_txnid"] - txn_before  # LMDB counts commits that changed pages
    buf.store.write(lambda t: None)  # a transaction that writes nothing appends nothing
    recs = records(buf.store)
    assert [r.seq for r in recs] == list(range(1, writes + 1)) and log.last == writes
    assert {r.epoch for r in recs} == {1} and {r.store for r in recs} == {log.tag}
    assert log.tag == replog.history_tag(buf.store.store_id, log.history) != replog.store_tag(buf.store.store_id)
    assert replay(base, recs) == main_db(buf.store)
    assert any(v is None for r in recs for _, v in r.ops)  # deletes are captured too


def test_a_refused_item_of_a_group_commit_leaves_nothing_in_the_batch_record(buffer_factory):
    buf = buffer_factory()
    replog.ReplicationLog.enable(buf.store)
    leases = buf.admit([Prompt(prompt_idx=i) for i in range(2)])
    buf.commit_group(leases[0], make_group(2, 0))
    base, before = main_db(buf.store), len(records(buf.store))
    results = buf.commit_many([{"lease": leases[0], "rows": make_group(2, 7)},
                               {"lease": leases[1], "rows": make_group(2, 1)}])
    assert type(results[0]).__name__ == "DuplicateCommit"

    def wrote_then_refused(t):  # a nested transaction that wrote, then refused: rolled back, so unlogged
        t.put("meta", b"half", b"written")
        raise BadArgument("refused after writing")

    assert isinstance(buf.store.write_each([lambda t: t.put("meta", b"a", b"1"), wrote_then_refused,
                                            lambda t: t.delete("meta", b"a")])[1], BadArgument)
    recs = records(buf.store)
    assert len(recs) == before + 2  # one durable transaction, one record, each batch
    assert recs[-1].ops == ((b"ma", b"1"), (b"ma", None))
    assert replay(base, recs[before:]) == main_db(buf.store)


def test_the_value_store_logs_its_puts_and_deletes(tmp_path):
    vs = ValueStore(str(tmp_path / "v.kv"))
    try:
        log = replog.ReplicationLog.enable(vs._store)
        base = main_db(vs._store)
        vs.put(["a", "b"], [b"x" * 10, b"y" * 20])
        vs.write(["c"], [b"z"], ["a"])
        recs = records(vs._store)
        assert [r.seq for r in recs] == [1, 2] and log.last == 2
        assert [v is None for _, v in recs[1].ops].count(True) == 1
        assert replay(base, recs) == main_db(vs._store)
    finally:
        vs.close()


def test_a_reopened_primary_keeps_logging_from_its_last_sequence_in_a_fresh_process(tmp_path):
    path = str(tmp_path / "p.kv")
    with Store(path, create=True) as store:
        replog.ReplicationLog.enable(store)
        store.write(lambda t: t.put("meta", b"x1", b"1"))
    out = run_fresh("""
        from kvckpt.storage.store import Store
        with Store(ARGS["path"]) as store:
            store.write(lambda t: t.put("meta", b"x2", b"2"))
            print(json.dumps(store.replication.status()))
    """, path=path)
    assert out["rc"] == 0, out["err"]
    assert out["out"]["last"] == 2 and out["out"]["role"] == "primary"
    with Store(path) as store:
        assert [r.seq for r in records(store)] == [1, 2]
        assert records(store)[1].ops == ((b"mx2", b"2"),)


def test_a_transaction_replayed_after_the_map_grew_is_logged_once(tmp_path):
    with Store(str(tmp_path / "m.kv"), create=True, map_size=1 << 20) as store:
        replog.ReplicationLog.enable(store)
        calls = []

        def big(t):
            calls.append(1)
            for i in range(8):
                t.put("rows", b"k%d" % i, bytes(300_000))

        store.write(big)
        assert len(calls) > 1  # the map was full: the whole function ran again
        [rec] = records(store)
        assert rec.seq == 1 and len(rec.ops) == 8 and store.replication.last == 1


def test_past_its_bound_the_log_drops_its_oldest_record_and_marks_the_standby_for_a_snapshot(tmp_path, caplog):
    with Store(str(tmp_path / "b.kv"), create=True) as store:
        log = replog.ReplicationLog.enable(store, max_records=3)
        for i in range(3):
            store.write(lambda t, i=i: t.put("meta", b"k%d" % i, b"v"))
        log.trim(1)
        assert [r.seq for r in records(store)] == [2, 3]
        with caplog.at_level(logging.WARNING, "kvckpt.replication"):
            for i in range(3, 6):
                store.write(lambda t, i=i: t.put("meta", b"k%d" % i, b"v"))
        assert [r.seq for r in records(store)] == [4, 5, 6]
        assert log.status() == {**log.status(), "standby": "snapshot", "records": 3, "acked": 1, "lag_records": 5}
        [warned] = [r.getMessage() for r in caplog.records if "passed its bound" in r.getMessage()]  # once
        assert "dropped record 2," in warned
        with pytest.raises(LogGap):
            log.read_since(1)
        assert [replog.decode_record(r).seq for r in log.read_since(3)] == [4, 5, 6]
    with Store(str(tmp_path / "b.kv")) as store:  # the state is the file's
        assert store.replication.status()["standby"] == "snapshot"
        store.replication.trim(5)  # a standby caught up by a snapshot at 3 acknowledges: streaming again
        assert store.replication.status() == {**store.replication.status(), "standby": "streaming", "records": 1}


def test_trim_deletes_what_the_standby_acknowledged_and_refuses_what_was_never_written(tmp_path):
    with Store(str(tmp_path / "t.kv"), create=True) as store:
        log = replog.ReplicationLog.enable(store)
        for i in range(4):
            store.write(lambda t, i=i: t.put("meta", b"k%d" % i, b"v"))
        log.trim(3)
        assert [r.seq for r in records(store)] == [4] and log.acked == 3
        with pytest.raises(BadArgument):
            log.trim(5)
        log.trim(4)
        assert records(store) == [] and log.first == 5
    with Store(str(tmp_path / "t.kv")) as store:  # an empty log reopens at its last sequence
        store.write(lambda t: t.put("meta", b"k9", b"v"))
        assert [r.seq for r in records(store)] == [5]


def test_a_record_checks_its_bytes():
    data = replog.encode_record(2, 7, b"s" * 16, [(b"mk", b"v"), (b"md", None)])
    assert replog.decode_record(data) == replog.LogRecord(2, 7, b"s" * 16, ((b"mk", b"v"), (b"md", None)))
    for bad in (data[:-1] + bytes([data[-1] ^ 1]), data[:20], data[:-5] + data[-4:],
                replog.encode_record(1, 1, b"s" * 16, [(b"lr", b"x")])):
        with pytest.raises(CorruptLogRecord):
            replog.decode_record(bad)


def test_enabling_refuses_old_layouts_and_standbys(tmp_path):
    with Store(str(tmp_path / "s.kv"), create=True) as store:
        with pytest.raises(BadArgument):
            replog.ReplicationLog.enable(store, max_records=0)
        log = replog.ReplicationLog.enable(store)
        assert replog.ReplicationLog.enable(store) is log
        log.role = replog.STANDBY
        with pytest.raises(NotPrimary):
            replog.ReplicationLog.enable(store)
    with Store(str(tmp_path / "o.kv"), create=True):
        pass
    rewrite_as_named_tables(str(tmp_path / "o.kv"), 2)
    with Store(str(tmp_path / "o.kv")) as store, pytest.raises(FormatError):
        replog.ReplicationLog.enable(store)
