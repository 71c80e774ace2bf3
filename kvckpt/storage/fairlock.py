"""A re-entrant lock handed to its waiters in the order they arrived (the store's writer lock).

``threading.RLock`` lets a releasing thread, or any newcomer, take the lock again before a woken
waiter gets a CPU: on a saturated machine the trainer's checkpoint stamp lost the writer lock to
several producer transactions in a row (each one fsync long). :class:`FairLock` hands the lock
over on release: the longest waiter becomes the owner before anybody else can ask, so a waiter
waits for at most the holders queued before it.

A waiter may also ask to go first (``acquire(first=True)``, or ``with lock.first():``): it is
queued behind the earlier waiters that asked to go first and ahead of every plain waiter, so it
waits only for the holder in progress and those. The store's checkpoint stamp asks so
(:meth:`kvckpt.storage.store.Store.write_then_snapshot`): it waits for one producer batch at most,
not for the ones queued before it. Plain waiters can be overtaken only by such waiters; a caller
that asked to go first again and again would starve them, so only the stamp (one per checkpoint)
uses it.

Guarantees: mutual exclusion; re-entrancy (the owner may acquire again, with or without ``first``,
at once, and releases as often); on release the lock goes to the longest waiter that asked to go
first, else to the longest plain waiter (FIFO within each class); a waiter interrupted while
waiting (``KeyboardInterrupt`` in the main thread) leaves its queue, or passes on the lock if it
had already been handed to it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator


class FairLock:
    """A re-entrant FIFO lock; use it as ``with lock:`` (or :meth:`acquire`/:meth:`release`), and
    ``with lock.first():`` to go ahead of the plain waiters."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._waiters: deque[tuple[int, threading.Lock]] = deque()
        self._first: deque[tuple[int, threading.Lock]] = deque()

    @property
    def waiting(self) -> int:
        """Threads waiting for the lock now (both kinds)."""
        with self._mutex:
            return len(self._waiters) + len(self._first)

    def acquire(self, first: bool = False) -> None:
        """Wait until this thread owns the lock: in arrival order, or, with ``first``, ahead of
        every waiter that did not ask to go first (see the module docstring)."""
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me:
                self._depth += 1
                return
            if self._owner is None:  # free implies nobody waits: release hands it on otherwise
                self._owner, self._depth = me, 1
                return
            gate = threading.Lock()
            gate.acquire()
            entry = (me, gate)
            queue = self._first if first else self._waiters
            queue.append(entry)
        try:
            gate.acquire()  # released by the release() that made this thread the owner
        except BaseException:
            with self._mutex:
                handed = self._owner == me
                if not handed:
                    queue.remove(entry)
            if handed:
                self.release()
            raise

    @contextlib.contextmanager
    def first(self) -> Iterator[FairLock]:
        """Hold the lock for the ``with`` block, taken with ``acquire(first=True)``."""
        self.acquire(first=True)
        try:
            yield self
        finally:
            self.release()

    def release(self) -> None:
        """Release once; the last release hands the lock to the longest waiter that asked to go
        first, else to the longest plain waiter, if any.

        Raises:
            RuntimeError: this thread does not own the lock.
        """
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release a FairLock this thread does not own")
            self._depth -= 1
            if self._depth:
                return
            queue = self._first or self._waiters
            if not queue:
                self._owner = None
                return
            self._owner, gate = queue.popleft()
            self._depth = 1
            gate.release()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
