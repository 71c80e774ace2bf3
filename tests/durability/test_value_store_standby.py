"""The value store's standby (issue 44: both store kinds): its writes logged through the public API,
a standby that applies them, a load that starts a new history, and promotion (docs/replication.md)."""

from __future__ import annotations

import numpy as np
import pytest
from _fresh import run_fresh

from kvckpt import (
    BufferConfig,
    ReplayBuffer,
    Standby,
    ValueStore,
    codec,
    enable_replication,
    log_since,
    promote,
    promote_value_store,
    replication_status,
    snapshot_for_standby,
    trim_log,
)
from kvckpt.durability.replication import compare_replicas
from kvckpt.errors import ForeignStore, FormatError, NotStandby
from kvckpt.testing.conformance.buffer import SCHEMA


def rec(key: str, payload: bytes) -> bytes:
    return codec.encode({"v": np.frombuffer(payload, np.uint8)}, {"k": key, "w": "w1", "t": "bytes"}, 0)


def ship(values: ValueStore, standby: Standby) -> int:
    applied = standby.applied
    while records := log_since(values, applied, 4):
        applied = standby.apply(records)
    trim_log(values, applied)
    return applied


def new_pair(tmp_path) -> tuple[ValueStore, Standby]:
    values = ValueStore(str(tmp_path / "primary.kv"))
    enable_replication(values)
    values.put(["a"], [rec("a", b"1")])
    snapshot_for_standby(values, str(tmp_path / "snap.kv")).wait()
    return values, Standby.install(str(tmp_path / "snap.kv"), str(tmp_path / "standby.kv"))


def chunk(start: int, n: int) -> dict:
    return {"group": "g", "index": 0, "start": start, "tokens": np.arange(start, start + n, dtype=np.int64),
            "logprobs": np.zeros(n, np.float32), "versions": np.zeros(n, np.int64)}


def test_each_write_of_the_value_store_is_one_record_and_the_standby_ends_equal(tmp_path):
    values, standby = new_pair(tmp_path)
    last = replication_status(values)["last"]
    values.write(["b", "c"], [rec("b", b"2"), rec("c", b"3")], ["a"])
    values.clear(["b"])
    values.record_progress([chunk(0, 3)], max_tokens=16)
    values.record_progress([chunk(3, 2)], max_tokens=16)
    stamp = values.checkpoint(str(tmp_path / "ckpt.kv"))  # its stamp is a write too
    values.clear(["c"])
    values.merge_checkpoint(str(tmp_path / "ckpt.kv"), lambda keys, live: ["c"], checkpoint_id=stamp["checkpoint_id"])
    values.write([], [], ["absent"])  # wrote nothing: no record
    assert replication_status(values)["last"] == last + 7
    resend = log_since(values, last, 3)
    assert ship(values, standby) == last + 7
    assert standby.apply(resend) == last + 7  # a resend is answered, not applied again
    values.close()
    standby.close()
    report = compare_replicas(str(tmp_path / "primary.kv"), str(tmp_path / "standby.kv"))
    assert report["equal"], report["differing"]


def test_a_load_starts_a_new_history_the_old_standby_refuses_and_a_new_snapshot_serves(tmp_path):
    values, standby = new_pair(tmp_path)
    stamp = values.checkpoint(str(tmp_path / "ckpt.kv"))
    values.put(["after"], [rec("after", b"x")])
    ship(values, standby)
    tag = replication_status(values)["store_tag"]
    values.load(str(tmp_path / "ckpt.kv"), checkpoint_id=stamp["checkpoint_id"])
    status = replication_status(values)
    assert status["store_tag"] != tag and status["last"] == 0 and status["role"] == "primary"
    values.put(["again"], [rec("again", b"y")])
    with pytest.raises(ForeignStore):
        standby.apply(log_since(values, 0))
    assert standby.applied > 0  # nothing of the new history was applied
    values.close()
    # the new history is the file's: a fresh process reopening it logs under the new tag
    fresh = run_fresh("""
v = ValueStore(ARGS["path"])
print(json.dumps([replication_status(v)["store_tag"], replication_status(v)["last"]]))
""", path=str(tmp_path / "primary.kv"))
    assert fresh["out"] == [status["store_tag"], 1], fresh["err"]
    values = ValueStore(str(tmp_path / "primary.kv"))
    snapshot_for_standby(values, str(tmp_path / "snap2.kv")).wait()
    standby.close()
    standby = Standby.install(str(tmp_path / "snap2.kv"), str(tmp_path / "standby.kv"))
    values.put(["more"], [rec("more", b"z")])
    ship(values, standby)
    values.close()
    standby.close()
    assert compare_replicas(str(tmp_path / "primary.kv"), str(tmp_path / "standby.kv"))["equal"]


def test_promotion_takes_a_new_epoch_and_the_old_primary_is_refused(tmp_path):
    values, standby = new_pair(tmp_path)
    values.put(["b"], [rec("b", b"2")])
    applied = ship(values, standby)
    values.put(["late"], [rec("late", b"never shipped")])
    late = log_since(values, applied)
    standby.close()
    promoted = promote_value_store(str(tmp_path / "standby.kv"))
    status = replication_status(promoted)
    assert status["role"] == "primary" and status["epoch"] == 2 and status["last"] == applied
    assert promoted.get(["a", "b", "late"]) == [rec("a", b"1"), rec("b", b"2"), None]
    promoted.put(["new"], [rec("new", b"3")])
    assert replication_status(promoted)["last"] == applied + 1
    promoted.close()
    with pytest.raises(NotStandby):  # the old primary's shipment is refused: nothing applied
        Standby(str(tmp_path / "standby.kv")).apply(late)
    with pytest.raises(NotStandby):
        promote_value_store(str(tmp_path / "standby.kv"))  # a primary is not promoted twice
    values.close()


def test_promoting_another_kinds_standby_as_a_value_store_changes_nothing(tmp_path):
    buf = ReplayBuffer.create(str(tmp_path / "buf.kv"), BufferConfig(group_size=2, max_buffered_rollouts=8,
                                                                        schema=SCHEMA))
    enable_replication(buf)
    snapshot_for_standby(buf, str(tmp_path / "snap.kv")).wait()
    buf.close()
    Standby.install(str(tmp_path / "snap.kv"), str(tmp_path / "standby.kv")).close()
    with pytest.raises(FormatError):
        promote_value_store(str(tmp_path / "standby.kv"))
    with Standby(str(tmp_path / "standby.kv")) as standby:  # still a standby, at its epoch
        assert standby.epoch == 1 and standby.status()["role"] == "standby"


def test_promoting_a_value_stores_standby_as_a_replay_buffer_changes_nothing(tmp_path):
    """``kvckpt.promote`` checks the kind before the epoch: a value store's standby stays a standby."""
    values, standby = new_pair(tmp_path)
    ship(values, standby)
    standby.close()
    with pytest.raises(FormatError, match="promote_value_store"):
        promote(str(tmp_path / "standby.kv"))
    with Standby(str(tmp_path / "standby.kv")) as again:  # still a standby, at its epoch
        assert again.epoch == 1 and again.status()["role"] == "standby"
    values.close()
