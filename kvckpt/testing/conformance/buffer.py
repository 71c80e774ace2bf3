"""A conformance suite for every surface of the replay buffer: a Hypothesis state machine drives one
surface against a small pure-Python model of the replay semantics.

A surface is anything that offers :data:`kvckpt.buffer.surface.OPERATIONS` synchronously with
:class:`~kvckpt.ReplayBuffer`'s results: the buffer itself, the asyncio facade run on an event loop,
the Ray actor through a shim, the reference trainer's in-memory buffer, or an integration's own.
Describe it with a :class:`BufferSurface` (a factory, and the capabilities it lacks, each with its
reason) and run::

    from kvckpt.testing.conformance.buffer import BufferSurface, run_buffer_conformance

    def test_my_buffer_conforms():
        run_buffer_conformance(BufferSurface("mine", create=MyBuffer.create), "in_order")

Random sequences of admit / commit_group / commit_sample / record_progress (appends, retries,
conflicts, gaps, future versions) / select / finish_step / evict (the sampler's or named groups) /
abort / abort_stale_inflight / redispatch / promote_ready_group / checkpoint / close-and-reopen /
recover / restore of *any* earlier checkpoint run on the surface. Every lease ever issued is kept,
and zombies (leases of abandoned timelines, before a recovery or a restore, and leases of another
store with the same group ids) try to commit at random moments: none may be accepted (neither a
commit nor a progress append), and the rows a trainer reads are always those of the one legitimate
commit. Token progress: within a timeline a sample's durable prefix only grows, every acknowledged
chunk survives reopens, recoveries and restores (at the checkpoint's cut), no zombie chunk lands,
and a committed row starts with its sample's prefix (a row that does not is refused). Each run must
draw (:data:`MUST_SEE`) the fencing rules and the progress promises of issue 35 its capabilities
allow. Every operation's outcome (result or exact error) is predicted by the model first; a refused
operation must leave the store unchanged (byte for byte where the surface has a store file, else
every public read). After every step the machine checks the invariants of replay_semantics.md §G:
single owner (§G.10), capacity conservation (§G.6), counters, stamps (§G.9), cursor exactness
(§G.12), sampler semantics (§G.5) and, on a store file, ``kvckpt.durability.verify.check``.

A surface that legitimately lacks something declares it in :attr:`BufferSurface.lacks` by one of
:data:`CAPABILITIES`; the rules and promises that need it are then not run (and not required), by
that declaration, never by silence.

Long (over 400 lines): the model and the machine are one specification (the model predicts what each rule
asserts), read side by side; split, each half would be meaningless alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import functools
import inspect
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvckpt import (
    AbandonedTimeline,
    AsyncReplayBuffer,
    BadArgument,
    BufferConfig,
    CapacityError,
    DuplicateCommit,
    ForeignLease,
    FutureVersion,
    GateTimeout,
    Prompt,
    RecoveryError,
    ReplayBuffer,
    SampleCommitted,
    SchemaMismatch,
    StaleAttempt,
    UnknownGroup,
    restore,
)
from kvckpt.durability.safe_open import verify_path
from kvckpt.durability.verify import check
from kvckpt.samplers import BufferView
from kvckpt.storage.layout import ONE_TREE_TABLES

if TYPE_CHECKING:  # torch is imported where rows are made: a venv without it (.venv-gym) still loads tests/conftest.py
    import torch

#: ``ci`` is derandomized: every run draws the same examples, so a CI failure replays with the same
#: command (``--hypothesis-seed`` does nothing there). ``soak`` draws fresh examples every run
#: (``--hypothesis-seed=N`` pins one). Both print a failure's ``@reproduce_failure`` blob, which
#: replays it exactly: docs/testing.md, "The buffer state machine".
PROFILES = {
    "ci": settings(max_examples=30, stateful_step_count=40, deadline=None, database=None, derandomize=True,
                   print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
    "soak": settings(max_examples=2000, stateful_step_count=120, deadline=None, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
}
#: The smallest schema that exercises both field kinds and two dtypes.
SCHEMA: dict[str, tuple[str, str]] = {
    "input_ids": ("int64", "token"),
    "generation_logprobs": ("float32", "token"),
    "total_reward": ("float32", "row"),
}
N = 2  # rows per group
#: The machine's schema bound: row ``N - 1`` has ``3 + N - 1`` tokens, so its prefix can reach exactly
#: ``max_tokens`` and one more token is refused.
MAX_TOKENS = 3 + N - 1
MSCHEMA = {"fields": SCHEMA, "max_tokens": MAX_TOKENS}

#: What a surface may lack, and what lacking it means for the suite.
CAPABILITIES = {
    "durability": "checkpoints, recovery and restore (rules checkpoint, recover, restore, lag_and_roll_back)",
    "reopen": "closing and opening a fresh handle on the same file without a recovery (rule reopen)",
    "progress": "token progress: record_progress and progress (rules progress, generate, zombie_progress, "
                "lag_and_roll_back)",
    "store_file": "a store file read through kvckpt: refusals compared byte for byte, and verify's check",
}
#: Rule -> the capabilities it needs.
RULE_NEEDS = {"checkpoint": {"durability"}, "recover": {"durability"}, "restore": {"durability"},
              "lag_and_roll_back": {"durability", "progress"}, "reopen": {"reopen", "durability"},
              "progress": {"progress"}, "generate": {"progress"}, "zombie_progress": {"progress"}}
#: What a run must have drawn, not only by luck, with the capabilities each needs: the fencing rules
#: and the progress promises (issue 35: weights behind the trainer, versions going down, recovery
#: between chunks, a commit while a sibling holds progress, prefixes at the bound).
MUST_SEE = {"restore": {"durability"}, "timeline zombie": {"durability"}, "foreign zombie": set(),
            "progress": {"progress"}, "zombie progress": {"progress"}, "weights behind": set(),
            "chunk past the weights": {"progress"}, "versions down": {"progress", "durability"},
            "recovery mid-sample": {"progress", "durability"}, "commit beside progress": {"progress"},
            "prefix at bound": {"progress"}, "over the bound": {"progress"}}
#: Operations with their relative frequency (drawn as a number: sampled_from favours its first item).
WEIGHTS = {"produce": 4, "commit_group": 3, "select": 3, "admit": 2, "commit_sample": 3, "train": 2, "finish_step": 1,
           "evict": 1, "abort": 1, "abort_stale_inflight": 1, "redispatch": 1, "promote_ready_group": 1,
           "checkpoint": 1, "reopen": 1, "recover": 1, "restore": 1, "foreign_admit": 1, "zombie": 3, "progress": 3,
           "zombie_progress": 2, "generate": 3, "lag_and_roll_back": 1}
INFLIGHT = "inflight"


@dataclass(frozen=True)
class BufferSurface:
    """One surface of the buffer, as the suite drives it.

    Args:
        name: how reports name it.
        create: ``create(path, config)``: a new buffer on ``path`` (a file, or nothing for a surface
            without one) whose methods are :class:`~kvckpt.ReplayBuffer`'s, synchronous, returning its
            result types and raising its errors.
        lacks: capability (a key of :data:`CAPABILITIES`) -> why this surface does not have it.
        open: ``open(path)``: a fresh handle on an existing store (capability ``reopen``).
        restore: ``restore(handle, checkpoint, path) -> (handle, plan)``: the live store replaced by a
            checkpoint file (capability ``durability``); default :func:`kvckpt.restore` on a closed handle.
        inspect: ``inspect(handle)``: a :class:`~kvckpt.ReplayBuffer` on the same store file to read
            it through (capability ``store_file``); default the handle itself. Called again after
            every reopen and restore.
        close: ``close(handle)``; default ``handle.close()``.
        offers: the columns of the operation table (:data:`kvckpt.buffer.surface.SURFACES`) whose
            operations the surface offers (any of them); empty (the default): every operation, as
            ReplayBuffer. :func:`kvckpt.testing.conformance.scenarios.run_operation_scenarios` skips an
            operation only where the table says these columns do not offer it.
    """

    name: str
    create: Callable[[str, BufferConfig], Any]
    lacks: Mapping[str, str] = field(default_factory=dict)
    open: Callable[[str], Any] = ReplayBuffer.open
    restore: Callable[[Any, str, str], tuple[Any, Any]] | None = None
    inspect: Callable[[Any], Any] = lambda handle: handle
    close: Callable[[Any], None] = lambda handle: handle.close()
    offers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.lacks) - set(CAPABILITIES)
        if unknown:
            raise ValueError(f"{self.name}: unknown capabilities {sorted(unknown)}; known: {sorted(CAPABILITIES)}")

    def has(self, *capabilities: str) -> bool:
        """Whether the surface has every one of ``capabilities``."""
        return not set(capabilities) & set(self.lacks)


def _restore_closed(handle: Any, checkpoint: str, path: str) -> tuple[Any, Any]:
    handle.close()
    return restore(checkpoint, path, overwrite=True)


def make_row(length: int, seed: int) -> dict[str, torch.Tensor]:
    """One row of :data:`SCHEMA` with ``length`` tokens; equal ``(length, seed)`` give equal rows."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 1000, (length,), generator=gen, dtype=torch.int64),
        "generation_logprobs": -torch.rand(length, generator=gen, dtype=torch.float32),
        "total_reward": torch.rand((), generator=gen, dtype=torch.float32),
    }


def dump_store(buf: ReplayBuffer) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every key and value of every table, from one snapshot: compare two dumps to prove that a
    refused operation wrote nothing."""
    return buf.store.read(lambda t: {name: list(t.iter_prefix(name, b"")) for name in ONE_TREE_TABLES})


def public_reads(buf: Any) -> Any:
    """Everything a surface without a store file shows: state, ledger, groups, dataloader state,
    shortfalls and token progress (what a refused operation must leave as it was)."""
    ledger = buf.ledger()
    progress = {e.group_id: {i: (p.tokens.tolist(), p.versions.tolist()) for i, p in buf.progress(e.group_id).items()}
                for e in ledger} if hasattr(buf, "progress") else None
    return (buf.state(), ledger, buf.groups(), buf.dataloader_state(), buf.batch_shortfall(), progress)


def row_for(gid: str, index: int, variant: int) -> dict[str, Any]:
    """Row ``index`` of group ``gid``; the same ``variant`` always gives identical bytes."""
    return make_row(3 + index, zlib.crc32(f"{gid}/{index}/{variant}".encode()))


def starts_with_prefix(gid: str, index: int, variant: int, length: int) -> bool:
    """Whether row ``variant`` begins with the sample's progress prefix of ``length`` tokens (progress
    is always a prefix of variant 0's tokens: the row with no schema mask is all completion)."""
    return bool((row_for(gid, index, variant)["input_ids"][:length] == row_for(gid, index, 0)["input_ids"][:length])
                .all())


@dataclass
class Owned:
    """The model of one prompt that left the dataloader: a ledger entry or a group record."""

    gid: str
    seq: int
    start_weight: int
    target_step: int | None
    attempt: int = 0
    state: str = INFLIGHT
    rows: dict[int, int] = field(default_factory=dict)  # row index -> content variant
    end_weight: int | None = None
    claimed_step: int | None = None
    consumed_step: int | None = None
    rows_stored: bool = True
    timeline: str = ""
    chunks: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # index -> (start, n, version)
    token_weight: int | None = None  # the oldest version of progress its committed siblings consumed
    fork: int | None = None  # lineage_fork: set by a recovery below the newest token (issue 39)
    newest: int | None = None  # lineage_newest: the newest token's version when above the stamp (issue 49)

    @property
    def nw(self) -> int:
        """The newest weight version of its work: ``newest``, else the stamp."""
        return self.start_weight if self.newest is None else self.newest

    @property
    def lw(self) -> int:
        """The lineage weight staleness reads: the stamp, or its stalest token's, min(stamp, 2 * fork - newest)."""
        return self.start_weight if self.fork is None else min(self.start_weight, 2 * self.fork - self.nw)

    def length(self, index: int) -> int:
        """The durable progress length of row ``index``."""
        return sum(n for _, n, _ in self.chunks.get(index, ()))


class Model:
    """The replay semantics, in plain Python (replay_semantics.md §B.2, §C, §G)."""

    def __init__(self, sampler: dict[str, Any], capacity: int, retain: bool, durable_checkpoints: int,
                 durability: bool = True) -> None:
        self.durability = durability  # without it nothing can roll back: consumed rows go at once
        self.name = sampler["name"]
        self.window = sampler.get("max_lookahead_versions", sampler.get("max_staleness_versions", 1))
        self.freshest = sampler.get("sample_freshest_first", False)
        self.gated = self.name != "windowed"
        self.capacity, self.retain, self.keep = capacity, retain, durable_checkpoints
        self.tv = self.wv = self.seq = self.admissions = self.drop_floor = 0
        self.dispatch = -1
        self.durable: list[int] = []
        self.shortfall: dict[int, int] = {}
        self.counters = dict.fromkeys(("admitted", "committed", "samples_committed", "selected", "consumed",
                                       "evicted", "aborted", "redispatched"), 0)
        self.prompts: dict[str, Owned] = {}
        self.dataloader: bytes | None = None
        self.rolled_back = False
        self.timeline = ""  # learnt from the store: random at create, restore and recovery

    def having(self, *states: str) -> list[Owned]:
        return sorted((p for p in self.prompts.values() if p.state in states), key=lambda p: p.seq)

    @property
    def floor(self) -> int:
        return self.tv - self.window  # no clamp: a forked group's lineage weight may be negative

    def eligible(self) -> list[str]:
        ready, lo, cur = self.having("ready"), self.floor, self.tv
        if self.name == "in_order":
            chosen = [p for p in ready if p.target_step == cur]
        elif self.name == "ready_first":
            chosen = [p for p in ready if p.lw <= cur]
        elif self.name == "windowed":
            chosen = [p for p in ready if lo <= p.lw <= cur]
            if self.freshest:
                chosen.sort(key=lambda p: (cur - p.lw, p.seq))
        else:
            weights = [p.lw for p in self.having("ready", INFLIGHT) if lo <= p.lw <= cur]
            chosen = [p for p in ready if weights and p.lw == min(weights)]
        return [p.gid for p in chosen]

    def evictable(self) -> list[str]:
        ready = self.having("ready")
        if self.name == "in_order":
            found = sorted((p for p in ready if p.target_step < self.tv), key=lambda p: (p.target_step, p.seq))
        elif self.name == "ready_first":
            found = []
        else:
            found = sorted((p for p in ready if p.lw < self.floor), key=lambda p: (p.lw, p.seq))
        return [p.gid for p in found]

    def stale_inflight(self) -> list[str]:
        if self.name != "windowed":
            return []
        found = [p for p in self.having(INFLIGHT) if p.lw < self.floor]
        return [p.gid for p in sorted(found, key=lambda p: (p.lw, p.seq))]

    def admit_error(self, count: int) -> type[Exception] | None:
        if count > self.capacity:
            return CapacityError
        if self.gated and self.dispatch >= self.tv + self.window:
            return GateTimeout
        if len(self.having(INFLIGHT, "ready")) + count > self.capacity:
            return GateTimeout
        return None

    def admit(self, count: int, weight: int, dataloader: bytes) -> list[Owned]:
        if self.gated:
            self.dispatch += 1
        target = self.dispatch if self.name == "in_order" else None
        admitted = []
        for j in range(count):
            prompt = Owned(f"a{self.admissions}-p{j}", self.seq, weight, target, timeline=self.timeline)
            self.seq += 1
            self.prompts[prompt.gid] = prompt
            admitted.append(prompt)
        self.admissions += 1
        self.counters["admitted"] += count
        self.dataloader = dataloader
        return admitted

    def commit_error(self, lease: Any, rows: dict[int, int], whole: bool,
                     store_id: str) -> tuple[type[Exception] | None, bool]:
        """The error a commit raises (or None), and whether it is a replay that writes nothing."""
        prompt = self.prompts.get(lease.group_id)
        if prompt is None:
            return UnknownGroup, False
        fenced = (ForeignLease if lease.store_id != store_id else AbandonedTimeline
                  if lease.timeline != prompt.timeline else StaleAttempt if lease.attempt != prompt.attempt else None)
        if prompt.state == INFLIGHT:
            if fenced is not None:
                return fenced, False
            if not whole:
                [(index, variant)] = rows.items()
                if index in prompt.rows:
                    return (None, True) if prompt.rows[index] == variant else (DuplicateCommit, False)
            if any(not starts_with_prefix(prompt.gid, i, v, prompt.length(i)) for i, v in rows.items()):
                return BadArgument, False  # the row contradicts its sample's durable prefix
            return None, False
        if prompt.state in ("evicted", "aborted"):
            return UnknownGroup, False
        if fenced is not None:
            return fenced, False
        if prompt.rows_stored and all(prompt.rows[i] == v for i, v in rows.items()):
            return None, True
        return DuplicateCommit, False

    def commit(self, gid: str, rows: dict[int, int], whole: bool, end_weight: int | None) -> bool:
        prompt = self.prompts[gid]
        prompt.rows.update(rows)
        consumed = [v for i in rows for _, _, v in prompt.chunks.pop(i, ())]
        weights = [w for w in (prompt.token_weight, *consumed) if w is not None]
        prompt.token_weight = min(weights) if weights else None
        newest = prompt.nw if prompt.fork is not None else max(  # a fork freezes the newest (issue 49)
            [prompt.nw, *consumed, *([] if end_weight is None else [end_weight])])
        if not whole:
            self.counters["samples_committed"] += len(rows)
        if len(prompt.rows) < N:
            prompt.newest = newest if newest > prompt.start_weight else None
            return False
        if prompt.token_weight is not None and prompt.fork is None:  # the stamp is the oldest token's weight
            prompt.start_weight = min(prompt.start_weight, prompt.token_weight)
        prompt.newest = newest if newest > prompt.start_weight else None
        prompt.state, prompt.end_weight = "ready", self.wv if end_weight is None else end_weight
        self.counters["committed"] += 1
        return True

    def select(self, min_groups: int, max_groups: int) -> list[str]:
        chosen = self.eligible()[:max_groups]
        if len(chosen) < min_groups:
            return []
        for gid in chosen:
            self.prompts[gid].state, self.prompts[gid].claimed_step = "claimed", self.tv
        self.counters["selected"] += len(chosen)
        return chosen

    def finish_step(self, weight: int | None = None) -> None:
        for prompt in self.having("claimed"):
            prompt.state, prompt.consumed_step = "consumed", self.tv
            self.counters["consumed"] += 1
        self.tv += 1
        self.wv = self.tv if weight is None else weight
        if self.retain:
            return
        if not self.durability:
            for prompt in self.having("consumed"):
                prompt.rows_stored = False
            return
        if len(self.durable) < self.keep:
            return
        floor = self.durable[-self.keep]
        if floor <= self.drop_floor:
            return
        for prompt in self.having("consumed"):
            if prompt.consumed_step < floor:
                prompt.rows_stored = False
        self.drop_floor = floor

    def evict(self, named: list[str] | None = None) -> list[str]:
        gids = self.evictable() if named is None else named
        for gid in gids:
            self.prompts[gid].state, self.prompts[gid].rows_stored = "evicted", False
        self.counters["evicted"] += len(gids)
        return gids

    def abort(self, gids: list[str]) -> None:
        for gid in gids:
            prompt = self.prompts[gid]
            prompt.state, prompt.rows_stored, prompt.end_weight, prompt.rows = "aborted", False, -1, {}
            prompt.chunks = {}
            if prompt.target_step is not None:
                self.shortfall[prompt.target_step] = self.shortfall.get(prompt.target_step, 0) + 1
        self.counters["aborted"] += len(gids)

    def progress_error(self, lease: Any, index: int, start: int, n: int, tokens_match: bool, version: int,
                       store_id: str) -> tuple[type[Exception] | None, bool]:
        """The error a progress append raises (or None), and whether it is a no-op retry."""
        if start + n > MAX_TOKENS:  # checked before the transaction, so before the fencing
            return SchemaMismatch, False
        prompt = self.prompts.get(lease.group_id)
        if prompt is None or prompt.state in ("evicted", "aborted"):
            return UnknownGroup, False
        fenced = (ForeignLease if lease.store_id != store_id else AbandonedTimeline
                  if lease.timeline != prompt.timeline else StaleAttempt if lease.attempt != prompt.attempt else None)
        if fenced is not None:  # a fenced resend of a chunk that landed gets its first answer (exactly-once)
            landed = fenced is not ForeignLease and prompt.state == INFLIGHT and index not in prompt.rows
            return (None, True) if landed and tokens_match else (fenced, False)
        if prompt.state != INFLIGHT or index in prompt.rows:
            return SampleCommitted, False
        if version > max(self.tv, self.wv):
            return FutureVersion, False
        length = prompt.length(index)
        if start > length:
            return BadArgument, False
        if start < length:
            return (None, True) if tokens_match else (DuplicateCommit, False)
        return None, False

    def redispatch(self, gid: str, start_weight: int | None) -> Owned:
        prompt = self.prompts[gid]
        prompt.attempt += 1
        prompt.timeline = self.timeline
        if start_weight is not None and prompt.fork is None:  # a forked entry keeps its stamp (issue 39)
            newest = max(prompt.nw, start_weight)
            prompt.start_weight, prompt.newest = start_weight, newest if newest > start_weight else None
        self.counters["redispatched"] += 1
        return prompt

    def promote(self, step: int) -> int | None:
        stamped = [p for p in self.having("ready") if p.target_step is not None]
        if not stamped:
            return None
        lender = max(stamped, key=lambda p: (p.target_step, p.seq))
        if lender.target_step <= step:
            return None
        lent, lender.target_step = lender.target_step, step
        return lent

    def checkpoint(self) -> None:
        if not self.durable or self.durable[-1] < self.tv:
            self.durable = [*self.durable, self.tv][-16:]

    def recover_error(self, version: int) -> bool:
        return version > self.tv or version < self.drop_floor

    def recover(self, version: int, timeline: str, rollback: bool = True) -> tuple[int, list[Owned]]:
        """``rollback``: a ``resume_version`` was given (the run continues from its weights); a
        plain ``recover()`` destroys no weights (nothing forked or restamped, the weight version stays)."""
        returned = 0
        for prompt in self.having("claimed", "consumed"):
            step = prompt.claimed_step if prompt.state == "claimed" else prompt.consumed_step
            if step >= version:
                assert prompt.rows_stored, f"{prompt.gid} consumed at {step} >= {version} lost its rows"
                prompt.state, prompt.claimed_step, prompt.consumed_step = "ready", None, None
                returned += 1
        self.rolled_back |= returned > 0
        for prompt in self.having("ready"):  # a token generated by weights the rollback destroyed
            if rollback and prompt.nw > version:
                prompt.fork = version if prompt.fork is None else min(prompt.fork, version)
        for prompt in self.having(INFLIGHT):
            if not rollback:
                continue
            durable = [v for chunks in prompt.chunks.values() for _, n, v in chunks if n]
            if prompt.start_weight > version and not (prompt.rows or durable):  # the resumed weights generate it
                prompt.start_weight, prompt.fork, prompt.newest = version, None, None
                continue
            newest = prompt.nw if prompt.fork is not None else max([prompt.nw, *durable])
            if newest > version:  # it kept work of the destroyed weights (issue 49: its newest decides)
                prompt.fork = version if prompt.fork is None else min(prompt.fork, version)
                prompt.newest = newest if newest > prompt.start_weight else None
        self.tv = version
        self.wv = version if rollback else self.wv
        self.durable = [v for v in self.durable if v <= version]
        inflight = self.having(INFLIGHT)
        assert timeline != self.timeline, "recovery must start a new timeline"
        self.timeline = timeline
        for prompt in inflight:
            prompt.attempt += 1
            prompt.timeline = timeline
        self.counters["redispatched"] += len(inflight)
        return returned, inflight


class BufferMachine(RuleBasedStateMachine):
    """One surface under random operations; :func:`machine_for` sets ``SURFACE``, ``SAMPLER`` and the
    ``OPERATIONS`` its capabilities allow per subclass."""

    SURFACE: ClassVar[BufferSurface]
    SAMPLER: ClassVar[str] = "in_order"
    OPERATIONS: ClassVar[tuple[str, ...]] = tuple(op for op, weight in WEIGHTS.items() for _ in range(weight))
    #: How often the fencing rules really ran (a run where none did would prove nothing).
    seen: ClassVar[collections.Counter[str]] = collections.Counter()

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvckpt-stateful-")
        self.path = os.path.join(self.dir, "live.kv")
        self.buf: Any = None
        self.inspector: Any = None
        self.leases: list[Any] = []
        self.checkpoints = 0
        self.saved: list[tuple[str, Model]] = []  # each checkpoint file with the model at its stamp
        self.prefixes: dict[tuple[str, int], tuple[str, int]] = {}  # (gid, row) -> (timeline, prefix length)
        self.foreign: ReplayBuffer | None = None

    # -- setup ---------------------------------------------------------------------------------------
    @initialize(window=st.sampled_from([1, 2, 0]), freshest=st.booleans(), groups_per_step=st.integers(1, 2),
                extra=st.integers(0, 3), retain=st.booleans(), keep=st.integers(1, 2))
    def create(self, window, freshest, groups_per_step, extra, retain, keep):
        key = "max_lookahead_versions" if self.SAMPLER == "in_order" else "max_staleness_versions"
        sampler = {"name": self.SAMPLER, key: window}
        if self.SAMPLER == "windowed":
            sampler["sample_freshest_first"] = freshest
        capacity = groups_per_step * (window + 1) + extra
        self.buf = self.SURFACE.create(self.path, BufferConfig(
            group_size=N, schema=MSCHEMA, sampler=sampler, max_buffered_rollouts=capacity,
            groups_per_step=groups_per_step, retain_consumed=retain, durable_checkpoints=keep))
        self.inspector = self.SURFACE.inspect(self.buf)
        self.model = Model(sampler, capacity, retain, keep, durability=self.SURFACE.has("durability"))
        self.model.timeline = self.buf.state()["timeline"]
        self.store_id = (self.inspector.store.store_id if self.SURFACE.has("store_file") else
                         self.buf.state()["store_id"])
        # Another store of the same config: its group ids collide with ours, its leases must not commit.
        self.foreign = ReplayBuffer.create(os.path.join(self.dir, "foreign.kv"), BufferConfig(
            group_size=N, schema=MSCHEMA, sampler=sampler, max_buffered_rollouts=capacity,
            groups_per_step=groups_per_step, retain_consumed=retain, durable_checkpoints=keep))

    def teardown(self) -> None:
        if self.buf is not None:
            self.SURFACE.close(self.buf)
        if self.foreign is not None:
            self.foreign.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def snapshot(self) -> Any:
        """The store as a refused operation must leave it: every byte, or every public read."""
        return dump_store(self.inspector) if self.SURFACE.has("store_file") else public_reads(self.buf)

    def refused(self, error: type[Exception], fn: Any, *args: Any, **kwargs: Any) -> None:
        before = self.snapshot()
        try:
            fn(*args, **kwargs)
        except error:
            pass
        else:
            raise AssertionError(f"{getattr(fn, '__name__', fn)} was not refused with {error.__name__}")
        assert self.snapshot() == before, f"refused {getattr(fn, '__name__', fn)} wrote to the store"

    # -- operations --------------------------------------------------------------------------------
    # One rule draws the operation, so producers and the trainer run far more often than
    # checkpoints, reopens and rollbacks (each still appears about once per run).
    @rule(pick=st.integers(0, 100 * len(OPERATIONS) - 1), data=st.data())
    def step(self, pick, data):
        getattr(self, self.OPERATIONS[pick % len(self.OPERATIONS)])(data)

    def live_leases(self) -> list[Any]:
        """The leases that can still commit: this store's, current timeline and attempt, in flight."""
        m = self.model
        return [x for x in self.leases if x.store_id == self.store_id and x.timeline == m.timeline
                and (p := m.prompts.get(x.group_id)) is not None and p.state == INFLIGHT and p.attempt == x.attempt]

    def lease(self, data: Any) -> Any:
        """Mostly a lease that can still commit; sometimes any lease ever issued (stale, replayed)."""
        live = self.live_leases()
        pool = live if live and data.draw(st.sampled_from([True, True, True, False]), label="live") else self.leases
        return data.draw(st.sampled_from(pool), label="lease")

    def admit(self, data) -> list[Any]:
        m = self.model
        count = data.draw(st.integers(1, 3), label="count")
        lag = data.draw(st.none() | st.integers(-1, 2), label="weight lag (-1: a future weight)")
        weight = m.wv if lag is None else max(0, m.wv - lag)
        dataloader = f"dl-{m.admissions}-{count}".encode()
        prompts = [Prompt(prompt_idx=m.seq + j) for j in range(count)]
        kwargs = {} if lag is None else {"weight_version": weight}
        error = m.admit_error(count)
        if error is not None:
            self.refused(error, self.buf.admit, prompts, dataloader, timeout=0, **kwargs)
            return []
        leases = self.buf.admit(prompts, dataloader, timeout=0, **kwargs)
        expected = m.admit(count, weight, dataloader)
        assert [(x.group_id, x.attempt, x.target_step, x.start_weight, x.missing) for x in leases] == [
            (p.gid, 0, p.target_step, weight, tuple(range(N))) for p in expected]
        self.leases += leases
        return leases

    def produce(self, data):
        """A rollout batch: admit, then commit most of the groups at once."""
        for lease in self.admit(data):
            if data.draw(st.sampled_from([True, True, False]), label="commit it"):
                self.commit_lease(lease, 0, False, None)

    def train(self, data):
        """A training step: select, read the batch (the rows of the one legitimate commit of each
        group, never a fenced lease's), then finish the step."""
        selection = self.select(data)
        if selection.group_ids:
            batch = self.buf.read_batch(selection, layout="list")
            for gid, index, row in zip(batch.group_ids, batch.row_indices, batch.rows, strict=True):
                want = row_for(gid, index, self.model.prompts[gid].rows[index])
                assert all(bool((row[k] == want[k]).all()) for k in want), f"{gid} row {index}: wrong rows"
        self.finish_step(data)

    def zombie(self, data):
        """A lease of an abandoned timeline or another store commits (zombies use variant 2). With no
        foreign lease yet, the other store admits one first, and the kind is drawn before the lease:
        a run that draws zombies fences both kinds, not only by luck."""
        if all(x.store_id == self.store_id for x in self.leases):
            self.foreign_admit(data)
        stale = {"timeline zombie": [x for x in self.leases
                                     if x.store_id == self.store_id and x.timeline != self.model.timeline],
                 "foreign zombie": [x for x in self.leases if x.store_id != self.store_id]}
        kind = data.draw(st.sampled_from([kind for kind, leases in stale.items() if leases]), label="zombie kind")
        lease = data.draw(st.sampled_from(stale[kind]), label="zombie")
        self.seen[kind] += 1
        if data.draw(st.booleans(), label="whole group"):
            error, _ = self.model.commit_error(lease, dict.fromkeys(range(N), 2), whole=True, store_id=self.store_id)
            assert error is not None, f"zombie {lease} would be accepted"
            self.commit_lease(lease, 2, False, None)
        else:
            index = data.draw(st.integers(0, N - 1), label="index")
            error, _ = self.model.commit_error(lease, {index: 2}, whole=False, store_id=self.store_id)
            assert error is not None, f"zombie {lease} would be accepted"
            self.refused(error, self.buf.commit_sample, lease, index, row_for(lease.group_id, index, 2))

    def append(self, lease: Any, index: int, data: Any, label: str,
               kinds: tuple[str, ...] = ("next", "next", "next", "retry", "conflict", "gap", "future", "over"),
               versions: list[int] | None = None, most: int = 2) -> None:
        """One ``record_progress`` of ``lease``'s sample ``index``: the next chunk, a retry of a
        recorded chunk, a conflicting one, a gap or a weight from the future (drawn as ``label``);
        ``versions``: the weight versions to draw the chunk's from (default: 0, and the older and the
        newer of the trainer's and the weights' versions); ``most``: tokens in a next chunk, at most."""
        m = self.model
        prompt = m.prompts.get(lease.group_id)
        chunks = [] if prompt is None else list(prompt.chunks.get(index, ()))
        length = sum(n for _, n, _ in chunks)
        base = row_for(lease.group_id, index, 0)
        kind = data.draw(st.sampled_from(kinds), label=label)
        start, n, change = length, min(most, 1 + (length < 3 + index - 1)), 0
        # any version up to the newest of the trainer's and the weights' (which may lag the trainer)
        versions = versions or sorted({0, min(m.wv, m.tv), max(m.wv, m.tv)})
        version = data.draw(st.sampled_from(versions), label="version")
        if kind in ("retry", "conflict") and chunks:
            start, n, version = data.draw(st.sampled_from(chunks), label="chunk")
            change = int(kind == "conflict")
        elif kind == "gap":
            start += 1
        elif kind == "future":
            version = max(m.tv, m.wv) + 1
        if kind == "next" and start >= 3 + index:
            return  # the sample is complete: its producer appends nothing more
        n = min(n, max(1, 3 + index - start))  # a prefix never outgrows variant 0's row
        if kind == "over":
            n = MAX_TOKENS - start + 1  # one token past the schema's bound
        import torch

        tokens = base["input_ids"][start:start + n] + change
        if len(tokens) < n:  # past the row's end: pad (only a gap or a refused append gets here)
            tokens = torch.cat([tokens, torch.zeros(n - len(tokens), dtype=torch.int64)])
        logprobs = torch.full((n,), -0.5)
        error, retry = m.progress_error(lease, index, start, n, (start, n, version) in chunks and not change, version,
                                        self.store_id)
        call = functools.partial(self.buf.record_progress, lease, index, start=start, tokens=tokens,
                                 logprobs=logprobs, weight_version=version)
        if error is None and start + n > 3 + index:
            error = None if retry else BadArgument  # never reached: appends stay within the row
        if error is not None:
            self.seen["over the bound"] += error is SchemaMismatch
            self.refused(error, call)
            return
        before = self.snapshot() if retry else None
        assert call() == start + n  # where the chunk ends (a retry: its first answer)
        if retry:
            assert self.snapshot() == before
            return
        self.seen["chunk past the weights"] += version > m.wv
        self.seen["versions down"] += bool(chunks) and version < chunks[-1][2]
        self.seen["prefix at bound"] += length + n == MAX_TOKENS
        prompt.chunks.setdefault(index, []).append((start, n, version))
        self.seen["progress"] += 1

    def progress(self, data):
        """A producer records the next chunk of a sample (mostly under a lease that may)."""
        if not self.leases:
            return
        lease = self.lease(data)
        self.append(lease, data.draw(st.integers(0, N - 1), label="index"), data, "progress kind")

    def generate(self, data):
        """A producer generates one sample chunk by chunk (each chunk's weight version drawn, so
        versions go down as well as up) until the row is complete, which for the last row is the
        schema's bound; then it commits a sibling (which must leave this prefix alone) or the sample."""
        live = self.live_leases()
        if not live:
            self.produce(data)
            return
        lease = data.draw(st.sampled_from(live), label="lease")
        index = data.draw(st.integers(0, N - 1), label="index")
        for _ in range(2):
            self.append(lease, index, data, "generate kind", kinds=("next",))
        which = data.draw(st.sampled_from([None, index, *(i for i in range(N) if i != index)]), label="then commit")
        if which is not None:
            self.commit_one(lease, which, 0)

    def lag_and_roll_back(self, data):
        """Issue 35's progress path in one operation, each step predicted by the model: a sample's
        first chunk, the step closes with the rollout weights behind the trainer, a chunk made by
        the trainer's (newer) version, a recovery that rolls the weights back, and the new attempt
        continuing with older weights (the sample's versions go down)."""
        live = [x for x in self.live_leases() if any(not self.model.prompts[x.group_id].chunks.get(i)
                                                     and i not in self.model.prompts[x.group_id].rows
                                                     for i in range(N))]
        if not live:
            self.produce(data)
            return
        lease = data.draw(st.sampled_from(live), label="lease")
        prompt = self.model.prompts[lease.group_id]
        index = next(i for i in range(N) if not prompt.chunks.get(i) and i not in prompt.rows)
        # one token each before the recovery, so the shortest sample (3 tokens) has room for the third
        self.append(lease, index, data, "scenario kind", kinds=("next",), most=1)
        lag = data.draw(st.integers(1, 2), label="weight lag")
        assert self.buf.finish_step(weight_version=max(0, self.model.tv + 1 - lag)) == self.model.tv + 1
        self.model.finish_step(max(0, self.model.tv + 1 - lag))
        self.seen["weights behind"] += 1
        newest = max(self.model.tv, self.model.wv)
        self.append(lease, index, data, "scenario kind", kinds=("next",), versions=[newest], most=1)
        self.recover(data)
        resumed = [x for x in self.live_leases() if x.group_id == lease.group_id]
        older = sorted({0, min(self.model.tv, self.model.wv)} - {newest})  # newest >= 1: never empty
        if resumed:
            self.append(resumed[-1], index, data, "scenario kind", kinds=("next",), versions=older)

    def zombie_progress(self, data):
        """A lease of an abandoned timeline or another store appends progress: always refused."""
        stale = [x for x in self.leases if x.store_id != self.store_id or x.timeline != self.model.timeline]
        if not stale:
            return
        lease = data.draw(st.sampled_from(stale), label="zombie")
        index = data.draw(st.integers(0, N - 1), label="index")
        prompt = self.model.prompts.get(lease.group_id)
        error, _ = self.model.progress_error(lease, index, 0 if prompt is None else prompt.length(index), 1, False, 0,
                                             self.store_id)
        assert error is not None, f"zombie progress of {lease} would be accepted"
        self.seen["zombie progress"] += 1
        self.append(lease, index, data, "zombie progress kind")

    def foreign_admit(self, data):
        """Another store admits prompts (its group ids collide with ours): keep its leases as zombies."""
        with contextlib.suppress(GateTimeout, CapacityError):
            self.leases += self.foreign.admit([Prompt(prompt_idx=0)], timeout=0)

    def restore(self, data):
        """Restore any earlier checkpoint (a crash loop may restore the same one many times); with
        none taken yet, take one (so a run that draws restores does restore)."""
        if not self.saved:
            self.checkpoint(data)
            return
        dest, snapshot = data.draw(st.sampled_from(self.saved), label="checkpoint")
        self.seen["restore"] += 1
        handle, self.buf = self.buf, None
        self.buf, plan = (self.SURFACE.restore or _restore_closed)(handle, dest, self.path)
        self.inspector = self.SURFACE.inspect(self.buf)
        self.model = m = copy.deepcopy(snapshot)
        _, redispatch = m.recover(m.tv, plan.timeline)
        assert [(x.group_id, x.attempt, x.timeline, x.store_id) for x in plan.leases] == [
            (p.gid, p.attempt, m.timeline, self.store_id) for p in redispatch]
        self.leases += plan.leases

    def commit_group(self, data):
        if not self.leases:
            return
        lease = self.lease(data)
        variant = data.draw(st.integers(0, 1), label="variant")
        missing_only = data.draw(st.booleans(), label="missing rows only")
        end_weight = data.draw(st.none() | st.integers(0, 9), label="end_weight")
        self.commit_lease(lease, variant, missing_only, end_weight)

    def commit_lease(self, lease: Any, variant: int, missing_only: bool, end_weight: int | None) -> None:
        indices = list(lease.missing) if missing_only and len(lease.missing) < N else list(range(N))
        rows = {i: variant for i in indices}
        payload = [row_for(lease.group_id, i, variant) for i in indices]
        error, replay = self.model.commit_error(lease, rows, whole=True, store_id=self.store_id)
        if error is not None:
            self.refused(error, self.buf.commit_group, lease, payload, end_weight=end_weight)
            return
        before = self.snapshot() if replay else None
        result = self.buf.commit_group(lease, payload, end_weight=end_weight)
        if replay:
            assert (result.ready, result.replayed, result.rows_written) == (True, True, 0)
            assert self.snapshot() == before
            return
        assert self.model.commit(lease.group_id, rows, whole=True, end_weight=end_weight)
        assert (result.ready, result.replayed, result.rows_written) == (True, False, len(indices))

    def commit_sample(self, data):
        if not self.leases:
            return
        lease = self.lease(data)
        index = data.draw(st.integers(0, N - 1), label="index")
        self.commit_one(lease, index, data.draw(st.integers(0, 1), label="variant"))

    def commit_one(self, lease: Any, index: int, variant: int) -> None:
        """``commit_sample`` of row ``index`` (content ``variant``), its outcome predicted by the model."""
        rows = {index: variant}
        error, replay = self.model.commit_error(lease, rows, whole=False, store_id=self.store_id)
        payload = row_for(lease.group_id, index, rows[index])
        if error is not None:
            self.refused(error, self.buf.commit_sample, lease, index, payload)
            return
        before = self.snapshot() if replay else None
        held = self.model.prompts[lease.group_id].chunks if not replay else {}
        self.seen["commit beside progress"] += any(c for i, c in held.items() if i != index)
        result = self.buf.commit_sample(lease, index, payload)
        if replay:
            assert result.replayed and result.ready == (self.model.prompts[lease.group_id].state != INFLIGHT)
            assert self.snapshot() == before
            return
        ready = self.model.commit(lease.group_id, rows, whole=False, end_weight=None)
        assert (result.ready, result.replayed, result.rows_written) == (ready, False, 1)

    def abort(self, data):
        inflight = [p.gid for p in self.model.having(INFLIGHT)]
        if inflight and data.draw(st.booleans(), label="in flight"):
            gid = data.draw(st.sampled_from(inflight), label="gid")
        else:
            gid = data.draw(st.sampled_from(sorted(self.model.prompts) or ["nobody"]), label="gid")
            if gid not in inflight:
                self.refused(UnknownGroup, self.buf.abort, gid, "test")
                return
        self.buf.abort(gid, "test")
        self.model.abort([gid])

    def abort_stale_inflight(self, data):
        expected = self.model.stale_inflight()
        assert self.buf.abort_stale_inflight() == expected
        self.model.abort(expected)

    def select(self, data):
        min_groups = data.draw(st.sampled_from([1, 2, 3]), label="min_groups")
        max_groups = min_groups + data.draw(st.integers(0, 2), label="extra")
        selection = self.buf.select(min_groups, max_groups)
        assert selection.group_ids == self.model.select(min_groups, max_groups)
        assert selection.step == self.model.tv
        return selection

    def finish_step(self, data):
        """Close the step; the rollout weights follow the trainer, or lag it (or run ahead) when drawn."""
        lag = data.draw(st.none() | st.integers(-1, 2), label="weight lag")
        weight = None if lag is None else max(0, self.model.tv + 1 - lag)
        assert self.buf.finish_step(weight_version=weight) == self.model.tv + 1
        self.model.finish_step(weight)
        self.seen["weights behind"] += self.model.wv < self.model.tv

    def evict(self, data):
        if not data.draw(st.sampled_from([False, False, True]), label="named"):
            assert self.buf.evict() == self.model.evict()
            return
        named = data.draw(st.lists(st.sampled_from(sorted(self.model.prompts) or ["nobody"]), max_size=2), label="gids")
        named = list(dict.fromkeys(named))
        if any(gid not in self.model.prompts or self.model.prompts[gid].state != "ready" for gid in named):
            self.refused(BadArgument, self.buf.evict, named)
            return
        assert self.buf.evict(named) == self.model.evict(named)

    def redispatch(self, data):
        inflight = [p.gid for p in self.model.having(INFLIGHT)]
        gid = data.draw(st.sampled_from(inflight or sorted(self.model.prompts) or ["nobody"]), label="gid")
        weight = data.draw(st.none() | st.integers(0, self.model.wv), label="new start_weight")
        if gid not in inflight:
            self.refused(UnknownGroup, self.buf.redispatch, gid, start_weight=weight)
            return
        lease = self.buf.redispatch(gid, start_weight=weight)
        prompt = self.model.redispatch(gid, weight)
        assert (lease.group_id, lease.attempt, lease.start_weight, lease.target_step, lease.missing) == (
            gid, prompt.attempt, prompt.start_weight, prompt.target_step,
            tuple(i for i in range(N) if i not in prompt.rows))
        self.leases.append(lease)

    def promote_ready_group(self, data):
        step = self.model.tv + data.draw(st.integers(0, 2), label="step - trainer_version")
        assert self.buf.promote_ready_group(step) == self.model.promote(step)

    def checkpoint(self, data):
        self.checkpoints += 1
        dest = os.path.join(self.dir, f"ckpt{self.checkpoints}.kv")
        snapshot = copy.deepcopy(self.model)  # what the file holds: durable is marked after the copy
        result = self.buf.checkpoint(dest, {"n": self.checkpoints}).wait()
        assert result.trainer_version == self.model.tv
        self.saved.append((dest, snapshot))
        self.model.checkpoint()
        assert verify_path(dest).ok

    def reopen(self, data):
        handle, self.buf = self.buf, None
        self.SURFACE.close(handle)
        self.buf = self.SURFACE.open(self.path)
        self.inspector = self.SURFACE.inspect(self.buf)

    def recover(self, data):
        m = self.model
        back = data.draw(st.none() | st.integers(-1, 3), label="versions back (None: default)")
        version = m.tv if back is None else m.tv - back
        if m.recover_error(version):
            self.refused(RecoveryError, self.buf.recover, version)
            return
        plan = self.buf.recover(None if back is None else version)
        returned, redispatch = m.recover(version, plan.timeline, rollback=back is not None)
        self.seen["recovery mid-sample"] += any(c for p in redispatch for c in p.chunks.values())
        assert (plan.resume_version, plan.groups_returned_to_ready) == (version, returned)
        assert plan.groups_complete_restored == len(m.having("ready"))
        assert [(x.group_id, x.attempt, x.target_step, x.start_weight) for x in plan.leases] == [
            (p.gid, p.attempt, p.target_step, p.start_weight) for p in redispatch]
        assert [x.missing for x in plan.leases] == [tuple(i for i in range(N) if i not in p.rows) for p in redispatch]
        assert plan.siblings_reused == sum(len(p.rows) for p in redispatch)
        assert (plan.progress_samples, plan.progress_tokens) == (
            sum(1 for p in redispatch for i in p.chunks if p.chunks[i]),
            sum(p.length(i) for p in redispatch for i in p.chunks))
        assert plan.dispatch_index == m.dispatch
        assert plan.dataloader_state == m.dataloader
        self.leases += plan.leases

    # -- invariants ----------------------------------------------------------------------------------
    @invariant()
    def store_matches_model(self):
        if self.buf is None:
            return
        m, buf, surface = self.model, self.buf, self.SURFACE
        if surface.has("store_file"):
            assert self.inspector.store.read(check).problems == []
        st_ = buf.state()
        cursors = {"dispatch_index": m.dispatch, "trainer_version": m.tv, "weight_version": m.wv, "seq": m.seq,
                   "admissions": m.admissions}
        if surface.has("durability"):
            cursors.update(durable=m.durable, drop_floor=m.drop_floor)
        assert {k: st_[k] for k in cursors} == cursors
        assert {k: st_["counters"][k] for k in m.counters} == m.counters
        inflight, ready, claimed = (m.having(s) for s in (INFLIGHT, "ready", "claimed"))
        assert (st_["inflight"], st_["ready"], st_["claimed"]) == (len(inflight), len(ready), len(claimed))
        # Capacity conservation (§G.6): only a rollback may return more groups than fit.
        assert len(inflight) + len(ready) <= m.capacity or m.rolled_back
        # Single owner (§G.10): every admitted prompt is a ledger entry xor a group record.
        ledger = buf.ledger()
        groups = buf.groups()
        assert not {e.group_id for e in ledger} & {g.group_id for g in groups}
        assert sorted([e.group_id for e in ledger] + [g.group_id for g in groups]) == sorted(m.prompts)
        assert st_["timeline"] == m.timeline
        assert [(e.group_id, e.seq, e.attempt, e.timeline, e.target_step, e.start_weight, e.lineage_fork,
                 e.lineage_newest, e.siblings) for e in ledger] == [
            (p.gid, p.seq, p.attempt, p.timeline, p.target_step, p.start_weight, p.fork, p.newest,
             tuple(sorted(p.rows))) for p in inflight]
        # Stamps (§G.9) and states of every group record, tombstones included.
        assert [(g.group_id, g.seq, g.state, g.start_weight, g.lineage_fork, g.lineage_newest, g.end_weight,
                 g.target_step, g.attempt, g.timeline, g.claimed_step, g.consumed_step, g.rows_stored)
                for g in groups] == [
            (p.gid, p.seq, p.state, p.start_weight, p.fork, p.newest, p.end_weight, p.target_step, p.attempt,
             p.timeline,
             p.claimed_step, p.consumed_step, p.rows_stored) for p in sorted(m.prompts.values(), key=lambda p: p.seq)
            if p.state != INFLIGHT]
        # Cursor exactness (§G.12): no owned work is stamped past the cursor.
        targets = [p.target_step for p in inflight + ready + claimed if p.target_step is not None]
        assert max(targets, default=-1) <= m.dispatch
        assert buf.batch_shortfall() == m.shortfall
        assert buf.dataloader_state() == m.dataloader
        # Token progress: every acknowledged chunk is there and nothing else; within a timeline a
        # sample's prefix only grows (a restore to an earlier cut starts another timeline).
        for p in inflight if surface.has("progress") else ():
            got = buf.progress(p.gid)
            want = {i: c for i, c in p.chunks.items() if c}
            assert sorted(got) == sorted(want), f"{p.gid}: progress of rows {sorted(got)}, acknowledged {sorted(want)}"
            for i, chunks in want.items():
                length = p.length(i)
                assert got[i].tokens.tolist() == row_for(p.gid, i, 0)["input_ids"][:length].tolist()
                assert got[i].versions.tolist() == [v for _, n, v in chunks for _ in range(n)]
                seen = self.prefixes.get((p.gid, i))
                assert seen is None or seen[0] != m.timeline or seen[1] <= length, f"{p.gid}/{i} shrank"
                self.prefixes[p.gid, i] = (m.timeline, length)
        # Sampler semantics (§G.5): read-only views of what select / evict / abort would take.
        if surface.has("store_file"):
            sampler = self.inspector.sampler
            view = self.inspector.store.read(lambda t: (list(sampler.eligible(BufferView(t), m.tv)),
                                                        list(sampler.evictable(BufferView(t), m.tv)),
                                                        list(sampler.inflight_to_abort(BufferView(t), m.tv))))
        else:  # a surface without a file answers the sampler's queries from its own view
            sampler, memory = buf.sampler, buf.view()
            view = (list(sampler.eligible(memory, m.tv)), list(sampler.evictable(memory, m.tv)),
                    list(sampler.inflight_to_abort(memory, m.tv)))
        assert view == (m.eligible(), m.evictable(), m.stale_inflight())


def machine_for(surface: BufferSurface, sampler: str) -> type[BufferMachine]:
    """The machine of one surface and sampler: only the rules the surface's capabilities allow."""
    operations = tuple(op for op, weight in WEIGHTS.items() if surface.has(*RULE_NEEDS.get(op, ()))
                       for _ in range(weight))
    return type(f"BufferMachine_{surface.name}_{sampler}", (BufferMachine,),
                {"SURFACE": surface, "SAMPLER": sampler, "OPERATIONS": operations})


def required(surface: BufferSurface) -> list[str]:
    """What a run on ``surface`` must draw (:data:`MUST_SEE`, less what its capabilities rule out)."""
    return [key for key, needs in MUST_SEE.items() if surface.has(*needs)]


def run_buffer_conformance(surface: BufferSurface, sampler: str, profile: settings | None = None,
                           must_see: list[str] | None = None) -> collections.Counter[str]:
    """Run the state machine on ``surface`` with a built-in sampler (``in_order``, ``weight_fifo``,
    ``windowed`` or ``ready_first``) under ``profile`` (default: ``KVCKPT_HYPOTHESIS_PROFILE``'s, ``ci``
    unless set); fail on any disagreement with the model, and if the run did not draw everything in
    ``must_see`` (default :func:`required`). Returns how often each promise was drawn."""
    BufferMachine.seen.clear()
    profile = profile or PROFILES[os.environ.get("KVCKPT_HYPOTHESIS_PROFILE", "ci")]
    run_state_machine_as_test(machine_for(surface, sampler), settings=profile)
    missing = [key for key in (required(surface) if must_see is None else must_see) if not BufferMachine.seen[key]]
    assert not missing, f"{surface.name}/{sampler}: the run never drew {missing} ({dict(BufferMachine.seen)})"
    return collections.Counter(BufferMachine.seen)


class SyncAsyncBuffer:
    """:class:`~kvckpt.AsyncReplayBuffer` driven synchronously: each coroutine runs to completion on
    this object's own event loop (the facade's transactions still run on its thread pool).
    ``buffer`` is the wrapped :class:`~kvckpt.ReplayBuffer` (what the suite inspects)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._loop = asyncio.new_event_loop()
        self._async = self._loop.run_until_complete(make())
        self.buffer = self._async.buffer

    def __getattr__(self, name: str) -> Any:
        member = getattr(self._async, name)
        if not inspect.iscoroutinefunction(member):
            return member

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.run_until_complete(member(*args, **kwargs))

        call.__name__ = name
        return call

    def close(self) -> None:
        """Close the facade (and its buffer), then the loop."""
        try:
            self._loop.run_until_complete(self._async.close())
        finally:
            self._loop.close()


def _async_restore(handle: SyncAsyncBuffer, checkpoint: str, path: str) -> tuple[SyncAsyncBuffer, Any]:
    handle.close()
    buffer, plan = restore(checkpoint, path, overwrite=True)

    async def wrap() -> AsyncReplayBuffer:
        return AsyncReplayBuffer(buffer)

    return SyncAsyncBuffer(wrap), plan


#: The asyncio facade as a surface (through :class:`SyncAsyncBuffer`); it has every capability.
ASYNC_SURFACE = BufferSurface(
    "AsyncReplayBuffer", create=lambda path, config: SyncAsyncBuffer(lambda: AsyncReplayBuffer.create(path, config)),
    open=lambda path: SyncAsyncBuffer(lambda: AsyncReplayBuffer.open(path)), restore=_async_restore,
    inspect=lambda handle: handle.buffer, offers=("async",))
#: The buffer itself as a surface: every capability, the reference the others are held to.
REPLAY_BUFFER_SURFACE = BufferSurface("ReplayBuffer", create=ReplayBuffer.create)
