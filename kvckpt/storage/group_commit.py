"""Group commit: concurrent transitions share one write transaction and one fsync.

A leader/follower queue (LevelDB's write batching, PostgreSQL's group commit): every caller
enqueues its transition and waits. If no batch is being written, a waiting caller becomes the
writer: it takes the prepared transitions queued so far, runs them through
:meth:`kvckpt.storage.store.Store.write_each` (one durable transaction; a refusal writes nothing)
and hands each caller its result. Callers that arrive while a batch is being
written form the next batch.

A caller may submit raw items with a ``prepare`` function instead of ready transitions
(:meth:`GroupCommitter.submit_many`): then a second role, the preparer, turns every raw item queued
so far into its transition (outside any transaction), while the writer writes (and fsyncs) the
batch before. One waiting caller at a time prepares, for everyone (issue 45): with many producer
threads, each preparing its own message, they competed with the writer for the GIL (py-lmdb
releases it around every LMDB call) and nothing was left to do during the fsync. A caller is woken
only when its own items are done or when a role is free and work waits for it (not all callers at
every batch).

Guarantees:

* **acknowledged ⇒ durable**: a caller returns only after the transaction holding its transition
  committed (LMDB's fsync), or raises; an item its ``prepare`` refused (nothing written) returns at
  once with that error;
* **one transition, one transaction**: a transition is never split; several share one parent
  transaction, and a refused one (a :class:`~kvckpt.errors.KvckptError` it raised) writes nothing
  (``Store.write_each`` rolls it back alone) and is reported to its caller only;
* **order**: transitions of one batch apply in the order they were queued; a writer takes only the
  queue's prepared head (it never passes an item still being prepared).

:attr:`GroupCommitter.before_commit` is a test seam into the batch: it runs inside the batch's
write transaction, after its transitions and before its durable commit, and sees which of them
have been acknowledged so far (none may be, by the first guarantee; ``tests/core/test_group_commit.py``
checks that against another process's snapshot taken at exactly that point).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvckpt.errors import KvckptError
from kvckpt.storage.store import Store, Txn

#: An item's stage: submitted raw (waits for the preparer), being prepared, or a transition ready to write.
_RAW, _PREPARING, _READY = 0, 1, 2


class _Pending:
    __slots__ = ("done", "fn", "prepare", "raises", "result", "stage")

    def __init__(self, item: Any, prepare: Callable[[Any], Callable[[Txn], Any]] | None) -> None:
        self.fn = item  # the transition, or the raw item until it is prepared
        self.prepare = prepare
        self.done = False
        self.result: Any = None
        self.raises = False  # ``result`` is what ``prepare`` raised that is no refusal: raised to the caller
        self.stage = _READY if prepare is None else _RAW


class GroupCommitter:
    """The leader/follower queue in front of one store's writer. Thread-safe.

    ``stats`` counts ``transactions`` (durable commits made) and ``transitions`` (transitions in
    them): their ratio is the number of commits each fsync acknowledged.
    """

    def __init__(self, store: Store, *, max_batch: int = 256) -> None:
        self.store = store
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._raw = 0  # items of the queue not yet taken by a preparer
        self._leading = False  # a writer is writing a batch
        self._preparing = False  # a preparer is preparing
        #: Waiting callers: each one's wakeup lock (held; released to wake it) and items.
        self._idle: list[tuple[Any, list[_Pending]]] = []
        self.stats = {"transactions": 0, "transitions": 0}
        #: Test seam (``None`` in production): ``before_commit(txn, acknowledged)`` runs inside every
        #: batch's write transaction (after the batch's transitions, as one more function of the
        #: batch) before its durable commit; ``acknowledged[i]`` says whether the batch's
        #: ``i``-th transition has been handed back to its caller.
        self.before_commit: Callable[[Txn, list[bool]], None] | None = None

    @property
    def queued(self) -> int:
        """Transitions waiting for the next batch (not counting the one being written)."""
        with self._lock:
            return len(self._queue)

    def submit_many(self, items: Sequence[Any],
                    prepare: Callable[[Any], Callable[[Txn], Any]] | None = None) -> list[Any]:
        """Run every item as its own transition, in order (in one batch where ``max_batch`` allows);
        each result in order, a refusal as its exception object. Without ``prepare`` the items are
        the transitions (``fn(txn)``); with it, each is a raw item that ``prepare(item)`` turns into
        its transition, in whichever waiting caller holds the preparer role (outside any
        transaction). A :class:`~kvckpt.errors.KvckptError` ``prepare`` raises is that item's result
        (nothing of it is written); any other exception is raised here, once every item is done."""
        mine = [_Pending(item, prepare) for item in items]
        me = threading.Lock()  # this caller's wakeup: held while it sleeps on it, released to wake it
        me.acquire()
        with self._lock:
            self._queue.extend(mine)
            self._raw += sum(p.stage == _RAW for p in mine)
        while True:
            with self._lock:
                role = self._role(me, mine)
            if role is None:
                break
            if role[0] == "prepare":
                self._prepare(role[1])
            else:
                self._write(role[1])
        for p in mine:
            if p.raises:
                raise p.result
        return [p.result for p in mine]

    def _role(self, me: Any, mine: list[_Pending]) -> tuple[str, list[_Pending]] | None:
        """Wait (lock held) until ``mine`` are done (``None``) or a role is free and taken:
        ``("prepare", the raw items taken)`` or ``("write", the batch taken)``."""
        while True:
            if all(p.done for p in mine):
                self._hand_off()
                return None
            if self._may_prepare():
                raw = self._take_raw()
                self._hand_off()  # the writer's role, if it is free and has work, to another caller
                return "prepare", raw
            if self._may_write():
                batch = self._take_batch()
                self._hand_off()
                return "write", batch
            self._idle.append((me, mine))
            self._lock.release()
            try:
                me.acquire()  # until a waker releases it (then it is held again, for the next wait)
            finally:
                self._lock.acquire()

    def _may_prepare(self) -> bool:
        return not self._preparing and self._raw > 0

    def _may_write(self) -> bool:
        return not self._leading and bool(self._queue) and self._queue[0].stage == _READY

    def _take_raw(self) -> list[_Pending]:
        """Become the preparer of every raw item queued so far (lock held)."""
        self._preparing = True
        raw = [p for p in self._queue if p.stage == _RAW]
        for p in raw:
            p.stage = _PREPARING
        self._raw -= len(raw)
        return raw

    def _take_batch(self) -> list[_Pending]:
        """Become the writer of the queue's prepared head, up to ``max_batch`` (lock held)."""
        self._leading = True
        n = 0
        for p in self._queue[:self.max_batch]:
            if p.stage != _READY:
                break
            n += 1
        batch, self._queue = self._queue[:n], self._queue[n:]
        return batch

    def _prepare(self, raw: list[_Pending]) -> None:
        refused = []
        for p in raw:
            assert p.prepare is not None
            try:
                p.fn = p.prepare(p.fn)
            except KvckptError as exc:  # this item's refusal: nothing of it is written
                p.result = exc
                refused.append(p)
            except BaseException as exc:  # a failure, not a refusal: its caller raises it (nothing is written)
                p.result, p.raises = exc, True
                refused.append(p)
        with self._lock:
            for p in raw:
                p.stage = _READY
            for p in refused:
                p.done = True
            if refused:
                self._queue = [p for p in self._queue if not p.done]
            self._preparing = False
            self._wake_done()

    def _write(self, batch: list[_Pending]) -> None:
        fns = [p.fn for p in batch]
        hook = self.before_commit
        if hook is not None:
            fns.append(lambda txn, batch=batch, hook=hook: hook(txn, [p.done for p in batch]))
        try:
            results: list[Any] = self.store.write_each(fns)[:len(batch)]
        except BaseException as exc:  # the whole transaction failed (disk full, closed store...)
            results = [exc] * len(batch)
        with self._lock:
            for pending, result in zip(batch, results, strict=True):
                pending.result, pending.done = result, True
            self.stats["transactions"] += 1
            self.stats["transitions"] += len(batch)
            self._leading = False
            self._wake_done()

    def _wake_done(self) -> None:
        """Wake the waiting callers whose items are all done (lock held)."""
        waiting, self._idle = self._idle, []
        for wakeup, items in waiting:
            if all(p.done for p in items):
                wakeup.release()
            else:
                self._idle.append((wakeup, items))

    def _hand_off(self) -> None:
        """Wake one waiting caller if a role is free and has work (lock held): called by a caller
        that takes a role or returns, so a free role never waits while its work is queued."""
        if self._idle and (self._may_prepare() or self._may_write()):
            self._idle.pop(0)[0].release()
