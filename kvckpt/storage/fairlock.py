"""A re-entrant lock handed to its waiters in the order they arrived (the store's writer lock).

``threading.RLock`` lets a releasing thread, or any newcomer, take the lock again before a woken
waiter gets a CPU: on a saturated machine the trainer's checkpoint stamp lost the writer lock to
several producer transactions in a row (each one fsync long). :class:`FairLock` hands the lock
over on release: the longest waiter becomes the owner before anybody else can ask, so a waiter
waits for at most the holders queued before it.

Guarantees: mutual exclusion; re-entrancy (the owner may acquire again, and releases as often);
FIFO order among waiters; a waiter interrupted while waiting (``KeyboardInterrupt`` in the main
thread) leaves the queue, or passes on the lock if it had already been handed to it.
"""

from __future__ import annotations

import threading
from collections import deque


class FairLock:
    """A re-entrant FIFO lock; use it as ``with lock:`` (or :meth:`acquire`/:meth:`release`)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._waiters: deque[tuple[int, threading.Lock]] = deque()

    @property
    def waiting(self) -> int:
        """Threads waiting for the lock now."""
        with self._mutex:
            return len(self._waiters)

    def acquire(self) -> None:
        """Wait (in arrival order) until this thread owns the lock."""
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
            self._waiters.append(entry)
        try:
            gate.acquire()  # released by the release() that made this thread the owner
        except BaseException:
            with self._mutex:
                handed = self._owner == me
                if not handed:
                    self._waiters.remove(entry)
            if handed:
                self.release()
            raise

    def release(self) -> None:
        """Release once; the last release hands the lock to the longest waiter, if any.

        Raises:
            RuntimeError: this thread does not own the lock.
        """
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release a FairLock this thread does not own")
            self._depth -= 1
            if self._depth:
                return
            if not self._waiters:
                self._owner = None
                return
            self._owner, gate = self._waiters.popleft()
            self._depth = 1
            gate.release()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
