"""An in-memory replay buffer with the interface of :class:`kvckpt.ReplayBuffer`, for comparison.

``replay_buffer: {backend: memory}`` selects it in the reference trainer. It keeps the same
bookkeeping as the kvckpt buffer — ledger of in-flight prompts, group states, cursors, fencing
attempts — in Python dicts under one lock, and uses **the same sampler objects** (a
:class:`MemoryView` answers the index queries of :class:`kvckpt.samplers.BufferView`), so a run
differs from a kvckpt run only in where the state lives and what it costs. Rows are validated
against the same schema and handed back by the same batch assembly.

What it cannot do is the point of the comparison: nothing survives the process. There is no
checkpoint of the buffer (``checkpoint`` raises) and no recovery: a restarted trainer resumes its
model checkpoint with an empty buffer, and every prompt that was admitted, generated or buffered
but not trained is lost (or, if the dataloader cursor was saved with the model, silently skipped).
With nothing to roll back to, consumed rows are dropped when their step finishes (unless
``retain_consumed``). It takes no encoded rows or progress messages (nothing is encoded in memory).

Otherwise it conforms to the buffer's semantics: the conformance suite
(:mod:`kvckpt.testing.buffer_conformance`) runs on it with the capabilities it lacks declared
(``tests/core/test_buffer_conformance.py``); it lives in :mod:`kvckpt.testing` beside that suite (the
conformance double, and the reference trainer's ``memory`` backend). Leases are fenced by a store id and
timeline of its own (random per buffer) and the attempt; commits are idempotent (an identical retry is ``replayed``,
different rows are a :class:`~kvckpt.DuplicateCommit`); token progress is kept per sample and a
committed row must begin with it, as in the kvckpt buffer.

Queries scan the buffer (O(buffered groups) per select): fine at the sizes it is meant for.

Long (over 400 lines): one class holds the buffer's whole surface on dicts, each operation beside the
state it changes, as :class:`kvckpt.ReplayBuffer` holds it on one file.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kvckpt.buffer import Batch, BufferConfig
from kvckpt.buffer.batch import assemble_batch
from kvckpt.errors import (
    BadArgument,
    CapacityError,
    DuplicateCommit,
    ForeignLease,
    FutureVersion,
    GateTimeout,
    KvckptError,
    SampleCommitted,
    StaleAttempt,
    UnknownGroup,
)
from kvckpt.storage.codec import Record
from kvckpt.tables.records import (
    ABORTED,
    CLAIMED,
    CONSUMED,
    EVICTED,
    READY,
    Admission,
    CommitResult,
    GroupInfo,
    Lease,
    LedgerEntry,
    Progress,
    Prompt,
    Selection,
)
from kvckpt.transitions.fencing import fence
from kvckpt.transitions.progress import (
    FIELD_PREFIX,
    Chunk,
    decode_chunk,
    encode_chunk,
    hold_row_against_prefix,
)


class MemoryView:
    """The index queries of :class:`kvckpt.samplers.BufferView`, answered from dicts."""

    def __init__(self, groups: Mapping[str, GroupInfo], ledger: Mapping[str, LedgerEntry]) -> None:
        self._ready = sorted((g for g in groups.values() if g.state == READY), key=lambda g: g.seq)
        self._ledger = ledger
        self._groups = groups

    def ready_in_order(self) -> Iterator[str]:
        """Every ready group in dispatch order."""
        return (g.group_id for g in self._ready)

    def group_weight(self, group_id: str) -> int:
        """The ``start_weight`` of a committed group."""
        return self._groups[group_id].start_weight

    def ready_with_weight(self, weight: int) -> Iterator[str]:
        """Ready groups whose ``start_weight`` equals ``weight``."""
        return (g.group_id for g in self._ready if g.start_weight == weight)

    def ready_in_weight_range(self, lo: int, hi: int) -> Iterator[str]:
        """Ready groups with ``lo <= start_weight <= hi``, in dispatch order."""
        return (g.group_id for g in self._ready if lo <= g.start_weight <= hi)

    def ready_below_weight(self, lo: int) -> Iterator[str]:
        """Ready groups with ``start_weight < lo``, by weight then dispatch order (the index's order)."""
        return (g.group_id for g in sorted(self._ready, key=lambda g: (g.start_weight, g.seq)) if g.start_weight < lo)

    def ready_for_target(self, step: int) -> Iterator[str]:
        """Ready groups stamped with ``target_step == step``."""
        return (g.group_id for g in self._ready if g.target_step == step)

    def ready_below_target(self, step: int) -> Iterator[str]:
        """Ready groups stamped with a ``target_step < step``, by step then dispatch order (the index's order)."""
        stamped = sorted((g for g in self._ready if g.target_step is not None), key=lambda g: (g.target_step, g.seq))
        return (g.group_id for g in stamped if g.target_step < step)

    def pending_below_weight(self, lo: int) -> Iterator[str]:
        """In-flight groups with ``start_weight < lo``, by weight then dispatch order (the index's order)."""
        return (e.group_id for e in sorted(self._ledger.values(), key=lambda e: (e.start_weight, e.seq))
                if e.start_weight < lo)

    def min_weight(self, lo: int, hi: int, include_pending: bool) -> int | None:
        """The smallest ``start_weight`` in ``[lo, hi]`` over ready (and optionally in-flight) groups."""
        weights = [g.start_weight for g in self._ready]
        if include_pending:
            weights += [e.start_weight for e in self._ledger.values()]
        inside = [w for w in weights if lo <= w <= hi]
        return min(inside) if inside else None


class MemoryReplayBuffer:
    """The replay buffer's operations on Python dicts; nothing is written anywhere.

    Args:
        config: the same :class:`kvckpt.BufferConfig` a kvckpt store takes.

    Thread-safe (one lock). Methods, arguments and refusals follow :class:`kvckpt.ReplayBuffer`;
    ``checkpoint`` and ``recover`` raise :class:`NotImplementedError`.
    """

    #: Counters of :meth:`kvckpt.ReplayBuffer.state` this buffer keeps.
    COUNTERS = ("admitted", "committed", "samples_committed", "selected", "consumed", "evicted", "aborted",
                "redispatched")

    def __init__(self, config: BufferConfig) -> None:
        self.config = config
        self.sampler = config.sampler
        self.schema = config.schema
        self.path = ":memory:"
        self._lock = threading.Condition()
        self._ledger: dict[str, LedgerEntry] = {}
        self._partial: dict[str, dict[int, dict[str, Any]]] = {}
        self._groups: dict[str, GroupInfo] = {}
        self._rows: dict[str, dict[int, dict[str, Any]]] = {}
        self._progress: dict[str, dict[int, list[Chunk]]] = {}  # in-flight group -> sample -> chunks
        self._token_weight: dict[str, int] = {}  # in-flight group -> oldest version of progress it consumed
        self._shortfall: dict[int, int] = {}
        self._dataloader: bytes | None = None
        #: Its own fencing identity: a lease of another buffer (or kvckpt store) is refused.
        self.store_id, self.timeline = uuid.uuid4().hex, uuid.uuid4().hex
        self._st = {"dispatch_index": -1, "trainer_version": 0, "weight_version": 0, "admissions": 0, "seq": 0}
        self._counters = dict.fromkeys(self.COUNTERS, 0)

    # -- admission -------------------------------------------------------------------------------
    def _blocker(self, count: int, gated: bool = True) -> str | None:
        st, gate = self._st, self.sampler.gate_window
        if gated and gate is not None and st["dispatch_index"] >= st["trainer_version"] + gate:
            return f"gate closed at dispatch_index {st['dispatch_index']}"
        ready = sum(1 for g in self._groups.values() if g.state == READY)
        if len(self._ledger) + ready + count > self.config.max_buffered_rollouts:
            return "capacity"
        return None

    def admissible(self, count: int = 1) -> bool:
        """Whether ``count`` prompts could be admitted now."""
        with self._lock:
            return self._blocker(count) is None

    def _wait_for(self, count: int, timeout: float | None, gated: bool) -> None:
        """Wait (holding the lock between tries) until ``count`` prompts fit, and the gate is open if ``gated``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (blocker := self._blocker(count, gated)) is not None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise GateTimeout(f"admission still blocked after {timeout}s: {blocker}")
            self._lock.wait(remaining)

    def _advance(self, dataloader_state: bytes | None) -> Admission:
        st = self._st
        target = None
        if self.sampler.gate_window is not None:
            st["dispatch_index"] += 1
            target = st["dispatch_index"] if self.sampler.stamps_target_step else None
        admission = Admission(f"a{st['admissions']}", st["dispatch_index"], target)
        st["admissions"] += 1
        if dataloader_state is not None:
            self._dataloader = bytes(dataloader_state)
        return admission

    def advance_dispatch(self, dataloader_state: bytes | None = None, *, timeout: float | None = None) -> Admission:
        """Make an admission without prompts yet; prompts join it with ``admit(..., admission=...)``."""
        with self._lock:
            self._wait_for(0, timeout, gated=True)
            return self._advance(dataloader_state)

    def admit(self, prompts: Sequence[Prompt | int | Mapping[str, Any]], dataloader_state: bytes | None = None,
              *, timeout: float | None = None, weight_version: int | None = None,
              admission: Admission | None = None, holder: str | None = None) -> list[Lease]:
        """Admit one dataloader batch (waits for the gate and capacity, like the kvckpt buffer), or
        join ``admission`` (from :meth:`advance_dispatch`: only capacity is waited for), for the
        producer ``holder``."""
        batch = [p if isinstance(p, Prompt) else Prompt(prompt_idx=p) if isinstance(p, int) else Prompt(**p)
                 for p in prompts]
        if not batch:
            raise BadArgument("admit needs at least one prompt")
        if len(batch) > self.config.max_buffered_rollouts:
            raise CapacityError(f"a batch of {len(batch)} prompts exceeds max_buffered_rollouts")
        with self._lock:
            self._wait_for(len(batch), timeout, gated=admission is None)
            st = self._st
            id_format = "{a}-s{seq}" if admission is not None else "{a}-p{j}"  # joined: many calls, as kvckpt's
            if admission is None:
                admission = self._advance(None)
            admission_id, target = admission.admission_id, admission.target_step
            start = st["weight_version"] if weight_version is None else int(weight_version)
            leases = []
            for j, prompt in enumerate(batch):
                gid = prompt.group_id or id_format.format(a=admission_id, j=j, seq=st["seq"])
                if gid in self._ledger or gid in self._groups:
                    raise BadArgument(f"group id {gid!r} is already in use")
                entry = LedgerEntry(gid, admission_id, int(prompt.prompt_idx), prompt.task_name,
                                    self.config.group_size, target, start, attempt=0, seq=st["seq"],
                                    timeline=self.timeline, holder=holder)
                st["seq"] += 1
                self._ledger[gid] = entry
                self._partial[gid] = {}
                leases.append(entry.lease(self.store_id))
            self._counters["admitted"] += len(batch)
            if dataloader_state is not None:
                self._dataloader = bytes(dataloader_state)
            return leases

    # -- commits ---------------------------------------------------------------------------------
    def commit_group(self, lease: Lease, rows: Sequence[Mapping[str, Any]] | Mapping[int, Mapping[str, Any]],
                     *, end_weight: int | None = None) -> CommitResult:
        """Commit the missing rows of a group (all of them, or ``{index: row}``)."""
        items = sorted(rows.items()) if isinstance(rows, Mapping) else list(enumerate(rows))
        return self._commit(lease, items, end_weight, whole=True)

    def commit_sample(self, lease: Lease, index: int, row: Mapping[str, Any],
                      *, end_weight: int | None = None) -> CommitResult:
        """Commit one row of a group; the group is ready once all its rows are in."""
        return self._commit(lease, [(index, row)], end_weight, whole=False)

    def commit_many(self, items: Sequence[Mapping[str, Any]]) -> list[CommitResult | KvckptError]:
        """Commit several groups (``{"lease", "rows", "end_weight"}``) or single rows (with ``"index"``),
        each its own transition; returns each result or the error that refused it."""
        out: list[CommitResult | KvckptError] = []
        for item in items:
            try:
                if item.get("index") is None:
                    out.append(self.commit_group(item["lease"], item["rows"], end_weight=item.get("end_weight")))
                else:
                    out.append(self.commit_sample(item["lease"], item["index"], item["rows"],
                                                  end_weight=item.get("end_weight")))
            except KvckptError as exc:
                out.append(exc)
        return out

    def _commit(self, lease: Lease, items: list[tuple[int, Mapping[str, Any]]], end_weight: int | None,
                whole: bool) -> CommitResult:
        arrays = [(i, self.schema.validate(row, f"row {lease.group_id}_g{i}")) for i, row in items]
        gid = lease.group_id
        with self._lock:
            entry = self._ledger.get(gid)
            if entry is None:
                return self._commit_again(lease, arrays)
            fence(lease, self.store_id, entry.timeline, entry.attempt, "in flight")
            partial = self._partial[gid]
            if not whole and arrays[0][0] in partial:
                [(index, row)] = arrays
                if not _same(partial[index], row):
                    raise DuplicateCommit(f"row {index} of group {gid!r} is already committed with other content")
                return CommitResult(gid, ready=False, replayed=True)
            consumed = [self._consume(gid, i, row) for i, row in arrays]
            for i, _ in arrays:
                self._progress.get(gid, {}).pop(i, None)
            weights = [w for w in (self._token_weight.get(gid), *consumed) if w is not None]
            if weights:
                self._token_weight[gid] = min(weights)
            partial.update(arrays)
            if not whole:
                self._counters["samples_committed"] += len(arrays)
            if len(partial) < entry.group_size:
                self._ledger[gid] = dataclasses.replace(entry, siblings=tuple(sorted(partial)))
                return CommitResult(gid, ready=False, rows_written=len(arrays))
            del self._ledger[gid]
            self._progress.pop(gid, None)
            token_weight = self._token_weight.pop(gid, None)
            start = entry.start_weight if token_weight is None else min(entry.start_weight, token_weight)
            self._rows[gid] = self._partial.pop(gid)
            self._groups[gid] = GroupInfo(
                entry.group_id, entry.prompt_idx, entry.task_name, entry.admission_id, entry.seq, entry.group_size,
                READY, start, self._st["weight_version"] if end_weight is None else int(end_weight),
                entry.target_step, entry.attempt, "", timeline=entry.timeline)
            self._counters["committed"] += 1
            self._lock.notify_all()
            return CommitResult(gid, ready=True, rows_written=len(arrays))

    def _commit_again(self, lease: Lease, arrays: list[tuple[int, dict[str, Any]]]) -> CommitResult:
        """A commit of a group no longer in flight: a replay of what it holds, or refused."""
        gid = lease.group_id
        group = self._groups.get(gid)
        if group is None or group.state in (EVICTED, ABORTED):
            raise UnknownGroup(f"group {gid!r} is not in flight")
        fence(lease, self.store_id, group.timeline, group.attempt, f"committed ({group.state})")
        stored = self._rows.get(gid)
        if stored is None or not all(_same(stored[i], row) for i, row in arrays):
            raise DuplicateCommit(f"group {gid!r} is already committed ({group.state}) with other rows, or its rows "
                                  "were dropped")
        return CommitResult(gid, ready=True, replayed=True)

    def _consume(self, gid: str, index: int, row: Mapping[str, Any]) -> int | None:
        """Hold a row against its sample's progress (as the kvckpt commit does); the oldest version of it."""
        chunks = self._progress.get(gid, {}).get(index)
        if not chunks:
            return None
        records = [decode_chunk(self.schema, gid, index, c.start, c.value) for c in chunks]
        tokens = np.concatenate([r.arrays["tokens"] for r in records])
        versions = np.concatenate([np.full(c.length, c.version, np.int64) for c in chunks])
        hold_row_against_prefix(f"row {index} of group {gid!r}", row, tokens, versions)
        return int(versions.min())

    # -- token progress --------------------------------------------------------------------------
    def record_progress(self, lease: Lease, index: int, *, start: int, tokens: Any, logprobs: Any,
                        weight_version: int, fields: Mapping[str, Any] | None = None) -> int:
        """Append the next chunk of sample ``index``'s completion; returns where it ends (a retry of the
        same chunk is a no-op answered the same). Refusals as :meth:`kvckpt.ReplayBuffer.record_progress`."""
        chunk = encode_chunk(self.schema, lease, index, start, tokens, logprobs, weight_version, fields)
        gid, where = lease.group_id, f"progress of row {index} of group {lease.group_id!r}"
        with self._lock:
            entry = self._ledger.get(gid)
            if entry is None:
                group = self._groups.get(gid)
                if group is None or group.state in (EVICTED, ABORTED):
                    raise UnknownGroup(f"{where} refused: the group is not in flight")
                fence(lease, self.store_id, group.timeline, group.attempt, "committed", "progress")
                raise SampleCommitted(f"{where} refused: the group is already committed ({group.state})")
            try:
                fence(lease, self.store_id, entry.timeline, entry.attempt, "in flight", "progress")
            except StaleAttempt as exc:  # a resend of a chunk that landed gets its first answer (exactly-once)
                landed = self._progress.get(gid, {}).get(chunk.index, ())
                if isinstance(exc, ForeignLease) or chunk.index in self._partial[gid] or not any(
                        c.start == chunk.start and c.value == chunk.value for c in landed):
                    raise
                return chunk.start + chunk.length
            if chunk.index in self._partial[gid]:
                raise SampleCommitted(f"{where} refused: the row is already committed")
            if chunk.version > max(self._st["trainer_version"], self._st["weight_version"]):
                raise FutureVersion(f"{where} refused: weight version {chunk.version} is from the future")
            chunks = self._progress.setdefault(gid, {}).setdefault(chunk.index, [])
            length = sum(c.length for c in chunks)
            if chunk.start > length:
                raise BadArgument(f"{where} refused: the prefix is {length} tokens long (a gap)")
            if chunk.start < length:
                if any(c.start == chunk.start and c.value == chunk.value for c in chunks):
                    return chunk.start + chunk.length  # a retry: its first answer
                raise DuplicateCommit(f"{where} refused: tokens from {chunk.start} are recorded with other content")
            chunks.append(chunk)
            return length + chunk.length

    def record_progress_many(self, items: Sequence[Mapping[str, Any]]) -> list[int | KvckptError]:
        """:meth:`record_progress` of each item (its keyword arguments plus ``lease`` and ``index``);
        returns each prefix length or the error that refused it."""
        out: list[int | KvckptError] = []
        for item in items:
            try:
                out.append(self.record_progress(**item))
            except KvckptError as exc:
                out.append(exc)
        return out

    def progress(self, lease_or_group_id: Lease | str) -> dict[int, Progress]:
        """The token prefix of every sample of a group that has one (``{}`` when none)."""
        import torch

        gid = lease_or_group_id.group_id if isinstance(lease_or_group_id, Lease) else lease_or_group_id
        with self._lock:
            held = {i: list(chunks) for i, chunks in self._progress.get(gid, {}).items() if chunks}
        found = {}
        for index, chunks in sorted(held.items()):
            tensors = [decode_chunk(self.schema, gid, index, c.start, c.value).tensors() for c in chunks]
            names = [n for n in tensors[0] if n.startswith(FIELD_PREFIX) and all(n in t for t in tensors)]
            found[index] = Progress(index, torch.cat([t["tokens"] for t in tensors]),
                                    torch.cat([t["logprobs"] for t in tensors]),
                                    torch.cat([torch.full((c.length,), c.version, dtype=torch.int64) for c in chunks]),
                                    {n[len(FIELD_PREFIX):]: torch.cat([t[n] for t in tensors]) for n in names})
        return found

    # -- training side ---------------------------------------------------------------------------
    def select(self, min_groups: int = 1, max_groups: int | None = None) -> Selection:
        """Claim up to ``max_groups`` groups the sampler picks (fewer than ``min_groups``: none)."""
        max_groups = self.config.groups_per_step if max_groups is None else max_groups
        with self._lock:
            step = self._st["trainer_version"]
            gids = self.sampler.select(self.view(), step, min_groups, max_groups)
            return self._claim(gids)

    def _claim(self, gids: Iterable[str]) -> Selection:
        step = self._st["trainer_version"]
        claimed = tuple(self._replace(gid, state=CLAIMED, claimed_step=step) for gid in gids)
        self._counters["selected"] += len(claimed)
        return Selection(step, claimed)

    def claim(self, group_ids: Iterable[str]) -> Selection:
        """Claim exactly the named ready groups for the current step, all or none.

        Raises:
            BadArgument: a named group is not ready (nothing is claimed then).
        """
        gids = list(group_ids)
        with self._lock:
            self._require(gids, READY, "claimed")
            return self._claim(gids)

    def release_claims(self, group_ids: Iterable[str]) -> list[str]:
        """Return claims of the current step to ready, all or none.

        Raises:
            BadArgument: a named group is not claimed by the current step (nothing is released).
        """
        gids = list(group_ids)
        with self._lock:
            step = self._st["trainer_version"]
            for gid in gids:
                group = self._groups.get(gid)
                if group is None or group.state != CLAIMED or group.claimed_step != step:
                    raise BadArgument(f"group {gid!r} is not claimed by the current step; nothing was released")
            for gid in gids:
                self._replace(gid, state=READY, claimed_step=None)
            self._lock.notify_all()
            return gids

    def _require(self, gids: list[str], state: str, verb: str) -> None:
        """Refuse (before any change) unless every named group is in ``state``."""
        for gid in gids:
            group = self._groups.get(gid)
            if group is None or group.state != state:
                raise BadArgument(f"group {gid!r} is {'unknown' if group is None else group.state}, not {state}: "
                                  f"nothing was {verb}")

    def _replace(self, gid: str, **changes: Any) -> GroupInfo:
        group = GroupInfo.from_dict({**self._groups[gid].to_dict(), **changes})
        self._groups[gid] = group
        return group

    def read_batch(self, groups: Selection | Iterable[str], *, fields: Sequence[str] | None = None,
                   layout: str = "padded", pad_value: float = 0) -> Batch:
        """The rows of the given groups as torch tensors (same assembly as the kvckpt buffer)."""
        gids = groups.group_ids if isinstance(groups, Selection) else list(groups)
        with self._lock:
            infos = [self._groups[g] for g in gids]
            rows = [(g, i, self._rows[g][i]) for g in gids for i in sorted(self._rows[g])]
        dtypes = self.schema.dtypes
        decoded = [Record({k: v if isinstance(v, (str, bytes)) else v.copy() for k, v in arrays.items()
                           if fields is None or k in fields}, dtypes).tensors()  # bfloat16 bits -> bfloat16
                   for _, _, arrays in rows]
        return assemble_batch(self.schema, infos, [(g, i, b"") for g, i, _ in rows], decoded, layout, pad_value)

    def finish_step(self, *, weight_version: int | None = None) -> int:
        """Claimed groups -> consumed (their rows dropped), ``trainer_version`` + 1."""
        with self._lock:
            step = self._st["trainer_version"]
            keep = self.config.retain_consumed  # else nothing can roll back to them: dropped at once
            for gid in [g.group_id for g in self._groups.values() if g.state == CLAIMED]:
                self._replace(gid, state=CONSUMED, consumed_step=step, rows_stored=keep)
                if not keep:
                    self._rows.pop(gid, None)
                self._counters["consumed"] += 1
            self._st["trainer_version"] = step + 1
            self._st["weight_version"] = step + 1 if weight_version is None else int(weight_version)
            self._lock.notify_all()
            return step + 1

    def evict(self, group_ids: Iterable[str] | None = None) -> list[str]:
        """Remove ready groups the sampler can no longer select (or exactly the named ready groups).

        Raises:
            BadArgument: a named group is not ready (nothing is evicted then).
        """
        with self._lock:
            if group_ids is None:
                gids = list(self.sampler.evictable(self.view(), self._st["trainer_version"]))
            else:
                gids = list(group_ids)
                self._require(gids, READY, "evicted")
            for gid in gids:
                self._replace(gid, state=EVICTED, rows_stored=False)
                self._rows.pop(gid, None)
            self._counters["evicted"] += len(gids)
            if gids:
                self._lock.notify_all()
            return gids

    def promote_ready_group(self, to_target_step: int) -> int | None:
        """Re-stamp the ready group with the largest later ``target_step`` onto ``to_target_step``;
        the lender's step, or ``None`` if no later ready group exists."""
        with self._lock:
            stamped = [g for g in self._groups.values() if g.state == READY and g.target_step is not None]
            if not stamped:
                return None
            lender = max(stamped, key=lambda g: (g.target_step, g.seq))
            if lender.target_step <= to_target_step:
                return None
            self._replace(lender.group_id, target_step=int(to_target_step))
            return lender.target_step

    def redispatch(self, group_id: str, *, start_weight: int | None = None, holder: str | None = None) -> Lease:
        """Hand an in-flight prompt to a new attempt (fencing the old lease) held by ``holder``,
        with a new ``start_weight`` if given; committed siblings and progress are kept.

        Raises:
            UnknownGroup: ``group_id`` is not in flight.
        """
        with self._lock:
            entry = self._ledger.get(group_id)
            if entry is None:
                raise UnknownGroup(f"group {group_id!r} is not in flight")
            return self._bump(entry, start_weight, holder)

    def _bump(self, entry: LedgerEntry, start_weight: int | None, holder: str | None) -> Lease:
        entry = dataclasses.replace(entry, attempt=entry.attempt + 1, timeline=self.timeline, holder=holder,
                                    start_weight=entry.start_weight if start_weight is None else int(start_weight))
        self._ledger[entry.group_id] = entry
        self._counters["redispatched"] += 1
        return entry.lease(self.store_id)

    def leases_held_by(self, holder: str) -> list[Lease]:
        """The current lease of every in-flight prompt ``holder`` holds, in dispatch order."""
        with self._lock:
            return [e.lease(self.store_id) for e in sorted(self._ledger.values(), key=lambda e: e.seq)
                    if e.holder == holder]

    def redispatch_held_by(self, holder: str, *, to: str | None = None,
                           start_weight: int | None = None) -> list[Lease]:
        """:meth:`redispatch` every in-flight prompt ``holder`` holds, to ``to``, at once."""
        with self._lock:
            return [self._bump(e, start_weight, to) for e in sorted(self._ledger.values(), key=lambda e: e.seq)
                    if e.holder == holder]

    def abort(self, group_id: str, reason: str) -> None:
        """Give up on an in-flight prompt."""
        with self._lock:
            self._abort([group_id], reason)

    def abort_stale_inflight(self) -> list[str]:
        """Abort in-flight prompts the sampler says are useless now."""
        with self._lock:
            gids = list(self.sampler.inflight_to_abort(self.view(), self._st["trainer_version"]))
            self._abort(gids, f"stale at version {self._st['trainer_version']}")
            return gids

    def _abort(self, gids: list[str], reason: str) -> None:
        for gid in gids:
            entry = self._ledger.pop(gid, None)
            if entry is None:
                raise UnknownGroup(f"group {gid!r} is not in flight; nothing to abort")
            self._partial.pop(gid, None)
            self._progress.pop(gid, None)
            self._token_weight.pop(gid, None)
            if entry.target_step is not None:
                self._shortfall[entry.target_step] = self._shortfall.get(entry.target_step, 0) + 1
            self._groups[gid] = GroupInfo(gid, entry.prompt_idx, entry.task_name, entry.admission_id, entry.seq,
                                          entry.group_size, ABORTED, entry.start_weight, -1, entry.target_step,
                                          entry.attempt, "", rows_stored=False, reason=reason,
                                          timeline=entry.timeline)
        self._counters["aborted"] += len(gids)
        if gids:
            self._lock.notify_all()

    # -- inspection and lifecycle ----------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Cursors and counts (a copy)."""
        with self._lock:
            ready = sum(1 for g in self._groups.values() if g.state == READY)
            claimed = sum(1 for g in self._groups.values() if g.state == CLAIMED)
            return {**self._st, "inflight": len(self._ledger), "ready": ready, "claimed": claimed,
                    "counters": dict(self._counters), "store_id": self.store_id, "timeline": self.timeline}

    def stats(self) -> dict[str, Any]:
        """Counters and counts, with the kvckpt buffer's key names where they exist."""
        st = self.state()
        return {**st["counters"], "ledger_size": st["inflight"], "ready": st["ready"], "claimed": st["claimed"],
                "trainer_version": st["trainer_version"], "dispatch_index": st["dispatch_index"]}

    @property
    def trainer_version(self) -> int:
        """The number of finished steps."""
        return self._st["trainer_version"]

    def groups(self, states: Iterable[str] | None = None) -> list[GroupInfo]:
        """Group records (optionally filtered by state), in dispatch order."""
        wanted = None if states is None else set(states)
        with self._lock:
            return sorted((g for g in self._groups.values() if wanted is None or g.state in wanted),
                          key=lambda g: g.seq)

    def group(self, group_id: str) -> GroupInfo | None:
        """A group's record (any state), or ``None``."""
        with self._lock:
            return self._groups.get(group_id)

    def batch_shortfall(self) -> dict[int, int]:
        """Prompts aborted per ``target_step`` (the steps left short)."""
        with self._lock:
            return dict(self._shortfall)

    def count_for_target_step(self, step: int) -> int:
        """In-flight plus ready groups stamped for ``step``."""
        with self._lock:
            return (sum(1 for e in self._ledger.values() if e.target_step == step)
                    + sum(1 for g in self._groups.values() if g.state == READY and g.target_step == step))

    def view(self) -> MemoryView:
        """What the sampler queries: the ready groups and in-flight prompts as they are now."""
        with self._lock:
            return MemoryView(dict(self._groups), dict(self._ledger))

    def ledger(self) -> list[LedgerEntry]:
        """Every in-flight prompt, in dispatch order."""
        with self._lock:
            return sorted(self._ledger.values(), key=lambda e: e.seq)

    def dataloader_state(self) -> bytes | None:
        """The dataloader state stored with the last admission."""
        return self._dataloader

    def wait_for_change(self, timeout: float) -> None:
        """Block until another thread changes the buffer, or ``timeout``."""
        with self._lock:
            self._lock.wait(timeout)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Not possible: the state lives only in this process."""
        raise NotImplementedError("the memory replay buffer cannot be checkpointed; use backend: kvckpt")

    def recover(self, *args: Any, **kwargs: Any) -> Any:
        """Not possible: nothing survives the process."""
        raise NotImplementedError("the memory replay buffer has nothing to recover; use backend: kvckpt")

    def close(self) -> None:
        """Drop everything."""
        with self._lock:
            self._ledger.clear()
            self._partial.clear()
            self._groups.clear()
            self._rows.clear()
            self._progress.clear()


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two validated rows hold the same values."""
    return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) if not isinstance(
        a[k], (str, bytes)) else a[k] == b[k] for k in a)
