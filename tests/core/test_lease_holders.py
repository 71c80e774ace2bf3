"""Lease holders (issue 45): each ledger entry records the producer its lease was issued to, so a
trainer lists what a dead producer or node held in one read (``leases_held_by``) and hands it on in
one transaction (``redispatch_held_by``). The holder survives a restart of the world (fresh
processes, fresh objects, the writer SIGKILLed), an entry without one is byte for byte what an older
kvckpt wrote, and a record whose holder is not a string is ``malformed``. The Ray fleet's node kill
(tests/integrations/ray/test_ray_fleet.py) asks the same question of a real cluster.
"""

from __future__ import annotations

import asyncio
import shutil

import _crafted
import pytest
import torch
from _fresh import run_fresh

from kvckpt import (
    AsyncReplayBuffer,
    BadArgument,
    BufferConfig,
    Lease,
    LedgerEntry,
    ReplayBuffer,
    StaleAttempt,
    verify_path,
)
from kvckpt.storage import keys
from kvckpt.testing.memory_buffer import MemoryReplayBuffer

SCHEMA = {"input_ids": ("int64", "token"), "total_reward": ("float32", "row")}
CONFIG = {"group_size": 2, "schema": SCHEMA, "sampler": "ready_first", "max_buffered_rollouts": 8}
ROW = {"input_ids": torch.tensor([1, 2, 3]), "total_reward": torch.tensor(1.0)}

#: A producer process: admits for two nodes and for nobody, streams a chunk on node-a's first
#: sequence, prints its leases and dies by SIGKILL (no close, no cleanup).
WRITER = """
buf = ReplayBuffer.create(ARGS["path"], BufferConfig(**ARGS["config"]))
step = buf.advance_dispatch()  # one dispatch step, its prompts sent to two nodes and one unnamed producer
a = buf.admit([0, 1], holder="node-a", admission=step)
b = buf.admit([2], holder="node-b", admission=step)
none = buf.admit([3], admission=step)
buf.record_progress(a[0], 0, start=0, tokens=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3], weight_version=0)
print(json.dumps({k: [x.to_dict() for x in v] for k, v in (("a", a), ("b", b), ("none", none))}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

#: A trainer restarted after the world died: recovers, and says what each holder holds now.
RECOVERER = """
buf = ReplayBuffer.open(ARGS["path"])
plan = buf.recover()
print(json.dumps({"plan": sorted(x.group_id for x in plan.leases),
                  "held": {h: [x.to_dict() for x in buf.leases_held_by(h)] for h in ("node-a", "node-b", "node-c")}}))
"""


def test_a_dead_nodes_leases_are_listed_and_redispatched_in_one_call_across_restarts(tmp_path):
    path = str(tmp_path / "live.kv")
    wrote = run_fresh(WRITER, path=path, config=CONFIG)
    assert wrote["rc"] == -9, wrote["err"]
    issued = {k: [Lease.from_dict(x) for x in v] for k, v in wrote["out"].items()}
    assert [x.holder for x in issued["a"] + issued["b"] + issued["none"]] == ["node-a", "node-a", "node-b", None]

    # the trainer, restarted (fresh process state: this one never opened the store), asks what node-a held
    buf = ReplayBuffer.open(path)
    assert buf.leases_held_by("node-a") == issued["a"]  # exactly the issued leases, in dispatch order
    assert buf.leases_held_by("node-b") == issued["b"]
    assert buf.leases_held_by("node-z") == []
    fresh = buf.redispatch_held_by("node-a", to="node-c")  # node-a died: one call hands its leases on
    assert [(x.group_id, x.attempt, x.holder) for x in fresh] == [(x.group_id, 1, "node-c") for x in issued["a"]]
    assert buf.leases_held_by("node-a") == [] and buf.leases_held_by("node-c") == fresh
    assert buf.leases_held_by("node-b") == issued["b"]  # the others are untouched
    assert [e.holder for e in buf.ledger()] == ["node-c", "node-c", "node-b", None]
    assert buf.progress(fresh[0])[0].tokens.tolist() == [5, 6, 7]  # the durable prefix stays for the new holder
    with pytest.raises(StaleAttempt):  # the dead node's lease is fenced
        buf.commit_group(issued["a"][1], [ROW, ROW])
    assert buf.stats()["redispatched"] == 2
    buf.close()

    # another restart: recovery fences every lease again and keeps who held it
    again = run_fresh(RECOVERER, path=path)
    assert again["rc"] == 0, again["err"]
    held = {h: [Lease.from_dict(x) for x in v] for h, v in again["out"]["held"].items()}
    assert again["out"]["plan"] == sorted(x.group_id for v in issued.values() for x in v)
    assert [(x.group_id, x.attempt) for x in held["node-c"]] == [(x.group_id, 2) for x in issued["a"]]
    assert [(x.group_id, x.attempt) for x in held["node-b"]] == [(issued["b"][0].group_id, 1)]
    assert held["node-a"] == []
    assert verify_path(path, deep=True).problems == []


def test_redispatch_records_the_new_holder_or_none(tmp_path):
    with ReplayBuffer.create(str(tmp_path / "b.kv"), BufferConfig(**CONFIG)) as buf:
        [lease] = buf.admit([0], holder="w1")
        moved = buf.redispatch(lease.group_id, holder="w2")
        assert (moved.holder, buf.leases_held_by("w1"), buf.leases_held_by("w2")) == ("w2", [], [moved])
        dropped = buf.redispatch(lease.group_id)
        assert dropped.holder is None and buf.leases_held_by("w2") == []
        assert buf.redispatch_held_by("w2") == []  # holds nothing: nothing changes
        assert buf.stats()["redispatched"] == 2
        for bad in ("", 5, "a\nb"):
            with pytest.raises(BadArgument):
                buf.admit([1], holder=bad, timeout=0)
            with pytest.raises(BadArgument):
                buf.leases_held_by(bad)
        assert len(buf.ledger()) == 1  # the refused admissions wrote nothing


def test_an_entry_without_a_holder_is_the_bytes_an_older_kvckpt_wrote(tmp_path):
    path = str(tmp_path / "b.kv")
    with ReplayBuffer.create(path, BufferConfig(**CONFIG)) as buf:
        step = buf.advance_dispatch()
        [plain] = buf.admit([0], admission=step)
        [held] = buf.admit([1], holder="node-a", admission=step)
    edit = _crafted._Edit(path)
    try:
        docs = {gid: edit.doc("ledger", keys.group_key(gid)) for gid in (plain.group_id, held.group_id)}
    finally:
        edit.close()
    assert "holder" not in docs[plain.group_id] and docs[held.group_id]["holder"] == "node-a"
    assert "holder" not in plain.to_dict() and Lease.from_dict(plain.to_dict()) == plain
    old = {k: v for k, v in docs[held.group_id].items() if k != "holder"}  # what an older kvckpt wrote
    assert LedgerEntry.from_dict(old).holder is None


def test_a_holder_that_is_not_a_string_is_malformed(tmp_path):
    path = str(tmp_path / "b.kv")
    with ReplayBuffer.create(path, BufferConfig(**CONFIG)) as buf:
        [lease] = buf.admit([0], holder="node-a")
    assert verify_path(path).problems == []
    broken = str(tmp_path / "broken.kv")
    shutil.copy(path, broken)
    edit = _crafted._Edit(broken)
    doc = edit.doc("ledger", keys.group_key(lease.group_id))
    edit.put("ledger", keys.group_key(lease.group_id), _crafted.json_record({**doc, "holder": 5}))
    edit.close()
    problems = verify_path(broken).problems
    malformed = [p for p in problems if p.code == "malformed"]  # (its index entry then points at no record)
    assert [(p.key, p.message) for p in malformed] == [(lease.group_id, "holder is '5', not a string")], problems


def _memory(tmp_path):
    return MemoryReplayBuffer(BufferConfig(**CONFIG))


def _async(tmp_path):
    """The asyncio facade, driven through a small synchronous shim."""
    loop = asyncio.new_event_loop()
    abuf = loop.run_until_complete(AsyncReplayBuffer.create(str(tmp_path / "a.kv"), BufferConfig(**CONFIG)))

    class Shim:
        def __getattr__(self, name):
            return lambda *a, **k: loop.run_until_complete(getattr(abuf, name)(*a, **k))

    return Shim()


@pytest.mark.parametrize("surface", [_memory, _async], ids=["memory", "async"])
def test_every_surface_records_and_answers_holders_alike(tmp_path, surface):
    buf = surface(tmp_path)
    step = buf.advance_dispatch()
    a = buf.admit([0, 1], holder="node-a", admission=step)
    b = buf.admit([2], holder="node-b", admission=step)
    assert buf.leases_held_by("node-a") == a and buf.leases_held_by("node-b") == b
    fresh = buf.redispatch_held_by("node-a", to="node-c")
    assert [(x.group_id, x.attempt, x.holder) for x in fresh] == [(x.group_id, 1, "node-c") for x in a]
    assert buf.leases_held_by("node-a") == [] and buf.leases_held_by("node-c") == fresh
    assert buf.redispatch(b[0].group_id, holder="node-d").holder == "node-d"
    buf.close()
