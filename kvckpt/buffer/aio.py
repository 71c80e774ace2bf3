"""The asyncio facade of the replay buffer: every transaction runs off the event loop.

:class:`AsyncReplayBuffer` wraps a :class:`~kvckpt.buffer.ReplayBuffer` and gives each of its
operations an ``async`` form. The transaction itself is the wrapped buffer's, run on a dedicated
thread pool, so the guarantees are exactly the synchronous ones (one durable write transaction
per state transition, idempotent commit retries, fencing of stale leases) and the event loop never
blocks on LMDB, fsync, row encoding or a checkpoint copy.

The gate wait of :meth:`AsyncReplayBuffer.admit` (and :meth:`AsyncReplayBuffer.advance_dispatch`)
happens on the loop, not in a pool thread: each try is a non-blocking admission (``timeout=0``),
and between tries the coroutine sleeps until a write made through this facade completes (or
``poll_interval`` passes, to see writes made by other handles). Waiting admissions therefore hold
no thread, and cannot starve the commits and ``finish_step`` calls that open the gate.

.. note::
   Cancelling an awaited call does not cancel its transaction: a thread cannot be interrupted,
   so the transaction lands or not exactly as if the caller had died right after submitting it.
   Commits are safe to retry (an identical re-commit returns ``replayed=True``).

Examples:
    >>> import asyncio, tempfile
    >>> from kvckpt import BufferConfig
    >>> async def main():
    ...     path = tempfile.mkdtemp() + "/buf.kv"
    ...     config = BufferConfig(group_size=1, schema={"input_ids": ("int64", "token")})
    ...     async with await AsyncReplayBuffer.create(path, config) as buf:
    ...         [lease] = await buf.admit([0])
    ...         await buf.commit_group(lease, [{"input_ids": [1, 2]}])
    ...         return (await buf.select(1, 1)).group_ids == [lease.group_id]
    >>> asyncio.run(main())
    True
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvckpt.buffer.replay_buffer import ReplayBuffer
from kvckpt.buffer.step_batcher import StepBatcher
from kvckpt.buffer.surface import GENERATED, Operation, mark_generated, offered_by, summary
from kvckpt.durability.checkpoint import CheckpointHandle, CheckpointResult
from kvckpt.errors import BadArgument, GateTimeout
from kvckpt.storage.progress_message import ProgressMessage
from kvckpt.tables.records import (
    Admission,
    Lease,
    Prompt,
)
from kvckpt.transitions.config import BufferConfig

T = TypeVar("T")

#: Default size of the dedicated pool: enough for row encoding to overlap with a transaction.
DEFAULT_WORKERS = 4


class AsyncReplayBuffer:
    """A :class:`~kvckpt.buffer.ReplayBuffer` whose operations are coroutines.

    Args:
        buffer: the buffer to wrap; the facade owns it from now on (:meth:`close` closes it).
        max_workers: threads of the dedicated pool that runs transactions and row encoding.
            Defaults to :data:`DEFAULT_WORKERS`.
        poll_interval: longest sleep between admission tries while the gate is closed, in
            seconds; writes made through this facade wake waiters at once. Defaults to 0.05.

    Use it from one event loop at a time. Methods return the same types as the synchronous ones.
    """

    def __init__(self, buffer: ReplayBuffer, *, max_workers: int = DEFAULT_WORKERS,
                 poll_interval: float = 0.05) -> None:
        if max_workers < 1:
            raise BadArgument(f"max_workers must be >= 1, got {max_workers}")
        self.buffer = buffer
        self.poll_interval = poll_interval
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvckpt-aio")
        self._changed: asyncio.Event | None = None
        self._closed = False
        self._steps = StepBatcher(buffer.record_progress_steps, self._pool)

    # -- lifecycle -------------------------------------------------------------------------------
    @classmethod
    async def create(cls, path: str, config: BufferConfig, *, map_size: int | None = None,
                     **kwargs: Any) -> AsyncReplayBuffer:
        """Create a new store (see :meth:`ReplayBuffer.create`) off the loop and wrap it."""
        buffer = await asyncio.to_thread(ReplayBuffer.create, path, config, map_size=map_size)
        return cls(buffer, **kwargs)

    @classmethod
    async def open(cls, path: str, *, readonly: bool = False, **kwargs: Any) -> AsyncReplayBuffer:
        """Reopen an existing store (see :meth:`ReplayBuffer.open`) off the loop and wrap it."""
        buffer = await asyncio.to_thread(ReplayBuffer.open, path, readonly=readonly)
        return cls(buffer, **kwargs)

    async def close(self) -> None:
        """Close the store (waiting for running transactions and checkpoint copies), then the
        pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._run(self.buffer.close)
        self._pool.shutdown(wait=False)

    async def __aenter__(self) -> AsyncReplayBuffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def path(self) -> str:
        """The store file."""
        return self.buffer.path

    # -- plumbing --------------------------------------------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def _change_event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    async def _write(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return await self._run(fn, *args, **kwargs)
        finally:
            self._wake()

    def _wake(self) -> None:
        """Wake admissions waiting on the gate; a fresh event for the next round of waiters."""
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    # -- admission -------------------------------------------------------------------------------
    async def admit(self, prompts: Sequence[Prompt | int | Mapping[str, Any]], dataloader_state: bytes | None = None,
                    *, timeout: float | None = None, weight_version: int | None = None,
                    admission: Admission | None = None, holder: str | None = None) -> list[Lease]:
        """Admit one dataloader batch (see :meth:`ReplayBuffer.admit`); the gate wait never
        blocks the loop or holds a pool thread.

        Raises:
            GateTimeout: the gate or capacity stayed closed for ``timeout`` seconds.
            CapacityError, BadArgument: as :meth:`ReplayBuffer.admit`, at once.
        """
        return await self._when_open(self.buffer.admit, prompts, dataloader_state, timeout=timeout,
                                     weight_version=weight_version, admission=admission, holder=holder)

    async def advance_dispatch(self, dataloader_state: bytes | None = None, *,
                               timeout: float | None = None) -> Admission:
        """Make an admission without prompts yet (see :meth:`ReplayBuffer.advance_dispatch`); the
        gate wait happens on the loop, as in :meth:`admit`.

        Raises:
            GateTimeout: the gate stayed closed for ``timeout`` seconds.
        """
        return await self._when_open(self.buffer.advance_dispatch, dataloader_state, timeout=timeout)

    async def _when_open(self, fn: Callable[..., T], *args: Any, timeout: float | None, **kwargs: Any) -> T:
        """Try ``fn(..., timeout=0)`` until the gate lets it through, sleeping on the loop between
        tries until a write through this facade lands or ``poll_interval`` passes."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            changed = self._change_event()
            try:
                admitted = await self._run(fn, *args, timeout=0, **kwargs)
            except GateTimeout as exc:  # a refused try wrote nothing: it must not wake the waiters, itself included
                blocked = exc
            else:
                self._wake()
                return admitted
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise GateTimeout(f"admission still blocked after {timeout}s ({blocked})") from None
            wait = self.poll_interval if remaining is None else min(self.poll_interval, remaining)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), wait)

    # -- progress step messages (batched) ---------------------------------------------------------
    async def record_progress_step(self, message: ProgressMessage | bytes) -> list[Any]:
        """Record one engine step's progress message (see :meth:`ReplayBuffer.record_progress_step`)."""
        [result] = await self.record_progress_steps([message])
        if isinstance(result, BaseException):
            raise result
        return result

    async def record_progress_steps(self, messages: Sequence[ProgressMessage | bytes]) -> list[Any]:
        """Progress messages in one durable transaction (see :meth:`ReplayBuffer.record_progress_steps`),
        shared with the messages of concurrent calls (:class:`~kvckpt.buffer.step_batcher.StepBatcher`:
        one pool handoff per batch, not per call)."""
        return await self._steps.submit(messages)

    # -- checkpoint and recovery -----------------------------------------------------------------
    async def checkpoint(self, dest: str, trainer_state: Mapping[str, Any] | None = None, *,
                         overwrite: bool = False) -> CheckpointHandle:
        """Stamp a checkpoint (one transaction) and start its background copy.

        Returns the handle at once; ``await`` :meth:`wait_checkpoint` for the finished file.
        See :func:`kvckpt.checkpoint`.
        """
        return await self._write(self.buffer.checkpoint, dest, trainer_state, overwrite=overwrite)

    @staticmethod
    async def wait_checkpoint(handle: CheckpointHandle) -> CheckpointResult:
        """Wait for a checkpoint's copy without blocking the loop (on a thread outside the pool,
        so a long copy never delays transactions).

        Raises:
            CheckpointError: the copy failed; no file carries the final name.
        """
        return await asyncio.to_thread(handle.wait)


# -- made from the operation table -----------------------------------------------------------------
def passthrough(row: Operation) -> Callable[..., Any]:
    """The facade's method of one operation of :data:`kvckpt.buffer.surface.TABLE`: a coroutine with
    :class:`~kvckpt.ReplayBuffer`'s signature, type hints and summary that runs the buffer's method on
    the facade's pool (and, after a write that may open the gate, wakes gated admissions). An
    operation whose result is ``local`` (an encoder: no transaction) is a plain method instead."""
    name = row.name
    reference = getattr(ReplayBuffer, name)
    signature = inspect.signature(reference)
    lists = [param for param, codec in row.args.items() if codec in ("ids", "ids?")]
    if row.result == "local":
        def method(self: AsyncReplayBuffer, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.buffer, name)(*args, **kwargs)

        how = "Made on the calling thread (no transaction: nothing to await)."
    else:
        async def method(self: AsyncReplayBuffer, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            if lists:  # iterables of group ids are read here, not on a pool thread
                bound = signature.bind(self, *args, **kwargs)
                for param in lists:
                    if bound.arguments.get(param) is not None:
                        bound.arguments[param] = list(bound.arguments[param])
                args, kwargs = bound.args[1:], bound.kwargs
            run = self._write if row.wakes_admissions else self._run
            return await run(getattr(self.buffer, name), *args, **kwargs)

        how = ("A coroutine: the call runs on the facade's thread pool"
               + ("; gated admissions wake after it." if row.wakes_admissions else "."))
    method.__name__, method.__qualname__, method.__module__ = name, f"AsyncReplayBuffer.{name}", __name__
    method.__doc__ = f"{summary(name)}\n\n{how} See :meth:`kvckpt.ReplayBuffer.{name}`."
    method.__signature__ = signature  # type: ignore[attr-defined]
    method.__annotations__ = dict(reference.__annotations__)
    method.__wrapped__ = reference  # type: ignore[attr-defined]  # typing.get_type_hints reads its module
    return mark_generated(method)


def _install(cls: type, rows: Iterable[Operation]) -> None:
    for row in rows:
        if row.name in vars(cls):
            raise TypeError(f"{cls.__name__}.{row.name} is written by hand, but the table says it is generated")
        setattr(cls, row.name, passthrough(row))


_install(AsyncReplayBuffer, offered_by("async", GENERATED))
