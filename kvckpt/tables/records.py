"""The buffer's value types: prompts, leases, group and ledger documents, results.

These are plain frozen dataclasses with ``to_dict``/``from_dict`` so they cross process
boundaries (Ray, asyncio executors) as JSON-able dicts, never as pickled objects of the store.
"""

from __future__ import annotations

import functools
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kvckpt import args
from kvckpt.errors import BadArgument

# Group states, in lifecycle order. A prompt that left the dataloader is either a ledger entry
# (in flight) or a record in ``groups`` in exactly one of these states.
READY, CLAIMED, CONSUMED, EVICTED, ABORTED = "ready", "claimed", "consumed", "evicted", "aborted"
GROUP_STATES = (READY, CLAIMED, CONSUMED, EVICTED, ABORTED)
PHASE_ADMITTED = "admitted"


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


@functools.cache
def _required_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)


#: The JSON scalars a document's fields hold, shared as they are.
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _plain(value: Any) -> Any:
    """``dataclasses.asdict``'s conversion for the value types documents hold (nested documents
    become dicts, containers are copied, scalars shared), without its per-value ``deepcopy``."""
    if type(value) in _SCALARS:
        return value
    if isinstance(value, _Doc):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


#: Fields a document leaves out of :meth:`_Doc.to_dict` while they are ``None``: added after format 4
#: was pinned, so a record that does not use them is byte for byte what an older kvckpt wrote.
_OMITTED_WHEN_NONE = frozenset({"lineage_fork", "holder"})


def lineage_weight(start_weight: int, lineage_fork: int | None) -> int:
    """The weight version that puts a stamp on the trained lineage: staleness at trainer version
    ``current`` is ``current - lineage_weight(...)``.

    A stamp on the current lineage (``lineage_fork is None``) is its own lineage weight. A stamp
    ``v`` on a lineage a recovery destroyed (weights newer than the version ``f`` it rolled back
    to, never an ancestor of the weights trained since) is as far from version ``current`` as the
    path through the version tree: down from ``v`` to the fork, then up to ``current``,
    ``(v - f) + (current - f)``, so its lineage weight is ``2f - v`` (below ``f``, possibly below 0).
    """
    return start_weight if lineage_fork is None else 2 * lineage_fork - start_weight


class _Doc:
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field (an unset :data:`_OMITTED_WHEN_NONE` field left out)."""
        return {name: _plain(value) for name in _field_names(type(self))
                if (value := getattr(self, name)) is not None or name not in _OMITTED_WHEN_NONE}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Any:
        """Rebuild from :meth:`to_dict` output (unknown keys are ignored).

        Raises:
            BadArgument: ``doc`` is not a dict or lacks a required field.
        """
        if not isinstance(doc, dict):
            raise BadArgument(f"a {cls.__name__} document must be a dict, got {type(doc).__name__}")
        kwargs = {k: doc[k] for k in _field_names(cls) if k in doc}
        for name in ("missing", "siblings"):
            if name in kwargs and isinstance(kwargs[name], list):
                kwargs[name] = tuple(kwargs[name])
        lacking = [name for name in _required_names(cls) if name not in kwargs]
        if lacking:
            raise BadArgument(f"a {cls.__name__} document lacks {', '.join(lacking)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class Prompt(_Doc):
    """A prompt leaving the dataloader: its dataset identity and, optionally, a chosen group id."""

    prompt_idx: int
    task_name: str = "default"
    group_id: str | None = None

    def __post_init__(self) -> None:
        """Refuse what the store cannot keep exactly (a negative or fractional index, odd ids)."""
        object.__setattr__(self, "prompt_idx", args.integer("prompt_idx", self.prompt_idx))
        args.identifier("task_name", self.task_name)
        if self.group_id is not None:
            args.identifier("group_id", self.group_id)


@dataclass(frozen=True)
class Lease(_Doc):
    """The right to commit one group: returned by admission, redispatch and recovery.

    A lease is fenced by three things together, and a commit is accepted only when all three match
    the group's ledger entry as it is *now* (see docs/recovery.md, "Fencing"):

    * ``store_id``: the random identity of the store that issued it (a lease of another store is
      refused even if the group id exists there);
    * ``timeline``: the random id of the run history it was issued in; every restore and every
      recovery starts a new one, so restoring the same checkpoint twice still fences the leases of
      the first restore;
    * ``attempt``: the fencing epoch within a timeline; :meth:`~kvckpt.buffer.ReplayBuffer.redispatch`
      and recovery bump it.

    Everything else a lease carries (group size, prompt identity, stamps) is informational: the
    ledger entry is the only authority, and a lease that disagrees with it is refused.
    ``missing`` lists the row indices still to generate (siblings already committed under an
    earlier attempt are kept). Leases cross process boundaries as :meth:`to_dict` documents;
    one without ``store_id``/``timeline`` (an older kvckpt's) is refused when it commits.
    ``holder`` is the name of the producer the lease was issued to (``admit(..., holder=...)``,
    ``redispatch(..., holder=...)``), or ``None``; it is not part of the fencing.
    """

    group_id: str
    attempt: int
    group_size: int
    target_step: int | None
    start_weight: int
    prompt_idx: int
    task_name: str
    admission_id: str
    missing: tuple[int, ...] = ()
    store_id: str = ""
    timeline: str = ""
    holder: str | None = None


@dataclass(frozen=True)
class GroupInfo(_Doc):
    """A committed group's metadata and stamps (no row payload).

    ``start_weight`` is the oldest weight version that generated any of its rows' tokens, on the
    lineage it was generated on. ``lineage_fork`` is ``None`` while that lineage is the trained
    one; a recovery to a version ``f < start_weight`` sets it to ``f`` (the newest version the
    group's lineage shares with the weights trained since), and a later recovery to an older
    version lowers it. Staleness reads :attr:`lineage_weight`, never ``start_weight`` alone.
    """

    group_id: str
    prompt_idx: int
    task_name: str
    admission_id: str
    seq: int
    group_size: int
    state: str
    start_weight: int
    end_weight: int
    target_step: int | None
    attempt: int
    digest: str
    claimed_step: int | None = None
    consumed_step: int | None = None
    rows_stored: bool = True
    reason: str | None = None
    raw_bytes: int = 0
    stored_bytes: int = 0
    timeline: str = ""
    lineage_fork: int | None = None

    @property
    def lineage_weight(self) -> int:
        """:func:`lineage_weight` of this group's stamp: ``current - lineage_weight`` is its staleness."""
        return lineage_weight(self.start_weight, self.lineage_fork)


@dataclass(frozen=True)
class LedgerEntry(_Doc):
    """A prompt that left the dataloader and is not yet a committed group.

    ``siblings`` holds the row indices already committed one by one (sibling progress) and
    ``digests`` their content digests (for idempotent retries). ``timeline`` and ``attempt`` are
    the fencing identity of the one lease that may commit it now (with the store's id).
    ``token_weight`` is the oldest weight version of the token progress (:class:`Progress`) its
    committed siblings consumed, or ``None``: the group's ``start_weight`` stamp takes it into
    account when the group completes. ``lineage_fork`` is :class:`GroupInfo`'s: set by a recovery
    that rolled the weights back below ``start_weight`` while the entry kept work generated by the
    destroyed weights (committed siblings or token progress); the group inherits it. ``holder``
    names the producer its current lease was issued to (a name the producer gives: an actor id, a
    node id), or ``None``: :meth:`~kvckpt.ReplayBuffer.leases_held_by` reads it.
    """

    group_id: str
    admission_id: str
    prompt_idx: int
    task_name: str
    group_size: int
    target_step: int | None
    start_weight: int
    attempt: int
    seq: int
    phase: str = PHASE_ADMITTED
    siblings: tuple[int, ...] = ()
    digests: dict[str, str] = field(default_factory=dict)
    raw_bytes: int = 0
    stored_bytes: int = 0
    timeline: str = ""
    token_weight: int | None = None
    lineage_fork: int | None = None
    holder: str | None = None

    @property
    def lineage_weight(self) -> int:
        """:func:`lineage_weight` of this entry's stamp."""
        return lineage_weight(self.start_weight, self.lineage_fork)

    def lease(self, store_id: str) -> Lease:
        """The lease a worker needs to finish this entry, issued by the store ``store_id``."""
        done = set(self.siblings)
        return Lease(self.group_id, self.attempt, self.group_size, self.target_step, self.start_weight,
                     self.prompt_idx, self.task_name, self.admission_id,
                     tuple(i for i in range(self.group_size) if i not in done), store_id, self.timeline,
                     self.holder)


@dataclass(frozen=True)
class Progress:
    """The durable token prefix of one sample still being generated (``ReplayBuffer.progress``).

    ``tokens`` (int64) are the completion tokens generated so far, ``logprobs`` (float32) their
    log-probabilities, ``versions`` (int64) the weight version that produced each token, and
    ``fields`` the schema's other per-token generation fields recorded with them (first dimension
    = :attr:`length`). All of it survived every crash since it was acknowledged; a new attempt
    continues at position :attr:`length`.
    """

    index: int
    tokens: Any
    logprobs: Any
    versions: Any
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """The number of durable tokens (the ``start`` of the next chunk)."""
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class Admission(_Doc):
    """An admission issued by :meth:`~kvckpt.buffer.ReplayBuffer.advance_dispatch`: the cursor has
    moved and prompts can still join it (``admit(..., admission=...)``).

    ``dispatch_index`` is the cursor after the advance; ``target_step`` the stamp its prompts get
    (``in_order`` only, else ``None``).
    """

    admission_id: str
    dispatch_index: int
    target_step: int | None


@dataclass(frozen=True)
class CommitResult(_Doc):
    """Outcome of a commit: ``ready`` once all rows are in; ``replayed`` when this exact commit had
    already landed (a retry after a lost acknowledgement) and nothing new was written."""

    group_id: str
    ready: bool
    replayed: bool = False
    rows_written: int = 0


@dataclass(frozen=True)
class Selection(_Doc):
    """Groups claimed for training step ``step`` (rows stay readable until the step finishes)."""

    step: int
    groups: tuple[GroupInfo, ...] = ()

    @property
    def group_ids(self) -> list[str]:
        """Ids of the selected groups, in selection order."""
        return [g.group_id for g in self.groups]

    def __len__(self) -> int:
        return len(self.groups)
