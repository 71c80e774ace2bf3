"""Steps of the fencing tests, each run in a fresh interpreter (``python _fencing_steps.py STEP JSON``).

A step opens the store itself, does one thing a trainer or a worker does, prints one JSON line
and exits: nothing survives between steps but the files, as after a crash.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

from _buffers import SCHEMA, dump_store, make_group

from kvckpt import BufferConfig, KvckptError, Lease, Prompt, ReplayBuffer, check, restore


def _digest(buf: ReplayBuffer) -> str:
    return hashlib.sha256(repr(dump_store(buf)).encode()).hexdigest()


def setup(live: str, ckpt: str) -> dict[str, Any]:
    """A new store with one prompt in flight, checkpointed: the lease the first worker got."""
    buf = ReplayBuffer.create(live, BufferConfig(group_size=2, schema=SCHEMA, sampler="in_order",
                                                 max_buffered_rollouts=4))
    [lease] = buf.admit([Prompt(prompt_idx=0, group_id="g0")], dataloader_state=b"pos=1")
    buf.checkpoint(ckpt, {"step": 0}).wait()
    buf.close()
    return {"lease": lease.to_dict()}


def restore_again(live: str, ckpt: str) -> dict[str, Any]:
    """``restore(..., overwrite=True)``, as a trainer in a crash loop does at every start."""
    buf, plan = restore(ckpt, live, overwrite=True)
    buf.close()
    return {"leases": [lease.to_dict() for lease in plan.leases], "timeline": plan.timeline}


def redispatch(live: str, group_id: str) -> dict[str, Any]:
    """Hand the prompt to a new worker (a replaced worker, no crash)."""
    with ReplayBuffer.open(live) as buf:
        return {"lease": buf.redispatch(group_id).to_dict()}


def commit(live: str, lease: dict[str, Any], seed: int) -> dict[str, Any]:
    """A worker commits its group; the result, or the error's class, and whether any byte changed."""
    with ReplayBuffer.open(live) as buf:
        before = _digest(buf)
        try:
            result = buf.commit_group(Lease.from_dict(lease), make_group(2, seed))
        except KvckptError as exc:
            return {"error": type(exc).__name__, "message": str(exc), "unchanged": _digest(buf) == before}
        return {"ready": result.ready, "replayed": result.replayed}


def train(live: str) -> dict[str, Any]:
    """The trainer's next step: which rows does it train on?"""
    with ReplayBuffer.open(live) as buf:
        batch = buf.read_batch(buf.select(1))
        return {"group_ids": batch.group_ids, "rewards": batch.tensors["total_reward"].tolist(),
                "verified": buf.store.read(lambda t: check(t, deep=True).ok)}


STEPS = {"setup": setup, "restore": restore_again, "redispatch": redispatch, "commit": commit, "train": train}

if __name__ == "__main__":
    print(json.dumps(STEPS[sys.argv[1]](**json.loads(sys.argv[2]))))
