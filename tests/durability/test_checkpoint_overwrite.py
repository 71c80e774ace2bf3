"""A checkpoint over an existing file: the file it replaces keeps a second name (``.retired``) through the rename
and is then removed (its blocks released in steps), so no name is ever left behind, a leftover of an interrupted
checkpoint is dropped by the next one, and a file the user linked elsewhere keeps every byte."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from kvckpt import ValueStore
from kvckpt.durability.checkpoint import RETIRED_SUFFIX, read_stamp
from kvckpt.storage import codec


def _filled(path: str, n: int) -> ValueStore:
    store = ValueStore(path)
    keys = [f"k{i}" for i in range(n)]
    store.put(keys, [codec.encode({"v": np.full(3000, i % 251, np.uint8)}, {"k": k, "w": "w1", "t": "bytes"}, 0)
                     for i, k in enumerate(keys)])
    return store


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _values_in(checkpoint: Path, tmp_path: Path, name: str) -> int:
    """How many values a fresh store loaded from ``checkpoint`` holds."""
    fresh = ValueStore(str(tmp_path / name))
    try:
        fresh.load(str(checkpoint))
        return fresh.count()
    finally:
        fresh.close()


def test_an_overwriting_checkpoint_leaves_the_new_file_under_its_name_and_no_second_name(tmp_path: Path) -> None:
    store = _filled(str(tmp_path / "live.kv"), 10)
    dest = tmp_path / "ckpt.kv"
    first = store.checkpoint(str(dest))
    store.put(["extra"], [codec.encode({"v": np.zeros(10, np.uint8)}, {"k": "extra", "w": "w1", "t": "bytes"}, 0)])
    second = store.checkpoint(str(dest))
    store.close()
    assert first["checkpoint_id"] != second["checkpoint_id"]
    assert read_stamp(str(dest))["checkpoint_id"] == second["checkpoint_id"]
    assert not Path(f"{dest}{RETIRED_SUFFIX}").exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt.kv", "live.kv", "live.kv-lock"]
    assert _values_in(dest, tmp_path, "fresh.kv") == 11


def test_a_checkpoint_file_linked_elsewhere_keeps_every_byte_when_a_checkpoint_replaces_it(tmp_path: Path) -> None:
    store = _filled(str(tmp_path / "live.kv"), 10)
    dest, backup = tmp_path / "ckpt.kv", tmp_path / "backup" / "kept.kv"
    first = store.checkpoint(str(dest))
    backup.parent.mkdir()
    os.link(dest, backup)  # the user's hard link of the old checkpoint
    before = _digest(backup)
    second = store.checkpoint(str(dest))
    store.close()
    assert _digest(backup) == before and os.stat(backup).st_nlink == 1
    assert read_stamp(str(backup))["checkpoint_id"] == first["checkpoint_id"]
    assert read_stamp(str(dest))["checkpoint_id"] == second["checkpoint_id"]
    assert _values_in(backup, tmp_path, "fresh.kv") == 10


def test_a_retired_name_an_interrupted_checkpoint_left_is_dropped_by_the_next_checkpoint(tmp_path: Path) -> None:
    """Both leftovers a crash can leave: the old file's second name before the rename (a link of ``dest``),
    and after it (the old file's only name)."""
    store = _filled(str(tmp_path / "live.kv"), 10)
    for linked in (True, False):
        dest = tmp_path / f"ckpt-{linked}.kv"
        retired = Path(f"{dest}{RETIRED_SUFFIX}")
        first = store.checkpoint(str(dest))
        if linked:
            os.link(dest, retired)
        else:
            retired.write_bytes(dest.read_bytes())
        second = store.checkpoint(str(dest))
        assert not retired.exists(), linked
        assert read_stamp(str(dest))["checkpoint_id"] == second["checkpoint_id"] != first["checkpoint_id"]
        assert os.stat(dest).st_nlink == 1
    store.close()
