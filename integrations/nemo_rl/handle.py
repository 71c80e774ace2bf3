"""What one process holds of a NeMo-RL replay buffer's store: the open store and its memory.

:class:`BufferHandle` is the one object the buffer, its ledger, its samplers and its step driver
share. The store is the truth; the handle keeps only what the store cannot know:

* the pending slots this process's workers hold (``reserve`` .. ``commit`` / ``remove``), and the
  in-flight prompts the ledger owns (fenced, not aborted, when their slot is removed);
* prompts ``ledger.reserve_group`` staged but not admitted yet (memory only until ``admit``);
* the latest admission per ``target_step`` (a replacement prompt joins it), the metadata each
  ``commit`` returned, and the gate waiters (:class:`~.gate.GateSignal`).

A method that writes says so (one transaction each); none holds the handle's lock across a
transaction.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvckpt.integrations.nemo_rl.config import AdapterConfig
from kvckpt.integrations.nemo_rl.gate import GateSignal
from kvckpt.integrations.nemo_rl.meta import ReplayMeta

from kvckpt import READY, Admission, GroupInfo, Lease, Prompt, ReplayBuffer
from kvckpt.errors import BadArgument

#: ``(group_id, ready, start_weight, end_weight, target_step, meta)``: one NeMo-RL slot.
Slot = tuple[str, bool, int, int, int | None, ReplayMeta | None]


def open_store(cfg: AdapterConfig) -> ReplayBuffer:
    """Create ``cfg``'s store file, or reopen it if it exists (configured the same way).

    Raises:
        BadArgument: an existing store with another sampler, capacity or group size.
    """
    if not os.path.exists(cfg.path):
        return ReplayBuffer.create(cfg.path, cfg.buffer)
    core = ReplayBuffer.open(cfg.path)
    stored, wanted = core.config.to_dict(), cfg.buffer.to_dict()
    differing = sorted(k for k in ("sampler", "max_buffered_rollouts", "group_size") if stored[k] != wanted[k])
    if differing:
        core.close()
        raise BadArgument(f"{cfg.path!r} is configured with {', '.join(f'{k}={stored[k]!r}' for k in differing)}; "
                          "the config asks otherwise. Switch them through restore_replay_buffer or recover")
    return core


class BufferHandle:
    """One open store (``core``, replaced by a restore) and this process's memory of it (see the
    module docstring). ``leases``: in-flight prompts the ledger owns from the start."""

    def __init__(self, core: ReplayBuffer, partition_id: str, leases: Iterable[Lease] = ()) -> None:
        self.core = core
        self.partition_id = partition_id
        self.gate = GateSignal()
        self._lock = threading.Lock()
        self._idle: dict[str, Lease] = {lease.group_id: lease for lease in leases}  # ledger-owned, no worker
        self._owned: set[str] = set(self._idle)  # ledger-owned prompts (fenced, not aborted, on removal)
        self._reserved: dict[str, Lease] = {}  # pending slots, held by a worker
        self._staged: dict[str, Prompt] = {}  # ledger.reserve_group'd, not admitted: memory only
        self._admissions: dict[int | None, Admission] = {}  # the latest admission per stamp, for joins
        self._meta: dict[str, ReplayMeta] = {}

    def adopt(self, leases: Iterable[Lease]) -> None:
        """Forget everything but the store (after a restore or recovery): the ledger owns ``leases``."""
        with self._lock:
            self._reserved.clear()
            self._staged.clear()
            self._idle = {lease.group_id: lease for lease in leases}
            self._owned = set(self._idle)
            self._admissions.clear()
            self._meta.clear()
        self.gate.wake()  # the cursor and the trainer version may both have moved

    # -- the ledger's prompts ---------------------------------------------------------------------
    def stage(self, prompt: Prompt) -> None:
        """Keep ``prompt`` until the next admission. Raises BadArgument: its group id is staged."""
        with self._lock:
            if prompt.group_id in self._staged:
                raise BadArgument(f"group {prompt.group_id!r} is already reserved in the ledger")
            self._staged[prompt.group_id] = prompt

    def unstage(self, group_id: str) -> bool:
        """Drop a staged prompt; whether it was staged."""
        with self._lock:
            return self._staged.pop(group_id, None) is not None

    def staged(self) -> list[Prompt]:
        """The staged prompts, in reserve order."""
        with self._lock:
            return list(self._staged.values())

    def is_staged(self, group_id: object) -> bool:
        """Whether ``group_id`` is staged."""
        with self._lock:
            return group_id in self._staged

    def take_staged(self) -> list[Prompt]:
        """Every staged prompt, no longer staged (an admission takes them; :meth:`restage` if it fails)."""
        with self._lock:
            staged = list(self._staged.values())
            self._staged.clear()
        return staged

    def restage(self, prompts: Sequence[Prompt]) -> None:
        """Put prompts :meth:`take_staged` gave back in front of those staged since."""
        with self._lock:
            self._staged = {**{p.group_id: p for p in prompts}, **self._staged}

    def own(self, leases: Iterable[Lease]) -> None:
        """The ledger owns these just-admitted prompts, no worker on them yet."""
        with self._lock:
            for lease in leases:
                self._idle[lease.group_id] = lease
                self._owned.add(lease.group_id)

    def forget(self, group_ids: Iterable[str]) -> None:
        """Prompts that left the store's ledger (aborted): no slot, no ownership."""
        with self._lock:
            for gid in group_ids:
                self._reserved.pop(gid, None)
                self._idle.pop(gid, None)
                self._owned.discard(gid)

    def idle_leases(self) -> list[Lease]:
        """The leases of ledger-owned prompts no worker holds."""
        with self._lock:
            return list(self._idle.values())

    # -- pending slots ----------------------------------------------------------------------------
    def take_idle(self, group_id: str | None) -> Lease | None:
        """The ledger's lease of ``group_id`` for a new slot (None: not ledger-owned or no id).

        Raises:
            BadArgument: a worker already holds its slot, or it is staged (not admitted yet).
        """
        if group_id is None:
            return None
        with self._lock:
            if group_id in self._reserved:
                raise BadArgument(f"group {group_id!r} is already reserved; remove_group it before retrying")
            if group_id in self._staged:
                raise BadArgument(f"group {group_id!r} is staged in the ledger; sampler.admit admits it")
            return self._idle.pop(group_id, None)

    def untake(self, lease: Lease) -> None:
        """Give back a lease :meth:`take_idle` handed out for a slot that did not open."""
        with self._lock:
            self._idle.setdefault(lease.group_id, lease)

    def hold(self, lease: Lease) -> None:
        """A worker holds ``lease``'s slot."""
        with self._lock:
            self._reserved[lease.group_id] = lease

    def held(self, group_id: str) -> Lease | None:
        """The lease of the pending slot ``group_id``, if a worker of this process holds it."""
        with self._lock:
            return self._reserved.get(group_id)

    def pending(self) -> int:
        """How many pending slots workers hold."""
        with self._lock:
            return len(self._reserved)

    def committed(self, group_id: str, meta: ReplayMeta) -> None:
        """The slot's group was committed (its ledger entry released) with metadata ``meta``."""
        with self._lock:
            self._reserved.pop(group_id, None)
            self._owned.discard(group_id)
            self._meta[group_id] = meta

    def release_attempt(self, group_id: str) -> None:
        """Close a pending slot, one transaction: a ledger-owned prompt is fenced and handed back to
        the ledger (``redispatch``); any other attempt is aborted, releasing its capacity."""
        with self._lock:
            owned = group_id in self._owned
        if owned:
            lease = self.core.redispatch(group_id)
            with self._lock:
                self._reserved.pop(group_id, None)
                self._idle[group_id] = lease
        else:
            self.core.abort(group_id, "attempt released by remove_group")
            with self._lock:
                self._reserved.pop(group_id, None)

    # -- admissions -------------------------------------------------------------------------------
    def note_admission(self, admission: Admission) -> None:
        """``admission`` is the latest of its ``target_step``: prompts of that stamp join it."""
        with self._lock:
            self._admissions[admission.target_step] = admission

    def admission_for(self, target_step: int | None) -> Admission:
        """The admission a prompt stamped ``target_step`` joins (one made before a restart is found
        through the records that name it).

        Raises:
            BadArgument: no admission is stamped ``target_step``.
        """
        with self._lock:
            admission = self._admissions.get(target_step)
        if admission is not None:
            return admission
        for record in [*self.core.ledger(), *self.core.groups()]:
            if record.target_step == target_step:
                return Admission(record.admission_id, self.core.state()["dispatch_index"], target_step)
        sampler = self.core.sampler.name
        raise BadArgument(
            f"no admission is stamped for target_step {target_step}: await sampler.admit first (it returns the stamp "
            f"to pass). Under {sampler} the store's gate admits batches and its ledger records each in-flight prompt "
            "with its admission (what a restart redispatches, which batch is short); a slot without one would slip "
            "past the gate" + (", and a step no admission stamped would be stamped again when the cursor reaches it"
                               if target_step is not None else ""))

    # -- ready slots ------------------------------------------------------------------------------
    def row_length(self, row: Mapping[str, Any]) -> int:
        """A row's sequence length: ``input_lengths``, else its first token field's length."""
        if "input_lengths" in row:
            return int(row["input_lengths"])
        token = self.core.schema.token_fields
        return len(row[token[0]]) if token else 0

    def meta_of(self, group: GroupInfo) -> ReplayMeta:
        """A committed group's metadata, a copy the caller may change (for a group committed before
        this handle existed, the lengths are read from its rows)."""
        with self._lock:
            meta = self._meta.get(group.group_id)
        if meta is None:
            batch = self.core.read_batch([group.group_id], layout="list")
            meta = ReplayMeta.of_group(self.partition_id, group.group_id, group.start_weight,
                                       list(self.core.schema.fields), [self.row_length(r) for r in batch.rows])
            with self._lock:
                self._meta[group.group_id] = meta
        return meta.with_fields(())

    def drop_meta(self, group_ids: Iterable[str]) -> None:
        """These groups left the slots (trained or evicted)."""
        with self._lock:
            for gid in group_ids:
                self._meta.pop(gid, None)

    def handed_over(self, groups: Sequence[GroupInfo]) -> ReplayMeta:
        """The one metadata of groups just claimed for training (they leave the slots)."""
        metas = [self.meta_of(group) for group in groups]
        self.drop_meta(g.group_id for g in groups)
        return metas[0].concat(*metas[1:])

    def slots(self) -> list[Slot]:
        """Every slot, in reserve (dispatch) order: the ready groups and the pending slots this
        process's workers hold."""
        with self._lock:
            reserved = dict(self._reserved)
        rows: list[tuple[int, Slot]] = []
        for entry in self.core.ledger():
            if entry.group_id in reserved:
                lease = reserved[entry.group_id]
                rows.append((entry.seq, (entry.group_id, False, lease.start_weight, -1, lease.target_step, None)))
        for group in self.core.groups([READY]):
            rows.append((group.seq, (group.group_id, True, group.start_weight, group.end_weight, group.target_step,
                                     self.meta_of(group))))
        return [slot for _, slot in sorted(rows, key=lambda r: r[0])]
