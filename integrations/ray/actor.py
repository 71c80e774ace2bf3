"""The buffer as a Ray actor: one process owns the store, producers and the trainer call it.

:class:`BufferActor` opens the store inside its own process (never inherited across ``fork``),
wraps it in :class:`~kvckpt.buffer.aio.AsyncReplayBuffer` and runs as an *async* actor: calls overlap,
transactions run on the facade's thread pool (serialised by the store's writer lock), and a gated
``admit`` waits on the event loop, so it never blocks the commits and ``finish_step`` that open
the gate.

What crosses the wire:

* leases, commit results, selections, group records and recovery plans as plain dicts (the
  records' ``to_dict``; rebuild them with ``from_dict`` or the helpers in
  :mod:`kvckpt.integrations.ray.client`);
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

The module is long (about 600 lines) because the actor mirrors the buffer's whole public API as
async methods, each with its wire conversion (leases, batches, plans as plain dicts) and its
restart behaviour (and the per-caller order of progress calls); the client side is
:mod:`kvckpt.integrations.ray.client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ray
from kvckpt.integrations.ray import LOOPBACK_ENV
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvckpt import (
    DEFAULT_WORKERS,
    Admission,
    AsyncReplayBuffer,
    Batch,
    BufferConfig,
    CheckpointHandle,
    Lease,
    RecoveryPlan,
    ReplayBuffer,
    check,
    restore,
)
from kvckpt.errors import BadArgument, KvckptError, RecoveryError, StaleAttempt

LOOPBACK = "127.0.0.1"
DEFAULT_NAME = "kvckpt-buffer"
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


# -- wire format -----------------------------------------------------------------------------------
def to_wire(value: Any) -> Any:
    """Rows (nested dicts/lists of tensors) with every CPU torch tensor replaced by a zero-copy
    numpy view, so Ray ships it out of band. Dtypes numpy lacks (bfloat16) stay torch tensors."""
    if isinstance(value, Mapping):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        tensor = value.detach().cpu()
        with contextlib.suppress(TypeError):
            return tensor.numpy()
        return tensor
    return value


def plan_to_dict(plan: RecoveryPlan) -> dict[str, Any]:
    """A recovery plan as a dict (leases as dicts); inverse of
    :func:`kvckpt.integrations.ray.client.plan_from_dict`."""
    return dataclasses.asdict(plan)


def batch_to_dict(batch: Batch) -> dict[str, Any]:
    """A batch with numpy payloads and dict group records (see
    :func:`kvckpt.integrations.ray.client.batch_from_dict`)."""
    return {"group_ids": batch.group_ids, "row_indices": batch.row_indices, "lengths": to_wire(batch.lengths),
            "tensors": to_wire(batch.tensors), "cu_seqlens": to_wire(batch.cu_seqlens),
            "rows": to_wire(batch.rows), "groups": [g.to_dict() for g in batch.groups]}


#: Seconds a tagged record_progress_steps call waits for its client's earlier calls before it goes ahead.
ORDER_WAIT_S = 60.0


@dataclasses.dataclass
class _ClientOrder:
    """One caller's next expected sequence number, and the condition its parked calls wait on."""

    expected: int
    ready: asyncio.Condition


# -- the actor -------------------------------------------------------------------------------------
@ray.remote
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

    Raises (at creation, from the first call):
        RecoveryError: a restart found no store at ``path``, or the store fails verification.
        StoreLocked: another process holds the store open for writing.
    """

    def __init__(self, path: str, config: BufferConfig | Mapping[str, Any] | None = None, *,
                 resume_version: int | None = None, map_size: int | None = None,
                 max_workers: int = DEFAULT_WORKERS) -> None:
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

    # -- identity and recovery -------------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        """Where and what this incarnation is: path, pid, node id, session, restarted, and the
        buffer's config (what a producer needs to encode rows itself: ``RowEncoder.from_config``)."""
        return {"path": self.path, "pid": os.getpid(), "node_id": self.node_id, "session": self.session,
                "restarted": self.restarted, "config": self._abuf.buffer.config.to_dict()}

    async def recovery_plan(self) -> dict[str, Any] | None:
        """The plan of the recovery this incarnation ran on start (or of the last
        :meth:`restore`/:meth:`recover`), ``None`` if it created a new store. Its ``leases`` are
        the in-flight prompts to redispatch, each once."""
        return self._plan

    async def recover(self, resume_version: int | None = None, sampler: Any = None,
                      max_buffered_rollouts: int | None = None) -> dict[str, Any]:
        """Reconcile the live store to ``resume_version`` (see :func:`kvckpt.recover`)."""
        plan = await self._abuf.recover(resume_version, sampler=sampler, max_buffered_rollouts=max_buffered_rollouts)
        self._plan = plan_to_dict(plan)
        return self._plan

    async def restore(self, checkpoint_file: str, sampler: Any = None,
                      max_buffered_rollouts: int | None = None) -> dict[str, Any]:
        """Replace the live store with a checkpoint file (see :func:`kvckpt.restore`).

        Calls running meanwhile fail with a closed-store error; selections made before are void
        (a new session). If the checkpoint is refused the live store is reopened unchanged.
        """
        await self._abuf.close()
        try:
            buffer, plan = await asyncio.to_thread(restore, checkpoint_file, self.path, sampler=sampler,
                                                   max_buffered_rollouts=max_buffered_rollouts, overwrite=True)
        except BaseException:
            self._abuf = AsyncReplayBuffer(await asyncio.to_thread(ReplayBuffer.open, self.path),
                                           max_workers=self.max_workers)
            raise
        self._abuf = AsyncReplayBuffer(buffer, max_workers=self.max_workers)
        self.session = uuid.uuid4().hex
        self._plan = plan_to_dict(plan)
        return self._plan

    # -- producers -------------------------------------------------------------------------------
    async def admit(self, prompts: Sequence[Any], dataloader_state: bytes | None = None,
                    timeout: float | None = None, weight_version: int | None = None,
                    admission: Mapping[str, Any] | None = None, holder: str | None = None) -> list[dict[str, Any]]:
        """Admit one dataloader batch (or join ``admission``, a dict from :meth:`advance_dispatch`)
        for the producer ``holder`` (:func:`holder_name` on a Ray producer); returns the leases as
        dicts (see :meth:`kvckpt.ReplayBuffer.admit`)."""
        joined = None if admission is None else Admission.from_dict(dict(admission))
        leases = await self._abuf.admit(prompts, dataloader_state, timeout=timeout, weight_version=weight_version,
                                        admission=joined, holder=holder)
        return [lease.to_dict() for lease in leases]

    async def advance_dispatch(self, dataloader_state: bytes | None = None,
                               timeout: float | None = None) -> dict[str, Any]:
        """Make an admission without prompts yet (see :meth:`kvckpt.ReplayBuffer.advance_dispatch`)."""
        return (await self._abuf.advance_dispatch(dataloader_state, timeout=timeout)).to_dict()

    async def redispatch(self, group_id: str, start_weight: int | None = None,
                         holder: str | None = None) -> dict[str, Any]:
        """Fence an in-flight prompt's lease and return a new one (see :meth:`kvckpt.ReplayBuffer.redispatch`)."""
        return (await self._abuf.redispatch(group_id, start_weight=start_weight, holder=holder)).to_dict()

    async def leases_held_by(self, holder: str) -> list[dict[str, Any]]:
        """The leases ``holder`` holds as dicts, in one read (see :meth:`kvckpt.ReplayBuffer.leases_held_by`)."""
        return [lease.to_dict() for lease in await self._abuf.leases_held_by(holder)]

    async def redispatch_held_by(self, holder: str, to: str | None = None,
                                 start_weight: int | None = None) -> list[dict[str, Any]]:
        """Redispatch what ``holder`` (a dead producer, a dead node) holds to ``to``, in one transaction;
        the new leases as dicts (see :meth:`kvckpt.ReplayBuffer.redispatch_held_by`)."""
        return [lease.to_dict() for lease in await self._abuf.redispatch_held_by(holder, to=to,
                                                                                 start_weight=start_weight)]

    async def commit_group(self, lease: Mapping[str, Any], rows: Any, end_weight: int | None = None,
                           ) -> dict[str, Any]:
        """Commit one group (see :meth:`kvckpt.ReplayBuffer.commit_group`); idempotent on retry."""
        result = await self._abuf.commit_group(Lease.from_dict(dict(lease)), rows, end_weight=end_weight)
        return result.to_dict()

    async def commit_sample(self, lease: Mapping[str, Any], index: int, row: Mapping[str, Any],
                            end_weight: int | None = None) -> dict[str, Any]:
        """Commit one row of a group (see :meth:`kvckpt.ReplayBuffer.commit_sample`)."""
        result = await self._abuf.commit_sample(Lease.from_dict(dict(lease)), index, row, end_weight=end_weight)
        return result.to_dict()

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

    async def record_progress(self, lease: Mapping[str, Any], index: int, start: int, tokens: Any, logprobs: Any,
                              weight_version: int, fields: Mapping[str, Any] | None = None) -> int:
        """Record one chunk of a sample's token progress (see :meth:`kvckpt.ReplayBuffer.record_progress`)."""
        return await self._abuf.record_progress(Lease.from_dict(dict(lease)), index, start=start, tokens=tokens,
                                                logprobs=logprobs, weight_version=weight_version, fields=fields)

    async def progress(self, group_id: str) -> dict[int, dict[str, Any]]:
        """A group's durable token prefixes: ``{index: {"tokens", "logprobs", "versions", "fields"}}``
        with numpy payloads (see :meth:`kvckpt.ReplayBuffer.progress`;
        :func:`kvckpt.integrations.ray.client.progress_from_dict` rebuilds them)."""
        found = await self._abuf.progress(group_id)
        return {i: to_wire({"tokens": p.tokens, "logprobs": p.logprobs, "versions": p.versions, "fields": p.fields})
                for i, p in found.items()}

    async def abort(self, group_id: str, reason: str) -> None:
        """Give up on an in-flight prompt (see :meth:`kvckpt.ReplayBuffer.abort`)."""
        await self._abuf.abort(group_id, reason)

    # -- trainer ---------------------------------------------------------------------------------
    async def select(self, min_groups: int = 1, max_groups: int | None = None) -> dict[str, Any]:
        """Claim groups for the current step; the dict carries this incarnation's ``session``."""
        selection = await self._abuf.select(min_groups, max_groups)
        return {**selection.to_dict(), "session": self.session}

    async def claim(self, group_ids: Iterable[str]) -> dict[str, Any]:
        """Claim exactly the named ready groups (see :meth:`kvckpt.ReplayBuffer.claim`); the dict carries
        this incarnation's ``session``, as :meth:`select`'s."""
        selection = await self._abuf.claim(list(group_ids))
        return {**selection.to_dict(), "session": self.session}

    async def release_claims(self, group_ids: Iterable[str]) -> list[str]:
        """Return claims of the current step to ready (see :meth:`kvckpt.ReplayBuffer.release_claims`)."""
        return await self._abuf.release_claims(list(group_ids))

    async def read_batch(self, groups: Iterable[str] | Mapping[str, Any], fields: Sequence[str] | None = None,
                         layout: str = "padded", pad_value: float = 0) -> dict[str, Any]:
        """Read the rows of ``groups`` (ids or a selection dict) as numpy payloads (see
        :func:`kvckpt.integrations.ray.client.batch_from_dict`)."""
        gids = [g["group_id"] for g in groups["groups"]] if isinstance(groups, Mapping) else list(groups)
        batch = await self._abuf.read_batch(gids, fields=fields, layout=layout, pad_value=pad_value)
        return batch_to_dict(batch)

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

    async def evict(self, group_ids: Iterable[str] | None = None) -> list[str]:
        """Remove out-of-window (or the named) ready groups (see :meth:`kvckpt.ReplayBuffer.evict`)."""
        return await self._abuf.evict(None if group_ids is None else list(group_ids))

    async def promote_ready_group(self, to_target_step: int) -> int | None:
        """See :meth:`kvckpt.ReplayBuffer.promote_ready_group`."""
        return await self._abuf.promote_ready_group(to_target_step)

    async def count_for_target_step(self, step: int) -> int:
        """In-flight plus ready groups stamped for ``step``."""
        return await self._abuf.count_for_target_step(step)

    async def abort_stale_inflight(self) -> list[str]:
        """Abort in-flight prompts the sampler says are useless now."""
        return await self._abuf.abort_stale_inflight()

    # -- checkpoints -----------------------------------------------------------------------------
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
        (``actor_step_calls_unparked_by_timeout``)."""
        calls = self._calls
        return {**await self._abuf.stats(), "actor_commit_calls": calls["calls"],
                "actor_commit_call_commits": calls["commits"], "actor_commit_calls_most_running": calls["most_running"],
                "actor_max_workers": self.max_workers, "actor_step_calls": calls["step_calls"],
                "actor_step_messages": calls["step_messages"], "actor_step_calls_parked": calls["step_calls_parked"],
                "actor_step_calls_unparked_by_timeout": calls["step_calls_unparked_by_timeout"]}

    async def state(self) -> dict[str, Any]:
        """Cursors, counts and counters (see :meth:`kvckpt.ReplayBuffer.state`)."""
        return await self._abuf.state()

    async def groups(self, states: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Group records as dicts, optionally filtered by state, in dispatch order."""
        return [g.to_dict() for g in await self._abuf.groups(None if states is None else list(states))]

    async def ledger(self) -> list[dict[str, Any]]:
        """In-flight ledger entries as dicts, in dispatch order."""
        return [e.to_dict() for e in await self._abuf.ledger()]

    async def verify(self, deep: bool = False) -> dict[str, Any]:
        """Run :func:`kvckpt.durability.verify.check` on a snapshot of the live store; the report as a dict."""
        store = self._abuf.buffer.store
        report = await asyncio.to_thread(store.read, lambda txn: check(txn, deep=deep))
        return report.to_dict()

    async def close(self) -> None:
        """Close the store (after running transactions and checkpoint copies). Later calls fail;
        call before ``ray.kill`` for a clean shutdown (a kill is safe too: every acknowledged
        call is durable)."""
        await self._abuf.close()


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
                       max_workers: int = DEFAULT_WORKERS, get_if_exists: bool = True) -> Any:
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

    .. note::
       Ray does not resubmit calls that were running when the actor died (``max_task_retries``
       stays 0): whether such a commit landed is for the producer to find out by retrying it,
       which is idempotent (:class:`~kvckpt.integrations.ray.client.BufferClient` does this).
    """
    options: dict[str, Any] = {"name": name, "max_restarts": max_restarts, "num_cpus": num_cpus,
                               "get_if_exists": get_if_exists}
    if namespace is not None:
        options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    if resources:
        options["resources"] = dict(resources)
    return BufferActor.options(**options).remote(path, config, resume_version=resume_version, map_size=map_size,
                                                 max_workers=max_workers)
