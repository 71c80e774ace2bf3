"""The replay buffer's transactions: exactly-once commits, fencing, schema refusals, batch reads,
step accounting, durable consumption, persisted config and concurrent producers.

Every refusal is checked the strong way: a dump of every table before and after is identical.
"""

from __future__ import annotations

import asyncio
import doctest
import threading

import pytest
import torch
from _buffers import SCHEMA, dump_store, make_group, make_row, refused
from _paths import ROOT

from kvckpt import (
    AbandonedTimeline,
    BadArgument,
    BufferConfig,
    DuplicateCommit,
    Lease,
    NotSelectable,
    Prompt,
    RecoveryError,
    ReplayBuffer,
    SchemaMismatch,
    StaleAttempt,
    UnknownGroup,
)
from kvckpt.durability.verify import check


def ok(buf: ReplayBuffer, deep: bool = False) -> bool:
    report = buf.store.read(lambda t: check(t, deep=deep))
    assert report.problems == []
    return report.ok


def admit_one(buf: ReplayBuffer, gid: str, **kwargs) -> Lease:
    [lease] = buf.admit([Prompt(prompt_idx=0, group_id=gid)], timeout=0, **kwargs)
    return lease


# -- fencing and exactly-once -----------------------------------------------------------------------
def test_zombie_commit_after_recover_is_refused_and_writes_nothing(buffer_factory):
    buf = buffer_factory("in_order")
    rows = make_group(2, seed=1)
    old = admit_one(buf, "g1")
    buf.commit_sample(old, 0, rows[0])
    plan = buf.recover()
    [new] = plan.leases
    assert (new.attempt, new.missing, plan.siblings_reused, plan.siblings_rerun) == (1, (1,), 1, 1)
    error = refused(buf, AbandonedTimeline, buf.commit_group, old, rows)
    assert "a restore or recovery came after the lease was issued" in str(error)
    refused(buf, StaleAttempt, buf.commit_sample, old, 1, rows[1])
    assert buf.commit_group(new, [rows[1]]).ready  # only the missing sibling
    # The zombie comes back after the redispatched attempt landed: still fenced.
    refused(buf, StaleAttempt, buf.commit_group, old, rows)
    refused(buf, StaleAttempt, buf.commit_sample, old, 1, rows[1])
    batch = buf.read_batch(["g1"], layout="list")
    for got, want in zip(batch.rows, rows, strict=True):
        assert all(torch.equal(got[k], want[k]) for k in SCHEMA)
    assert ok(buf, deep=True)


def test_lease_from_the_future_is_refused(buffer_factory):
    buf = buffer_factory("windowed")
    lease = admit_one(buf, "g1")
    forged = Lease(**{**lease.to_dict(), "attempt": 3})
    error = refused(buf, StaleAttempt, buf.commit_group, forged, make_group(2, 1))
    assert "attempt 3 refused: it is newer than the current attempt 0" in str(error)


def test_duplicate_identical_commit_is_idempotent(buffer_factory):
    buf = buffer_factory("in_order")
    lease = admit_one(buf, "g1")
    rows = make_group(2, seed=7)
    first = buf.commit_group(lease, rows)
    assert (first.ready, first.replayed, first.rows_written) == (True, False, 2)
    stats = {k: v for k, v in buf.stats().items() if not k.startswith("commit_")}
    before = dump_store(buf)
    again = buf.commit_group(lease, make_group(2, seed=7))  # equal content, new tensors
    assert (again.ready, again.replayed, again.rows_written) == (True, True, 0)
    assert dump_store(buf) == before
    assert {k: v for k, v in buf.stats().items() if not k.startswith("commit_")} == stats
    assert buf.commit_sample(lease, 1, rows[1]).replayed  # one identical row of it, too
    assert dump_store(buf) == before
    buf.select(1, 1)  # still idempotent once claimed
    assert buf.commit_group(lease, rows).replayed
    assert len(buf.read_batch(["g1"]).row_indices) == 2


def test_duplicate_commit_with_other_content_is_refused(buffer_factory):
    buf = buffer_factory("in_order")
    lease = admit_one(buf, "g1")
    buf.commit_group(lease, make_group(2, seed=1))
    refused(buf, DuplicateCommit, buf.commit_group, lease, make_group(2, seed=2))
    refused(buf, DuplicateCommit, buf.commit_group, lease, [make_group(2, 1)[0], make_row(3, 0)])
    refused(buf, DuplicateCommit, buf.commit_sample, lease, 0, make_row(4, 99))


def test_commit_for_unknown_group_writes_nothing(buffer_factory):
    buf = buffer_factory("in_order")
    admit_one(buf, "g1")
    ghost = Lease("ghost", 0, 2, 0, 0, 5, "default", "a0", (0, 1))
    error = refused(buf, UnknownGroup, buf.commit_group, ghost, make_group(2, 1))
    assert str(error) == "group 'ghost' is neither in flight nor committed in this store; nothing was written"
    refused(buf, UnknownGroup, buf.commit_sample, ghost, 0, make_row(3, 1))


@pytest.mark.parametrize("exit_path", ["abort", "evict"])
def test_commit_after_abort_or_evict_is_refused(buffer_factory, exit_path):
    buf = buffer_factory({"name": "windowed", "max_staleness_versions": 0})
    lease = admit_one(buf, "g1")
    rows = make_group(2, seed=1)
    if exit_path == "abort":
        buf.abort("g1", "reward model down")
    else:
        buf.commit_group(lease, rows)
        buf.finish_step()
        assert buf.evict() == ["g1"]
    error = refused(buf, UnknownGroup, buf.commit_group, lease, rows)
    assert f"was {exit_path}ed" in str(error)



def test_a_commit_failing_midway_leaves_no_row(buffer_factory, monkeypatch):
    """§G.2: a commit that fails after writing some rows leaves no row and the prompt in flight."""
    from kvckpt.storage.store import Txn

    buf = buffer_factory("in_order")
    lease = admit_one(buf, "g1")
    put = Txn.put
    calls = []

    def failing_put(self, table, key, value):
        calls.append(table)
        if table == "rows" and calls.count("rows") == 2:
            raise OSError("injected: the second row's write fails")
        return put(self, table, key, value)

    monkeypatch.setattr(Txn, "put", failing_put)
    refused(buf, OSError, buf.commit_group, lease, make_group(2, 1))
    monkeypatch.setattr(Txn, "put", put)
    assert calls.count("rows") == 2
    assert buf.store.read(lambda t: list(t.iter_prefix("rows", b""))) == []
    assert [e.group_id for e in buf.ledger()] == ["g1"]
    assert buf.commit_group(lease, make_group(2, 1)).ready


def test_commits_replayed_after_map_full_land_once(tmp_path):
    """A full map aborts the transaction, grows the map and replays it: nothing may be counted twice."""
    buf = ReplayBuffer.create(str(tmp_path / "tiny.kv"), BufferConfig(
        group_size=2, schema=SCHEMA, sampler="windowed", max_buffered_rollouts=64, compression_level=0),
        map_size=1 << 16)
    try:
        raw = 0
        for i in range(24):
            [lease] = buf.admit([Prompt(i)], dataloader_state=bytes(2000), timeout=0)
            rows = [make_row(2000, i), make_row(1500, i + 100)]
            raw += sum(t.numpy().nbytes for row in rows for t in row.values())
            assert buf.commit_group(lease, rows).ready
        assert buf.store.env.info()["map_size"] > 1 << 16
        stats = buf.stats()
        assert (stats["admitted"], stats["committed"], stats["ready"], stats["raw_bytes"]) == (24, 24, 24, raw)
        assert buf.state()["seq"] == 24
        assert ok(buf, deep=True)
    finally:
        buf.close()

# -- per-sample commits --------------------------------------------------------------------------------
def test_commit_sample_tracks_sibling_progress_and_readies_on_the_last(buffer_factory):
    buf = buffer_factory("in_order", group_size=3)
    lease = admit_one(buf, "g1")
    rows = make_group(3, seed=3)
    first = buf.commit_sample(lease, 2, rows[2])
    assert (first.ready, first.replayed, first.rows_written) == (False, False, 1)
    [entry] = buf.ledger()
    assert (entry.siblings, entry.lease(buf.store.store_id).missing) == ((2,), (0, 1))
    assert buf.group("g1") is None
    with pytest.raises(NotSelectable):
        buf.read_batch(["g1"])
    replay = buf.commit_sample(lease, 2, rows[2])
    assert (replay.ready, replay.replayed) == (False, True)
    refused(buf, DuplicateCommit, buf.commit_sample, lease, 2, rows[0])
    assert not buf.commit_sample(lease, 0, rows[0]).ready
    assert buf.select(1, 1).group_ids == []  # not ready before the last sibling
    last = buf.commit_sample(lease, 1, rows[1], end_weight=5)
    assert (last.ready, last.rows_written) == (True, 1)
    assert buf.ledger() == []
    group = buf.group("g1")
    assert (group.state, group.end_weight, group.attempt) == ("ready", 5, 0)
    stats = buf.stats()
    assert (stats["samples_committed"], stats["committed"], stats["ledger_size"], stats["ready"]) == (3, 1, 0, 1)
    assert buf.commit_sample(lease, 1, rows[1]).replayed  # a late retry of the last sibling
    batch = buf.read_batch(["g1"], layout="list")
    assert batch.row_indices == [0, 1, 2]
    for got, want in zip(batch.rows, rows, strict=True):
        assert all(torch.equal(got[k], want[k]) for k in SCHEMA)
    assert ok(buf, deep=True)



def test_a_whole_commit_over_kept_siblings_replaces_them_and_counts_bytes_once(buffer_factory):
    buf = buffer_factory("windowed")
    lease = admit_one(buf, "g1")
    buf.commit_sample(lease, 0, make_row(9, 5))  # a sibling the worker then regenerates anyway
    rows = make_group(2, seed=1)
    assert buf.commit_group(lease, rows).ready
    raw = sum(t.numpy().nbytes for row in rows for t in row.values())
    stored = buf.store.read(lambda t: sum(len(v) for _, v in t.iter_prefix("rows", b"")))
    group = buf.group("g1")
    assert (group.raw_bytes, group.stored_bytes) == (raw, stored)
    assert (buf.stats()["raw_bytes"], buf.stats()["stored_bytes"]) == (raw, stored)
    assert torch.equal(buf.read_batch(["g1"], layout="list").rows[0]["input_ids"], rows[0]["input_ids"])
    assert ok(buf, deep=True)

# -- abort ---------------------------------------------------------------------------------------------
def test_abort_credits_shortfall_and_leaves_a_tombstone(buffer_factory):
    buf = buffer_factory("in_order", capacity=8, groups_per_step=2)
    a, b = buf.admit([Prompt(1, group_id="A"), Prompt(2, group_id="B")], timeout=0)
    c = admit_one(buf, "C")
    buf.commit_sample(a, 0, make_row(3, 1))
    assert buf.count_for_target_step(0) == 2
    buf.abort("A", "generation failed")
    buf.abort("C", "skipped")
    assert buf.batch_shortfall() == {0: 1, 1: 1}
    assert buf.count_for_target_step(0) == 1
    group = buf.group("A")
    assert (group.state, group.reason, group.rows_stored, group.target_step, group.prompt_idx) == (
        "aborted", "generation failed", False, 0, 1)
    assert buf.store.read(lambda t: list(t.iter_prefix("rows", b""))) == []  # partial sibling gone
    assert [e.group_id for e in buf.ledger()] == ["B"]
    stats = buf.stats()
    assert (stats["aborted"], stats["ledger_size"], stats["admitted"]) == (2, 1, 3)
    refused(buf, UnknownGroup, buf.abort, "A", "again")
    refused(buf, UnknownGroup, buf.abort, "nobody", "x")
    assert buf.commit_group(b, make_group(2, 2)).ready
    refused(buf, UnknownGroup, buf.commit_group, c, make_group(2, 3))
    assert ok(buf)


def test_abort_of_an_unstamped_prompt_credits_no_step(buffer_factory):
    buf = buffer_factory("weight_fifo")
    admit_one(buf, "A")
    buf.abort("A", "skipped")
    assert buf.batch_shortfall() == {}
    assert buf.group("A").state == "aborted"


# -- schema validation ---------------------------------------------------------------------------------
def _spoil(row: dict, kind: str) -> None:
    if kind == "missing field":
        del row["total_reward"]
    elif kind == "extra field":
        row["advantages"] = torch.zeros_like(row["generation_logprobs"])
    elif kind == "wrong dtype":  # floats are never cast to integers (int32 would be: kvckpt.storage.casts)
        row["input_ids"] = row["input_ids"].to(torch.float32)
    elif kind == "wrong row dtype":  # a float64 that float32 cannot hold (an exact one would be cast)
        row["total_reward"] = torch.tensor(1e300, dtype=torch.float64)
    elif kind == "token lengths":
        row["generation_logprobs"] = row["generation_logprobs"][:-1]
    elif kind == "2-D token field":
        row["input_ids"] = row["input_ids"][:4].reshape(2, 2)
        row["generation_logprobs"] = row["generation_logprobs"][:4].reshape(2, 2)


@pytest.mark.parametrize("kind", ["missing field", "extra field", "wrong dtype", "wrong row dtype", "token lengths",
                                  "2-D token field"])
def test_schema_violations_write_nothing(buffer_factory, kind):
    buf = buffer_factory("in_order")
    lease = admit_one(buf, "g1")
    rows = make_group(2, seed=1)
    _spoil(rows[1], kind)
    error = refused(buf, SchemaMismatch, buf.commit_group, lease, rows)
    assert "row g1_g1" in str(error)
    refused(buf, SchemaMismatch, buf.commit_sample, lease, 1, rows[1])
    assert buf.commit_group(lease, make_group(2, 1)).ready  # the lease still works afterwards


@pytest.mark.parametrize("count", [0, 1, 3])
def test_wrong_row_count_writes_nothing(buffer_factory, count):
    buf = buffer_factory("in_order")
    lease = admit_one(buf, "g1")
    error = refused(buf, SchemaMismatch, buf.commit_group, lease, make_group(3, 1)[:count])
    assert f"needs 2 rows (or the 2 missing ones [0, 1]), got {count}" in str(error)


def test_sample_index_outside_the_group_is_refused(buffer_factory):
    buf = buffer_factory("in_order")
    lease = admit_one(buf, "g1")
    refused(buf, SchemaMismatch, buf.commit_sample, lease, 2, make_row(3, 0))
    refused(buf, SchemaMismatch, buf.commit_sample, lease, -1, make_row(3, 0))
    refused(buf, SchemaMismatch, buf.commit_group, lease, {0: make_row(3, 0), 5: make_row(3, 1)})


def test_a_refused_admission_admits_nothing(buffer_factory):
    buf = buffer_factory("in_order")
    admit_one(buf, "taken")
    refused(buf, BadArgument, buf.admit, [Prompt(1, group_id="new"), Prompt(2, group_id="taken")], timeout=0)
    refused(buf, BadArgument, buf.admit, [Prompt(1, group_id="x"), Prompt(2, group_id="x")], timeout=0)
    refused(buf, BadArgument, buf.admit, [], timeout=0)



def test_a_chosen_id_in_the_generated_form_never_blocks_later_admissions(buffer_factory):
    buf = buffer_factory("windowed")
    admit_one(buf, "a1-p0")  # e.g. a prompt re-admitted under its id from an earlier store
    assert [lease.group_id for lease in buf.admit([Prompt(1), Prompt(2)], timeout=0)] == ["a1-p0.1", "a1-p1"]
    assert [lease.group_id for lease in buf.admit([Prompt(3)], timeout=0)] == ["a2-p0"]
    assert ok(buf)

# -- reading batches -----------------------------------------------------------------------------------
def test_read_batch_layouts_return_the_committed_tensors(buffer_factory):
    buf = buffer_factory("windowed")
    groups = {}
    for gid, seed in (("A", 1), ("B", 2)):
        lease = admit_one(buf, gid)
        groups[gid] = [make_row(3, seed), make_row(6, seed + 10)]
        buf.commit_group(lease, groups[gid])
    selection = buf.select(2, 2)
    rows = groups["A"] + groups["B"]
    lengths = [3, 6, 3, 6]

    padded = buf.read_batch(selection, pad_value=-7)
    assert (padded.group_ids, padded.row_indices, padded.lengths.tolist()) == (
        ["A", "A", "B", "B"], [0, 1, 0, 1], lengths)
    assert [g.group_id for g in padded.groups] == ["A", "B"]
    assert padded.tensors["input_ids"].shape == (4, 6)
    assert padded.tensors["input_ids"].dtype == torch.int64
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        for name in ("input_ids", "generation_logprobs"):
            assert torch.equal(padded.tensors[name][i, :n], row[name])
            assert (padded.tensors[name][i, n:] == -7).all()
    assert torch.equal(padded.tensors["total_reward"], torch.stack([r["total_reward"] for r in rows]))

    packed = buf.read_batch(selection, layout="packed")
    assert packed.cu_seqlens.tolist() == [0, 3, 9, 12, 18]
    assert torch.equal(packed.tensors["input_ids"], torch.cat([r["input_ids"] for r in rows]))
    assert torch.equal(packed.tensors["generation_logprobs"], torch.cat([r["generation_logprobs"] for r in rows]))
    assert torch.equal(packed.tensors["total_reward"], torch.stack([r["total_reward"] for r in rows]))

    listed = buf.read_batch(["B", "A"], layout="list")
    assert listed.group_ids == ["B", "B", "A", "A"]
    for got, want in zip(listed.rows, groups["B"] + groups["A"], strict=True):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)

    only = buf.read_batch(selection, fields=["total_reward"])
    assert list(only.tensors) == ["total_reward"]


def test_read_batch_refuses_groups_without_rows(buffer_factory):
    buf = buffer_factory("windowed")
    admit_one(buf, "pending")
    for gids in (["pending"], ["unknown"]):
        with pytest.raises(NotSelectable):
            buf.read_batch(gids)
    with pytest.raises(BadArgument):
        buf.read_batch([], layout="ragged")


# -- steps and durable consumption ---------------------------------------------------------------------
def _train_one_step(buf: ReplayBuffer, gid: str) -> None:
    buf.commit_group(admit_one(buf, gid), make_group(2, seed=len(gid)))
    assert buf.select(1, 1).group_ids == [gid]
    buf.finish_step()


def test_finish_step_consumes_claimed_groups_and_advances_the_version(buffer_factory):
    buf = buffer_factory("in_order", groups_per_step=2, capacity=8)
    a, b = buf.admit([Prompt(0, group_id="A"), Prompt(1, group_id="B")], timeout=0)
    buf.commit_group(a, make_group(2, 1))
    buf.commit_group(b, make_group(2, 2))
    assert buf.select(1, 1).group_ids == ["A"]
    assert buf.finish_step() == 1
    assert (buf.group("A").state, buf.group("A").consumed_step) == ("consumed", 0)
    assert buf.group("B").state == "ready"  # selected nothing: stays ready (and is now evictable)
    st = buf.state()
    assert (st["trainer_version"], st["weight_version"], st["claimed"], st["ready"]) == (1, 1, 0, 1)
    assert buf.finish_step(weight_version=1) == 2
    assert buf.state()["weight_version"] == 1
    assert buf.stats()["consumed"] == 1
    assert buf.read_batch(["A"]).group_ids == ["A", "A"]  # consumed rows stay until checkpoints cover them


@pytest.mark.parametrize("retain", [False, True])
def test_consumed_rows_are_dropped_only_after_durable_checkpoints(buffer_factory, tmp_path, retain):
    buf = buffer_factory("in_order", durable_checkpoints=2, retain_consumed=retain)
    _train_one_step(buf, "A")                      # consumed at step 0
    buf.checkpoint(str(tmp_path / "c1.kv")).wait()  # covers version 1
    _train_one_step(buf, "B")                      # consumed at step 1; one checkpoint only: nothing dropped
    assert buf.group("A").rows_stored
    buf.checkpoint(str(tmp_path / "c2.kv")).wait()  # covers version 2
    assert buf.group("A").rows_stored             # dropping happens at finish_step
    _train_one_step(buf, "C")
    assert buf.state()["durable"] == [1, 2]
    assert buf.group("A").rows_stored is retain    # older than the oldest kept checkpoint (version 1)
    assert buf.group("B").rows_stored and buf.group("C").rows_stored
    if not retain:
        with pytest.raises(NotSelectable):
            buf.read_batch(["A"])
        with pytest.raises(RecoveryError, match="resume from a checkpoint at version >= 1"):
            buf.recover(0)
    assert buf.read_batch(["B"]).group_ids == ["B", "B"]
    assert ok(buf, deep=True)
    plan = buf.recover(1)  # the model checkpoint of version 1: steps 1 and 2 are trained again
    assert plan.groups_returned_to_ready == 2
    assert buf.select(1, 1).group_ids == ["B"]


def test_rollback_forgets_checkpoints_of_the_abandoned_future(buffer_factory, tmp_path):
    """After resuming from an older model checkpoint, later checkpoints of the abandoned run must
    not count as durable: only the resumed run's own checkpoints may let consumed rows go."""
    buf = buffer_factory("in_order", durable_checkpoints=2)
    _train_one_step(buf, "A")
    buf.checkpoint(str(tmp_path / "v1.kv")).wait()
    _train_one_step(buf, "B")
    _train_one_step(buf, "C")
    buf.checkpoint(str(tmp_path / "v3.kv")).wait()
    _train_one_step(buf, "D")
    buf.recover(1)  # the version-3 model was lost: steps 1..3 are trained again
    for gid in "BCD":
        assert buf.select(1, 1).group_ids == [gid]
        buf.finish_step()
        if gid != "C":
            buf.checkpoint(str(tmp_path / f"again-v{buf.trainer_version}.kv")).wait()  # versions 2 and 4
    _train_one_step(buf, "E")
    # The resumed run's two latest checkpoints are versions 2 and 4: resuming from 2 must work.
    assert buf.state()["durable"] == [1, 2, 4]
    assert (buf.group("B").rows_stored, buf.group("C").rows_stored) == (False, True)
    assert buf.recover(2).groups_returned_to_ready == 3



def test_many_durable_checkpoints_still_drop_old_rows(buffer_factory, tmp_path):
    buf = buffer_factory("in_order", durable_checkpoints=17)
    for step in range(18):
        _train_one_step(buf, f"g{step}")
        buf.checkpoint(str(tmp_path / f"v{step + 1}.kv")).wait()
    _train_one_step(buf, "last")
    assert buf.state()["durable"] == list(range(2, 19))  # the 17 newest
    assert [g.group_id for g in buf.groups() if not g.rows_stored] == ["g0", "g1"]  # before version 2

# -- config --------------------------------------------------------------------------------------------
def test_config_persists_and_reopen_needs_no_arguments(buffer_factory):
    sampler = {"name": "windowed", "max_staleness_versions": 3, "sample_freshest_first": True}
    buf = buffer_factory(sampler, group_size=3, capacity=20, groups_per_step=5, retain_consumed=True,
                         compression_level=0, durable_checkpoints=4)
    saved = buf.config.to_dict()
    path = buf.path
    buf.close()
    with ReplayBuffer.open(path) as again:
        assert again.config.to_dict() == saved
        assert again.sampler.config() == sampler
        assert again.schema.to_dict()["fields"] == {k: list(v) for k, v in SCHEMA.items()}
    with ReplayBuffer.open(path, readonly=True) as ro:
        assert ro.config.to_dict() == saved
    with pytest.raises(BadArgument, match="already exists"):
        ReplayBuffer.create(path, again.config)


# -- concurrency ---------------------------------------------------------------------------------------
def test_concurrent_producers_land_every_group_exactly_once(buffer_factory):
    buf = buffer_factory("windowed", capacity=256)
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def producer(t: int) -> None:
        try:
            start.wait()
            for i in range(50):
                [lease] = buf.admit([Prompt(t * 100 + i, group_id=f"t{t}-{i}")], timeout=30)
                if i % 2:
                    rows = make_group(2, seed=t * 100 + i)
                    buf.commit_sample(lease, 1, rows[1])
                    buf.commit_sample(lease, 0, rows[0])
                else:
                    buf.commit_group(lease, make_group(2, seed=t * 100 + i))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    groups = buf.groups()
    assert sorted(g.group_id for g in groups) == sorted(f"t{t}-{i}" for t in range(4) for i in range(50))
    assert {g.state for g in groups} == {"ready"}
    assert sorted(g.seq for g in groups) == list(range(200))
    stats = buf.stats()
    assert (stats["admitted"], stats["committed"], stats["ledger_size"], stats["ready"]) == (200, 200, 0, 200)
    assert stats["samples_committed"] == 200  # 100 groups committed row by row
    assert buf.store.read(lambda t: sum(1 for _ in t.iter_prefix("rows", b""))) == 400
    assert ok(buf, deep=True)
    batch = buf.read_batch(["t3-49"], layout="list")
    assert torch.equal(batch.rows[1]["input_ids"], make_group(2, seed=349)[1]["input_ids"])


def test_concurrent_producers_and_a_trainer(buffer_factory):
    buf = buffer_factory({"name": "in_order", "max_lookahead_versions": 1}, capacity=4, groups_per_step=2)
    steps, trained = 10, []
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            for step in range(steps):
                leases = buf.admit([Prompt(step * 2), Prompt(step * 2 + 1)], timeout=30)
                for lease in leases:
                    buf.commit_group(lease, make_group(2, seed=lease.prompt_idx))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=producer)
    thread.start()
    for step in range(steps):
        claimed: list[str] = []
        while len(claimed) < 2:
            selection = buf.select(1, 2 - len(claimed))
            claimed += selection.group_ids
            if not selection.group_ids:
                buf.wait_for_change(0.2)
        assert [buf.group(g).target_step for g in claimed] == [step, step]
        trained += claimed
        buf.finish_step()
    thread.join()
    assert errors == []
    assert sorted(buf.group(g).prompt_idx for g in trained) == list(range(2 * steps))
    assert ok(buf)


# -- asyncio facade --------------------------------------------------------------------------------------
def test_concurrent_coroutines_land_every_group_exactly_once(buffer_factory):
    aio = pytest.importorskip("kvckpt.buffer.aio", reason="the asyncio facade is not part of this build")
    buf = buffer_factory("windowed", capacity=128)

    async def scenario() -> None:
        facade = aio.AsyncReplayBuffer(buf, max_workers=2)

        async def producer(t: int) -> None:
            for i in range(25):
                [lease] = await facade.admit([Prompt(t * 100 + i, group_id=f"c{t}-{i}")], timeout=30)
                assert (await facade.commit_group(lease, make_group(2, seed=t * 100 + i))).ready

        try:
            await asyncio.gather(*(producer(t) for t in range(4)))
            assert (await facade.select(100, 100)).group_ids == [g.group_id for g in buf.groups()]
        finally:
            await facade.close()

    asyncio.run(scenario())
    reopened = ReplayBuffer.open(buf.path)
    try:
        groups = reopened.groups()
        assert sorted(g.group_id for g in groups) == sorted(f"c{t}-{i}" for t in range(4) for i in range(25))
        assert {g.state for g in groups} == {"claimed"}
        assert ok(reopened, deep=True)
    finally:
        reopened.close()


# -- the documentation ------------------------------------------------------------------------------
def test_the_example_in_docs_buffer_md_runs():
    doc = ROOT / "docs" / "buffer.md"
    result = doctest.testfile(str(doc), module_relative=False, optionflags=doctest.ELLIPSIS, verbose=False)
    assert (result.failed, result.attempted > 20) == (0, True)


def test_read_batch_refuses_fields_outside_the_schema(buffer_factory):
    buf = buffer_factory()
    with pytest.raises(BadArgument, match=r"fields \['nope'\] are not in the store's schema"):
        buf.read_batch([], fields=["nope"])


# -- claiming named groups, releasing claims --------------------------------------------------------
def _three_ready(buf: ReplayBuffer) -> None:
    leases = buf.admit([Prompt(prompt_idx=i, group_id=f"g{i + 1}") for i in range(3)], timeout=0)
    for seed, lease in enumerate(leases):
        buf.commit_group(lease, make_group(2, seed=seed))


def test_claim_takes_exactly_the_named_ready_groups_for_the_current_step(buffer_factory):
    buf = buffer_factory("ready_first", capacity=8)
    _three_ready(buf)
    selection = buf.claim(["g3", "g1"])
    assert (selection.step, selection.group_ids) == (0, ["g3", "g1"])
    assert [g.state for g in buf.groups()] == ["claimed", "ready", "claimed"]
    assert (buf.state()["ready"], buf.state()["claimed"]) == (1, 2)
    assert buf.read_batch(selection).group_ids == ["g3", "g3", "g1", "g1"]
    buf.finish_step()
    assert [g.state for g in buf.groups()] == ["consumed", "ready", "consumed"]
    assert ok(buf, deep=True)


def test_claim_is_all_or_nothing(buffer_factory):
    buf = buffer_factory("ready_first", capacity=8)
    _three_ready(buf)
    buf.claim(["g2"])
    error = refused(buf, BadArgument, buf.claim, ["g1", "g2"])
    assert "'g2' is claimed, not ready" in str(error) and "nothing was claimed" in str(error)
    refused(buf, BadArgument, buf.claim, ["g1", "nope"])
    refused(buf, BadArgument, buf.claim, "g1")  # a string is not a list of ids
    assert ok(buf)


def test_released_claims_are_ready_again_and_selectable(buffer_factory):
    buf = buffer_factory("ready_first", capacity=8)
    _three_ready(buf)
    selection = buf.select(2, 2)
    assert buf.release_claims(selection.group_ids) == selection.group_ids
    assert [g.state for g in buf.groups()] == ["ready", "ready", "ready"]
    assert all(g.claimed_step is None for g in buf.groups())
    assert (buf.state()["ready"], buf.state()["claimed"]) == (3, 0)
    assert ok(buf)
    assert buf.select(3, 3).group_ids == ["g1", "g2", "g3"]


def test_release_refuses_what_the_current_step_does_not_hold(buffer_factory):
    buf = buffer_factory("ready_first", capacity=8)
    _three_ready(buf)
    buf.claim(["g1"])
    refused(buf, BadArgument, buf.release_claims, ["g1", "g2"])  # g2 is ready
    buf.finish_step()  # g1 is consumed now
    error = refused(buf, BadArgument, buf.release_claims, ["g1"])
    assert "not claimed by the current step 1" in str(error)
