"""A checkpoint written page for page carries both LMDB meta pages; damage to the newer one's
transaction id must never make restore hand back another state (the one before the stamp, with
the previous checkpoint's stamp): a specific error, or exactly the undamaged file's data."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from kvckpt import BufferConfig, ReplayBuffer, restore
from kvckpt.errors import KvckptError

PAGE = 4096
#: MDB_meta after the 16-byte page header: magic u32, version u32, address u64, mapsize u64,
#: two MDB_db of 48 bytes, last_pg u64, then the transaction id.
TXNID = 16 + 4 + 4 + 8 + 8 + 2 * 48 + 8
SCHEMA = {"input_ids": ("int64", "token"), "total_reward": ("float32", "row")}


def _row(n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(n), "total_reward": torch.tensor(1.0)}


def _fill(buf: ReplayBuffer, first: int, groups: int) -> None:
    for lease in buf.admit(list(range(first, first + groups))):
        buf.commit_group(lease, [_row(3000), _row(2000)])


def _state(path: str, live: str) -> tuple:
    buf, plan = restore(path, live)
    try:
        groups = sorted((g.group_id, g.state) for g in buf.groups())
        rows = hashlib.sha256()
        for gid, _ in groups:
            for row in buf.read_batch([gid], layout="list").rows:
                rows.update(row["input_ids"].numpy().tobytes())
        state = {k: v for k, v in buf.state().items() if k != "timeline"}  # each restore starts its own
        return plan.checkpoint_id, plan.trainer_state, state, groups, rows.hexdigest()
    finally:
        buf.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("metas")
    cfg = BufferConfig(group_size=2, schema=SCHEMA, sampler={"name": "windowed", "max_staleness_versions": 4},
                       max_buffered_rollouts=200, groups_per_step=2)
    buf = ReplayBuffer.create(str(d / "live.kv"), cfg)
    _fill(buf, 0, 60)
    first = buf.checkpoint(str(d / "one.kvckpt"), {"step": 1}).wait()
    _fill(buf, 60, 60)
    second = buf.checkpoint(str(d / "two.kvckpt"), {"step": 2}).wait()
    buf.close()
    assert (first.how, second.how) != ("compact", "compact")
    return str(d), str(d / "two.kvckpt")


@pytest.mark.parametrize("slot", ["newer", "older"])
@pytest.mark.parametrize("damage", ["minus-2", "zero-parity", "plus-2"])
def test_damaged_meta_txnid_restores_the_same_state_or_refuses(checkpoints, slot, damage, tmp_path) -> None:
    _, good = checkpoints
    want = _state(good, str(tmp_path / "want.kv"))
    with open(good, "rb") as f:
        raw = bytearray(f.read())
    txnids = [struct.unpack_from("<Q", raw, i * PAGE + TXNID)[0] for i in (0, 1)]
    newer = int(txnids[1] > txnids[0])
    index = newer if slot == "newer" else 1 - newer
    value = txnids[index]
    value = {"minus-2": max(value - 2, index), "zero-parity": index, "plus-2": value + 2}[damage]
    struct.pack_into("<Q", raw, index * PAGE + TXNID, value)
    bad = tmp_path / "bad.kvckpt"
    bad.write_bytes(bytes(raw))
    try:
        got = _state(str(bad), str(tmp_path / "got.kv"))
    except KvckptError:
        return  # refused with a kvckpt error: allowed
    diff = [(i, a, b) for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    assert got == want, f"txnids {txnids}, slot {index} set to {value}: another state restored: {str(diff)[:600]}"
