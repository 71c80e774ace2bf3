"""An LMDB file can end before its last committed page: LMDB never writes a page it allocated and
freed in one transaction (a "loose" page), so a commit that puts and deletes in one transaction can
leave the file shorter than its meta page says. Found in a verl ledger's restart (``FormatError``:
"... is 126976 bytes but its last committed page ends at byte 131072: the file is truncated").
Such a file is sound; kvckpt must open, recover, checkpoint and restore it, and still refuse a file
that really is cut short."""

from __future__ import annotations

import os
import random

import lmdb
import pytest
import torch

from kvckpt import BufferConfig, ReplayBuffer, restore
from kvckpt.durability.safe_open import check_structure
from kvckpt.errors import FormatError
from kvckpt.storage.store import Store

PAGE = 4096
SCHEMA = {"input_ids": ("int64", "token"), "total_reward": ("float32", "row")}


def _row(n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(n), "total_reward": torch.tensor(1.0)}


def _last_page_end(path: str) -> int:
    env = lmdb.open(path, subdir=False, readonly=True, lock=False)
    try:
        return (env.info()["last_pgno"] + 1) * PAGE
    finally:
        env.close()


@pytest.fixture
def short_store(tmp_path) -> str:
    """A closed kvckpt store whose file ends before its last committed page."""
    path = str(tmp_path / "live.kv")
    buf = ReplayBuffer.create(path, BufferConfig(
        group_size=2, schema=SCHEMA, sampler={"name": "windowed", "max_staleness_versions": 4},
        max_buffered_rollouts=64, groups_per_step=2))
    for lease in buf.admit(list(range(8))):
        buf.commit_group(lease, [_row(300), _row(200)])
    buf.checkpoint(str(tmp_path / "first.kvckpt"), {"step": 0}).wait()  # a stamp: restore reads the file too
    buf.close()
    # transactions that put and delete the same keys: pages allocated and freed in one transaction
    rng = random.Random(1)
    env = lmdb.open(path, subdir=False, map_size=1 << 30)
    try:
        for attempt in range(40):
            with env.begin(write=True) as txn:
                keys = [b"\xfftmp-%03d-%05d" % (attempt, i) for i in range(rng.randint(50, 400))]
                for key in keys:
                    txn.put(key, os.urandom(rng.choice((50, 500, 3000, 9000))))
                for key in keys:
                    txn.delete(key)
            if os.path.getsize(path) < (env.info()["last_pgno"] + 1) * PAGE:
                break
    finally:
        env.close()
    assert os.path.getsize(path) < _last_page_end(path), "no short file came out of 40 transactions"
    return path


def test_a_file_that_ends_before_its_last_free_pages_opens_recovers_and_checkpoints(short_store, tmp_path):
    buf = ReplayBuffer.open(short_store)
    try:
        buf.recover()
        assert len([g for g in buf.groups() if g.rows_stored]) == 8
        for lease in buf.admit(list(range(8, 10))):
            buf.commit_group(lease, [_row(30), _row(20)])
        result = buf.checkpoint(str(tmp_path / "ckpt.kvckpt"), {"step": 1}).wait()
    finally:
        buf.close()
    assert result.trainer_version == 0, result
    restored, _ = restore(str(tmp_path / "ckpt.kvckpt"), str(tmp_path / "restored.kv"))
    try:
        assert len([g for g in restored.groups() if g.rows_stored]) == 10
    finally:
        restored.close()


def test_restore_from_a_short_file_pads_its_free_pages(short_store, tmp_path):
    restored, _ = restore(short_store, str(tmp_path / "restored.kv"))
    try:
        assert len([g for g in restored.groups() if g.rows_stored]) == 8
        assert [len(r["input_ids"]) for r in restored.read_batch([restored.groups()[0].group_id],
                                                                  layout="list").rows] == [300, 200]
    finally:
        restored.close()
    assert os.path.getsize(tmp_path / "restored.kv") >= _last_page_end(str(tmp_path / "restored.kv"))


def test_a_file_cut_into_its_reachable_pages_is_still_refused(short_store):
    os.truncate(short_store, os.path.getsize(short_store) // 2)
    with pytest.raises(FormatError, match="truncated"):
        ReplayBuffer.open(short_store)


def test_the_page_copy_of_a_short_file_writes_its_missing_free_pages_as_zeros(short_store, tmp_path):
    with Store(short_store) as store:
        _, snapshot = store.write_then_snapshot(lambda txn: txn.put_json("meta", b"probe", {"n": 1}))
        try:
            pages_end = (store.env.info()["last_pgno"] + 1) * PAGE
            assert os.path.getsize(short_store) < pages_end  # the snapshot's commit left it short
            fd = os.open(tmp_path / "copy.kv", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                store.copy_pinned(fd, snapshot)
            finally:
                os.close(fd)
        finally:
            snapshot.close()
    assert os.path.getsize(tmp_path / "copy.kv") == pages_end
    check_structure(tmp_path / "copy.kv")  # every page parsed, free and live pages cover the file
    with Store(tmp_path / "copy.kv", readonly=True) as copy:
        assert copy.read(lambda txn: txn.get_json("meta", b"probe")) == {"n": 1}
