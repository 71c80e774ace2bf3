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

Queries scan the buffer (O(buffered groups) per select): fine at the sizes it is meant for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from kvckpt import (
    ABORTED,
    CLAIMED,
    CONSUMED,
    EVICTED,
    READY,
    Batch,
    BufferConfig,
    CommitResult,
    GroupInfo,
    Lease,
    LedgerEntry,
    Prompt,
    Selection,
    assemble_batch,
    codec,
)
from kvckpt.errors import BadArgument, CapacityError, GateTimeout, StaleAttempt, UnknownGroup


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
        """Ready groups with ``start_weight < lo``."""
        return (g.group_id for g in self._ready if g.start_weight < lo)

    def ready_for_target(self, step: int) -> Iterator[str]:
        """Ready groups stamped with ``target_step == step``."""
        return (g.group_id for g in self._ready if g.target_step == step)

    def ready_below_target(self, step: int) -> Iterator[str]:
        """Ready groups stamped with a ``target_step < step``."""
        return (g.group_id for g in self._ready if g.target_step is not None and g.target_step < step)

    def pending_below_weight(self, lo: int) -> Iterator[str]:
        """In-flight groups with ``start_weight < lo``."""
        return (e.group_id for e in sorted(self._ledger.values(), key=lambda e: e.seq) if e.start_weight < lo)

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
        self._dataloader: bytes | None = None
        self._st = {"dispatch_index": -1, "trainer_version": 0, "weight_version": 0, "admissions": 0, "seq": 0}
        self._counters = dict.fromkeys(("admitted", "committed", "selected", "consumed", "evicted", "aborted"), 0)

    # -- admission -------------------------------------------------------------------------------
    def _blocker(self, count: int) -> str | None:
        st, gate = self._st, self.sampler.gate_window
        if gate is not None and st["dispatch_index"] >= st["trainer_version"] + gate:
            return f"gate closed at dispatch_index {st['dispatch_index']}"
        ready = sum(1 for g in self._groups.values() if g.state == READY)
        if len(self._ledger) + ready + count > self.config.max_buffered_rollouts:
            return "capacity"
        return None

    def admissible(self, count: int = 1) -> bool:
        """Whether ``count`` prompts could be admitted now."""
        with self._lock:
            return self._blocker(count) is None

    def admit(self, prompts: Sequence[Prompt | int | Mapping[str, Any]], dataloader_state: bytes | None = None,
              *, timeout: float | None = None, weight_version: int | None = None) -> list[Lease]:
        """Admit one dataloader batch (waits for the gate and capacity, like the kvckpt buffer)."""
        batch = [p if isinstance(p, Prompt) else Prompt(prompt_idx=p) if isinstance(p, int) else Prompt(**p)
                 for p in prompts]
        if not batch:
            raise BadArgument("admit needs at least one prompt")
        if len(batch) > self.config.max_buffered_rollouts:
            raise CapacityError(f"a batch of {len(batch)} prompts exceeds max_buffered_rollouts")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while (blocker := self._blocker(len(batch))) is not None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise GateTimeout(f"admission still blocked after {timeout}s: {blocker}")
                self._lock.wait(remaining)
            st = self._st
            target = None
            if self.sampler.gate_window is not None:
                st["dispatch_index"] += 1
                target = st["dispatch_index"] if self.sampler.stamps_target_step else None
            admission_id = f"a{st['admissions']}"
            st["admissions"] += 1
            start = st["weight_version"] if weight_version is None else int(weight_version)
            leases = []
            for j, prompt in enumerate(batch):
                gid = prompt.group_id or f"{admission_id}-p{j}"
                if gid in self._ledger or gid in self._groups:
                    raise BadArgument(f"group id {gid!r} is already in use")
                entry = LedgerEntry(gid, admission_id, int(prompt.prompt_idx), prompt.task_name,
                                    self.config.group_size, target, start, attempt=0, seq=st["seq"])
                st["seq"] += 1
                self._ledger[gid] = entry
                self._partial[gid] = {}
                leases.append(entry.lease("memory"))  # one process, no restore: nothing to fence by
            self._counters["admitted"] += len(batch)
            if dataloader_state is not None:
                self._dataloader = bytes(dataloader_state)
            return leases

    # -- commits ---------------------------------------------------------------------------------
    def commit_group(self, lease: Lease, rows: Sequence[Mapping[str, Any]] | Mapping[int, Mapping[str, Any]],
                     *, end_weight: int | None = None) -> CommitResult:
        """Commit the missing rows of a group (all of them, or ``{index: row}``)."""
        items = sorted(rows.items()) if isinstance(rows, Mapping) else list(enumerate(rows))
        return self._commit(lease, items, end_weight)

    def commit_sample(self, lease: Lease, index: int, row: Mapping[str, Any],
                      *, end_weight: int | None = None) -> CommitResult:
        """Commit one row of a group; the group is ready once all its rows are in."""
        return self._commit(lease, [(index, row)], end_weight)

    def _commit(self, lease: Lease, items: list[tuple[int, Mapping[str, Any]]], end_weight: int | None,
                ) -> CommitResult:
        arrays = [(i, self.schema.validate(row, f"row {lease.group_id}_g{i}")) for i, row in items]
        with self._lock:
            entry = self._ledger.get(lease.group_id)
            if entry is None:
                raise UnknownGroup(f"group {lease.group_id!r} is not in flight")
            if lease.attempt != entry.attempt:
                raise StaleAttempt(f"lease attempt {lease.attempt} != current attempt {entry.attempt}")
            partial = self._partial[lease.group_id]
            partial.update(arrays)
            if len(partial) < entry.group_size:
                return CommitResult(lease.group_id, ready=False, rows_written=len(arrays))
            del self._ledger[lease.group_id]
            self._rows[lease.group_id] = self._partial.pop(lease.group_id)
            self._groups[lease.group_id] = GroupInfo(
                entry.group_id, entry.prompt_idx, entry.task_name, entry.admission_id, entry.seq, entry.group_size,
                READY, entry.start_weight, self._st["weight_version"] if end_weight is None else int(end_weight),
                entry.target_step, entry.attempt, "")
            self._counters["committed"] += 1
            self._lock.notify_all()
            return CommitResult(lease.group_id, ready=True, rows_written=len(arrays))

    # -- training side ---------------------------------------------------------------------------
    def select(self, min_groups: int = 1, max_groups: int | None = None) -> Selection:
        """Claim up to ``max_groups`` groups the sampler picks (fewer than ``min_groups``: none)."""
        max_groups = self.config.groups_per_step if max_groups is None else max_groups
        with self._lock:
            step = self._st["trainer_version"]
            gids = self.sampler.select(MemoryView(self._groups, self._ledger), step, min_groups, max_groups)
            claimed = []
            for gid in gids:
                group = self._replace(gid, state=CLAIMED, claimed_step=step)
                claimed.append(group)
            self._counters["selected"] += len(claimed)
            return Selection(step, tuple(claimed))

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
        decoded = [codec.Record({k: v if isinstance(v, (str, bytes)) else v.copy() for k, v in arrays.items()
                           if fields is None or k in fields}, dtypes).tensors()  # bfloat16 bits -> bfloat16
                   for _, _, arrays in rows]
        return assemble_batch(self.schema, infos, [(g, i, b"") for g, i, _ in rows], decoded, layout, pad_value)

    def finish_step(self, *, weight_version: int | None = None) -> int:
        """Claimed groups -> consumed (their rows dropped), ``trainer_version`` + 1."""
        with self._lock:
            step = self._st["trainer_version"]
            for gid in [g.group_id for g in self._groups.values() if g.state == CLAIMED]:
                self._replace(gid, state=CONSUMED, consumed_step=step, rows_stored=False)
                self._rows.pop(gid, None)
                self._counters["consumed"] += 1
            self._st["trainer_version"] = step + 1
            self._st["weight_version"] = step + 1 if weight_version is None else int(weight_version)
            self._lock.notify_all()
            return step + 1

    def evict(self) -> list[str]:
        """Remove ready groups the sampler can no longer select."""
        with self._lock:
            gids = list(self.sampler.evictable(MemoryView(self._groups, self._ledger), self._st["trainer_version"]))
            for gid in gids:
                self._replace(gid, state=EVICTED, rows_stored=False)
                self._rows.pop(gid, None)
            self._counters["evicted"] += len(gids)
            if gids:
                self._lock.notify_all()
            return gids

    def abort(self, group_id: str, reason: str) -> None:
        """Give up on an in-flight prompt."""
        with self._lock:
            self._abort([group_id], reason)

    def abort_stale_inflight(self) -> list[str]:
        """Abort in-flight prompts the sampler says are useless now."""
        with self._lock:
            current = self._st["trainer_version"]
            gids = [e.group_id for e in sorted(self._ledger.values(), key=lambda e: e.seq)
                    if self.sampler.should_abort_inflight(e.start_weight, current)]
            self._abort(gids, f"stale at version {self._st['trainer_version']}")
            return gids

    def _abort(self, gids: list[str], reason: str) -> None:
        for gid in gids:
            entry = self._ledger.pop(gid, None)
            if entry is None:
                raise UnknownGroup(f"group {gid!r} is not in flight; nothing to abort")
            self._partial.pop(gid, None)
            self._groups[gid] = GroupInfo(gid, entry.prompt_idx, entry.task_name, entry.admission_id, entry.seq,
                                          entry.group_size, ABORTED, entry.start_weight, -1, entry.target_step,
                                          entry.attempt, "", rows_stored=False, reason=reason)
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
                    "counters": dict(self._counters)}

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
