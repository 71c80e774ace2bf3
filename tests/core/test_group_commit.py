"""Group commit (issue 19): concurrent commits share one durable transaction; each is still one
transition, acknowledged only once durable, and a refused one fails alone."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from _buffers import dump_store, make_group

from kvckpt import AbandonedTimeline, BadArgument, CommitResult, DuplicateCommit, Prompt, SchemaMismatch, check
from kvckpt.tables.access import Tables


def test_commit_many_is_one_transaction_and_a_refused_item_fails_alone(buffer_factory):
    buf = buffer_factory(capacity=8)
    leases = buf.admit([Prompt(prompt_idx=i) for i in range(4)])
    buf.commit_group(leases[3], make_group(2, 3))
    fenced = leases[2]
    buf.redispatch(fenced.group_id)
    bad_rows = make_group(2, 1)
    bad_rows[1] = {k: v for k, v in bad_rows[1].items() if k != "total_reward"}
    last_txn = buf.store.env.info()["last_txnid"]
    results = buf.commit_many([
        {"lease": leases[0], "rows": make_group(2, 0)},
        {"lease": leases[1], "rows": bad_rows},                   # schema: refused before the txn
        {"lease": fenced, "rows": make_group(2, 2)},              # a redispatch fenced it
        {"lease": leases[3], "rows": make_group(2, 9)},           # committed with other content
        {"lease": leases[1], "index": 0, "rows": make_group(2, 1)[0]},
        {"rows": []},                                             # not an item
    ])
    assert isinstance(results[0], CommitResult) and results[0].ready
    assert [type(r).__name__ for r in results[1:]] == ["SchemaMismatch", "StaleAttempt", "DuplicateCommit",
                                                        "CommitResult", "BadArgument"]
    assert isinstance(results[1], SchemaMismatch) and isinstance(results[3], DuplicateCommit)
    assert buf.store.env.info()["last_txnid"] == last_txn + 1  # one durable transaction for the batch
    assert [g.group_id for g in buf.groups()] == [leases[0].group_id, leases[3].group_id]
    assert [e.group_id for e in buf.ledger() if e.siblings] == [leases[1].group_id]
    assert buf.store.read(lambda t: check(t, deep=True)).ok


def test_concurrent_commits_share_one_fsync_and_are_acknowledged_only_once_durable(buffer_factory):
    buf = buffer_factory(capacity=16)
    leases = buf.admit([Prompt(prompt_idx=i) for i in range(9)])
    zombie = leases[8]
    buf.recover()  # every lease above is now of an abandoned timeline ...
    leases = [e.lease(buf.store.store_id) for e in buf.ledger()]  # ... these are the current ones
    acked: dict[str, object] = {}
    first_txn = buf.store.env.info()["last_txnid"]
    with buf.store._write_lock:  # the writer is busy: the first producer leads and waits for it ...
        threads = [threading.Thread(target=lambda x=x: acked.__setitem__(x.group_id, buf.commit_group(
            x, make_group(2, 1)))) for x in leases[:8]]
        for t in threads:
            t.start()
        _wait_until(lambda: buf.committer.queued == 7)  # ... and the other seven queue behind it
        threads.append(threading.Thread(target=lambda: acked.__setitem__("zombie", _refusal(
            buf.commit_group, zombie, make_group(2, 1)))))
        threads[-1].start()
        _wait_until(lambda: buf.committer.queued == 8)
        assert not acked  # nobody is acknowledged before the transaction holding it is durable
    for t in threads:
        t.join(60)
    assert isinstance(acked.pop("zombie"), AbandonedTimeline)
    assert all(r.ready for r in acked.values()) and len(acked) == 8
    # The first leader's batch (its own commit), then one batch of the eight queued: two fsyncs.
    assert buf.store.env.info()["last_txnid"] == first_txn + 2
    assert buf.committer.stats == {"transactions": 2, "transitions": 9}
    assert buf.store.read(lambda t: check(t, deep=True)).ok


def test_a_failed_batch_transaction_reaches_every_caller_and_writes_nothing(buffer_factory):
    buf = buffer_factory()
    leases = buf.admit([Prompt(prompt_idx=i) for i in range(2)])
    before = dump_store(buf)

    def boom(txn):
        raise RuntimeError("the disk went away")

    results = buf.committer.submit_many([boom])
    assert isinstance(results[0], RuntimeError)
    assert dump_store(buf) == before
    assert all(r.ready for r in buf.commit_many([{"lease": x, "rows": make_group(2, 1)} for x in leases]))


#: Another process's fresh read snapshot of a store: the ids of its group records.
_SNAPSHOT = ("import json, sys\nfrom kvckpt import ReplayBuffer\n"
             "with ReplayBuffer.open(sys.argv[1], readonly=True) as buf:\n"
             "    print(json.dumps(sorted(g.group_id for g in buf.groups())))\n")


def _fresh_snapshot(path: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", _SNAPSHOT, path], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout))


def test_inside_a_batch_nothing_acknowledged_is_missing_from_another_process_snapshot(buffer_factory):
    """Issue 29: look inside the batch, between its transitions and its durable commit (the
    committer's ``before_commit`` seam): no producer may have been told "committed" yet for a
    transition that a fresh read snapshot, in another process, does not hold."""
    buf = buffer_factory(capacity=16)
    leases = buf.admit([Prompt(prompt_idx=i) for i in range(6)])
    leader, followers = leases[0], leases[1:]
    told: list[str] = []  # group ids whose producer got its CommitResult back
    told_lock = threading.Lock()
    seen: list[dict] = []
    in_first_batch = threading.Event()

    def probe(txn, acknowledged):
        if not seen:  # the leader's own batch: hold it until every follower queued behind it
            in_first_batch.set()
            _wait_until(lambda: buf.committer.queued == len(followers))
        written = {x.group_id for x in leases if Tables(txn).group(x.group_id) is not None}
        snapshot = _fresh_snapshot(buf.path)
        with told_lock:
            told_now = set(told)
        seen.append({"acknowledged": list(acknowledged), "written": written, "snapshot": snapshot,
                     "told": told_now})

    def produce(lease):
        result = buf.commit_group(lease, make_group(2, lease.prompt_idx))
        assert result.ready
        with told_lock:
            told.append(lease.group_id)

    buf.committer.before_commit = probe
    threads = [threading.Thread(target=produce, args=(leader,))]
    threads[0].start()
    assert in_first_batch.wait(60), "the leader's batch never reached its commit"
    threads += [threading.Thread(target=produce, args=(x,)) for x in followers]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(120)
    buf.committer.before_commit = None
    assert [len(s["acknowledged"]) for s in seen] == [1, len(followers)]  # the leader alone, then one batch
    durable: set[str] = set()
    early = []
    for n, batch in enumerate(seen):
        this_batch, durable = batch["written"] - durable, batch["written"]
        assert this_batch and not this_batch & batch["snapshot"], "the seam ran outside the batch"
        if any(batch["acknowledged"]) or batch["told"] - batch["snapshot"]:
            early.append(f"batch {n}: {sum(batch['acknowledged'])} of its {len(this_batch)} transitions "
                         f"acknowledged, {sorted(batch['told'] - batch['snapshot'])} returned to their producers")
    assert not early, ("acknowledged before durable (another process's fresh snapshot, taken inside the batch "
                       f"before its commit, lacks them): {'; '.join(early)}")
    assert sorted(told) == sorted(x.group_id for x in leases)
    assert _fresh_snapshot(buf.path) == set(told)  # once durable, the same snapshot sees them all


def _refusal(fn, *args):
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


def _wait_until(condition) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "producers did not queue"
        time.sleep(0.01)


# -- issue 45 (seventeenth session): the preparer role ------------------------------------------------------


class _Run:
    """Raw items for ``submit_many(items, prepare)``: ``prepare`` records who prepared what (and may be held
    on an item), the transitions record the order they ran in."""

    def __init__(self, hold: str | None = None) -> None:
        self.prepared: list[tuple[str, int]] = []  # (item, preparing thread)
        self.ran: list[str] = []  # transitions in the order they ran (committed or not)
        self.hold, self.held, self.release = hold, threading.Event(), threading.Event()

    def prepare(self, item: str):
        self.prepared.append((item, threading.get_ident()))
        if item == self.hold:
            self.held.set()
            assert self.release.wait(60), "the test never released the held prepare"
        return self.transition(item)

    def transition(self, item: str):
        def run(txn):
            self.ran.append(item)
            return item
        return run


def _start(results: dict, name: str, fn, *args) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.__setitem__(name, fn(*args)), daemon=True)
    thread.start()
    return thread


def test_one_waiting_caller_prepares_every_queued_item_while_the_batch_before_is_written(buffer_factory):
    """While the writer's batch is being written (here: held before its transaction), one waiting caller
    prepares the raw items, one preparer at a time; the items queued meanwhile are prepared together in
    its next pass, before anything of theirs is written; then they are written in queue order."""
    buf = buffer_factory()
    committer, run, results = buf.committer, _Run(hold="a"), {}
    with buf.store._write_lock:
        threads = [_start(results, "w", committer.submit_many, [run.transition("w")])]
        _wait_until(lambda: committer._leading)  # the writer took its batch and waits for the store
        threads.append(_start(results, "a", committer.submit_many, ["a"], run.prepare))
        assert run.held.wait(60)
        threads += [_start(results, x, committer.submit_many, [x], run.prepare) for x in "bc"]
        _wait_until(lambda: committer.queued == 3)
        assert [item for item, _ in run.prepared] == ["a"]  # one preparer at a time: b and c wait for it
        run.release.set()
        _wait_until(lambda: len(run.prepared) == 3)  # prepared while the batch before is still unwritten
        assert not run.ran
        (_, a_thread), (_, b_thread), (_, c_thread) = run.prepared
        assert a_thread == b_thread == c_thread  # a's preparer took b and c together in its next pass
    for thread in threads:
        thread.join(60)
    assert results == {"w": ["w"], "a": ["a"], "b": ["b"], "c": ["c"]}
    assert run.ran == ["w", "a", "b", "c"]
    assert committer.stats == {"transactions": 2, "transitions": 4}  # w's batch, then a, b and c's


def test_a_writer_never_passes_an_item_still_being_prepared(buffer_factory):
    """The queue holds r (ready), x (being prepared) and y (ready): the free writer takes r alone; y waits
    behind x, so transitions run in the order they were queued."""
    buf = buffer_factory()
    committer, run, results = buf.committer, _Run(hold="x"), {}
    with buf.store._write_lock:
        threads = [_start(results, "w", committer.submit_many, [run.transition("w")])]
        _wait_until(lambda: committer._leading)
        threads.append(_start(results, "r", committer.submit_many, [run.transition("r")]))
        _wait_until(lambda: committer.queued == 1)
        threads.append(_start(results, "x", committer.submit_many, ["x"], run.prepare))
        assert run.held.wait(60)
        threads.append(_start(results, "y", committer.submit_many, [run.transition("y")]))
        _wait_until(lambda: committer.queued == 3)
    _wait_until(lambda: "r" in results)  # w's batch, then r's: a writer took the prepared head alone
    assert run.ran == ["w", "r"]
    run.release.set()
    for thread in threads:
        thread.join(60)
    assert run.ran == ["w", "r", "x", "y"]
    assert results == {"w": ["w"], "r": ["r"], "x": ["x"], "y": ["y"]}
    assert committer.stats == {"transactions": 3, "transitions": 4}


def test_what_prepare_raises_is_a_refusal_of_its_item_or_raised_to_its_caller(buffer_factory):
    """A KvckptError from ``prepare`` is that item's result (its neighbours still land); any other exception is
    raised to the item's caller; neither writes anything, and the committer goes on."""
    buf = buffer_factory()
    committer, run = buf.committer, _Run()

    def prepare(item):
        if item == "refused":
            raise SchemaMismatch("refused by its prepare")
        if item == "broken":
            raise ZeroDivisionError("a bug in prepare")
        return run.prepare(item)

    before = dump_store(buf)
    first, refusal, last = committer.submit_many(["first", "refused", "last"], prepare)
    assert (first, last) == ("first", "last") and isinstance(refusal, SchemaMismatch)
    with pytest.raises(ZeroDivisionError):
        committer.submit_many(["broken"], prepare)
    assert run.ran == ["first", "last"] and dump_store(buf) == before
    assert committer.submit_many(["again"], prepare) == ["again"]


def test_a_batch_runs_in_one_transaction_and_a_refusal_after_writes_makes_it_run_again_nested(buffer_factory):
    """``Store.write_each`` runs the batch's functions in the durable transaction itself; a refusal that wrote
    nothing needs no rollback. One that put or deleted, then refused, sends the batch round again with each
    function in its own nested transaction: its writes are rolled back alone, the others land once."""
    store = buffer_factory().store
    store.write(lambda t: t.put("meta", b"old", b"kept"))
    seen: list[list] = []

    def fns(*middle):
        seen.append([])

        def put(key):
            def run(t):
                seen[-1].append(t)
                t.put("meta", key, b"1")
                return key
            return run

        def refuse(t):
            seen[-1].append(t)
            raise BadArgument("refused before writing")

        return [put(b"a"), refuse, *middle, put(b"b")]

    results = store.write_each(fns())
    assert results[0] == b"a" and isinstance(results[1], BadArgument) and results[2] == b"b"
    assert len(set(map(id, seen[-1]))) == 1  # one transaction object: no nested transaction

    def put_then_refuse(t):
        seen[-1].append(t)
        t.put("meta", b"half", b"written")
        raise BadArgument("refused after a put")

    def delete_then_refuse(t):
        seen[-1].append(t)
        t.delete("meta", b"old")
        raise BadArgument("refused after a delete")

    for wrote in (put_then_refuse, delete_then_refuse):
        store.write(lambda t: [t.delete("meta", k) for k in (b"a", b"b")])
        results = store.write_each(fns(wrote))
        assert [type(r).__name__ for r in results] == ["bytes", "BadArgument", "BadArgument", "bytes"]
        ran = seen[-1]
        # the flat pass stops at the refusal that wrote; the batch runs again, each in its own nested txn
        assert len(ran) == 7 and len(set(map(id, ran[:3]))) == 1 and len(set(map(id, ran[3:]))) == 4
        assert store.read(lambda t: (t.get("meta", b"a"), t.get("meta", b"b"), t.get("meta", b"half"),
                                     t.get("meta", b"old"))) == (b"1", b"1", None, b"kept")
