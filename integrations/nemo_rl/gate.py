"""The gate waiters of one NeMo-RL replay buffer: every sampler object over it shares them.

A gated ``admit`` waits while ``dispatch_index >= trainer_version_fn() + W``. It is woken
(thread-safely, from whichever thread or loop) by every call that tells the buffer the trainer's
version and by every restore or recovery; the waiter then re-reads ``trainer_version_fn()``. A
version that moves only inside ``trainer_version_fn`` (NeMo-RL's ``self._trainer_version += 1``,
read by nobody until the train pump's next ``evict``) cannot notify anyone, so each wait also
re-reads it after :data:`RECHECK_SECONDS`, NeMo-RL's own gate period.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

#: How long a gate wait trusts that no notification means no new version (NeMo-RL's gate period, s).
RECHECK_SECONDS = 0.005


class GateSignal:
    """The gate waiters of one buffer (every sampler object over it shares it): :meth:`wake`
    makes each waiting ``admit`` re-read the trainer's version and the cursor now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def wake(self) -> None:
        """Wake every waiter (safe from any thread or event loop)."""
        with self._lock:
            waiters = list(self._waiters)
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    async def wait_until(self, is_open: Callable[[], bool], deadline: float | None) -> bool:
        """Wait until ``is_open()``, re-checked at each :meth:`wake` and after
        :data:`RECHECK_SECONDS` without one; False once ``deadline`` (monotonic) passed closed."""
        event = asyncio.Event()
        entry = (asyncio.get_running_loop(), event)
        with self._lock:
            self._waiters.add(entry)
        try:
            while not is_open():
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                wait = RECHECK_SECONDS if deadline is None else min(RECHECK_SECONDS, deadline - time.monotonic())
                with contextlib.suppress(TimeoutError):  # no notification: re-read trainer_version_fn
                    await asyncio.wait_for(event.wait(), max(0.0, wait))
                event.clear()
            return True
        finally:
            with self._lock:
                self._waiters.discard(entry)
