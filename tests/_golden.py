"""The golden format-3 file: a small checkpoint written by the kvckpt that introduced format 3,
committed as ``tests/golden/format3.kvckpt`` with what it must read as (``format3.json``).

Every later kvckpt must open it, verify it and read it identically (``tests/durability/test_format_pinned.py``),
as formats 1 and 2 still are: a change to the on-disk layout that is consistent with itself (every
test writes and reads through the same code) still fails there.

``python tests/_golden.py [DIR]`` writes both files (default: ``tests/golden``). Run it only to
add a new golden file for a new format; never to refresh this one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import numpy as np

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
FILE = "format3.kvckpt"
EXPECTED = "format3.json"
TRAINER_STATE = {"step": 1, "note": "golden"}
DATALOADER = b"golden-dataloader-state"


def _array(value: Any) -> dict[str, Any]:
    arr = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    return {"dtype": str(arr.dtype), "shape": list(arr.shape), "hex": np.ascontiguousarray(arr).tobytes().hex()}


def read_everything(buf: Any) -> dict[str, Any]:
    """What a trainer reads from the buffer: cursors, groups, ledger, every readable row's bytes,
    the dataloader state and the shortfall (JSON-ready)."""
    readable = [g.group_id for g in buf.groups(("ready", "claimed")) if g.rows_stored]
    rows = {gid: [{name: _array(v) for name, v in sorted(row.items())}
                  for row in buf.read_batch([gid], layout="list").rows] for gid in readable}
    return {"state": buf.state(), "groups": [g.to_dict() for g in buf.groups()],
            "ledger": [e.to_dict() for e in buf.ledger()], "rows": rows,
            "dataloader": (buf.dataloader_state() or b"").hex(), "shortfall": buf.batch_shortfall()}


def build(directory: str) -> tuple[str, dict[str, Any]]:
    """Write the golden checkpoint into ``directory``; its path and what it reads as."""
    from _buffers import SCHEMA, make_group

    from kvckpt import BufferConfig, Prompt, ReplayBuffer

    config = BufferConfig(group_size=2, sampler="in_order", max_buffered_rollouts=8, schema=SCHEMA,
                          groups_per_step=2, retain_consumed=1)
    with tempfile.TemporaryDirectory() as tmp:
        buf = ReplayBuffer.create(os.path.join(tmp, "live.kv"), config)
        leases = buf.admit([Prompt(prompt_idx=i) for i in range(4)], dataloader_state=b"first")
        for lease in leases[:3]:
            buf.commit_group(lease, make_group(2, lease.prompt_idx))
        buf.claim([leases[0].group_id, leases[1].group_id])
        buf.finish_step(weight_version=1)  # two groups consumed, rows kept (retain_consumed)
        leases = [leases[3], *buf.admit([Prompt(prompt_idx=i) for i in range(4, 7)], dataloader_state=DATALOADER)]
        buf.commit_group(leases[1], make_group(2, 4, length=6))
        buf.commit_sample(leases[2], 1, make_group(2, 5)[1])  # a prompt half committed
        buf.claim([leases[1].group_id])
        buf.abort(leases[3].group_id, "golden abort")
        path = os.path.join(directory, FILE)
        buf.checkpoint(path, TRAINER_STATE, background=False).wait()
        buf.close()
    with ReplayBuffer.open(path, readonly=True) as ro:
        return path, read_everything(ro)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # conftest's schema and rows
    out = sys.argv[1] if len(sys.argv) > 1 else HERE
    os.makedirs(out, exist_ok=True)
    made, expected = build(out)
    with open(os.path.join(out, EXPECTED), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{made}: {os.path.getsize(made):,} bytes")
