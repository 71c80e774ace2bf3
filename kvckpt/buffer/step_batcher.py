"""Group commit of progress step messages on an event loop: one thread handoff per batch, not per call.

Many producers each send one message per engine step; an owner that handed every call to a pool
thread (which then queued on the group committer and woke the loop again) paid two cross-thread
handoffs per call, several times the cost of the message's own transitions
(``benchmarks/progress_bench.py``, BENCHMARKS.md "Token progress"). :class:`StepBatcher` is a
leader/follower queue on the loop instead: a call enqueues its messages and awaits a loop future;
while no batch is being written, the queued messages go to the pool as one
:meth:`~kvckpt.buffer.ReplayBuffer.record_progress_steps` (one durable transaction, each sequence
its own transition, through the buffer's group committer, so commits still share it), and when it
returns the loop hands every caller its slice of the results.

Guarantees: a caller's result is set only after the transaction holding its messages committed
(acknowledged => durable); messages apply in the order they were queued; a message refused whole
(:class:`~kvckpt.errors.MalformedMessage`) or a failed transaction fails only its callers.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any


class StepBatcher:
    """The loop-side queue in front of ``write`` (``ReplayBuffer.record_progress_steps``), run on
    ``pool``; use it from one event loop. ``max_batch`` caps the messages of one transaction."""

    def __init__(self, write: Callable[[list[Any]], list[Any]], pool: Executor, *, max_batch: int = 256) -> None:
        self.write = write
        self.pool = pool
        self.max_batch = max_batch
        self._queue: list[tuple[list[Any], asyncio.Future[list[Any]]]] = []
        self._writing = False
        #: batches written and the messages they held
        self.stats = {"batches": 0, "messages": 0}

    async def submit(self, messages: Sequence[Any]) -> list[Any]:
        """Record ``messages``; per message its per-sequence results or the error that refused it."""
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._queue.append((list(messages), future))
        if not self._writing:
            self._start()
        return await future

    def _start(self) -> None:
        taken, count = [], 0
        while self._queue and (not taken or count + len(self._queue[0][0]) <= self.max_batch):
            taken.append(self._queue.pop(0))
            count += len(taken[-1][0])
        self._writing = True
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self.pool, self.write, [m for messages, _ in taken for m in messages])
        job.add_done_callback(functools.partial(self._done, taken))

    def _done(self, taken: list[tuple[list[Any], asyncio.Future[list[Any]]]], job: asyncio.Future[list[Any]]) -> None:
        self._writing = False
        self.stats["batches"] += 1
        self.stats["messages"] += sum(len(messages) for messages, _ in taken)
        error = job.exception()
        results = iter(() if error is not None else job.result())
        for messages, future in taken:
            if future.cancelled():
                for _ in messages:
                    next(results, None)
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result([next(results) for _ in messages])
        if self._queue:
            self._start()
