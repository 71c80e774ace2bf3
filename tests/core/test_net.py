"""The net under the core refactor (issue 16): deterministic tests for bugs that the rest of the
suite caught only by chance, and the one-transition-one-transaction property of every public
transition.

Each test below names the plausible bug it exists to catch; ``scripts/mutation_check.py`` applies
those bugs to a copy of the tree and shows each of these tests failing on it. Everything runs on
real LMDB files through the public API. The only instrumentation is observation: a counter in
front of ``Store.write`` that forwards every call unchanged, LMDB's own transaction id, and one
hook that commits a group at a chosen moment of a checkpoint (after the stamp, before the copy).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _buffers import SCHEMA, make_group

from kvckpt import Lease, Prompt, ReplayBuffer, StaleAttempt
from kvckpt.buffer import restore
from kvckpt.durability import checkpoint
from kvckpt.storage import keys

GROUP_SIZE = 2
#: Group ids that are byte prefixes of each other: ``g1`` is a prefix of every other one.
FAMILY = ["g1", *(f"g1{i}" for i in range(10))]
VICTIM = "g1"


def admit(buf: ReplayBuffer, *gids: str) -> list[Lease]:
    """Admit one prompt per id, in this order (so the first gets the lowest sequence number)."""
    return buf.admit([Prompt(prompt_idx=i, group_id=gid) for i, gid in enumerate(gids)], timeout=0)


def rows_table(buf: ReplayBuffer) -> dict[bytes, bytes]:
    """Every key and value of the ``rows`` table, from one snapshot."""
    return dict(buf.store.read(lambda t: list(t.iter_prefix("rows", b""))))


def victim_keys() -> set[bytes]:
    return {keys.row_key(VICTIM, i) for i in range(GROUP_SIZE)}


def seed_of(gid: str) -> int:
    return FAMILY.index(gid) + 1


def assert_rows_equal(buf: ReplayBuffer, gid: str) -> None:
    """``read_batch`` of ``gid`` alone returns exactly the rows committed for it."""
    batch = buf.read_batch([gid], layout="list")
    assert batch.group_ids == [gid] * GROUP_SIZE
    for got, want in zip(batch.rows, make_group(GROUP_SIZE, seed_of(gid)), strict=True):
        assert all(torch.equal(got[name], want[name]) for name in SCHEMA), gid


# -- row-key prefix isolation -------------------------------------------------------------------------
# Bug: ``keys.row_prefix`` without its NUL separator makes every row operation on ``g1`` reach the
# rows of ``g10`` .. ``g19`` too.
@pytest.mark.parametrize("operation", ["evict", "abort", "drop", "read", "retry"])
def test_operations_on_a_group_leave_groups_whose_ids_extend_its_id_untouched(buffer_factory, operation):
    buf = buffer_factory({"name": "windowed", "max_staleness_versions": 8}, group_size=GROUP_SIZE,
                         capacity=32, durable_checkpoints=1)
    leases = dict(zip(FAMILY, admit(buf, *FAMILY), strict=True))
    for gid in FAMILY[1:]:
        assert buf.commit_group(leases[gid], make_group(GROUP_SIZE, seed_of(gid))).ready
    victim_rows = make_group(GROUP_SIZE, seed_of(VICTIM))
    if operation == "abort":
        buf.commit_sample(leases[VICTIM], 0, victim_rows[0])  # a partial group: one row to delete
    else:
        assert buf.commit_group(leases[VICTIM], victim_rows).ready
    if operation == "drop":
        assert buf.select(1, 1).group_ids == [VICTIM]  # the oldest ready group
        buf.finish_step()  # consumed at step 0
        buf.checkpoint(str(buf.path) + ".ckpt").wait()  # a durable checkpoint covers version 1
    before = rows_table(buf)
    others = {k: v for k, v in before.items() if k not in victim_keys()}
    assert len(others) == GROUP_SIZE * (len(FAMILY) - 1)

    if operation == "evict":
        assert buf.evict([VICTIM]) == [VICTIM]
    elif operation == "abort":
        buf.abort(VICTIM, "given up")
    elif operation == "drop":
        buf.finish_step()  # drops the rows of groups consumed before the durable checkpoint
        assert not buf.group(VICTIM).rows_stored
    elif operation == "read":
        assert_rows_equal(buf, VICTIM)
    else:  # a producer retries a commit whose acknowledgement it lost
        assert buf.commit_group(leases[VICTIM], victim_rows).replayed

    after = rows_table(buf)
    assert {k: after.get(k) for k in others} == others  # byte-identical, none lost
    if operation in ("evict", "abort", "drop"):
        assert not victim_keys() & after.keys()
        assert len(after) == len(others)
    else:
        assert after == before
    for gid in FAMILY[1:]:
        assert_rows_equal(buf, gid)


# -- the checkpoint holds the snapshot pinned at its stamp ------------------------------------------
# Bug: the copy reads the live state at copy time (a fresh read transaction, or ``Environment.copy``
# without ``txn=``), so a commit landing between the stamp and the copy leaks into the checkpoint:
# the file then holds a state its own stamp (step, trainer state, dataloader position) does not
# describe.
# Both ways a checkpoint writes its snapshot are held to it: the page copy and, with many free
# pages, the compacting copy (the threshold moved so that each runs on the same small buffer).
@pytest.mark.parametrize(("how", "compact_when_free"), [("copy", 1.0), ("compact", -1.0)])
def test_a_commit_after_the_stamp_stays_out_of_the_checkpoint(buffer_factory, tmp_path, monkeypatch, how,
                                                              compact_when_free):
    monkeypatch.setattr(checkpoint, "COMPACT_WHEN_FREE", compact_when_free)
    buf = buffer_factory({"name": "windowed", "max_staleness_versions": 8}, group_size=GROUP_SIZE, capacity=16)
    early, late = admit(buf, "early", "late")
    buf.commit_group(early, make_group(GROUP_SIZE, 1))
    stamp_then_snapshot = buf.store.write_then_snapshot
    landed: list[str] = []

    def commit_right_after_the_stamp(fn: Callable[[Any], Any], *args: Any) -> Any:
        result = stamp_then_snapshot(fn, *args)  # the stamp is committed; nothing has been copied yet
        landed.append(buf.commit_group(late, make_group(GROUP_SIZE, 2)).group_id)
        return result

    monkeypatch.setattr(buf.store, "write_then_snapshot", commit_right_after_the_stamp)
    dest = str(tmp_path / "ckpt.kv")
    assert buf.checkpoint(dest).wait().how == how
    assert landed == ["late"], "the checkpoint did not stamp through Store.write_then_snapshot"
    assert buf.group("late").state == "ready" and buf.ledger() == []

    with ReplayBuffer.open(dest, readonly=True) as saved:
        assert saved.group("late") is None
        assert [e.group_id for e in saved.ledger()] == ["late"]
        assert saved.state()["counters"]["committed"] == 1
    restored, plan = restore(dest, str(tmp_path / "live.kv"))
    with restored:
        assert [lease.group_id for lease in plan.leases] == ["late"]
        assert [g.group_id for g in restored.groups()] == ["early"]
        assert restored.commit_group(plan.leases[0], make_group(GROUP_SIZE, 2)).ready


# -- fencing and recovery stamps ----------------------------------------------------------------------
# Bug: ``redispatch`` hands out a new lease without bumping the attempt, so the old worker's lease
# still commits.
def test_redispatch_fences_the_previous_lease(buffer_factory):
    buf = buffer_factory("windowed", group_size=GROUP_SIZE)
    [old] = admit(buf, "g")
    new = buf.redispatch("g")
    with pytest.raises(StaleAttempt):
        buf.commit_group(old, make_group(GROUP_SIZE, 1))
    assert new.attempt == old.attempt + 1
    assert buf.ledger()[0].attempt == new.attempt and buf.group("g") is None
    assert buf.commit_group(new, make_group(GROUP_SIZE, 2)).ready
    assert buf.group("g").attempt == new.attempt


# Bug: ``recover`` rolls ``trainer_version`` back but keeps the abandoned run's rollout weight
# version, so new prompts are stamped with weights the resumed trainer never produced.
def test_recover_rolls_the_weight_version_back_with_the_trainer(buffer_factory):
    buf = buffer_factory({"name": "windowed", "max_staleness_versions": 8}, group_size=GROUP_SIZE, capacity=16)
    path = buf.path
    for _ in range(3):
        buf.finish_step()
    [inflight] = admit(buf, "inflight")
    assert (buf.state()["weight_version"], inflight.start_weight) == (3, 3)
    buf.close()
    with ReplayBuffer.open(path) as again:  # a fresh handle, as after a crash
        plan = again.recover(1)  # the model checkpoint of version 1 is what survived
        [fresh] = admit(again, "fresh")
        assert fresh.start_weight == 1
        assert again.state()["weight_version"] == 1
        assert again.commit_group(fresh, make_group(GROUP_SIZE, 1)).ready
        assert (again.group("fresh").start_weight, again.group("fresh").end_weight) == (1, 1)
        # An in-flight prompt stamped with weights the rollback destroyed (3) that kept nothing is
        # regenerated by the resumed weights, and stamped so (issue 39; it kept 3 before).
        [redone] = plan.leases
        assert redone.start_weight == 1 and plan.prompts_restamped == 1
        again.commit_group(redone, make_group(GROUP_SIZE, 2))
        assert (again.group("inflight").start_weight, again.group("inflight").end_weight) == (1, 1)


# -- one transition, one write transaction -------------------------------------------------------------
class WriteCounter:
    """Counts, per thread, the calls of one buffer's ``Store.write`` (every call is forwarded
    unchanged) and reads LMDB's last committed transaction id, which grows by exactly one per
    committed write transaction whatever path opened it."""

    def __init__(self, buf: ReplayBuffer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.env = buf.store.env
        self.calls: list[int] = []
        write = buf.store.write

        def counting(fn: Callable[[Any], Any]) -> Any:
            self.calls.append(threading.get_ident())
            return write(fn)

        monkeypatch.setattr(buf.store, "write", counting)

    def txnid(self) -> int:
        return self.env.info()["last_txnid"]

    def once(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` and assert it made exactly one ``Store.write`` and one LMDB commit."""
        calls, txnid = len(self.calls), self.txnid()
        result = action()
        assert (len(self.calls) - calls, self.txnid() - txnid) == (1, 1)
        return result


def test_every_transition_is_one_write_transaction(buffer_factory, tmp_path, monkeypatch):
    buf = buffer_factory({"name": "windowed", "max_staleness_versions": 1}, group_size=GROUP_SIZE,
                         capacity=16, durable_checkpoints=1)
    count = WriteCounter(buf, monkeypatch)
    a, b, c, _, _ = count.once(lambda: admit(buf, "a", "b", "c", "d", "e"))
    count.once(lambda: buf.commit_group(a, make_group(GROUP_SIZE, 1)))
    count.once(lambda: buf.commit_sample(b, 0, make_group(GROUP_SIZE, 2)[0]))
    assert count.once(lambda: buf.commit_sample(b, 1, make_group(GROUP_SIZE, 2)[1])).ready
    count.once(lambda: buf.commit_group(c, make_group(GROUP_SIZE, 3)))
    assert count.once(lambda: buf.select(1, 1)).group_ids == ["a"]
    assert count.once(buf.finish_step) == 1
    d2 = count.once(lambda: buf.redispatch("d", start_weight=1))
    count.once(lambda: buf.commit_group(d2, make_group(GROUP_SIZE, 4)))
    count.once(lambda: buf.redispatch("e", holder="node-x"))
    moved = count.once(lambda: buf.redispatch_held_by("node-x", to="node-y"))  # what a dead node held: one write
    writes = len(count.calls)
    assert [x.group_id for x in buf.leases_held_by("node-y")] == [x.group_id for x in moved] == ["e"]
    assert len(count.calls) == writes  # and its read writes nothing
    count.once(lambda: buf.abort("e", "given up"))
    assert count.once(lambda: buf.evict(["c"])) == ["c"]

    # the checkpoint stamp: one write by the caller; the copy thread later writes one more, the
    # durable marker (its own transition, after the file is complete)
    caller = threading.get_ident()
    calls, txnid = len(count.calls), count.txnid()
    handle = buf.checkpoint(str(tmp_path / "ckpt.kv"))
    assert count.calls[calls:].count(caller) == 1
    handle.wait()
    assert (len(count.calls) - calls, count.txnid() - txnid) == (2, 2)
    assert count.calls[-1] != caller

    assert count.once(lambda: buf.select(1, 1)).group_ids == ["b"]
    assert count.once(buf.finish_step) == 2  # consumes b, drops a's rows (before the checkpoint)
    assert not buf.group("a").rows_stored
    [f] = count.once(lambda: admit(buf, "f"))
    assert f.start_weight == 2
    for _ in range(2):
        count.once(buf.finish_step)
    assert count.once(buf.abort_stale_inflight) == ["f"]  # weight 2 fell out of the window at 4
    assert count.once(buf.evict) == ["d"]  # start weight 1, below the window at 4
    assert count.once(lambda: buf.recover(2)).resume_version == buf.trainer_version == 2


def test_split_admission_promotion_and_a_sampler_switch_are_one_write_transaction_each(
        buffer_factory, monkeypatch):
    buf = buffer_factory({"name": "in_order", "max_lookahead_versions": 2}, group_size=GROUP_SIZE, capacity=16)
    count = WriteCounter(buf, monkeypatch)
    admission = count.once(lambda: buf.advance_dispatch(b"cursor=1"))
    [a] = count.once(lambda: buf.admit([Prompt(prompt_idx=1, group_id="a")], admission=admission, timeout=0))
    [b] = count.once(lambda: admit(buf, "b"))
    assert (a.target_step, b.target_step) == (0, 1)
    count.once(lambda: buf.commit_group(b, make_group(GROUP_SIZE, 2)))
    count.once(lambda: buf.abort("a", "given up"))
    assert count.once(lambda: buf.promote_ready_group(0)) == 1  # b tops up step 0
    assert count.once(lambda: buf.select(1, 1)).group_ids == ["b"]
    assert count.once(lambda: buf.release_claims(["b"])) == ["b"]
    assert count.once(lambda: buf.claim(["b"])).group_ids == ["b"]
    plan = count.once(lambda: buf.recover(0, sampler={"name": "windowed", "max_staleness_versions": 2}))
    assert plan.groups_returned_to_ready == 1 and plan.changes
