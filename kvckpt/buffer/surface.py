"""The replay buffer's public operations, declared once, in one typed table.

:data:`TABLE` holds one :class:`Operation` per public operation of :class:`~kvckpt.ReplayBuffer`: whether
it writes, the wire codec of its result and of the arguments that need one, and how each other surface
of the buffer offers it (:data:`SURFACES`: the asyncio facade :class:`~kvckpt.AsyncReplayBuffer`, the
Ray actor ``kvckpt.integrations.ray.BufferActor``, its producer client ``BufferClient`` and the
reference trainer's in-memory buffer): made from this table, written by hand, shaped differently (and
why), or not offered (and why). The arguments and the result type are ReplayBuffer's own signature
(:func:`signature`): the table never repeats them.

What is made from it: the facade's pass-through coroutines (:func:`kvckpt.buffer.aio.passthrough`) and
the actor's methods (one function over the table, with the codecs of
``kvckpt.integrations.ray.wire``). What checks it: ``tests/core/test_surfaces.py`` fails on a surface
that does not offer an operation as its row says, and the conformance suite drives every operation
on every surface that offers it (``kvckpt.testing.conformance.buffer.run_operation_scenarios``).

Adding a transition is one method on ReplayBuffer and one row here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: The surfaces besides ReplayBuffer, by the name the table's rows use.
SURFACES = ("async", "actor", "client", "memory")

GENERATED, HAND, DIFFERS, ABSENT = "generated", "hand", "differs", "absent"


@dataclass(frozen=True)
class Offer:
    """How one surface offers one operation.

    Attributes:
        how: :data:`GENERATED` (made from the table, shaped as ReplayBuffer's), :data:`HAND` (written
            by hand, shaped as ReplayBuffer's), :data:`DIFFERS` (written by hand, with other
            parameters) or :data:`ABSENT` (not offered).
        why: the reason for anything but :data:`GENERATED`: what the hand-written method does that a
            generated one cannot, how it differs, or why it is not offered.
    """

    how: str
    why: str = ""

    def __post_init__(self) -> None:
        if self.how not in (GENERATED, HAND, DIFFERS, ABSENT) or (self.how != GENERATED and not self.why):
            raise ValueError(f"an offer is one of generated/hand/differs/absent, and all but generated say why: {self}")

    @property
    def offered(self) -> bool:
        """Whether the surface has a method of the operation's name."""
        return self.how != ABSENT


def hand(why: str) -> Offer:
    """Written by hand, shaped as ReplayBuffer's (``why``: what it does that a generated method cannot)."""
    return Offer(HAND, why)


def differs(why: str) -> Offer:
    """Written by hand, with other parameters than ReplayBuffer's (``why``: how and why)."""
    return Offer(DIFFERS, why)


def absent(why: str) -> Offer:
    """Not offered (``why``: why not, and what to call instead)."""
    return Offer(ABSENT, why)


MADE = Offer(GENERATED)
#: What a row leaves unsaid: the facade and the actor make the operation from the table, the
#: in-memory buffer implements it on its dicts, the producer client does not carry it.
DEFAULTS = {"async": MADE, "actor": MADE, "memory": hand("the in-memory buffer's own implementation, on dicts"),
            "client": absent("a trainer-side operation: call it on the actor handle")}


@dataclass(frozen=True)
class Operation:
    """One row of :data:`TABLE`.

    Attributes:
        name: the ReplayBuffer member.
        writes: it runs a write transaction (or changes the handle): the facade wakes gate waiters after it.
        result: the wire codec of its result (a key of ``kvckpt.integrations.ray.wire.CODECS``).
        args: parameter -> wire codec, for the parameters that do not cross the wire as they are.
        wakes: a write after which the facade wakes admissions waiting on the gate (default: ``writes``;
            progress appends never open the gate).
        surfaces: surface -> :class:`Offer`, for those that differ from :data:`DEFAULTS`.
    """

    name: str
    writes: bool = False
    result: str = "plain"
    args: Mapping[str, str] = field(default_factory=dict)
    wakes: bool | None = None
    surfaces: Mapping[str, Offer] = field(default_factory=dict)

    def on(self, surface: str) -> Offer:
        """How ``surface`` offers this operation."""
        return self.surfaces.get(surface, DEFAULTS[surface])

    @property
    def wakes_admissions(self) -> bool:
        """Whether the facade wakes gate waiters after it."""
        return self.writes if self.wakes is None else self.wakes


_FILELESS = "an in-memory buffer has no file"
_UNENCODED = "nothing is encoded in memory"
_STARTED = "the actor is started on a store (start_buffer_actor), not {} by a call"
_PRODUCER = "a producer's operation: one blocking actor call, its arguments and result through the table's codecs"
_SESSION = "carries the incarnation's session in the selection dict (finish_step checks it)"


def op(name: str, *, writes: bool = False, result: str = "plain", args: Mapping[str, str] | None = None,
       wakes: bool | None = None, **surfaces: Offer) -> Operation:
    """A row of :data:`TABLE` (``surfaces``: the offers that differ from :data:`DEFAULTS`; ``async_`` is the
    ``async`` surface, a keyword in Python)."""
    surfaces = {key.rstrip("_"): offer for key, offer in surfaces.items()}
    unknown = set(surfaces) - set(SURFACES)
    if unknown:
        raise ValueError(f"{name}: unknown surfaces {sorted(unknown)}")
    return Operation(name, writes, result, dict(args or {}), wakes, surfaces)


#: ReplayBuffer's public operations: constructors, transitions, reads, waits and checkpoints.
TABLE: tuple[Operation, ...] = (
    # -- constructors and the handle ----------------------------------------------------------------
    op("create", result="handle",
       async_=differs("**kwargs: the facade's own options (max_workers, poll_interval)"),
       actor=absent(_STARTED.format("created")), memory=absent(_FILELESS)),
    op("open", result="handle",
       async_=differs("no map_size; **kwargs: the facade's own options"),
       actor=absent(_STARTED.format("opened")), memory=absent(_FILELESS)),
    op("close", writes=True, async_=hand("waits for the store, then shuts its pool"),
       actor=hand("closes the facade it owns; later calls fail"), memory=hand("drops the dicts"),
       client=hand("flushes, then closes its progress channel's connection (the store stays open)")),
    op("path", async_=hand("a property of the wrapped buffer"),
       actor=absent("a Ray actor has no properties: info() carries the path"), memory=absent(_FILELESS)),
    # -- admission ----------------------------------------------------------------------------------
    op("admissible"),
    op("admit", writes=True, result="leases", args={"admission": "admission?"},
       async_=hand("the gate wait runs on the loop between non-blocking tries")),
    op("advance_dispatch", writes=True, result="admission",
       async_=hand("the gate wait runs on the loop between non-blocking tries")),
    op("redispatch", writes=True, result="lease"),
    op("leases_held_by", result="leases"),
    op("redispatch_held_by", writes=True, result="leases"),
    op("abort", writes=True),
    op("abort_stale_inflight", writes=True),
    # -- commits and progress -----------------------------------------------------------------------
    op("commit_group", writes=True, result="commit", args={"lease": "lease"},
       client=absent("BufferClient.commit queues a group for a batched, pipelined commit_many call")),
    op("commit_sample", writes=True, result="commit", args={"lease": "lease"},
       client=hand("queues the row for a batched, pipelined commit_many call and returns a Future of its result")),
    op("commit_encoded", writes=True, result="commit", args={"lease": "lease"},
       memory=absent(_UNENCODED)),
    op("commit_many", writes=True, result="commits", args={"items": "lease items"},
       actor=hand("counts its calls (stats) and answers a malformed item in its slot")),
    op("row_encoder", result="local", actor=absent("producers build their RowEncoder from the actor's config"),
       memory=absent(_UNENCODED)),
    op("record_progress", writes=True, wakes=False, args={"lease": "lease"}, client=hand(_PRODUCER)),
    op("record_progress_many", writes=True, wakes=False, args={"items": "lease items"},
       actor=hand("answers a malformed item in its slot"), client=hand(_PRODUCER)),
    op("progress_encoder", result="local",
       actor=absent("producers build their ProgressEncoder from the actor's config (BufferClient.progress_encoder)"),
       client=hand("built once from the actor's config"), memory=absent(_UNENCODED)),
    op("record_progress_step", writes=True, wakes=False,
       async_=hand("one message of record_progress_steps, batched with concurrent calls"),
       actor=absent("one message per call is record_progress_steps([message]): a remote call carries a batch "
                    "(BufferClient.record_progress_step batches them)"),
       client=differs("queues one step (a message, or record_progress_many's items encoded at the edge) for a "
                      "batched, pipelined call and returns a Future: its parameter is named step"),
       memory=absent("takes an encoded progress message: " + _UNENCODED)),
    op("record_progress_steps", writes=True, wakes=False,
       async_=hand("shares one pool handoff and one transaction with concurrent calls (StepBatcher)"),
       actor=differs("client, seq, oldest, wait: a pipelining caller's order tag (Ray may run an async actor's "
                     "calls out of order; BufferClient tags its calls)"),
       memory=absent("takes encoded progress messages: " + _UNENCODED)),
    op("progress", result="progress",
       actor=differs("takes a group id only: a lease crosses processes as a dict"), client=hand(_PRODUCER)),
    # -- the trainer --------------------------------------------------------------------------------
    op("select", writes=True, result="selection", actor=hand(_SESSION)),
    op("claim", writes=True, result="selection", args={"group_ids": "ids"}, actor=hand(_SESSION)),
    op("release_claims", writes=True, args={"group_ids": "ids"}),
    op("read_batch", result="batch", args={"groups": "selection or ids"}),
    op("finish_step", writes=True, actor=differs("session: refuses a step whose claims a restart returned")),
    op("evict", writes=True, args={"group_ids": "ids?"}),
    op("promote_ready_group", writes=True),
    op("count_for_target_step"),
    op("batch_shortfall"),
    op("trainer_version", async_=absent("a property cannot be awaited: (await state())['trainer_version']"),
       actor=absent("a Ray actor has no properties: state()['trainer_version']")),
    op("state"),
    op("stats", actor=hand("adds the actor's own call counters")),
    op("group", result="group?"),
    op("groups", result="groups", args={"states": "ids?"}),
    op("ledger", result="ledger"),
    op("dataloader_state"),
    op("wait_for_change",
       async_=absent("admit and advance_dispatch wait for the gate on the loop's own event (asyncio) instead"),
       actor=absent("waiting belongs to the caller's side of a remote call")),
    # -- checkpoints and recovery -------------------------------------------------------------------
    op("checkpoint", writes=True, result="checkpoint",
       async_=differs("no background: the coroutine returns at once and wait_checkpoint awaits the copy"),
       actor=differs("wait instead of background: returns when the file is complete, or with wait=False at once "
                     "(then checkpoint_status)"),
       memory=differs("(*args, **kwargs) raising NotImplementedError: the state lives only in this process")),
    op("recover", writes=True, result="plan", actor=hand("keeps the plan for recovery_plan()"),
       memory=differs("(*args, **kwargs) raising NotImplementedError: nothing survives the process")),
)


def _check(rows: tuple[Operation, ...]) -> tuple[Operation, ...]:
    names = [r.name for r in rows]
    if len(names) != len(set(names)):
        raise ValueError(f"operations declared twice: {sorted({n for n in names if names.count(n) > 1})}")
    return rows


TABLE = _check(TABLE)
#: The table by operation name.
BY_NAME: dict[str, Operation] = {row.name: row for row in TABLE}
#: ReplayBuffer's public operations, by name, in the table's order.
OPERATIONS = tuple(BY_NAME)
#: Parameters a transport adds to every method and no caller passes (Ray's tracing context).
_TRANSPORT_PARAMETERS = frozenset({"self", "cls", "_ray_trace_ctx"})


def offered_by(surface: str, how: str | None = None) -> list[Operation]:
    """The rows ``surface`` offers (``how``: only those offered that way)."""
    return [row for row in TABLE if row.on(surface).offered and (how is None or row.on(surface).how == how)]


def signature(name: str) -> inspect.Signature:
    """ReplayBuffer's signature of operation ``name``, without ``self``: the operation's arguments and result."""
    from kvckpt.buffer.replay_buffer import ReplayBuffer

    member = getattr(ReplayBuffer, name)
    sig = inspect.signature(member)
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name not in _TRANSPORT_PARAMETERS])


def summary(name: str) -> str:
    """The first paragraph of ReplayBuffer's docstring of ``name`` (a generated method's ``help()`` opens with it)."""
    from kvckpt.buffer.replay_buffer import ReplayBuffer

    doc = inspect.getdoc(getattr(ReplayBuffer, name)) or name
    return doc.split("\n\n")[0]


def mark_generated(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``function`` as made from the table (what ``tests/core/test_surfaces.py`` tells apart)."""
    function.__kvckpt_generated__ = True  # type: ignore[attr-defined]
    return function


def is_generated(member: Any) -> bool:
    """Whether a surface's member was made from the table."""
    return bool(getattr(member, "__kvckpt_generated__", False))


def shape(member: Callable[..., Any] | property) -> tuple[str, ...]:
    """The parameter names of an operation in order (``*name`` / ``**name`` for variadic ones), without
    ``self`` and transport parameters; ``("<property>",)`` for a property. Whether a parameter is
    keyword-only is not part of it: a Ray actor's methods take every argument by keyword too."""
    if isinstance(member, property):
        return ("<property>",)
    marks = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(marks.get(p.kind, "") + p.name for p in inspect.signature(member).parameters.values()
                 if p.name not in _TRANSPORT_PARAMETERS)
