"""The caller's side of the buffer actor: pipelined producer commits and reply decoding.

A plain actor call costs a few milliseconds of Ray round trip, several times what the commit
transaction itself costs. :class:`BufferClient` amortises it: it packs ``batch_groups`` commits
into one :meth:`BufferActor.commit_many <kvckpt.integrations.ray.actor.BufferActor.commit_many>`
call (its items passed by value) and keeps up to ``max_in_flight`` calls outstanding, so the actor
always has work queued while acknowledgements travel back.

Exactly-once across actor failures: if the actor dies with a call in flight, the client waits for
the restarted actor and resends the *same* items (same rows, same leases). Commits that had landed
come back ``replayed=True`` (the core recognises an identical re-commit); commits that had not
landed are refused with :class:`~kvckpt.AbandonedTimeline` (a :class:`~kvckpt.StaleAttempt`),
because the restart's recovery moved their prompts to a new timeline: the driver redispatches them
from the actor's ``recovery_plan()``. With ``failover`` names, the same resend goes to a promoted
standby once the actor is gone for good or answers that it was replaced (docs/replication.md, "On Ray").

The module is long (about 500 lines) because the client carries the producer's whole side of the
wire: pipelined commits and step messages with their order tags, restart resends and failover (one
state machine over the same calls in flight), the step messages it builds from
``record_progress_many``'s items, and the decoding of the actor's replies. With ``channel=True`` the
step messages go over the actor's direct progress channel instead
(:mod:`kvckpt.integrations.ray.channel_link`)."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import ray
from kvckpt.integrations.ray.channel_link import ChannelGone, ChannelLink
from kvckpt.integrations.ray.wire import batch_from_dict as batch_from_dict  # public here too
from kvckpt.integrations.ray.wire import lease_dict as _lease_dict
from kvckpt.integrations.ray.wire import plan_from_dict as plan_from_dict  # public here too
from kvckpt.integrations.ray.wire import progress_from_dict, to_wire
from ray.exceptions import ActorUnschedulableError, GetTimeoutError, RayActorError

from kvckpt import (
    CommitResult,
    Lease,
    Progress,
    ProgressEncoder,
    ProgressMessage,
    RowEncoder,
)
from kvckpt.errors import BadArgument, ChannelError, KvckptError, NotPrimary

#: Seconds one look at an actor (the failed one, a failover candidate) waits for its answer.
FAILOVER_POLL_S = 1.0


class ClientFuture(Future):
    """A :class:`~concurrent.futures.Future` of a :class:`BufferClient` that completes on its own
    when waited on: :meth:`result` and :meth:`exception` first drive the client (send the queued
    call that carries this item and reap the calls ahead of it and its own, in order, with the
    client's retries) until this future is done, so a producer that waits without
    :meth:`BufferClient.flush` never hangs. The drive blocks until the owner answers (or the
    retries are spent), then ``timeout`` applies. ``concurrent.futures.wait``, ``as_completed`` and
    done-callbacks do not drive: call :meth:`BufferClient.flush` first, or wait with :meth:`result`."""

    def __init__(self, drive: Callable[[Future[Any]], None]) -> None:
        super().__init__()
        self._drive = drive

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._drive(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self._drive(self)
        return super().exception(timeout)


@dataclass
class _Call:
    payload: Any  # the items, resent as they are after an actor restart
    futures: list[Future[Any]]
    result: Any  # ObjectRef of the reply
    attempts: int = 1
    method: str = "commit_many"  # the actor method the payload is (re)sent to
    seq: int | None = None  # a progress call's sequence number (record_progress_steps' order tag)


class BufferClient:
    """Batched, pipelined, retrying commits through a buffer actor, for one producer.

    :meth:`commit` queues a group and returns a :class:`~concurrent.futures.Future` of its
    :class:`~kvckpt.CommitResult`. Every ``batch_groups`` queued commits go out as one call; at
    most ``max_in_flight`` calls are outstanding (the oldest is awaited before another is sent).
    Futures complete while :meth:`commit`, :meth:`commit_sample` or :meth:`flush` run, and when
    waited on: their :meth:`~ClientFuture.result` sends what carries them and reaps the replies
    (:class:`ClientFuture`), so waiting without :meth:`flush` never hangs. One client per producer
    thread (a future may be waited on from another thread: the client's state is locked).

    Args:
        actor: a :class:`~kvckpt.integrations.ray.actor.BufferActor` handle.
        batch_groups: commits per call. Defaults to 8.
        max_in_flight: calls outstanding at once. Defaults to 4.
        retries: resends of one call after the actor died under it. Defaults to 3.
        restart_timeout: seconds to wait for a restarted actor to answer before a resend.
            Defaults to 60.
        encode_at_edge: validate, encode, compress and checksum rows in this process (with the
            store's :class:`~kvckpt.storage.encoding.RowEncoder`, built from the actor's config) and send
            only record bytes; the actor checks them without re-encoding. A row the schema refuses
            fails its future at once, before anything is sent. Defaults to True.
        batch_steps: progress step messages (:meth:`record_progress_step`) per call. Defaults to 1
            (each engine step's message leaves at once; up to ``max_in_flight`` are outstanding).
        failover: names of standby actors (:func:`~kvckpt.integrations.ray.start_standby_actor`) to
            look up when the actor is gone for good or answers that it was replaced
            (:class:`~kvckpt.NotPrimary`): the first that is a primary of a newer epoch (promoted)
            becomes this client's actor, and the calls in flight are resent to it, with the same
            exactly-once answers as after a restart (docs/replication.md, "On Ray"). Defaults to none.
        namespace: the namespace of the ``failover`` names. Defaults to the driver's.
        channel: send :meth:`record_progress_step`'s messages over the actor's direct progress channel
            (:meth:`~kvckpt.integrations.ray.actor.BufferActor.progress_channel`, one connection, frames
            in order, up to ``max_in_flight`` unanswered; ``batch_steps`` does not apply) instead of
            actor calls: the owner pays a socket read per message, not a Ray call. After a broken
            connection the client asks the actor again (waiting for its restart, or a failover) and
            resends every unanswered message, exactly once as actor calls are. Where the actor offers no
            channel (a standby, a replicated primary) the actor calls are used. Defaults to False.

    Examples:
        >>> with BufferClient(actor, batch_groups=8, max_in_flight=4) as client:  # doctest: +SKIP
        ...     futures = [client.commit(lease, rows) for lease, rows in work]
        >>> [f.result().ready for f in futures]  # doctest: +SKIP
        [True, True, ...]
    """

    def __init__(self, actor: Any, *, batch_groups: int = 8, max_in_flight: int = 4, retries: int = 3,
                 restart_timeout: float = 60.0, encode_at_edge: bool = True, batch_steps: int = 1,
                 failover: Sequence[str] = (), namespace: str | None = None, channel: bool = False) -> None:
        if batch_groups < 1 or max_in_flight < 1 or retries < 0 or batch_steps < 1:
            raise BadArgument("batch_groups, batch_steps and max_in_flight must be >= 1 and retries >= 0")
        self.batch_steps = batch_steps
        self._pending_steps: list[tuple[bytes, Future[list[Any]]]] = []
        self._progress_encoder: ProgressEncoder | None = None
        self.actor = actor
        self.batch_groups = batch_groups
        self.max_in_flight = max_in_flight
        self.retries = retries
        self.restart_timeout = restart_timeout
        self._pending: list[tuple[dict[str, Any], Future[CommitResult]]] = []
        self._in_flight: deque[_Call] = deque()
        self._lock = threading.RLock()  # a ClientFuture may be waited on (and drive) from another thread
        #: record_progress_steps' order tag: this client's id and its next call's sequence number.
        self._client_id = uuid.uuid4().hex
        self._next_seq = 0
        self.failover, self.namespace = tuple(failover), namespace
        info = wait_for_actor(actor, restart_timeout)
        #: The replication epoch of the primary this client writes to (0 when not replicated).
        self.epoch: int = info.get("epoch") or 0
        self._encoder = RowEncoder.from_config(info["config"]) if encode_at_edge else None
        self._link: ChannelLink | None = None
        if channel:
            with contextlib.suppress(ChannelGone):  # not offered: actor calls
                self._link = ChannelLink(self._channel_info, max_in_flight=max_in_flight, retries=retries,
                                         timeout=restart_timeout)

    @property
    def channel(self) -> bool:
        """Whether progress step messages go over the actor's direct progress channel now."""
        return self._link is not None

    def commit(self, lease: Lease | Mapping[str, Any], rows: Sequence[Mapping[str, Any]] | Mapping[int, Any], *,
               end_weight: int | None = None) -> Future[CommitResult]:
        """Queue a group commit (see :meth:`kvckpt.ReplayBuffer.commit_group`).

        The future's exception is the kvckpt error that refused the commit (nothing of it was
        written), or the Ray error if the actor stayed unreachable through every retry.
        """
        return self._queue({"lease": _lease_dict(lease), "end_weight": end_weight}, rows)

    def commit_sample(self, lease: Lease | Mapping[str, Any], index: int, row: Mapping[str, Any], *,
                      end_weight: int | None = None) -> Future[CommitResult]:
        """Queue a single-row commit (see :meth:`kvckpt.ReplayBuffer.commit_sample`)."""
        return self._queue({"lease": _lease_dict(lease), "index": int(index), "end_weight": end_weight},
                           {int(index): row})

    def record_progress_step(self, step: ProgressMessage | bytes | Sequence[Mapping[str, Any]],
                             ) -> Future[list[int | BaseException]]:
        """Queue one engine step's progress: a :class:`~kvckpt.ProgressMessage` (built with
        :meth:`progress_encoder`), or :meth:`record_progress_many`'s items, encoded here into one.
        Every ``batch_steps`` queued messages go out as one actor call (one durable transaction
        with whatever else the owner is writing), pipelined like commits; the future's result is
        the per-sequence list of :meth:`kvckpt.ReplayBuffer.record_progress_step` (where each chunk
        ends, or the error that refused that sequence). Waiting on it (:meth:`ClientFuture.result`)
        sends it and reaps its reply: no :meth:`flush` is needed.

        In order: each call carries this client's id, its sequence number and the oldest call still
        unacknowledged, and the actor queues this client's calls for the store in that order (an
        async Ray actor may run them out of submission order), so an engine step's chunks are never
        judged before the previous step's.

        Exactly-once across an actor restart: a call the actor died under is resent with the same
        bytes; the sequences whose first try had landed return the same result, the others are
        refused as fenced (:class:`~kvckpt.AbandonedTimeline`: resume them from :meth:`progress`
        under the recovery plan's lease). The future's exception is a
        :class:`~kvckpt.MalformedMessage` (or the edge encoder's refusal) for the message as a whole,
        or the Ray error if the actor stayed unreachable through every retry.
        """
        future: Future[list[Any]] = ClientFuture(self._drive)
        if isinstance(step, (ProgressMessage, bytes, bytearray, memoryview)):
            value = bytes(step.value if isinstance(step, ProgressMessage) else step)
        else:
            try:
                value = self.progress_encoder().encode_items(step).value
            except KvckptError as exc:  # refused here, before it costs the owner anything
                future.set_exception(exc)
                return future
        with self._lock:
            if self._link is not None:
                self._over_channel(lambda link: link.send(value, future))
                return future
            self._pending_steps.append((value, future))
            if len(self._pending_steps) >= self.batch_steps:
                self._send_steps()
        return future

    def progress_encoder(self) -> ProgressEncoder:
        """The encoder of progress step messages for the actor's store (built from its config once)."""
        if self._progress_encoder is None:
            config = wait_for_actor(self.actor, self.restart_timeout)["config"]
            self._progress_encoder = ProgressEncoder.from_config(config)
        return self._progress_encoder

    def record_progress_many(self, items: Sequence[Mapping[str, Any]]) -> list[int | BaseException]:
        """Record chunks of token progress, e.g. every sequence of an engine step, as ONE step message
        built here (one per distinct set of per-token ``fields``, as :meth:`kvckpt.ReplayBuffer.record_progress_many`
        groups them) and sent as :meth:`record_progress_step` sends it; blocks until they are durable.
        Each item holds :meth:`kvckpt.ReplayBuffer.record_progress`'s keyword arguments plus ``lease``
        and ``index``; returns, in item order, where each chunk ends or the error that refused it (an
        item the encoder refuses is refused alone, the others are sent). Resends are the message's:
        exactly once across an actor restart (a sequence whose first try landed gets the same answer,
        the others are refused as fenced: resume them from :meth:`progress` under the recovery plan's
        lease).

        Raises:
            ray.exceptions.RayActorError: the actor stayed unreachable through every retry.
        """
        out: list[Any] = [None] * len(items)
        by_fields: dict[tuple[str, ...], list[int]] = {}
        for n, item in enumerate(items):
            try:
                by_fields.setdefault(tuple(sorted(item.get("fields") or ())), []).append(n)
            except (AttributeError, TypeError) as exc:
                out[n] = BadArgument(f"a record_progress_many item must be a mapping with a mapping of fields: {exc!r}")
        messages = [(ns, self._message(items, ns, out)) for ns in by_fields.values()]
        sent = [([n for n in ns if out[n] is None], self.record_progress_step(m))
                for ns, m in messages if m is not None]
        for ns, future in sent:
            try:
                results = future.result()
            except KvckptError as exc:  # the message as a whole (MalformedMessage)
                results = [exc] * len(ns)
            for n, result in zip(ns, results, strict=True):
                out[n] = result
        return out

    def _message(self, items: Sequence[Mapping[str, Any]], ns: list[int], out: list[Any]) -> Any:
        """The step message of ``items[n] for n in ns``; an item the encoder refuses gets its error in
        ``out`` and is left out (the rest are encoded again without it; ``None`` if none is left)."""
        encoder = self.progress_encoder()
        try:
            return encoder.encode_items([items[n] for n in ns])
        except KvckptError:
            for n in ns:
                try:
                    encoder.encode_items([items[n]])
                except KvckptError as exc:
                    out[n] = exc
            kept = [items[n] for n in ns if out[n] is None]
            return encoder.encode_items(kept) if kept else None

    def record_progress(self, lease: Lease | Mapping[str, Any], index: int, *, start: int, tokens: Any,
                        logprobs: Any, weight_version: int, fields: Mapping[str, Any] | None = None) -> int:
        """Record one chunk (see :meth:`kvckpt.ReplayBuffer.record_progress`) in one actor call."""
        [result] = self.record_progress_many([{"lease": lease, "index": index, "start": start, "tokens": tokens,
                                               "logprobs": logprobs, "weight_version": weight_version,
                                               "fields": fields}])
        if isinstance(result, BaseException):
            raise result
        return result

    def progress(self, lease_or_group_id: Lease | Mapping[str, Any] | str) -> dict[int, Progress]:
        """A group's durable token prefixes (see :meth:`kvckpt.ReplayBuffer.progress`)."""
        gid = lease_or_group_id if isinstance(lease_or_group_id, str) else _lease_dict(lease_or_group_id)["group_id"]
        return progress_from_dict(ray.get(self.actor.progress.remote(gid)))

    def flush(self) -> None:
        """Send what is queued and wait until every outstanding call is answered."""
        with self._lock:
            if self._link is not None:
                self._over_channel(lambda link: link.flush())
            self._send()
            self._send_steps()
            while self._in_flight:
                self._reap(self._in_flight.popleft())

    @property
    def outstanding(self) -> int:
        """Commits and progress messages queued or in flight (not yet acknowledged or refused)."""
        return (len(self._pending) + len(self._pending_steps) + sum(len(c.futures) for c in self._in_flight)
                + (self._link.outstanding if self._link is not None else 0))

    def close(self) -> None:
        """:meth:`flush`, then close the progress channel's connection (a later message reconnects)."""
        self.flush()
        if self._link is not None:
            self._link.close()

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------
    def _drive(self, future: Future[Any]) -> None:
        """Until ``future`` is done: send the queued call that carries it, then reap the calls in
        flight in order (those ahead of its own first, as :meth:`flush` would)."""
        with self._lock:
            if self._link is not None and self._link.holds(future):
                self._over_channel(lambda link: link.drive(future))
            if any(f is future for _, f in self._pending):
                self._send()
            if any(f is future for _, f in self._pending_steps):
                self._send_steps()
            while not future.done() and self._in_flight:
                self._reap(self._in_flight.popleft())

    def _channel_info(self) -> Mapping[str, Any] | None:
        """The actor's progress channel (``None``: not offered), once it answers again (after a
        restart; with ``failover``, a promoted standby's)."""
        if not self._actor_back():
            raise ChannelError(f"the buffer actor did not answer within {self.restart_timeout} s; its progress "
                               "channel is gone")
        return ray.get(self.actor.progress_channel.remote(), timeout=self.restart_timeout)

    def _over_channel(self, step: Callable[[ChannelLink], None]) -> None:
        """Run ``step`` on the channel; if the actor stopped offering one, resend what it held
        unanswered through actor calls, in order, and use those from now on."""
        assert self._link is not None
        try:
            step(self._link)
        except ChannelGone as gone:
            self._link = None
            self._call("record_progress_steps", gone.unanswered)

    def _queue(self, item: dict[str, Any], rows: Any) -> Future[CommitResult]:
        future: Future[CommitResult] = ClientFuture(self._drive)
        if self._encoder is None:
            item["rows"] = to_wire(rows[item["index"]] if "index" in item else rows)
        else:
            try:
                encoded = self._encoder.encode(Lease.from_dict(item["lease"]), rows)
            except KvckptError as exc:  # refused here, before it costs the owner anything
                future.set_exception(exc)
                return future
            item["encoded"] = [row.to_dict() for row in encoded]
        with self._lock:
            self._pending.append((item, future))
            if len(self._pending) >= self.batch_groups:
                self._send()
        return future

    def _send(self) -> None:
        pending, self._pending = self._pending, []
        self._call("commit_many", pending)

    def _send_steps(self) -> None:
        pending, self._pending_steps = self._pending_steps, []
        self._call("record_progress_steps", pending)

    def _call(self, method: str, pending: list[tuple[Any, Future[Any]]]) -> None:
        """Send ``pending`` (payload item, future) as one call of ``method``, at most ``max_in_flight`` out."""
        if not pending:
            return
        while len(self._in_flight) >= self.max_in_flight:
            self._reap(self._in_flight.popleft())
        items, futures = [i for i, _ in pending], [f for _, f in pending]
        call = _Call(items, futures, None, method=method)
        if method == "record_progress_steps":  # tagged: the actor queues this client's calls in order
            call.seq, self._next_seq = self._next_seq, self._next_seq + 1
        # By value, not ray.put: Ray inlines small items in the call (a put costs a round trip to the
        # object store and a fetch on the actor's side) and puts large ones in its store itself.
        call.result = self._remote(call)
        self._in_flight.append(call)

    def _remote(self, call: _Call) -> Any:
        """(Re)send ``call``; a progress call carries its order tag, with the oldest progress call
        still unacknowledged (``call`` itself or one in flight: where a restarted actor starts)."""
        if call.seq is None:
            return getattr(self.actor, call.method).remote(call.payload)
        oldest = min([call.seq] + [c.seq for c in self._in_flight if c.seq is not None])
        return getattr(self.actor, call.method).remote(call.payload, self._client_id, call.seq, oldest,
                                                       self.restart_timeout)

    def _reap(self, call: _Call) -> None:
        while True:
            try:
                replies = ray.get(call.result)
                break
            except (RayActorError, NotPrimary) as exc:  # the actor died with this call in flight (it may have
                # landed), or a promotion replaced it (the new primary answers what it ran)
                if call.attempts > self.retries or not self._back_after(exc):
                    _fail(call, exc)
                    return
                call.attempts += 1
                call.result = self._remote(call)
            except Exception as exc:  # the whole call was refused (e.g. its payload did not deserialise)
                _fail(call, exc)
                return
        for future, reply in zip(call.futures, replies, strict=True):
            if isinstance(reply, BaseException):
                future.set_exception(reply)
            else:
                future.set_result(CommitResult.from_dict(reply) if call.method == "commit_many" else reply)

    def _back_after(self, exc: BaseException) -> bool:
        """Whether a primary answers again after ``exc``: a promoted standby after a refusal as
        replaced, else the actor itself or (with ``failover``) a promoted standby."""
        return self._find_primary(self.restart_timeout) if isinstance(exc, NotPrimary) else self._actor_back()

    def _actor_back(self) -> bool:
        """Whether the actor answers again (restarted) or, with ``failover`` names, a promoted
        standby took its place, within ``restart_timeout``."""
        if not self.failover:
            try:
                wait_for_actor(self.actor, self.restart_timeout)
                return True
            except (RayActorError, ActorUnschedulableError, GetTimeoutError):
                return False
        deadline = time.monotonic() + self.restart_timeout
        while True:
            try:
                wait_for_actor(self.actor, FAILOVER_POLL_S)
                return True
            except (ActorUnschedulableError, RayActorError, GetTimeoutError):
                pass
            if self._find_primary(0.0):
                return True
            if time.monotonic() > deadline:
                return False

    def _find_primary(self, timeout: float) -> bool:
        """Look up the ``failover`` names (for ``timeout`` seconds, at least once) for a primary of
        a newer epoch than this client's; make it this client's actor."""
        deadline = time.monotonic() + timeout
        while True:
            for name in self.failover:
                try:
                    handle = ray.get_actor(name, namespace=self.namespace)
                    info = ray.get(handle.info.remote(), timeout=FAILOVER_POLL_S)
                except (ValueError, RayActorError, ActorUnschedulableError, GetTimeoutError):
                    continue  # not there (yet), or not answering
                if info["role"] == "primary" and (info["epoch"] or 0) > self.epoch:
                    self.actor, self.epoch = handle, info["epoch"]
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(FAILOVER_POLL_S / 4)


def holder_name(scope: str = "node") -> str:
    """The lease holder name of this Ray process (``admit(..., holder=...)``): ``node:<node id>`` (what
    dies with the node: ``leases_held_by`` after a node death) or, with ``scope="actor"``,
    ``actor:<actor id>`` (what dies with this actor; only inside one).

    Raises:
        BadArgument: an unknown ``scope``, or ``"actor"`` outside an actor.
    """
    context = ray.get_runtime_context()
    if scope == "node":
        return f"node:{context.get_node_id()}"
    actor_id = context.get_actor_id() if scope == "actor" else None
    if actor_id is None:
        raise BadArgument(f"holder_name: scope must be 'node' or 'actor' (inside an actor), got {scope!r}")
    return f"actor:{actor_id}"


def wait_for_actor(actor: Any, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the buffer actor answers (after a restart: its new incarnation) and return its
    ``info()``. Ray itself resubmits this read-only call until the restarted actor runs it
    (``max_task_retries=-1``: the call is retried across restarts, never polled here).

    Raises:
        RayActorError: the actor is dead for good (it has no restart left).
        ActorUnschedulableError: its restart can never run (it is pinned to a node that died).
        GetTimeoutError: no incarnation of the actor answered within ``timeout`` seconds.
    """
    return ray.get(actor.info.options(max_task_retries=-1).remote(), timeout=timeout)


def _fail(call: _Call, exc: BaseException) -> None:
    for future in call.futures:
        future.set_exception(exc)
