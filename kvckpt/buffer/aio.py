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
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvckpt.buffer.batch import Batch
from kvckpt.buffer.replay_buffer import ReplayBuffer
from kvckpt.buffer.step_batcher import StepBatcher
from kvckpt.durability.checkpoint import CheckpointHandle, CheckpointResult
from kvckpt.durability.recovery import RecoveryPlan
from kvckpt.errors import BadArgument, GateTimeout
from kvckpt.storage.progress_message import ProgressMessage
from kvckpt.tables.records import (
    Admission,
    CommitResult,
    GroupInfo,
    Lease,
    LedgerEntry,
    Progress,
    Prompt,
    Selection,
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
            # Wake admissions waiting on the gate; a fresh event for the next round of waiters.
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
                return await self._write(fn, *args, timeout=0, **kwargs)
            except GateTimeout as exc:
                blocked = exc
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise GateTimeout(f"admission still blocked after {timeout}s ({blocked})") from None
            wait = self.poll_interval if remaining is None else min(self.poll_interval, remaining)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), wait)

    async def admissible(self, count: int = 1) -> bool:
        """Whether ``count`` prompts could be admitted now."""
        return await self._run(self.buffer.admissible, count)

    # -- commits ---------------------------------------------------------------------------------
    async def commit_group(self, lease: Lease, rows: Sequence[Mapping[str, Any]] | Mapping[int, Mapping[str, Any]],
                           *, end_weight: int | None = None) -> CommitResult:
        """Commit a whole group (see :meth:`ReplayBuffer.commit_group`); rows are encoded in the pool."""
        return await self._write(self.buffer.commit_group, lease, rows, end_weight=end_weight)

    async def commit_sample(self, lease: Lease, index: int, row: Mapping[str, Any],
                            *, end_weight: int | None = None) -> CommitResult:
        """Commit one row of a group (see :meth:`ReplayBuffer.commit_sample`)."""
        return await self._write(self.buffer.commit_sample, lease, index, row, end_weight=end_weight)

    async def commit_many(self, items: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Commit several groups or rows in one durable transaction (see :meth:`ReplayBuffer.commit_many`)."""
        return await self._write(self.buffer.commit_many, items)

    async def record_progress(self, lease: Lease, index: int, *, start: int, tokens: Any, logprobs: Any,
                              weight_version: int, fields: Mapping[str, Any] | None = None) -> int:
        """Record one chunk of a sample's token progress (see :meth:`ReplayBuffer.record_progress`)."""
        return await self._run(self.buffer.record_progress, lease, index, start=start, tokens=tokens,
                               logprobs=logprobs, weight_version=weight_version, fields=fields)

    async def record_progress_many(self, items: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Record several chunks in one durable transaction (see :meth:`ReplayBuffer.record_progress_many`)."""
        return await self._run(self.buffer.record_progress_many, items)

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

    async def progress(self, lease_or_group_id: Lease | str) -> dict[int, Progress]:
        """A group's durable token prefixes (see :meth:`ReplayBuffer.progress`)."""
        return await self._run(self.buffer.progress, lease_or_group_id)

    # -- training side ---------------------------------------------------------------------------
    async def select(self, min_groups: int = 1, max_groups: int | None = None) -> Selection:
        """Claim groups for the current step (see :meth:`ReplayBuffer.select`)."""
        return await self._write(self.buffer.select, min_groups, max_groups)

    async def claim(self, group_ids: Iterable[str]) -> Selection:
        """Claim exactly the named ready groups for the current step (see :meth:`ReplayBuffer.claim`)."""
        return await self._write(self.buffer.claim, list(group_ids))

    async def release_claims(self, group_ids: Iterable[str]) -> list[str]:
        """Return claims of the current step to ready (see :meth:`ReplayBuffer.release_claims`)."""
        return await self._write(self.buffer.release_claims, list(group_ids))

    async def read_batch(self, groups: Selection | Iterable[str], **kwargs: Any) -> Batch:
        """Read and decode the rows of ``groups`` (see :meth:`ReplayBuffer.read_batch`)."""
        return await self._run(self.buffer.read_batch, groups, **kwargs)

    async def finish_step(self, *, weight_version: int | None = None) -> int:
        """Close the current step (see :meth:`ReplayBuffer.finish_step`); wakes gated admissions."""
        return await self._write(self.buffer.finish_step, weight_version=weight_version)

    async def evict(self, group_ids: Iterable[str] | None = None) -> list[str]:
        """Remove out-of-window (or the named) ready groups (see :meth:`ReplayBuffer.evict`)."""
        return await self._write(self.buffer.evict, group_ids)

    async def promote_ready_group(self, to_target_step: int) -> int | None:
        """Re-stamp the latest-stamped ready group onto ``to_target_step`` (see
        :meth:`ReplayBuffer.promote_ready_group`)."""
        return await self._write(self.buffer.promote_ready_group, to_target_step)

    async def redispatch(self, group_id: str, *, start_weight: int | None = None, holder: str | None = None) -> Lease:
        """Hand an in-flight prompt to a new attempt (see :meth:`ReplayBuffer.redispatch`)."""
        return await self._write(self.buffer.redispatch, group_id, start_weight=start_weight, holder=holder)

    async def leases_held_by(self, holder: str) -> list[Lease]:
        """The leases ``holder`` holds, in one read (see :meth:`ReplayBuffer.leases_held_by`)."""
        return await self._run(self.buffer.leases_held_by, holder)

    async def redispatch_held_by(self, holder: str, *, to: str | None = None,
                                 start_weight: int | None = None) -> list[Lease]:
        """Redispatch what ``holder`` holds, in one transaction (see :meth:`ReplayBuffer.redispatch_held_by`)."""
        return await self._write(self.buffer.redispatch_held_by, holder, to=to, start_weight=start_weight)

    async def abort(self, group_id: str, reason: str) -> None:
        """Give up on an in-flight prompt (see :meth:`ReplayBuffer.abort`)."""
        await self._write(self.buffer.abort, group_id, reason)

    async def abort_stale_inflight(self) -> list[str]:
        """Abort in-flight prompts the sampler says are useless (see :meth:`ReplayBuffer.abort_stale_inflight`)."""
        return await self._write(self.buffer.abort_stale_inflight)

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

    async def recover(self, resume_version: int | None = None, *, sampler: Any = None,
                      max_buffered_rollouts: int | None = None) -> RecoveryPlan:
        """Reconcile the store and fence in-flight work (see :meth:`kvckpt.ReplayBuffer.recover`)."""
        return await self._write(self.buffer.recover, resume_version, sampler=sampler,
                                 max_buffered_rollouts=max_buffered_rollouts)

    # -- inspection ------------------------------------------------------------------------------
    async def stats(self) -> dict[str, Any]:
        """Counters and latencies (see :meth:`ReplayBuffer.stats`)."""
        return await self._run(self.buffer.stats)

    async def state(self) -> dict[str, Any]:
        """Cursors, counts and counters (see :meth:`ReplayBuffer.state`)."""
        return await self._run(self.buffer.state)

    async def group(self, group_id: str) -> GroupInfo | None:
        """A group's record, or ``None``."""
        return await self._run(self.buffer.group, group_id)

    async def groups(self, states: Iterable[str] | None = None) -> list[GroupInfo]:
        """Group records, optionally filtered by state, in dispatch order."""
        return await self._run(self.buffer.groups, states)

    async def ledger(self) -> list[LedgerEntry]:
        """Every in-flight prompt, in dispatch order."""
        return await self._run(self.buffer.ledger)

    async def dataloader_state(self) -> bytes | None:
        """The dataloader state stored with the last admission."""
        return await self._run(self.buffer.dataloader_state)

    async def batch_shortfall(self) -> dict[int, int]:
        """Prompts aborted per target step."""
        return await self._run(self.buffer.batch_shortfall)

    async def count_for_target_step(self, step: int) -> int:
        """In-flight plus ready groups stamped for ``step``."""
        return await self._run(self.buffer.count_for_target_step, step)
