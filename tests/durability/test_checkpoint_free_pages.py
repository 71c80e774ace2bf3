"""A page-copied checkpoint carries its snapshot and nothing else. The live file's free pages, the
unused middle of its tree pages and the tails of its overflow runs hold whatever LMDB's reused page
buffers held (here an earlier stamp's trainer_state); the copy must not hand them on."""

from __future__ import annotations

import itertools
import os

import numpy as np
import torch
from lmdb import verify as lmdb_verify

from kvckpt import BufferConfig, ReplayBuffer, restore
from kvckpt.durability.checkpoint import _UnusedBytes
from kvckpt.durability.structure import is_sound, unused_ranges
from kvckpt.storage import filecopy

SCHEMA = {"input_ids": ("int64", "token"), "total_reward": ("float32", "row")}
SECRET = "an-earlier-stamp-only-" * 8


def _fill(buf: ReplayBuffer, first: int, groups: int) -> None:
    for lease in buf.admit(list(range(first, first + groups))):
        buf.commit_group(lease, [{"input_ids": torch.arange(3000 + i), "total_reward": torch.tensor(1.0)}
                                 for i in range(2)])


def test_a_page_copy_clears_what_is_not_its_snapshot(tmp_path) -> None:
    cfg = BufferConfig(group_size=2, schema=SCHEMA, sampler={"name": "windowed", "max_staleness_versions": 4},
                       max_buffered_rollouts=200, groups_per_step=2)
    live = str(tmp_path / "live.kv")
    with ReplayBuffer.create(live, cfg) as buf:
        _fill(buf, 0, 60)
        buf.checkpoint(str(tmp_path / "one.kvckpt"), {"step": 1, "note": SECRET}).wait()
        _fill(buf, 60, 20)
        two = buf.checkpoint(str(tmp_path / "two.kvckpt"), {"step": 2}).wait()
        with open(live, "rb") as f:
            assert SECRET.encode() in f.read(), "precondition: the old stamp is still in a free page of the live file"
    assert two.how in ("copy", "clone") and two.zeroed_bytes > 0
    with open(two.path, "rb") as f:
        data = f.read()
    assert SECRET.encode() not in data
    fd = os.open(two.path, os.O_RDONLY)
    try:
        offsets, lengths = unused_ranges(fd)
    finally:
        os.close(fd)
    assert two.zeroed_bytes == int(lengths.sum())
    assert all(data[o:o + n] == bytes(n) for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True))
    assert is_sound(two.path)  # the cleared bytes are none the structure proof reads
    assert lmdb_verify.verify(two.path, subdir=False) == []  # nor py-lmdb's verifier
    buf, plan = restore(two.path, str(tmp_path / "restored.kv"))
    with buf:
        assert plan.trainer_state == {"step": 2}
        assert len(buf.read_batch([g.group_id for g in buf.groups()][:5], layout="list").rows) == 10


def test_the_live_file_walked_from_a_pinned_snapshot_has_exactly_the_copys_unused_bytes(tmp_path) -> None:
    """The checkpoint finds the bytes to clear in the live file before copying, from the meta pages
    its snapshot pinned, while later commits change that file: the ranges must be the copy's."""
    cfg = BufferConfig(group_size=2, schema=SCHEMA, sampler={"name": "windowed", "max_staleness_versions": 4},
                       max_buffered_rollouts=200, groups_per_step=2)
    with ReplayBuffer.create(str(tmp_path / "live.kv"), cfg) as buf:
        _fill(buf, 0, 60)
        buf.checkpoint(str(tmp_path / "one.kvckpt"), {"step": 1}).wait()  # leaves free pages behind
        store = buf.store
        _, snapshot = store.write_then_snapshot(lambda txn: None)
        try:
            _fill(buf, 60, 30)  # later commits: new pages, reused free ones, new meta pages
            pinned = unused_ranges(store.data_fd(), snapshot.metas, headers=False)
            live_now = unused_ranges(store.data_fd())
            chunks: list[tuple[int, int]] = []
            fd = os.open(tmp_path / "copy.db", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                store.copy_pinned(fd, snapshot, before_writeback=lambda a, b: chunks.append((a, b)))
                copied = unused_ranges(fd)
            finally:
                os.close(fd)
        finally:
            snapshot.close()
    assert pinned is not None and copied is not None and live_now is not None
    assert all(np.array_equal(a, b) for a, b in zip(pinned, copied, strict=True))
    assert not (len(live_now[0]) == len(copied[0]) and np.array_equal(live_now[0], copied[0])), \
        "precondition: the live file's own state differs from the snapshot's"
    psize = len(snapshot.metas) // 2
    assert chunks[0][0] == 2 * psize and chunks[-1][1] == os.path.getsize(tmp_path / "copy.db")
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(chunks))  # in order, no gap


def test_bytes_cleared_chunk_by_chunk_stop_at_the_chunk_not_yet_copied(tmp_path, monkeypatch) -> None:
    """A range that runs into the next chunk is cleared in two parts: clearing it whole would be
    overwritten by the next chunk's copy and leave the source's bytes there."""
    monkeypatch.setattr(filecopy, "CHUNK", 3 * 4096)
    source = os.urandom(10 * 4096)
    (tmp_path / "src").write_bytes(source)
    offsets, lengths = np.array([100, 3 * 4096 - 50, 7 * 4096]), np.array([20, 300, 4096])
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        clear = _UnusedBytes(dst, offsets, lengths)
        filecopy.copy_range(src, dst, 0, len(source), clone=False, pace=True, before_writeback=clear.upto)
        assert clear.rest() == int(lengths.sum())
    finally:
        os.close(src)
        os.close(dst)
    expected = bytearray(source)
    for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
        expected[o:o + n] = bytes(n)
    assert (tmp_path / "dst").read_bytes() == bytes(expected)
