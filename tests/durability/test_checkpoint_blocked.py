"""What blocks the trainer during a checkpoint (issue 28): the store's writer lock is handed to its
waiters in arrival order, and each checkpoint's blocked time is broken down into its phases."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from _buffers import make_group

from benchmarks import baselines, blocked_bench
from kvckpt import CheckpointError, Prompt
from kvckpt.storage.fairlock import FairLock
from kvckpt.storage.store import Store


def _wait_until(condition) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "the thread never started waiting"
        time.sleep(0.005)


def test_a_waiting_writer_gets_the_lock_before_its_holder_takes_it_again(tmp_path):
    # The unfair RLock let the releasing thread (a producer's group-commit leader, in the loop of
    # the next batch) take the writer lock again before the woken trainer ran.
    store = Store(tmp_path / "s.kv", create=True)
    order: list[str] = []
    lock = store._write_lock
    lock.acquire()
    waiter = threading.Thread(target=lambda: store.write(lambda txn: order.append("waiter")))
    waiter.start()
    _wait_until(lambda: lock.waiting == 1)
    lock.release()
    store.write(lambda txn: order.append("holder again"))  # asks again at once, before the waiter ran
    waiter.join(60)
    store.close()
    assert order == ["waiter", "holder again"]


def test_fair_lock_serves_waiters_in_arrival_order_and_is_reentrant():
    lock, order = FairLock(), []
    lock.acquire()
    lock.acquire()  # re-entrant: two releases needed
    threads = []
    for queued, name in enumerate("abc", 1):
        threads.append(threading.Thread(target=lambda name=name: (lock.acquire(), order.append(name), lock.release())))
        threads[-1].start()
        _wait_until(lambda queued=queued: lock.waiting == queued)
    lock.release()
    assert lock.waiting == 3 and not order  # still held once
    lock.release()
    for t in threads:
        t.join(60)
    assert order == ["a", "b", "c"] and lock.waiting == 0
    with pytest.raises(RuntimeError, match="does not own"):
        lock.release()
    with lock:  # free again
        pass


def _queue(lock: FairLock, order: list[str], inside: list[int], name: str, first: bool) -> threading.Thread:
    """Start a thread that takes ``lock`` (``first`` or plain) and records ``name``; return once
    it is queued (the lock is held elsewhere), so the arrival order is forced, not timed."""
    queued = lock.waiting + 1

    def take() -> None:
        lock.acquire(first=first)
        inside[0] += 1
        order.append(name if inside[0] == 1 else f"{name} overlapped")
        inside[0] -= 1
        lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    _wait_until(lambda: lock.waiting == queued)
    return thread


def test_waiters_that_ask_to_go_first_overtake_the_plain_waiters_but_not_the_holder_or_each_other():
    lock, order, inside = FairLock(), [], [0]
    lock.acquire()
    lock.acquire()  # the holder in progress, re-entrant
    threads = [_queue(lock, order, inside, "plain 1", False), _queue(lock, order, inside, "first 1", True),
               _queue(lock, order, inside, "plain 2", False), _queue(lock, order, inside, "first 2", True)]
    lock.release()
    assert lock.waiting == 4 and not order  # a waiter that asked to go first still waits for the holder
    lock.release()
    for t in threads:
        t.join(60)
    assert order == ["first 1", "first 2", "plain 1", "plain 2"] and lock.waiting == 0


def test_the_owner_takes_the_lock_again_at_once_whether_or_not_it_asks_to_go_first():
    lock, order, inside = FairLock(), [], [0]
    with lock.first():
        waiter = _queue(lock, order, inside, "plain", False)
        with lock, lock.first():  # re-entrant both ways: no deadlock, no hand-over
            assert order == [] and lock.waiting == 1
        assert order == []
    waiter.join(60)
    assert order == ["plain"]
    with pytest.raises(RuntimeError, match="does not own"):
        lock.release()


def test_the_stamp_goes_ahead_of_a_producer_write_queued_before_it(tmp_path):
    store = Store(tmp_path / "s.kv", create=True)
    order: list[str] = []
    lock = store._write_lock
    snapshots = []
    with lock:  # a producer batch in progress
        producer = threading.Thread(target=lambda: store.write(lambda txn: order.append("producer")))
        producer.start()
        _wait_until(lambda: lock.waiting == 1)
        stamp = threading.Thread(target=lambda: snapshots.append(
            store.write_then_snapshot(lambda txn: order.append("stamp"))[1]))
        stamp.start()
        _wait_until(lambda: lock.waiting == 2)
    producer.join(60)
    stamp.join(60)
    snapshots[0].close()
    store.close()
    assert order == ["stamp", "producer"]


@pytest.mark.parametrize("first", [False, True], ids=["plain", "first"])
def test_an_interrupted_waiter_leaves_the_queue_and_the_lock_still_works(first):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")

    class Interrupted(Exception):
        pass

    def interrupt(*_: object) -> None:
        raise Interrupted

    lock, holder_done = FairLock(), threading.Event()
    holding = threading.Event()

    def hold() -> None:
        with lock:
            holding.set()
            _wait_until(lambda: lock.waiting == 1)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            holder_done.wait(60)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        holder = threading.Thread(target=hold)
        holder.start()
        holding.wait(60)
        with pytest.raises(Interrupted):
            lock.acquire(first=first)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert lock.waiting == 0
    holder_done.set()
    holder.join(60)
    with lock:  # the holder's release found nobody to hand it to
        pass


def test_checkpoint_timings_say_how_long_the_stamp_waited_for_the_writer_lock(buffer_factory, tmp_path):
    buf = buffer_factory()
    lease = buf.admit([Prompt(prompt_idx=0)])[0]
    buf.commit_group(lease, make_group(2, 0))
    handles = []
    lock = buf.store._write_lock
    with lock:  # a producer's transaction holds the writer
        caller = threading.Thread(target=lambda: handles.append(buf.checkpoint(tmp_path / "c.kvckpt")))
        caller.start()
        _wait_until(lambda: lock.waiting == 1)
        seen_waiting = time.perf_counter()
        time.sleep(0.05)
        released = time.perf_counter()
    caller.join(60)
    t = handles[0].wait(60).timings
    # The stamp waited at least from when it was seen waiting until the release; that wait is
    # lock_wait, and the other phases fit in what is left of the blocked time.
    assert t["lock_wait"] >= released - seen_waiting
    assert t["lock_wait"] + t["txn"] + t["commit"] + t["snapshot"] <= t["stamp"]
    assert t["reserve"] + t["stamp"] + t["start"] <= t["blocked"]
    assert min(t[k] for k in blocked_bench.PHASES) >= 0


def test_blocked_bench_breaks_down_every_checkpoint_under_its_own_load(tmp_path):
    result = blocked_bench.run(0.003, 1, 0.5, str(tmp_path), cpu_load=1, io_load=1, head_start=0.2)
    assert result["blocked"]["n"] >= 1 and result["commits"]["n"] >= 1
    assert set(result["breakdown"]) == set(blocked_bench.PHASES)
    assert result["breakdown"]["blocked"]["n"] == result["blocked"]["n"]  # every checkpoint's phases
    assert result["worst"][0]["blocked"] == result["breakdown"]["blocked"]["max"]
    assert (result["cpu_load"], result["io_load"]) == (1, 1) and len(result["loadavg"]) == 2
    # the bare stamp-sized transaction was timed once per checkpoint, in the same run
    assert result["bare"]["n"] == result["blocked"]["n"] == len(result["bare_all"])
    assert min(result["bare_all"]) > 0
    assert result["blocked_vs_bare"]["max"] == result["blocked"]["max"] / result["bare"]["max"]


def test_the_bare_transaction_writes_a_stamp_sized_value_with_the_stores_sync_settings(tmp_path):
    bare = baselines.BareLmdb(str(tmp_path / "bare.lmdb"))
    try:
        assert blocked_bench.bare_stamp(bare) > 0
        flags = bare.env.flags()
        assert flags["sync"] and flags["metasync"] and not flags["writemap"]
        with bare.env.begin() as txn:
            value = txn.get(b"stamp")
    finally:
        bare.close()
    assert len(value) == blocked_bench.STAMP_BYTES


def test_load_processes_are_stopped_and_reaped(tmp_path):
    procs = blocked_bench.start_load(1, 1, str(tmp_path))
    assert all(p.poll() is None for p in procs)
    blocked_bench.stop_load(procs)
    assert all(p.returncode is not None for p in procs)


def test_checkpoint_does_not_wait_for_its_copy_thread_to_run(buffer_factory, tmp_path, monkeypatch):
    # threading.Thread.start() returns only once the new thread has run; on a saturated machine
    # that wait blocked the trainer for longer than the stamp itself.
    buf = buffer_factory()
    lease = buf.admit([Prompt(prompt_idx=0)])[0]
    buf.commit_group(lease, make_group(2, 0))
    caller, start = threading.get_ident(), threading.Thread.start

    def no_waiting_start(self: threading.Thread) -> None:
        assert threading.get_ident() != caller, "checkpoint() waited for a threading.Thread to start"
        start(self)

    monkeypatch.setattr(threading.Thread, "start", no_waiting_start)
    handle = buf.checkpoint(tmp_path / "c.kvckpt")
    assert handle.wait(60).path == str(tmp_path / "c.kvckpt")


def test_a_checkpoint_into_a_missing_directory_is_refused_before_anything_is_stamped(buffer_factory, tmp_path):
    buf = buffer_factory()
    with pytest.raises(CheckpointError, match="does not exist"):
        buf.checkpoint(tmp_path / "missing" / "c.kvckpt")
    assert buf.store.read(lambda t: t.get("meta", b"checkpoint")) is None  # nothing stamped
    assert not (tmp_path / "missing").exists()
