"""The buffer as a Ray actor: one process owns the store, producers and the trainer call it.

:class:`BufferActor` opens the store inside its own process (never inherited across ``fork``),
wraps it in :class:`~kvckpt.buffer.aio.AsyncReplayBuffer` and runs as an *async* actor: calls overlap,
transactions run on the facade's thread pool (serialised by the store's writer lock), and a gated
``admit`` waits on the event loop, so it never blocks the commits and ``finish_step`` that open
the gate.

What crosses the wire (:mod:`kvckpt.integrations.ray.wire`, one codec per kind of value, named per
operation by the operation table :data:`kvckpt.buffer.surface.TABLE`):

* leases, commit results, selections, group records and recovery plans as plain dicts (the
  records' ``to_dict``; rebuild them with ``from_dict`` or the helpers in
  :mod:`kvckpt.integrations.ray.wire`, or call through :func:`kvckpt.integrations.ray.wire.call`);
* row payloads as numpy arrays inside one Ray object per call (:func:`to_wire` turns torch
  tensors into zero-copy numpy views; Ray ships numpy out of band, so the actor decodes them
  straight from the object store);
* errors as themselves: a refused call raises the kvckpt error in the caller (Ray's
  ``RayTaskError`` subclasses it), and :meth:`BufferActor.commit_many` returns each item's error
  in its slot.

Restart: with ``max_restarts`` the actor is started again after its process dies (SIGKILL,
``ray.kill(no_restart=False)``, OOM). The new incarnation reopens the store and runs live-store
recovery (:meth:`kvckpt.ReplayBuffer.recover`): every acknowledged commit is there (each one was a
durable transaction), nothing half-written is, claims of the interrupted step return to ready, and
every in-flight lease moves to a new timeline with a bumped attempt, so producers still holding the
old lease are refused with :class:`~kvckpt.AbandonedTimeline` (a :class:`~kvckpt.StaleAttempt`).
Leases travel as ``Lease.to_dict()`` dicts; one without ``store_id``/``timeline`` (an older
kvckpt's) is refused with :class:`~kvckpt.ForeignLease`. The driver fetches the redispatch list
with :meth:`BufferActor.recovery_plan`. A restart never creates a store: if the file is gone (the
actor landed on another node), the restart fails instead of silently starting empty.

The module is long (about 800 lines): most of the buffer's operations are made from the operation table
(:func:`remote_method`), but the actor's own behaviour is written here: its start (create, or open and
recover), its restart, restore, the per-caller order of progress calls, the direct progress channel's
life (:meth:`BufferActor.progress_channel`; its server is :mod:`kvckpt.integrations.ray.channel`),
checkpoints that wait, its call counters; the wire is :mod:`kvckpt.integrations.ray.wire` and the client
side :mod:`kvckpt.integrations.ray.client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import os
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import ray
from kvckpt.integrations.ray import LOOPBACK_ENV
from kvckpt.integrations.ray.channel import ChannelServer
from kvckpt.integrations.ray.replication import WATCH_PERIOD_S, ReplicationConfig, Shipper, StandbySide, node_alive
from kvckpt.integrations.ray.wire import CODECS, plan_to_dict, progress_to_dict
from kvckpt.integrations.ray.wire import batch_to_dict as batch_to_dict  # public here too
from kvckpt.integrations.ray.wire import to_wire as to_wire  # public here too
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvckpt import (
    DEFAULT_WORKERS,
    AsyncReplayBuffer,
    BufferConfig,
    CheckpointHandle,
    Lease,
    ReplayBuffer,
    check,
    enable_replication,
    replication_status,
    restore,
)
from kvckpt.buffer.surface import GENERATED, Operation, mark_generated, offered_by, signature, summary
from kvckpt.errors import BadArgument, KvckptError, NotPrimary, NotStandby, RecoveryError, StaleAttempt

LOOPBACK = "127.0.0.1"
DEFAULT_NAME = "kvckpt-buffer"
DEFAULT_STANDBY_NAME = "kvckpt-buffer-standby"
DEFAULT_NAMESPACE = "kvckpt"
DEFAULT_OBJECT_STORE_BYTES = 512 << 20


def init_local_ray(num_cpus: int | None = None, *, object_store_memory: int = DEFAULT_OBJECT_STORE_BYTES,
                   namespace: str = DEFAULT_NAMESPACE, **kwargs: Any) -> Any:
    """Start a single-node Ray instance that listens on loopback only, for tests and demos.

    Sets :data:`LOOPBACK_ENV` (unless the variables are already set), binds every Ray process to
    127.0.0.1, starts no dashboard, keeps the object store small, and checks the result.

    Args:
        num_cpus: CPUs Ray may schedule. Defaults to Ray's count of the machine's cores.
        object_store_memory: bytes of shared memory for objects. Defaults to 512 MiB.
        namespace: the namespace named actors live in; a driver that reconnects with the same
            namespace finds them. Defaults to :data:`DEFAULT_NAMESPACE`.
        **kwargs: passed to :func:`ray.init` (they override the defaults above).

    Raises:
        RuntimeError: Ray came up on a non-loopback address anyway (it was shut down again).

    .. note::
       Ray decides whether to bind the machine's address when it is *imported*, from
       ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``. Importing :mod:`kvckpt.integrations.ray` before
       ``ray`` sets it; if ray was imported first, this function applies the variable to the
       already-imported setting before starting.
    """
    keep_ray_on_loopback()
    kwargs = {"include_dashboard": False, "_node_ip_address": LOOPBACK, **kwargs}
    context = ray.init(num_cpus=num_cpus, object_store_memory=object_store_memory, namespace=namespace, **kwargs)
    address = ray.get_runtime_context().gcs_address
    if not address.startswith(f"{LOOPBACK}:") or context.address_info.get("node_ip_address") != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"Ray started on {address}, not on loopback; set "
                           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray")
    return context


def keep_ray_on_loopback() -> None:
    """Apply :data:`LOOPBACK_ENV` to this process before it starts or joins Ray nodes.

    Sets the variables unless already set (child processes inherit them) and, since ray reads
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` only once when it is imported, applies it to an
    already-imported ray as well. Call it before ``ray.cluster_utils.Cluster`` or ``ray.init``
    without :func:`init_local_ray`, and pass ``node_ip_address="127.0.0.1"`` to the nodes.
    """
    from ray._private import ray_constants  # the setting ray computed from the variable at import

    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    if os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        ray_constants.ENABLE_RAY_CLUSTER = False


#: Seconds a tagged record_progress_steps call waits for its client's earlier calls before it goes ahead.
ORDER_WAIT_S = 60.0


@dataclasses.dataclass
class _ClientOrder:
    """One caller's next expected sequence number, and the condition its parked calls wait on."""

    expected: int
    ready: asyncio.Condition


R = TypeVar("R")


def _replicated(method: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """A write method of the actor under its replication level: refused once this primary is
    fenced, held back in ``async`` while the standby lags past the bound, and in a remote level
    answered only once the standby acknowledged what it wrote (docs/replication.md, "On Ray")."""
    @functools.wraps(method)
    async def write(self: Any, *args: Any, **kwargs: Any) -> R:
        shipper = self._shipper
        if shipper is None:
            return await method(self, *args, **kwargs)
        shipper.start()
        await shipper.before_write()
        try:
            return await method(self, *args, **kwargs)
        finally:
            await shipper.after_write()

    return write


def _replacing_the_store(method: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """A method that replaces the actor's store (restore, promote): it holds the channel lock, so no
    :meth:`BufferActor.progress_channel` starts a channel on the store being replaced meanwhile."""
    @functools.wraps(method)
    async def replace(self: Any, *args: Any, **kwargs: Any) -> R:
        async with self._channel_lock:
            return await method(self, *args, **kwargs)

    return replace


# -- the actor -------------------------------------------------------------------------------------
class BufferActor:
    """The process that owns one kvckpt store; every method is one buffer operation.

    Start it with :func:`start_buffer_actor` (name, namespace, restarts, node pinning). On start
    the actor creates the store from ``config`` if the file does not exist, or opens it and runs
    live-store recovery to ``resume_version`` (a restart recovers to the store's own trainer
    version instead: the trainer is still running). The plan is kept for :meth:`recovery_plan`.

    Args:
        path: the store file, on a local disk of the node the actor runs on.
        config: a :class:`~kvckpt.BufferConfig` or its ``to_dict`` form, used only to create a
            new store (an existing store keeps its own config).
        resume_version: the trainer version to recover an existing store to on first start.
            Defaults to the store's trainer version.
        map_size: initial LMDB map size of a new store. Defaults to the store's default.
        max_workers: threads running transactions and row encoding. Defaults to 4.
        replication: make the store a replicated primary shipping its log to the standby actor
            this names, at its acknowledgement level (:class:`ReplicationConfig` or its dict); with
            ``standby``, what it ships to once promoted. Defaults to none.
        standby: start as a standby (:func:`start_standby_actor`): the actor holds ``path`` as a
            standby's file (installed from the primary's first snapshot) and answers only the
            replication calls and :meth:`promote` until it is promoted; a restart of a promoted
            one opens its file as the primary it became. Defaults to False.
        auto_promote: as a standby, promote itself once Ray declares the primary's node dead.
            Defaults to False.

    Raises (at creation, from the first call):
        RecoveryError: a restart found no store at ``path``, or the store fails verification.
        StoreLocked: another process holds the store open for writing.
    """

    def __init__(self, path: str, config: BufferConfig | Mapping[str, Any] | None = None, *,
                 resume_version: int | None = None, map_size: int | None = None,
                 max_workers: int = DEFAULT_WORKERS, replication: ReplicationConfig | Mapping[str, Any] | None = None,
                 standby: bool = False, auto_promote: bool = False) -> None:
        self.path = os.path.abspath(path)
        self.max_workers = max_workers
        context = ray.get_runtime_context()
        with warnings.catch_warnings():  # the property uses a deprecated accessor inside Ray
            warnings.simplefilter("ignore", DeprecationWarning)
            self.restarted = bool(context.was_current_actor_reconstructed)
        self.node_id = context.get_node_id()
        #: A new id per incarnation (and per restore): selections of an older one are void.
        self.session = uuid.uuid4().hex
        self._checkpoints: dict[str, CheckpointHandle] = {}
        self._plan: dict[str, Any] | None = None
        #: commit_many calls of this incarnation: calls, commits they carried, calls running now and at most;
        #: record_progress_steps calls and the messages they carried.
        self._calls = {"calls": 0, "commits": 0, "running": 0, "most_running": 0, "step_calls": 0, "step_messages": 0,
                       "step_calls_parked": 0, "step_calls_unparked_by_timeout": 0}
        #: Per record_progress_steps caller: the next sequence number to queue, and its waiters.
        self._order: dict[str, _ClientOrder] = {}
        self._async_buffer: AsyncReplayBuffer | None = None
        self._shipper: Shipper | None = None
        self._side: StandbySide | None = None
        self._successor: ReplicationConfig | None = None
        self.auto_promote = auto_promote
        self.promoted_at: float | None = None
        self.promoted_from: int | None = None
        self._watcher: asyncio.Task[None] | None = None
        #: The direct progress channel's server, started by the first progress_channel() (not on a
        #: standby or a replicated primary); closed and dropped by close, restore and promote.
        self._channel: ChannelServer | None = None
        self._channel_lock = asyncio.Lock()
        replication = ReplicationConfig.of(replication)
        if standby:
            with contextlib.suppress(NotStandby):  # a promoted standby's restart: it is the primary now
                self._side = StandbySide(self.path)
                self._successor = replication  # what it ships to once promoted
                return
        if os.path.exists(self.path):
            buffer = ReplayBuffer.open(self.path)
            try:
                plan = buffer.recover(None if self.restarted else resume_version)
            except BaseException:
                buffer.close()
                raise
            self._plan = plan_to_dict(plan)
        elif self.restarted:
            raise RecoveryError(f"the buffer actor restarted on node {self.node_id} but {self.path!r} does not "
                                "exist there; pin the actor to the node that holds the store")
        elif config is None:
            raise BadArgument(f"{self.path!r} does not exist and no config was given to create it")
        else:
            if not isinstance(config, BufferConfig):
                config = BufferConfig.from_dict(config)
            buffer = ReplayBuffer.create(self.path, config, map_size=map_size)
        self._abuf = AsyncReplayBuffer(buffer, max_workers=max_workers)
        self._replicate(replication)

    def _replicate(self, replication: ReplicationConfig | None) -> None:
        """Make the open store a replicated primary shipping to ``replication``'s standby (none: nothing)."""
        if replication is not None:
            enable_replication(self._abuf.buffer)
            self._shipper = Shipper(self._abuf.buffer, replication, self.node_id)

    @property
    def _abuf(self) -> AsyncReplayBuffer:
        if self._async_buffer is None:
            raise NotPrimary(f"the actor of {self.path!r} is a standby: it serves the buffer once promoted")
        return self._async_buffer

    @_abuf.setter
    def _abuf(self, value: AsyncReplayBuffer) -> None:
        self._async_buffer = value

    # -- replication -----------------------------------------------------------------------------
    async def replica_status(self) -> dict[str, Any] | None:
        """As a standby: its role, epoch, ``applied`` sequence and ``store_tag``, ``None`` before
        its first snapshot. As a primary: its :func:`kvckpt.replication_status` (``role``
        ``primary``), with the shipper's view when it replicates (``acked``, ``lag_records``,
        ``lag_s``, ``connected``, ``fenced``, ``ack``)."""
        if self._side is not None:
            self._watch()
            return self._side.status()
        status = replication_status(self._abuf.buffer)
        if status is not None and self._shipper is not None:
            status = {**status, **self._shipper.lag()}
        return status

    async def replica_lags(self) -> list[float]:
        """As a replicating primary: the seconds from each write's answer to the standby's
        acknowledgement of it, since the last call (empty when it ships to no standby)."""
        return [] if self._shipper is None else self._shipper.take_lags()

    async def apply_log(self, records: Sequence[bytes]) -> int:
        """As a standby: apply a shipped batch in one durable transaction (see :meth:`kvckpt.Standby.apply`).

        Raises:
            NotStandby: this actor is a primary (promoted: the sender is an old primary).
            LogGap: no snapshot installed yet, or the batch does not continue what is applied.
            CorruptLogRecord, ForeignStore, StaleEpoch, RepeatedSequence: the batch is refused.
        """
        side = self._standby_side()
        return await asyncio.to_thread(side.apply, records)

    async def receive_snapshot(self, token: str, offset: int, data: bytes) -> None:
        """As a standby: one chunk of a snapshot the primary is copying here."""
        side = self._standby_side()
        await asyncio.to_thread(side.receive, token, offset, data)

    async def install_snapshot(self, token: str, size: int) -> int:
        """As a standby: install the snapshot received under ``token``; returns the sequence it holds."""
        side = self._standby_side()
        return await asyncio.to_thread(side.install, token, size)

    async def watch_primary(self, node_id: str) -> None:
        """As a standby: the node of the primary that ships here (watched for automatic promotion)."""
        self._standby_side().primary_node = node_id
        self._watch()

    @_replacing_the_store
    async def promote(self, resume_version: int | None = None) -> dict[str, Any]:
        """Promote this standby to the primary (see :func:`kvckpt.promote`: a new epoch, then
        recovery as a restart runs it); returns the recovery plan (its ``leases`` are the in-flight
        prompts to redispatch, each once). From then on the actor serves the buffer and the old
        primary's shipments are refused. It ships its log to the standby named by the
        ``replication`` it was started with (:func:`start_standby_actor`), at that level, from a
        snapshot (a new standby is empty); without one it ships to no standby.

        Raises:
            NotStandby: this actor is a primary already.
        """
        side = self._standby_side()
        await self._close_channel()
        self._side = None
        self.promoted_from = side.standby.applied if side.standby is not None else None
        buffer, plan = await asyncio.to_thread(side.promote, resume_version)
        self._abuf = AsyncReplayBuffer(buffer, max_workers=self.max_workers)
        self._replicate(self._successor)
        self.session = uuid.uuid4().hex
        self._plan = plan_to_dict(plan)
        self.promoted_at = time.time()
        return self._plan

    def _standby_side(self) -> StandbySide:
        if self._side is None:
            raise NotStandby(f"the actor of {self.path!r} is a primary: it applies no shipped log (a sender of one "
                             "is an old primary)")
        return self._side

    def _watch(self) -> None:
        if self.auto_promote and self._watcher is None and self._side is not None:
            self._watcher = asyncio.ensure_future(self._watch_primary())

    async def _watch_primary(self) -> None:
        while self._side is not None:
            node = self._side.primary_node
            if node is not None and not await asyncio.to_thread(node_alive, node):
                with contextlib.suppress(NotStandby):
                    await self.promote()
                return
            await asyncio.sleep(WATCH_PERIOD_S)

    # -- identity and recovery -------------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        """Where and what this incarnation is: path, pid, node id, session, restarted, the
        buffer's config (what a producer needs to encode rows itself: ``RowEncoder.from_config``;
        ``None`` on a standby), ``role`` (``primary`` or ``standby``), ``epoch`` (``None`` when not
        replicated), ``promoted_at`` (when this incarnation was promoted, wall clock) and
        ``promoted_from`` (the sequence it had applied then)."""
        primary = self._async_buffer is not None
        status = replication_status(self._abuf.buffer) if primary else (self._side and self._side.status())
        return {"path": self.path, "pid": os.getpid(), "node_id": self.node_id, "session": self.session,
                "restarted": self.restarted, "config": self._abuf.buffer.config.to_dict() if primary else None,
                "role": "primary" if primary else "standby", "epoch": status and status["epoch"],
                "promoted_at": self.promoted_at, "promoted_from": self.promoted_from}

    async def recovery_plan(self) -> dict[str, Any] | None:
        """The plan of the recovery this incarnation ran on start (or of the last
        :meth:`restore`/:meth:`recover`), ``None`` if it created a new store. Its ``leases`` are
        the in-flight prompts to redispatch, each once."""
        return self._plan

    @_replicated
    async def recover(self, resume_version: int | None = None, sampler: Any = None,
                      max_buffered_rollouts: int | None = None, checksums: bool = False,
                      deep: bool = False) -> dict[str, Any]:
        """Reconcile the live store to ``resume_version`` (see :meth:`kvckpt.ReplayBuffer.recover`); the
        plan is kept for :meth:`recovery_plan`."""
        plan = await self._abuf.recover(resume_version, sampler=sampler, max_buffered_rollouts=max_buffered_rollouts,
                                        checksums=checksums, deep=deep)
        self._plan = plan_to_dict(plan)
        return self._plan

    @_replacing_the_store
    async def restore(self, checkpoint_file: str, sampler: Any = None,
                      max_buffered_rollouts: int | None = None) -> dict[str, Any]:
        """Replace the live store with a checkpoint file (see :func:`kvckpt.restore`).

        Calls running meanwhile fail with a closed-store error; selections made before are void
        (a new session). If the checkpoint is refused the live store is reopened unchanged. The
        progress channel is closed first (its connections with it) and the next
        :meth:`progress_channel` starts a new one with a new token: no connection of before writes
        into the restored store.
        """
        await self._close_channel()
        await self._abuf.close()
        try:
            buffer, plan = await asyncio.to_thread(restore, checkpoint_file, self.path, sampler=sampler,
                                                   max_buffered_rollouts=max_buffered_rollouts, overwrite=True)
        except BaseException:
            self._abuf = AsyncReplayBuffer(await asyncio.to_thread(ReplayBuffer.open, self.path),
                                           max_workers=self.max_workers)
            raise
        self._abuf = AsyncReplayBuffer(buffer, max_workers=self.max_workers)
        if self._shipper is not None:  # a new history (the restore drew it): the standby takes a snapshot
            await self._shipper.stop()
            enable_replication(buffer)
            self._shipper = Shipper(buffer, self._shipper.config, self.node_id)
        self.session = uuid.uuid4().hex
        self._plan = plan_to_dict(plan)
        return self._plan

    # -- producers -------------------------------------------------------------------------------
    @_replicated
    async def commit_many(self, items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any] | BaseException]:
        """Commit several groups (or samples) in one call and one durable transaction (group
        commit), each its own transition.

        Each item is ``{"lease": dict, "rows": rows, "end_weight": int | None}``, plus
        ``"index": i`` for a single-row commit (then ``rows`` is that row), or, from a producer that
        encodes at the edge, ``"encoded": [{"index", "value"}, ...]`` instead of ``rows`` (checked,
        not re-encoded: :meth:`kvckpt.ReplayBuffer.commit_encoded`). The result list holds,
        in item order, each commit's result dict or the exception that refused it (nothing of a
        refused item was written). Concurrent calls from several producers share transactions too.
        """
        calls = self._calls
        calls["calls"] += 1
        calls["commits"] += len(items)
        calls["running"] += 1
        calls["most_running"] = max(calls["most_running"], calls["running"])
        try:
            return await self._commit_items(items)
        finally:
            calls["running"] -= 1

    async def _commit_items(self, items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any] | BaseException]:
        parsed = _with_leases(items, "commit")
        good = [p for p in parsed if not isinstance(p, BaseException)]
        results = iter(await self._abuf.commit_many(good))
        out: list[dict[str, Any] | BaseException] = []
        for p in parsed:
            result = p if isinstance(p, BaseException) else next(results)
            out.append(result if isinstance(result, BaseException) else result.to_dict())
        return out

    @_replicated
    async def record_progress_many(self, items: Sequence[Mapping[str, Any]]) -> list[int | BaseException]:
        """Record chunks of token progress in one call and one durable transaction (group commit),
        each its own transition (see :meth:`kvckpt.ReplayBuffer.record_progress_many`). Each item
        holds ``record_progress``'s keyword arguments plus ``lease`` (a dict) and ``index``; the
        result list holds, in item order, each durable prefix length or the exception that refused
        the item (nothing of it was written). One call per engine step carries all its sequences."""
        parsed = _with_leases(items, "progress")
        good = [p for p in parsed if not isinstance(p, BaseException)]
        results = iter(await self._abuf.record_progress_many(good))
        return [p if isinstance(p, BaseException) else next(results) for p in parsed]

    @_replicated
    async def record_progress_steps(self, messages: Sequence[bytes], client: str | None = None, seq: int = 0,
                                    oldest: int = 0, wait: float = ORDER_WAIT_S,
                                    ) -> list[list[int | BaseException] | BaseException]:
        """Record progress step messages (:class:`~kvckpt.ProgressMessage` bytes, one engine step of
        one producer each) in one call and one durable transaction (group commit), each sequence its
        own transition (see :meth:`kvckpt.ReplayBuffer.record_progress_steps`). Returns, per message,
        its per-sequence results (where each chunk ends, or the exception that refused the sequence)
        or the :class:`~kvckpt.MalformedMessage` that refused it whole. Resending the same bytes
        after a restart returns the same results for the sequences that had landed.

        Per-caller order: Ray may run an async actor's calls out of submission order, so a caller
        that pipelines calls tags each with its ``client`` id, its sequence number ``seq`` and the
        ``oldest`` sequence number it still has unacknowledged. Calls of one client are queued for
        the store in ``seq`` order: a call waits (at most ``wait`` seconds, then goes ahead) until
        every earlier call of its client was queued, or is at or below the ``oldest`` the client
        still awaits (a restarted actor starts there). A call below the next expected number (a
        resend of one that ran) goes at once; the store answers it as it answered the first try.
        Without ``client`` the call is queued as it arrives."""
        calls = self._calls
        calls["step_calls"] += 1
        calls["step_messages"] += len(messages)
        if client is None:
            return await self._abuf.record_progress_steps(list(messages))
        order = self._order.get(client)
        if order is None:
            order = self._order[client] = _ClientOrder(oldest, asyncio.Condition())
        async with order.ready:
            order.expected = max(order.expected, oldest)
            if seq > order.expected:
                calls["step_calls_parked"] += 1
                try:
                    await asyncio.wait_for(order.ready.wait_for(lambda: seq <= order.expected), wait)
                except asyncio.TimeoutError:  # a predecessor was lost: go ahead, the gap refusal tells the truth
                    calls["step_calls_unparked_by_timeout"] += 1
            # The task queues the messages in the batcher at its first step, which the loop runs
            # before any call woken below can queue its own (the ready queue is FIFO).
            queued = asyncio.ensure_future(self._abuf.record_progress_steps(list(messages)))
            order.expected = max(order.expected, seq + 1)
            order.ready.notify_all()
        return await queued

    async def progress_channel(self) -> dict[str, Any] | None:
        """The direct progress channel into this process (:mod:`kvckpt.integrations.ray.channel`):
        ``{"host", "port", "token", "max_frame"}``, started on the first call, on the node's IP as Ray
        knows it. Each round of its one server thread records every message that arrived in one
        :meth:`kvckpt.ReplayBuffer.record_progress_steps` (one durable transaction), answered as
        :meth:`record_progress_steps` answers. The token is new per incarnation, restore and
        promotion. ``None`` on a standby and on a replicated primary (fenced or not): their writes
        pass the shipper (:func:`_replicated`), so producers use :meth:`record_progress_steps`."""
        async with self._channel_lock:  # not while a restore or promotion replaces the store
            if self._side is not None or self._shipper is not None:
                return None
            if self._channel is None or not self._channel.alive:
                await self._close_channel()
                self._channel = ChannelServer(self._abuf.buffer.record_progress_steps,
                                              ray.util.get_node_ip_address())
            return self._channel.info()

    async def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await asyncio.to_thread(channel.close)

    async def progress(self, group_id: str) -> dict[int, dict[str, Any]]:
        """A group's durable token prefixes: ``{index: {"tokens", "logprobs", "versions", "fields"}}``
        with numpy payloads (see :meth:`kvckpt.ReplayBuffer.progress`;
        :func:`kvckpt.integrations.ray.client.progress_from_dict` rebuilds them)."""
        return progress_to_dict(await self._abuf.progress(group_id))

    # -- trainer ---------------------------------------------------------------------------------
    @_replicated
    async def select(self, min_groups: int = 1, max_groups: int | None = None) -> dict[str, Any]:
        """Claim groups for the current step; the dict carries this incarnation's ``session``."""
        selection = await self._abuf.select(min_groups, max_groups)
        return {**selection.to_dict(), "session": self.session}

    @_replicated
    async def claim(self, group_ids: Iterable[str]) -> dict[str, Any]:
        """Claim exactly the named ready groups (see :meth:`kvckpt.ReplayBuffer.claim`); the dict carries
        this incarnation's ``session``, as :meth:`select`'s."""
        selection = await self._abuf.claim(list(group_ids))
        return {**selection.to_dict(), "session": self.session}

    @_replicated
    async def finish_step(self, weight_version: int | None = None, session: str | None = None) -> int:
        """Close the current step; returns the new trainer version.

        Pass the ``session`` of the step's selection: if the actor restarted since (recovery
        returned that step's claims to ready), the call is refused with
        :class:`~kvckpt.StaleAttempt` and nothing is written, instead of closing an empty step.
        """
        if session is not None and session != self.session:
            raise StaleAttempt(f"the selection belongs to buffer session {session}, but the buffer restarted or was "
                               f"restored since (session {self.session}); recovery returned its groups to ready: "
                               "select again before finishing the step")
        return await self._abuf.finish_step(weight_version=weight_version)

    # -- checkpoints -----------------------------------------------------------------------------
    @_replicated
    async def checkpoint(self, dest: str, trainer_state: Mapping[str, Any] | None = None, overwrite: bool = False,
                         wait: bool = True) -> dict[str, Any]:
        """Stamp a checkpoint and copy it to ``dest`` (a path on the actor's node).

        With ``wait`` the call returns once the file is complete: ``{"checkpoint_id", "done":
        True, "result": CheckpointResult as dict}``. Without it, it returns ``{"checkpoint_id"}``
        right after the stamp; poll :meth:`checkpoint_status` with the id.

        Raises:
            CheckpointError: the destination is unusable, or (``wait``) the copy failed.
        """
        handle = await self._abuf.checkpoint(dest, trainer_state, overwrite=overwrite)
        self._checkpoints[handle.checkpoint_id] = handle
        if not wait:
            return {"checkpoint_id": handle.checkpoint_id}
        return await self.checkpoint_status(handle.checkpoint_id, wait=True)

    async def checkpoint_status(self, checkpoint_id: str, wait: bool = False) -> dict[str, Any]:
        """Whether a checkpoint started with ``wait=False`` has finished (``wait``: until it has).

        A finished checkpoint is reported once, then forgotten.

        Raises:
            CheckpointError: the copy failed; no file carries the final name.
            BadArgument: unknown id (already reported, or started by an earlier incarnation,
                whose copy died with it).
        """
        handle = self._checkpoints.get(checkpoint_id)
        if handle is None:
            raise BadArgument(f"unknown checkpoint id {checkpoint_id!r}: already reported, or started before the "
                              "actor restarted (that copy died with it; take a new checkpoint)")
        if not wait and not handle.done():
            return {"checkpoint_id": checkpoint_id, "done": False}
        try:
            result = await self._abuf.wait_checkpoint(handle)
        finally:
            self._checkpoints.pop(checkpoint_id, None)
        return {"checkpoint_id": checkpoint_id, "done": True, "result": dataclasses.asdict(result)}

    # -- inspection ------------------------------------------------------------------------------
    async def stats(self) -> dict[str, Any]:
        """Counters, counts and commit latencies (see :meth:`kvckpt.ReplayBuffer.stats`: its
        ``commit_transactions`` / ``commit_transitions`` are the group committer's durable
        transactions and the commits they held), plus this incarnation's :meth:`commit_many`
        calls: ``actor_commit_calls``, ``actor_commit_call_commits`` (commits they carried),
        ``actor_commit_calls_most_running`` (the most calls in progress at once: calls overlap
        when above 1) and ``actor_max_workers`` (threads that run them); and its
        :meth:`record_progress_steps` calls and the messages they carried (``actor_step_calls``,
        ``actor_step_messages``), the calls that waited for an earlier call of their client
        (``actor_step_calls_parked``) and those of them whose wait expired
        (``actor_step_calls_unparked_by_timeout``); the progress channel's record calls and the messages
        they carried (``actor_channel_rounds``, ``actor_channel_messages``; of its current server)."""
        calls, channel = self._calls, self._channel
        return {**await self._abuf.stats(), "actor_commit_calls": calls["calls"],
                "actor_commit_call_commits": calls["commits"], "actor_commit_calls_most_running": calls["most_running"],
                "actor_max_workers": self.max_workers, "actor_step_calls": calls["step_calls"],
                "actor_step_messages": calls["step_messages"], "actor_step_calls_parked": calls["step_calls_parked"],
                "actor_step_calls_unparked_by_timeout": calls["step_calls_unparked_by_timeout"],
                "actor_channel_rounds": channel.rounds if channel else 0,
                "actor_channel_messages": channel.messages if channel else 0}

    async def verify(self, deep: bool = False) -> dict[str, Any]:
        """Run :func:`kvckpt.durability.verify.check` on a snapshot of the live store; the report as a dict."""
        store = self._abuf.buffer.store
        report = await asyncio.to_thread(store.read, lambda txn: check(txn, deep=deep))
        return report.to_dict()

    async def close(self) -> None:
        """Close the store (after running transactions and checkpoint copies). Later calls fail;
        call before ``ray.kill`` for a clean shutdown (a kill is safe too: every acknowledged
        call is durable). A standby closes its file. The progress channel closes first."""
        await self._close_channel()
        if self._shipper is not None:
            await self._shipper.stop()
        if self._side is not None:
            self._side.close()
            return
        await self._abuf.close()


# -- made from the operation table -----------------------------------------------------------------
def remote_method(row: Operation) -> Callable[..., Any]:
    """The actor's method of one operation of :data:`kvckpt.buffer.surface.TABLE`: a coroutine that takes
    :class:`~kvckpt.ReplayBuffer`'s parameters (each also by position: a Ray call passes them either
    way), rebuilds the arguments the row names a codec for, runs the operation on the actor's
    :class:`~kvckpt.AsyncReplayBuffer` and returns its result through the row's result codec
    (:data:`kvckpt.integrations.ray.wire.CODECS`)."""
    name = row.name
    reference = signature(name)
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD,
                  annotation=CODECS[row.args[p.name]].wire if p.name in row.args else p.annotation)
        for p in reference.parameters.values()]
    result = CODECS[row.result]
    remote = reference.replace(parameters=params, return_annotation=result.wire or reference.return_annotation)

    async def method(self: BufferActor, *args: Any, **kwargs: Any) -> Any:
        arguments = remote.bind(self, *args, **kwargs).arguments
        del arguments["self"]
        for param, codec in row.args.items():
            if param in arguments:
                arguments[param] = CODECS[codec].from_wire(arguments[param])
        return result.to_wire(await getattr(self._abuf, name)(**arguments))

    wire = ", ".join(f"``{param}`` as {codec}" for param, codec in row.args.items())
    method.__name__, method.__qualname__, method.__module__ = name, f"BufferActor.{name}", __name__
    method.__doc__ = (f"{summary(name)}\n\nOn the actor: " + (f"arguments {wire}; " if wire else "")
                      + f"the result crosses the wire as {row.result} (:data:`kvckpt.integrations.ray.wire.CODECS`). "
                      f"See :meth:`kvckpt.ReplayBuffer.{name}`.")
    method.__signature__ = remote  # type: ignore[attr-defined]
    method.__annotations__ = {p.name: p.annotation for p in params[1:]} | {"return": remote.return_annotation}
    return mark_generated(_replicated(method) if row.writes else method)


for _row in offered_by("actor", GENERATED):
    if _row.name in vars(BufferActor):
        raise TypeError(f"BufferActor.{_row.name} is written by hand, but the table says it is generated")
    setattr(BufferActor, _row.name, remote_method(_row))
BufferActor = ray.remote(BufferActor)  # after the table's methods: Ray reads the class's methods here


def _with_leases(items: Sequence[Mapping[str, Any]], what: str) -> list[Any]:
    """Each item with its ``lease`` dict rebuilt as a :class:`~kvckpt.Lease`, or the error that
    refuses a malformed item (in item order)."""
    parsed: list[Any] = []
    for item in items:
        try:
            parsed.append({**item, "lease": Lease.from_dict(dict(item["lease"]))})
        except (KvckptError, KeyError, TypeError) as exc:
            parsed.append(exc if isinstance(exc, KvckptError) else BadArgument(f"malformed {what} item: {exc!r}"))
    return parsed


def start_buffer_actor(path: str, config: BufferConfig | Mapping[str, Any] | None = None, *,
                       name: str = DEFAULT_NAME, namespace: str | None = None, max_restarts: int = 3,
                       detached: bool = False, node_id: str | None = None, resources: Mapping[str, float] | None = None,
                       num_cpus: float = 0, resume_version: int | None = None, map_size: int | None = None,
                       max_workers: int = DEFAULT_WORKERS, get_if_exists: bool = True,
                       replication: ReplicationConfig | Mapping[str, Any] | None = None) -> Any:
    """Start (or find) the named buffer actor and return its handle.

    Args:
        path: the store file on the node the actor runs on.
        config: creates the store if the file does not exist.
        name: the actor's name; drivers find it with ``ray.get_actor(name, namespace=...)``.
            Defaults to :data:`DEFAULT_NAME`.
        namespace: the namespace of the name. Defaults to the driver's namespace.
        max_restarts: process restarts Ray attempts after the actor dies. Defaults to 3.
        detached: keep the actor alive when the driver that started it exits (a reconnecting
            driver finds it by name). Defaults to False.
        node_id: pin the actor to this node (the one whose disk holds the store). A restart is
            then never scheduled elsewhere. Defaults to no pinning.
        resources: custom resources the actor needs (another way to pin it). Defaults to none.
        num_cpus: CPUs reserved for the actor. Defaults to 0 (its work is I/O and encoding).
        resume_version, map_size, max_workers: passed to :class:`BufferActor`.
        get_if_exists: return the running actor of that name instead of failing. Defaults to True.
        replication: replicate to a standby actor (:func:`start_standby_actor`) at an
            acknowledgement level (:class:`~kvckpt.integrations.ray.replication.ReplicationConfig`
            or its dict; docs/replication.md, "On Ray"). Defaults to none.

    .. note::
       Ray does not resubmit calls that were running when the actor died (``max_task_retries``
       stays 0): whether such a commit landed is for the producer to find out by retrying it,
       which is idempotent (:class:`~kvckpt.integrations.ray.client.BufferClient` does this).
    """
    options = _placement(name, namespace, max_restarts, node_id, resources, num_cpus, get_if_exists)
    if detached:
        options["lifetime"] = "detached"
    config_of = ReplicationConfig.of(replication)
    return BufferActor.options(**options).remote(path, config, resume_version=resume_version, map_size=map_size,
                                                 max_workers=max_workers,
                                                 replication=None if config_of is None else config_of.to_dict())


def _placement(name: str, namespace: str | None, max_restarts: int, node_id: str | None,
               resources: Mapping[str, float] | None, num_cpus: float, get_if_exists: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"name": name, "max_restarts": max_restarts, "num_cpus": num_cpus,
                               "get_if_exists": get_if_exists}
    if namespace is not None:
        options["namespace"] = namespace
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    if resources:
        options["resources"] = dict(resources)
    return options


def start_standby_actor(path: str, *, name: str = DEFAULT_STANDBY_NAME, namespace: str | None = None,
                        node_id: str | None = None, resources: Mapping[str, float] | None = None,
                        auto_promote: bool = False, max_restarts: int = 3, num_cpus: float = 0,
                        max_workers: int = DEFAULT_WORKERS, get_if_exists: bool = True,
                        replication: ReplicationConfig | Mapping[str, Any] | None = None) -> Any:
    """Start (or find) a standby buffer actor holding ``path`` (on its own node's disk) and return
    its handle. It is empty until the primary it is named in (``replication={"standby": name}``
    of :func:`start_buffer_actor`) copies it a snapshot; then it applies the shipped log.

    Args:
        path: the standby's file on the node the actor runs on (pin it there with ``node_id`` or
            ``resources``: a restart elsewhere would start empty and take a new snapshot).
        name: the actor's name (the primary's ``ReplicationConfig.standby``, a
            :class:`~kvckpt.integrations.ray.BufferClient`'s ``failover``). Defaults to
            :data:`DEFAULT_STANDBY_NAME`.
        auto_promote: promote itself once Ray declares the primary's node dead. Defaults to False
            (call ``promote`` on it).
        replication: once promoted, replicate to the standby this names, at its level (as
            :func:`start_buffer_actor`'s ``replication``): its own successor, started with
            :func:`start_standby_actor` under that name, before or after the promotion (it catches
            up from a snapshot). A restart of the promoted actor keeps it. Defaults to none.
        namespace, node_id, resources, max_restarts, num_cpus, max_workers, get_if_exists: as
            :func:`start_buffer_actor`.
    """
    options = _placement(name, namespace, max_restarts, node_id, resources, num_cpus, get_if_exists)
    config_of = ReplicationConfig.of(replication)
    return BufferActor.options(**options).remote(path, None, max_workers=max_workers, standby=True,
                                                 auto_promote=auto_promote,
                                                 replication=None if config_of is None else config_of.to_dict())
