"""Group commit: concurrent transitions share one write transaction and one fsync.

A leader/follower queue (LevelDB's write batching, PostgreSQL's group commit): every caller
enqueues its transition and waits. If no batch is being written, the caller becomes the leader: it
takes everything queued so far, runs it through :meth:`kvckpt.storage.store.Store.write_each` (one durable
transaction, each transition in its own nested transaction) and hands each follower its result.
Callers that arrive while a batch is being written form the next batch.

Guarantees:

* **acknowledged ⇒ durable**: a caller returns only after the transaction holding its transition
  committed (LMDB's fsync), or raises;
* **one transition, one transaction**: a transition is never split; several share one parent
  transaction, and a refused one (a :class:`~kvckpt.errors.KvckptError` it raised) is rolled back
  alone by its nested transaction and reported to its caller only;
* **order**: transitions of one batch apply in the order they were queued.

:attr:`GroupCommitter.before_commit` is a test seam into the batch: it runs inside the batch's
write transaction, after its transitions and before its durable commit, and sees which of them
have been acknowledged so far (none may be, by the first guarantee; ``tests/core/test_group_commit.py``
checks that against another process's snapshot taken at exactly that point).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvckpt.storage.store import Store, Txn


class _Pending:
    __slots__ = ("done", "fn", "result")

    def __init__(self, fn: Callable[[Txn], Any]) -> None:
        self.fn = fn
        self.done = False
        self.result: Any = None


class GroupCommitter:
    """The leader/follower queue in front of one store's writer. Thread-safe.

    ``stats`` counts ``transactions`` (durable commits made) and ``transitions`` (transitions in
    them): their ratio is the number of commits each fsync acknowledged.
    """

    def __init__(self, store: Store, *, max_batch: int = 256) -> None:
        self.store = store
        self.max_batch = max_batch
        self._cond = threading.Condition()
        self._queue: list[_Pending] = []
        self._leading = False
        self.stats = {"transactions": 0, "transitions": 0}
        #: Test seam (``None`` in production): ``before_commit(txn, acknowledged)`` runs inside every
        #: batch's write transaction (in a nested transaction of its own, after the batch's
        #: transitions) before its durable commit; ``acknowledged[i]`` says whether the batch's
        #: ``i``-th transition has been handed back to its caller.
        self.before_commit: Callable[[Txn, list[bool]], None] | None = None

    @property
    def queued(self) -> int:
        """Transitions waiting for the next batch (not counting the one being written)."""
        with self._cond:
            return len(self._queue)

    def submit_many(self, fns: Sequence[Callable[[Txn], Any]]) -> list[Any]:
        """Run every ``fn`` as its own transition, in order (in one batch where ``max_batch``
        allows); each result in order, a refusal as its exception object."""
        mine = [_Pending(fn) for fn in fns]
        with self._cond:
            self._queue.extend(mine)
        while True:
            with self._cond:
                while self._leading and not all(p.done for p in mine):
                    self._cond.wait()
                if all(p.done for p in mine):
                    return [p.result for p in mine]
                self._leading = True  # lead: our items are still queued, nobody is writing
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            fns = [p.fn for p in batch]
            hook = self.before_commit
            if hook is not None:
                fns.append(lambda txn, batch=batch, hook=hook: hook(txn, [p.done for p in batch]))
            try:
                results: list[Any] = self.store.write_each(fns)[:len(batch)]
            except BaseException as exc:  # the whole transaction failed (disk full, closed store...)
                results = [exc] * len(batch)
            with self._cond:
                for pending, result in zip(batch, results, strict=True):
                    pending.result, pending.done = result, True
                self.stats["transactions"] += 1
                self.stats["transitions"] += len(batch)
                self._leading = False
                self._cond.notify_all()
