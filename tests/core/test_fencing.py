"""Fencing (issue 15): a lease commits only under the store id, timeline and attempt its ledger
entry holds now, and the ledger entry is the only authority on what the group is.

One regression test per case the review reproduced; each refusal is checked the strong way (every
table byte-identical afterwards). The crash-loop cases restart the world: every step is a fresh
interpreter (tests/_fencing_steps.py) that opens the files itself.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from _buffers import make_group, refused
from _old_format import rewrite_as_named_tables
from _paths import TESTS

from kvckpt import (
    AbandonedTimeline,
    BadArgument,
    ForeignLease,
    KvckptError,
    Lease,
    LeaseMismatch,
    Prompt,
    ReadOnlyStore,
    ReplayBuffer,
    StaleAttempt,
    StoreLocked,
    check,
    restore,
)
from kvckpt.storage.store import FORMAT_VERSION

STEPS = str(TESTS / "_fencing_steps.py")


def step(name: str, **kwargs) -> dict:
    proc = subprocess.run([sys.executable, STEPS, name, json.dumps(kwargs)], capture_output=True, text=True,
                          timeout=120, cwd=TESTS)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def files(tmp_path):
    live, ckpt = str(tmp_path / "live.kv"), str(tmp_path / "step0.kvckpt")
    first = step("setup", live=live, ckpt=ckpt)["lease"]
    return live, ckpt, first


# -- 1. a zombie of an abandoned timeline -----------------------------------------------------------

def test_restoring_the_same_checkpoint_twice_fences_the_first_restores_workers(files):
    live, ckpt, original = files
    first = step("restore", live=live, ckpt=ckpt)
    [zombie] = first["leases"]
    second = step("restore", live=live, ckpt=ckpt)
    [legit] = second["leases"]
    # The file resets attempts: both restores hand out attempt 1; only the timeline tells them apart.
    assert zombie["attempt"] == legit["attempt"] == 1 and zombie["timeline"] != legit["timeline"]
    assert legit["timeline"] == second["timeline"] != first["timeline"]
    for lease in (zombie, original):
        got = step("commit", live=live, lease=lease, seed=1)
        assert (got["error"], got["unchanged"]) == ("AbandonedTimeline", True)
        assert "a restore or recovery came after the lease was issued" in got["message"]
    assert step("commit", live=live, lease=legit, seed=2) == {"ready": True, "replayed": False}
    assert step("commit", live=live, lease=legit, seed=2) == {"ready": True, "replayed": True}  # idempotent
    late = step("commit", live=live, lease=zombie, seed=1)  # the zombie after the legitimate commit
    assert (late["error"], late["unchanged"]) == ("AbandonedTimeline", True)
    trained = step("train", live=live)
    want = [float(row["total_reward"]) for row in make_group(2, 2)]
    assert (trained["group_ids"], trained["rewards"], trained["verified"]) == (["g0", "g0"], want, True)


def test_a_redispatched_lease_of_an_abandoned_timeline_is_fenced(files):
    live, ckpt, _ = files
    step("restore", live=live, ckpt=ckpt)
    zombie = step("redispatch", live=live, group_id="g0")["lease"]
    step("restore", live=live, ckpt=ckpt)
    legit = step("redispatch", live=live, group_id="g0")["lease"]
    assert zombie["attempt"] == legit["attempt"] == 2
    got = step("commit", live=live, lease=zombie, seed=1)
    assert (got["error"], got["unchanged"]) == ("AbandonedTimeline", True)
    assert step("commit", live=live, lease=legit, seed=2)["ready"]


def test_live_recovery_starts_a_timeline_too(buffer_factory):
    buf = buffer_factory()
    [lease] = buf.admit([Prompt(prompt_idx=0)])
    before = buf.state()["timeline"]
    plan = buf.recover()
    assert plan.timeline == buf.state()["timeline"] != before
    assert plan.leases[0].timeline == plan.timeline and plan.report()["timeline"] == plan.timeline
    error = refused(buf, AbandonedTimeline, buf.commit_group, lease, make_group(2, 1))
    assert error.differs == "timeline" and isinstance(error, StaleAttempt)


def test_a_redispatch_fences_the_previous_attempt(buffer_factory):
    buf = buffer_factory()
    [old] = buf.admit([Prompt(prompt_idx=0)])
    new = buf.redispatch(old.group_id)
    error = refused(buf, StaleAttempt, buf.commit_group, old, make_group(2, 1))
    assert type(error) is StaleAttempt and error.differs == "attempt"
    assert "older than the current attempt 1" in str(error)
    assert buf.commit_group(new, make_group(2, 2)).ready


# -- 2. a lease of another store; a lease for another prompt ---------------------------------------------

def test_a_lease_of_another_store_is_refused_even_for_the_same_group_id(buffer_factory):
    ours, theirs = buffer_factory(name="ours.kv"), buffer_factory(name="theirs.kv")
    [mine] = ours.admit([Prompt(prompt_idx=0, group_id="g0")])
    [foreign] = theirs.admit([Prompt(prompt_idx=0, group_id="g0")])
    assert (foreign.attempt, foreign.group_id) == (mine.attempt, mine.group_id)
    error = refused(ours, ForeignLease, ours.commit_group, foreign, make_group(2, 1))
    assert error.differs == "store_id" and theirs.store.store_id in str(error)


def test_a_lease_from_an_older_kvckpt_on_the_wire_is_refused_not_crashed_on(buffer_factory):
    buf = buffer_factory()
    [lease] = buf.admit([Prompt(prompt_idx=0)])
    wire = {k: v for k, v in lease.to_dict().items() if k not in ("store_id", "timeline")}
    error = refused(buf, ForeignLease, buf.commit_group, Lease.from_dict(wire), make_group(2, 1))
    assert "a kvckpt that issued no store id" in str(error)
    with pytest.raises(BadArgument, match="lacks group_id"):
        Lease.from_dict({"attempt": 0})
    refused(buf, BadArgument, buf.commit_group, lease.to_dict(), make_group(2, 1))  # a dict is not a lease


@pytest.mark.parametrize("name, value", [("prompt_idx", 5), ("task_name", "other"), ("target_step", 3),
                                         ("start_weight", 7), ("admission_id", "a9")])
def test_a_lease_that_disagrees_with_its_ledger_entry_is_refused_naming_the_field(buffer_factory, name, value):
    buf = buffer_factory()
    [lease] = buf.admit([Prompt(prompt_idx=0)])
    error = refused(buf, LeaseMismatch, buf.commit_group, dataclasses.replace(lease, **{name: value}),
                    make_group(2, 1))
    assert error.field == name and f"the lease says {name}=" in str(error)
    assert buf.commit_group(lease, make_group(2, 1)).ready


# -- 3. the group size comes from the store -----------------------------------------------------------------

def test_a_lease_claiming_another_group_size_cannot_make_the_store_unrecoverable(buffer_factory, tmp_path):
    buf = buffer_factory()
    [lease] = buf.admit([Prompt(prompt_idx=0)])
    forged = dataclasses.replace(lease, group_size=3, missing=(0, 1, 2))
    error = refused(buf, LeaseMismatch, buf.commit_group, forged, make_group(3, 1))
    assert error.field == "group_size"
    refused(buf, LeaseMismatch, buf.commit_sample, forged, 2, make_group(3, 1)[2])
    assert buf.commit_group(lease, make_group(2, 1)).ready
    assert buf.store.read(lambda t: check(t, deep=True)).ok
    buf.checkpoint(str(tmp_path / "c.kvckpt")).wait()
    restored, _ = restore(str(tmp_path / "c.kvckpt"), str(tmp_path / "restored.kv"))
    assert restored.read_batch(restored.select(1)).tensors["input_ids"].shape[0] == 2
    restored.close()


# -- 4. per-row shapes are pinned -------------------------------------------------------------------------

def test_a_group_whose_rows_disagree_on_a_per_row_shape_is_refused(buffer_factory):
    from kvckpt import SchemaMismatch

    buf = buffer_factory()
    [lease] = buf.admit([Prompt(prompt_idx=0)])
    rows = make_group(2, 1)
    rows[1] = {**rows[1], "total_reward": torch.rand(3)}
    refused(buf, SchemaMismatch, buf.commit_group, lease, rows)


# -- 5. prompt_idx and other arguments are validated ------------------------------------------------------

@pytest.mark.parametrize("prompt_idx", [-1, 1.5, "abc", None, True, 2**64])
def test_a_bad_prompt_idx_is_a_bad_argument_and_writes_nothing(buffer_factory, prompt_idx):
    buf = buffer_factory()
    error = refused(buf, BadArgument, buf.admit, [Prompt(prompt_idx=0), {"prompt_idx": prompt_idx}])
    assert "prompt_idx" in str(error)
    with pytest.raises(BadArgument, match="prompt_idx"):
        Prompt(prompt_idx=prompt_idx)


@pytest.mark.parametrize("call, match", [
    (lambda b: b.admit([0], weight_version=-2), "weight_version"),
    (lambda b: b.admit([0], timeout=-1), "timeout"),
    (lambda b: b.admit([0], dataloader_state="text"), "dataloader_state"),
    (lambda b: b.admit([Prompt(prompt_idx=0, group_id="x" * 300)]), "group_id"),
    (lambda b: b.admit([Prompt(prompt_idx=0, group_id="a\0b")]), "group_id"),
    (lambda b: b.admit([{"prompt_idx": 0, "colour": "red"}]), "prompt dict"),
    (lambda b: b.redispatch("g", start_weight=1.5), "start_weight"),
])
def test_arguments_are_checked_at_the_api_edge(buffer_factory, call, match):
    buf = buffer_factory()
    refused(buf, BadArgument, call, buf)
    with pytest.raises(BadArgument, match=match):
        call(buf)


# -- 6. read-only views in the writer's own process ------------------------------------------------------

def test_a_read_only_open_in_the_writers_process_is_a_consistent_view(buffer_factory):
    buf = buffer_factory()
    [lease] = buf.admit([Prompt(prompt_idx=0)])
    with pytest.raises(StoreLocked, match="readonly=True"):
        ReplayBuffer.open(buf.path)
    view = ReplayBuffer.open(buf.path, readonly=True)  # what the StoreLocked message offers
    assert [e.group_id for e in view.ledger()] == [lease.group_id]
    buf.commit_group(lease, make_group(2, 1))
    assert view.state()["ready"] == 1 and view.read_batch([lease.group_id]).tensors["input_ids"].shape[0] == 2
    with pytest.raises(ReadOnlyStore):
        view.admit([1])
    view.close()
    assert buf.state()["ready"] == 1  # closing the view leaves the writer open
    again = ReplayBuffer.open(buf.path, readonly=True)
    buf.close()
    with pytest.raises(KvckptError, match="closed"):
        again.state()
    again.close()


# -- format -------------------------------------------------------------------------------------------------

def test_a_version_1_store_is_upgraded_in_place_and_its_old_leases_fenced(buffer_factory):
    buf = buffer_factory()
    [old] = buf.admit([Prompt(prompt_idx=0)])
    path = buf.path

    def downgrade(txn):  # what a version-1 kvckpt wrote: no timeline anywhere
        st = txn.get_json("meta", b"state")
        del st["timeline"]
        txn.put_json("meta", b"state", st)
        for key, _ in list(txn.iter_prefix("ledger", b"")):
            doc = txn.get_json("ledger", key)
            del doc["timeline"]
            txn.put_json("ledger", key, doc)
        txn.put_json("meta", b"format", {**txn.get_json("meta", b"format"), "version": 1})

    buf.store.write(downgrade)
    buf.close()
    rewrite_as_named_tables(path, 1)
    with ReplayBuffer.open(path, readonly=True) as ro:  # readers read version 1 as it is
        assert ro.store.info["version"] == 1 and len(ro.ledger()) == 1
    with ReplayBuffer.open(path) as up:
        assert (up.store.info["version"], up.store.info["upgraded_from"]) == (FORMAT_VERSION, 1)
        [entry] = up.ledger()
        assert entry.attempt == 1 and entry.timeline == up.state()["timeline"] != ""
        v1_lease = Lease.from_dict({k: v for k, v in old.to_dict().items() if k not in ("store_id", "timeline")})
        refused(up, ForeignLease, up.commit_group, v1_lease, make_group(2, 1))
        assert up.commit_group(entry.lease(up.store.store_id), make_group(2, 1)).ready
        assert up.store.read(lambda t: check(t, deep=True)).ok
