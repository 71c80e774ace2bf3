"""The value store's checkpoint is loaded through the shared install primitive, which validates a
private copy before anything changes (issue 46's aimed test for issue 37's promise): a checkpoint
with another stamp is refused and the live store, reopened by a fresh handle, is untouched; the
right one replaces the live values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvckpt import CheckpointError, ValueStore
from kvckpt.storage import codec


def _record(key: str, payload: bytes) -> bytes:
    return codec.encode({"v": np.frombuffer(payload, np.uint8)}, {"k": key, "w": "w1", "t": "bytes"}, 0)


def test_a_checkpoint_of_another_stamp_is_refused_and_the_right_one_loads(tmp_path: Path) -> None:
    live, ckpt = str(tmp_path / "live.kv"), str(tmp_path / "ckpt.kv")
    store = ValueStore(live)
    store.put(["a@f"], [_record("a@f", b"saved")])
    stamp = store.checkpoint(ckpt)
    store.put(["b@f"], [_record("b@f", b"after")])
    with pytest.raises(CheckpointError):
        store.load(ckpt, checkpoint_id="not-" + str(stamp["checkpoint_id"]))
    store.close()
    fresh = ValueStore(live)  # a fresh handle: the refused load changed nothing
    try:
        assert fresh.keys() == ["a@f", "b@f"]
        assert fresh.load(ckpt, checkpoint_id=stamp["checkpoint_id"])["checkpoint_id"] == stamp["checkpoint_id"]
        assert fresh.keys() == ["a@f"]
    finally:
        fresh.close()
