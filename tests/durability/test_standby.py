"""Snapshot catch-up, `verify --against` and promotion (issue 44, stages 3 and 4; docs/replication.md)."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
from _buffers import make_group
from _cli import kv
from _fresh import run_fresh
from _replication import main_db

from kvckpt import AbandonedTimeline, BufferConfig, Prompt, ReplayBuffer, ValueStore, restore
from kvckpt.buffer.standby import promote
from kvckpt.durability.replication import compare_replicas, install_standby, snapshot_for_standby
from kvckpt.errors import ForeignStore, FormatError, LogGap, NotStandby, StaleEpoch
from kvckpt.storage import replog
from kvckpt.storage.replica import apply_batch, make_standby
from kvckpt.storage.store import Store
from kvckpt.testing.conformance.buffer import SCHEMA


def ship(primary: Store, standby: Store, batch: int = 64) -> int:
    applied = standby.replication.last
    while records := primary.replication.read_since(applied, batch):
        applied = apply_batch(standby, records)
    return applied


def producer(kind: str, path: str):
    """A primary of ``kind`` at ``path`` with replication on, and a function making its ``i``-th write."""
    if kind == "value-store":
        vs = ValueStore(path)
        replog.ReplicationLog.enable(vs._store)
        return vs, vs._store, lambda i: vs.write([f"k{i}"], [b"v%d" % i], [f"k{i - 3}"] if i >= 3 else [])
    buf = ReplayBuffer.create(path, BufferConfig(group_size=2, max_buffered_rollouts=20_002, schema=SCHEMA,
                                                 sampler={"name": "windowed", "max_staleness_versions": 10_000}))
    replog.ReplicationLog.enable(buf.store)
    return buf, buf.store, lambda i: buf.commit_group(buf.admit([Prompt(prompt_idx=i)])[0], make_group(2, i))


@pytest.mark.parametrize("kind", ["replay-buffer", "value-store"])
def test_a_new_standby_catches_up_from_a_snapshot_taken_while_producers_write(tmp_path, kind):
    owner, primary, write = producer(kind, str(tmp_path / "primary.kv"))
    stop, done = threading.Event(), []

    def produce():
        i = 0
        while not stop.is_set() or i < 30:
            write(i)
            done.append(i)
            i += 1

    thread = threading.Thread(target=produce)
    thread.start()
    try:
        while len(done) < 10:
            stop.wait(0.01)
        handle = snapshot_for_standby(primary, str(tmp_path / "snap.kvckpt"))
        snap_seq = handle.wait().trainer_version
        assert snap_seq > 0
        applied = install_standby(str(tmp_path / "snap.kvckpt"), str(tmp_path / "standby.kv"))
        assert applied == snap_seq
    finally:
        stop.set()
        thread.join()
    with Store(str(tmp_path / "standby.kv")) as standby:
        assert standby.replication.status()["role"] == "standby" and standby.replication.last == snap_seq
        assert primary.replication.last > snap_seq  # the producers went on meanwhile
        assert ship(primary, standby) == primary.replication.last
        primary.replication.trim(standby.replication.last)
        assert main_db(standby) == main_db(primary)
    kv("verify", str(tmp_path / "primary.kv"), "--against", str(tmp_path / "standby.kv"))
    assert compare_replicas(str(tmp_path / "primary.kv"), str(tmp_path / "standby.kv"))["equal"]
    write(10_000)  # one more on the primary: no longer the same sequence
    assert not compare_replicas(str(tmp_path / "primary.kv"), str(tmp_path / "standby.kv"))["same_sequence"]
    owner.close()


def test_verify_against_names_the_tables_that_differ_at_the_same_sequence(tmp_path):
    with Store(str(tmp_path / "a.kv"), create=True) as a:
        replog.ReplicationLog.enable(a)
        a.write(lambda t: t.put("meta", b"x", b"1"))
        with a.reader() as txn:
            a.copy_snapshot(str(tmp_path / "b.kv"), txn)
    with Store(str(tmp_path / "b.kv")) as b:
        make_standby(b, 1, 1)
        b.replication = None  # below the API: a standby that diverged (what the check is for)
        b.write(lambda t: t.put("rows", b"extra", b"1"))
    doc = compare_replicas(str(tmp_path / "a.kv"), str(tmp_path / "b.kv"))
    assert doc["same_sequence"] and doc["differing"] == ["rows"] and not doc["equal"]
    assert "different tables: rows" in kv("verify", str(tmp_path / "a.kv"), "--against", str(tmp_path / "b.kv"),
                                          check=1).stdout


def test_a_far_behind_standby_is_dropped_to_a_snapshot_and_then_streams_again(tmp_path):
    with Store(str(tmp_path / "p.kv"), create=True) as primary:
        log = replog.ReplicationLog.enable(primary, max_records=4)
        snapshot_for_standby(primary, str(tmp_path / "s0.kvckpt"), background=False).wait()
        install_standby(str(tmp_path / "s0.kvckpt"), str(tmp_path / "s.kv"))
        for i in range(10):  # the standby is down: the bound drops what it has not acknowledged
            primary.write(lambda t, i=i: t.put("meta", b"k%d" % i, b"v"))
        with Store(str(tmp_path / "s.kv")) as standby, pytest.raises(LogGap):
            log.read_since(standby.replication.last)
        assert log.status()["standby"] == "snapshot"
        seq = snapshot_for_standby(primary, str(tmp_path / "s1.kvckpt"), background=False).wait().trainer_version
        os.unlink(str(tmp_path / "s.kv"))
        assert install_standby(str(tmp_path / "s1.kvckpt"), str(tmp_path / "s.kv")) == seq == 10
        log.trim(seq)
        assert log.status()["standby"] == "streaming"
        primary.write(lambda t: t.put("meta", b"after", b"v"))
        with Store(str(tmp_path / "s.kv")) as standby:
            assert ship(primary, standby) == 11 and main_db(standby) == main_db(primary)


def test_install_refuses_a_file_that_is_not_a_replicated_primarys_snapshot(tmp_path):
    with Store(str(tmp_path / "plain.kv"), create=True) as plain:
        plain.write(lambda t: t.put("meta", b"x", b"1"))
    shutil.copy(str(tmp_path / "plain.kv"), str(tmp_path / "standby.kv"))
    before = (tmp_path / "standby.kv").read_bytes()
    with pytest.raises(FormatError, match="not a snapshot of a replicated primary"):
        install_standby(str(tmp_path / "plain.kv"), str(tmp_path / "standby.kv"))
    assert (tmp_path / "standby.kv").read_bytes() == before
    (tmp_path / "junk.kvckpt").write_bytes(b"\0" * 8192)
    with pytest.raises(FormatError):
        install_standby(str(tmp_path / "junk.kvckpt"), str(tmp_path / "standby.kv"))
    assert (tmp_path / "standby.kv").read_bytes() == before


def test_a_standby_refuses_the_log_of_a_restored_primary(tmp_path):
    """A restore rewinds the primary: its standby (ahead of the checkpoint) must not take the
    restored file's log as a continuation (it would skip its records as resends and diverge). The
    restore starts a new history, whose records the standby refuses as another store's."""
    owner, primary, write = producer("replay-buffer", str(tmp_path / "primary.kv"))
    for i in range(3):
        write(i)
    snapshot_for_standby(primary, str(tmp_path / "snap.kvckpt")).wait()
    install_standby(str(tmp_path / "snap.kvckpt"), str(tmp_path / "standby.kv"))
    owner.checkpoint(str(tmp_path / "step.kvckpt")).wait()
    for i in range(3, 6):
        write(i)
    old = primary.replication.status()
    with Store(str(tmp_path / "standby.kv")) as standby:
        applied = ship(primary, standby)
        owner.close()
        before = main_db(standby)
        restored, _ = restore(str(tmp_path / "step.kvckpt"), str(tmp_path / "primary.kv"), overwrite=True)
        status = restored.store.replication.status()
        assert status["role"] == "primary" and status["epoch"] == 1 and status["history"] != old["history"]
        restored.commit_group(restored.admit([Prompt(prompt_idx=99)])[0], make_group(2, 99))  # the new history
        with pytest.raises(ForeignStore, match="another history"):
            apply_batch(standby, restored.store.replication.read_since(0))
        assert standby.replication.last == applied and main_db(standby) == before  # nothing applied
        restored.close()


def test_promotion_takes_a_new_epoch_recovers_as_a_restart_and_refuses_the_old_primary(tmp_path):
    primary_path, standby_path = str(tmp_path / "p.kv"), str(tmp_path / "s.kv")
    buf = ReplayBuffer.create(primary_path, BufferConfig(group_size=2, sampler="in_order", max_buffered_rollouts=8,
                                                         schema=SCHEMA))
    replog.ReplicationLog.enable(buf.store)
    snapshot_for_standby(buf.store, str(tmp_path / "snap.kvckpt"), background=False).wait()
    install_standby(str(tmp_path / "snap.kvckpt"), standby_path)
    leases = buf.admit([Prompt(prompt_idx=i) for i in range(4)])
    buf.commit_group(leases[0], make_group(2, 0))
    buf.commit_group(leases[1], make_group(2, 1))
    with Store(standby_path) as standby:
        applied = ship(buf.store, standby)
    buf.close()
    shutil.copy(primary_path, str(tmp_path / "old.kv"))  # what a healed partition brings back
    os.unlink(primary_path)  # the primary's node and disk are gone
    out = run_fresh("""
        from kvckpt.buffer.standby import promote
        buf, plan = promote(ARGS["path"])
        status = buf.store.replication.status()
        buf.close()
        print(json.dumps({"leases": [[l.group_id, l.attempt] for l in plan.leases], "status": status,
                          "timeline": plan.timeline}))
    """, path=standby_path)
    assert out["rc"] == 0, out["err"]
    assert sorted(g for g, _ in out["out"]["leases"]) == sorted(lease.group_id for lease in leases[2:])
    assert {a for _, a in out["out"]["leases"]} == {leases[2].attempt + 1}
    assert out["out"]["status"] == {**out["out"]["status"], "role": "primary", "epoch": 2}
    assert out["out"]["status"]["last"] > applied  # recovery's own transaction is logged at epoch 2
    with pytest.raises(NotStandby):
        promote(standby_path)
    buf = ReplayBuffer.open(standby_path)
    try:
        assert sorted(g.group_id for g in buf.groups()) == sorted(lease.group_id for lease in leases[:2])
        with pytest.raises(AbandonedTimeline):  # an old worker is fenced
            buf.commit_group(leases[2], make_group(2, 2))
        recs = [replog.decode_record(r) for r in buf.store.replication.read_since(applied)]
        assert recs and {r.epoch for r in recs} == {2} and recs[0].seq == applied + 1
        snapshot_for_standby(buf.store, str(tmp_path / "snap2.kvckpt"), background=False).wait()
        install_standby(str(tmp_path / "snap2.kvckpt"), str(tmp_path / "s2.kv"))
    finally:
        buf.close()
    with Store(str(tmp_path / "old.kv")) as old, Store(standby_path) as promoted, \
            Store(str(tmp_path / "s2.kv")) as standby2:
        old.write(lambda t: t.put("meta", b"after-promotion", b"lost"))  # the revived primary goes on
        late = old.replication.read_since(applied)
        with pytest.raises(NotStandby):  # the promoted store applies nothing shipped
            apply_batch(promoted, late)
        resent = [replog.encode_record(1, promoted.replication.last + 1, old.replication.tag,
                                       replog.decode_record(late[-1]).ops)]
        with pytest.raises(StaleEpoch):  # and a standby of the new primary refuses the old epoch
            apply_batch(standby2, resent)
        assert promoted.read(lambda t: t.get("meta", b"after-promotion")) is None


def test_verify_against_refuses_equal_tables_at_different_sequences(tmp_path):
    with Store(str(tmp_path / "a.kv"), create=True) as a:
        replog.ReplicationLog.enable(a)
        a.write(lambda t: t.put("meta", b"x", b"1"))
        snapshot_for_standby(a, str(tmp_path / "snap.kvckpt"), background=False).wait()
        install_standby(str(tmp_path / "snap.kvckpt"), str(tmp_path / "b.kv"))
        a.write(lambda t: t.put("meta", b"x", b"2"))
        a.write(lambda t: t.put("meta", b"x", b"1"))  # the same tables again, two records later
    doc = compare_replicas(str(tmp_path / "a.kv"), str(tmp_path / "b.kv"))
    assert doc["differing"] == [] and (doc["this"]["sequence"], doc["that"]["sequence"]) == (3, 1)
    assert not doc["equal"]
    assert "not at the same sequence" in kv("verify", str(tmp_path / "a.kv"), "--against", str(tmp_path / "b.kv"),
                                            check=1).stdout


def test_inspect_shows_the_epoch_the_sequences_the_lag_and_a_standby_dropped_to_a_snapshot(tmp_path):
    import json

    with Store(str(tmp_path / "p.kv"), create=True) as primary:
        log = replog.ReplicationLog.enable(primary, max_records=2)
        snapshot_for_standby(primary, str(tmp_path / "snap.kvckpt"), background=False).wait()
        install_standby(str(tmp_path / "snap.kvckpt"), str(tmp_path / "s.kv"))
        for i in range(3):
            primary.write(lambda t, i=i: t.put("meta", b"k%d" % i, b"v"))
        with Store(str(tmp_path / "s.kv")) as standby, pytest.raises(LogGap):  # record 1 was dropped
            apply_batch(standby, log.read_since(1))
        rep = json.loads(kv("inspect", str(tmp_path / "p.kv"), "--json").stdout)["replication"]
        assert rep == {**rep, "role": "primary", "epoch": 1, "last": 3, "acked": 0, "lag_records": 3,
                       "standby": "snapshot", "records": 2, "max_records": 2}
        text = kv("inspect", str(tmp_path / "p.kv")).stdout
        assert "standby lag" in text and "snapshot: needs a snapshot catch-up" in text
    rep = json.loads(kv("inspect", str(tmp_path / "s.kv"), "--json").stdout)["replication"]
    assert rep == {**rep, "role": "standby", "epoch": 1, "applied": 0, "last": 0}
