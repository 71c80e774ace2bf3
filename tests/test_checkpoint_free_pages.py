"""A page-copied checkpoint carries its snapshot and nothing else. The live file's free pages, the
unused middle of its tree pages and the tails of its overflow runs hold whatever LMDB's reused page
buffers held (here an earlier stamp's trainer_state); the copy must not hand them on."""

from __future__ import annotations

import os

import torch
from lmdb import verify as lmdb_verify

from kvckpt import BufferConfig, ReplayBuffer, restore
from kvckpt.durability.structure import is_sound, unused_ranges

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
