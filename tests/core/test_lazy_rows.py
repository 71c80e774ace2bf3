"""Rows are checked where they are read, not by ``restore()``: a crafted row in a checkpoint is
restored, refused by ``read_batch`` of its group with the error ``kvckpt verify --deep`` reports for
the same key, and the trainer goes on with the other groups once it discards that group (one
``release_claims`` and one ``evict`` transaction, both existing API).
"""

from __future__ import annotations

import shutil

import _crafted
import numpy as np
import pytest

from kvckpt import BufferConfig, CorruptRecord, Prompt, ReplayBuffer, restore
from kvckpt.durability.safe_open import verify_path

SCHEMA = {"input_ids": ("int64", "token"), "logprobs": ("float32", "token"), "reward": ("float32", "row")}
#: a crafted row of the first ready group -> the key its read error names (verify --deep names the
#: same key, or the group for a digest)
ROWS = {"wrong-dtype": (lambda e: _crafted._row(e, _crafted._wrong_dtype_row), "rows/{gid}_g0"),
        "header-100k-deep": (lambda e: _crafted._row(e, _crafted._deep_header_row), "rows/{gid}_g0"),
        "zstd-bomb": (lambda e: _crafted._row(e, _crafted._bomb_row), "rows/{gid}_g0"),
        "changed-under-valid-checksum": (_crafted._stale_digest, "groups/{gid}")}


def _row(gid: str, i: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.arange(4, dtype=np.int64) + i, "logprobs": np.zeros(4, np.float32),
            "reward": np.float32(i)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Three ready groups of two rows, checkpointed."""
    d = tmp_path_factory.mktemp("lazy")
    config = BufferConfig(group_size=2, schema=SCHEMA, sampler={"name": "ready_first", "max_staleness_versions": 4},
                          max_buffered_rollouts=16, groups_per_step=3)
    with ReplayBuffer.create(str(d / "live.kv"), config) as buf:
        for lease in buf.admit([Prompt(i) for i in range(3)]):
            buf.commit_group(lease, [_row(lease.group_id, i) for i in range(2)])
        buf.checkpoint(str(d / "ckpt.kvckpt")).wait()
    return str(d / "ckpt.kvckpt")


@pytest.mark.parametrize("name", list(ROWS))
def test_a_crafted_row_fails_at_read_and_verify_deep_and_the_trainer_goes_on(checkpoint: str, tmp_path, name: str):
    edit, key = ROWS[name]
    crafted = str(tmp_path / "crafted.kvckpt")
    shutil.copyfile(checkpoint, crafted)
    _crafted._edited(edit)(crafted)

    deep = verify_path(crafted, deep=True)
    buf, _ = restore(crafted, str(tmp_path / "restored.kv"))  # metadata only: the rows are not read
    with buf:
        ready = [g.group_id for g in buf.groups(["ready"])]
        bad = next(g.group_id for g in buf.groups() if g.rows_stored)  # the group _crafted._row edits
        key = key.format(gid=bad)
        assert key.removeprefix("groups/") in {p.key for p in deep.problems}, deep.problems
        selection = buf.select(3, 3)
        assert sorted(selection.group_ids) == sorted(ready)
        with pytest.raises(CorruptRecord) as refused:  # the whole batch is refused: no wrong data
            buf.read_batch(selection)
        assert refused.value.key == key
        # the trainer discards the group (two transactions of the public API) and trains on the others
        buf.release_claims(selection.group_ids)
        assert buf.evict([bad]) == [bad]
        again = buf.select(2, 3)
        batch = buf.read_batch(again, layout="list")
        assert sorted(again.group_ids) == sorted(set(ready) - {bad})
        assert [int(row["reward"]) for row in batch.rows] == [0, 1, 0, 1]
        assert buf.group(bad).state == "evicted" and not buf.group(bad).rows_stored
