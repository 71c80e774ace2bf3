"""The value store, kvckpt's second store kind (kvckpt.values, kvckpt.ValueStore): it checkpoints and
restores through the same primitives as a replay buffer (reservation, stamp, page copy with its
unused bytes cleared, fsync, rename; the private-copy restore through the hardened open), a fenced
write is refused inside its own transaction, and the tools (verify, inspect, compact, export) know
the kind. No Ray, no TransferQueue: the store on its own."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from kvckpt.tools.compact import compact
from kvckpt.tools.export import export
from kvckpt.tools.inspect import inspect_path

from kvckpt import BadArgument, CheckpointError, FencedWrite, FormatError, ReplayBuffer, ValueStore, verify_path
from kvckpt.durability.structure import is_sound
from kvckpt.storage import codec
from kvckpt.storage.store import Store
from kvckpt.values import records

SECRET = b"a-value-overwritten-before-the-checkpoint-" * 1000  # 43 KB: overflow pages of their own


def _record(key: str, payload: bytes, write_id: str = "w1") -> bytes:
    return codec.encode({"v": np.frombuffer(payload, np.uint8)}, {"k": key, "w": write_id, "t": "bytes"}, 0)


def _filled(path: str, n: int = 60) -> ValueStore:
    store = ValueStore(path)
    store.put([f"{i}@f" for i in range(n)], [_record(f"{i}@f", bytes([i % 251]) * 20000) for i in range(n)])
    return store


def test_a_value_store_checkpoint_is_a_page_copy_that_carries_nothing_but_its_snapshot(tmp_path: Path) -> None:
    live = str(tmp_path / "live.kv")
    store = _filled(live)
    try:
        store.put(["s@f"], [_record("s@f", SECRET)])
        store.put(["s@f"], [_record("s@f", b"short", "w2")])  # the secret's pages are free now
        with open(live, "rb") as f:
            assert SECRET[:4000] in f.read(), "precondition: the overwritten value is still in the live file"
        stamp = store.checkpoint(str(tmp_path / "one.kv"))
        assert stamp["how"] in ("copy", "clone") and stamp["values"] == 61
        assert store.stamp_id() == stamp["checkpoint_id"]
    finally:
        store.close()
    data = (tmp_path / "one.kv").read_bytes()
    assert SECRET[:4000] not in data
    assert is_sound(str(tmp_path / "one.kv"))
    again = ValueStore(str(tmp_path / "restored.kv"))
    try:
        assert again.load(str(tmp_path / "one.kv"))["checkpoint_id"] == stamp["checkpoint_id"]
        assert again.get(["s@f", "7@f"]) == [_record("s@f", b"short", "w2"), _record("7@f", bytes([7]) * 20000)]
    finally:
        again.close()


def test_a_value_store_checkpoint_takes_the_reservation_first(tmp_path: Path) -> None:
    """A checkpoint to a name another checkpoint is still writing (its ``.partial`` is locked) is refused
    before anything is stamped, as a replay buffer's is."""
    store = _filled(str(tmp_path / "live.kv"), 3)
    dest = tmp_path / "ckpt.kv"
    fd = os.open(f"{dest}.partial", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(CheckpointError, match="still being written"):
            store.checkpoint(str(dest))
        assert store.stamp_id() is None and not dest.exists()
    finally:
        os.close(fd)
    assert store.checkpoint(str(dest))["values"] == 3  # the lock gone, the same name works
    store.close()


def test_a_fenced_write_is_refused_inside_its_transaction_and_leaves_everything(tmp_path: Path) -> None:
    store = ValueStore(str(tmp_path / "live.kv"))
    try:
        store.put(["run", "a@f"], [_record("run", b"1", "token-1"), _record("a@f", b"a")])
        store.write(["b@f"], [_record("b@f", b"b")], ["a@f"], fence=("run", "token-1"))
        assert store.keys() == ["b@f", "run"]
        store.put(["run"], [_record("run", b"2", "token-2")])  # a restart's new run
        with pytest.raises(FencedWrite, match="'token-1' refused; the record was written by 'token-2'") as caught:
            store.write(["c@f"], [_record("c@f", b"c")], ["b@f"], fence=("run", "token-1"))
        assert caught.value.found == "token-2"
        assert store.keys() == ["b@f", "run"]  # neither the put nor the delete landed
        with pytest.raises(FencedWrite):
            store.checkpoint(str(tmp_path / "ckpt.kv"), fence=("run", "token-1"))
        assert store.stamp_id() is None and not (tmp_path / "ckpt.kv").exists()
        assert not (tmp_path / "ckpt.kv.partial").exists()
    finally:
        store.close()


def test_the_tools_know_the_value_store(tmp_path: Path) -> None:
    live = str(tmp_path / "live.kv")
    store = _filled(live, 5)
    store.checkpoint(str(tmp_path / "ckpt.kv"))
    store.close()
    report = verify_path(live, checksums=True)
    assert report.ok and report.counts["values"] == 5
    doc = inspect_path(live)
    assert doc["kind"] == "values" and doc["values"] == 5 and doc["checkpoint"]["file"] == "ckpt.kv"
    assert doc["value_store"]["kind"] == records.FORMAT["kind"] and not doc["problems"]
    result = compact(live, str(tmp_path / "small.kv"), level=3)
    assert result.rows_reencoded == 5 and result.stored_after < result.stored_before
    small = ValueStore(str(tmp_path / "small.kv"))
    record = codec.decode(small.get(["4@f"])[0], "4@f")  # the same value, key and write id, at level 3
    assert record.meta == {"k": "4@f", "w": "w1", "t": "bytes"} and record.arrays["v"].tobytes() == bytes([4]) * 20000
    small.close()
    with pytest.raises(BadArgument, match="is a value store"):
        export(live, str(tmp_path / "out.jsonl"), fmt="jsonl")


def test_verify_names_a_damaged_value_record(tmp_path: Path) -> None:
    live = str(tmp_path / "live.kv")
    _filled(live, 2).close()
    with Store(live) as store:  # a record whose bytes name another key, and a key outside the layout
        store.write(lambda txn: txn.put("rows", records.store_key("0@f"), _record("1@f", b"x")))
        store.write(lambda txn: txn.put("rows", b"stray", _record("x", b"x")))
    report = verify_path(live, checksums=True)
    assert sorted(p.code for p in report.problems) == ["key-mismatch", "stray-key"]


def test_a_replay_buffer_is_not_a_value_store(tmp_path: Path, buffer_factory: Callable[..., ReplayBuffer]) -> None:
    buffer_factory(name="buf.kv").close()
    with pytest.raises(FormatError, match="is a kvckpt replay buffer, not a TransferQueue value store"):
        ValueStore(str(tmp_path / "buf.kv"))
    assert inspect_path(str(tmp_path / "buf.kv"))["kind"] == "replay-buffer"


def _chunk(index: int, start: int, tokens: list[int], version: int = 0) -> dict[str, object]:
    return {"group": "g", "index": index, "start": start, "tokens": tokens, "logprobs": [-0.5] * len(tokens),
            "versions": [version] * len(tokens)}


def test_value_store_progress_is_the_buffers_transition_inside_one_fenced_transaction(tmp_path: Path) -> None:
    """``ValueStore.record_progress`` (issue 45: the verl ledger's progress): the buffer's refusals per item (a gap,
    other bytes where some are durable, past max_tokens), a chunk per run of one weight version, the records the
    tools verify; a fenced call writes nothing (neither its drops nor its marks) but answers a resend of a landed
    chunk as the first try; a key under a sample's prefix that is not a chunk's is named."""
    from kvckpt.errors import CorruptRecord, DuplicateCommit, ProgressGap, SchemaMismatch

    live = str(tmp_path / "live.kv")
    store = ValueStore(live)
    try:
        store.put(["run"], [_record("run", b"1", "token-1")])
        fence = ("run", "token-1")
        assert store.record_progress([_chunk(0, 0, [1, 2, 3]), {**_chunk(1, 0, [7, 8]), "versions": [4, 5]}],
                                     max_tokens=6, fence=fence) == [3, 2]
        out = store.record_progress([_chunk(0, 5, [6]), _chunk(0, 1, [9]), _chunk(0, 3, [4, 5, 6, 7]),
                                     _chunk(0, 0, [1, 2, 3]), {"group": "g"}], max_tokens=6, fence=fence)
        assert [type(r) for r in out] == [ProgressGap, DuplicateCommit, SchemaMismatch, int, BadArgument]
        assert "the durable prefix is 3 tokens long" in str(out[0]) and out[3] == 3
        tokens, logprobs, versions = store.progress("g", 1, max_tokens=6)
        assert tokens.tolist() == [7, 8] and versions.tolist() == [4, 5] and logprobs.tolist() == [-0.5, -0.5]
        assert store.keys("progress/g/1/") == ["progress/g/1/0000000000", "progress/g/1/0000000001"]
        store.put(["run"], [_record("run", b"2", "token-2")])  # a restart's new run
        calls: list[object] = []
        out = store.record_progress([_chunk(0, 0, [1, 2, 3]), _chunk(0, 3, [4])], max_tokens=6, fence=fence,
                                    drop=["progress/g/1/"], then=lambda results: calls.append(results) or ([], []))
        assert out[0] == 3 and isinstance(out[1], FencedWrite) and out[1].found == "token-2" and not calls
        assert store.progress("g", 0, max_tokens=6)[0].tolist() == [1, 2, 3]
        assert store.progress("g", 1, max_tokens=6)[0].tolist() == [7, 8]  # the fenced call's drop did not land
        out = store.record_progress([_chunk(0, 3, [4])], max_tokens=6, fence=("run", "token-2"),
                                    drop=["progress/g/1/"], then=lambda results: (["mark"], [_record("mark", b"m")]))
        assert out == [4] and store.progress("g", 1, max_tokens=6) is None and store.keys("mark") == ["mark"]
        store.put(["progress/g/0/x"], [_record("progress/g/0/x", b"x")])
        [corrupt] = store.record_progress([_chunk(0, 4, [5])], max_tokens=6)
        assert isinstance(corrupt, CorruptRecord) and "not a chunk's" in str(corrupt)
    finally:
        store.close()
    report = verify_path(live, checksums=True)
    assert report.ok, report


def test_a_resend_after_compact_level_gets_its_first_answer(tmp_path: Path) -> None:
    """``kvckpt compact --level`` re-encodes every value-store record, progress chunks included, so a chunk's stored
    bytes are no longer the bytes its producer sends: a resend after the compaction (a producer that never saw its
    answer, the store compacted and reopened in between) still gets its first answer, from a live writer and from a
    fenced one, because the rule compares the chunk's content when the bytes differ; other tokens at a durable
    position are still refused DuplicateCommit. (A replay buffer's compaction leaves its progress chunks as they
    were written.)"""
    from kvckpt.errors import DuplicateCommit

    live, small = str(tmp_path / "live.kv"), str(tmp_path / "small.kv")
    sent = [_chunk(0, 0, [1, 2, 3]), {**_chunk(0, 3, [4, 5]), "logprobs": [float("nan"), -0.25]}]
    store = ValueStore(live)
    store.put(["run"], [_record("run", b"1", "token-1")])
    assert store.record_progress(sent, max_tokens=8, fence=("run", "token-1")) == [3, 5]
    before = store.get(store.keys("progress/g/0/"))
    store.close()
    compact(live, small, level=3)
    store = ValueStore(small)
    try:
        assert store.get(store.keys("progress/g/0/")) != before  # the chunks were re-encoded
        assert store.record_progress(sent, max_tokens=8, fence=("run", "token-1")) == [3, 5]
        store.put(["run"], [_record("run", b"2", "token-2")])  # a restart's new run: the old writer is fenced
        assert store.record_progress(sent, max_tokens=8, fence=("run", "token-1")) == [3, 5]
        [other] = store.record_progress([_chunk(0, 3, [4, 6])], max_tokens=8, fence=("run", "token-2"))
        assert isinstance(other, DuplicateCommit)
        assert store.progress("g", 0, max_tokens=8)[0].tolist() == [1, 2, 3, 4, 5]
    finally:
        store.close()
