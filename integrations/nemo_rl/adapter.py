"""NeMo-RL's ``TQReplayBuffer`` surface over a kvckpt :class:`~kvckpt.ReplayBuffer`.

:func:`create_replay_buffer` turns a NeMo-RL-style config dict into a :class:`KvckptReplayBuffer`
that carries the three objects NeMo-RL's SingleController drives: the buffer itself (``reserve``,
``commit``, ``remove_group``, ``remove``, ``count_for_target_step``, ``promote_ready_group``,
``size``), its :attr:`~KvckptReplayBuffer.sampler` (:class:`~.sampler.KvckptSampler`) and its
:attr:`~KvckptReplayBuffer.ledger` (:class:`~.ledger.KvckptLedger`).

How NeMo-RL's objects map onto kvckpt's one store:

* a *pending slot* is a kvckpt ledger entry (the prompt is in flight); a *ready slot* a ready group;
* ``select`` claims groups for the current step (their rows stay readable until
  :meth:`KvckptReplayBuffer.finish_train_step`), ``evict`` evicts them;
* the sampler's ``dispatch_index`` and the dataloader state are the store's cursors, so a
  checkpoint (:meth:`KvckptReplayBuffer.save_checkpoint`, one stamp transaction and one file) holds
  the buffer, the ledger and the cursors of one instant, with no barrier.

Admission: :meth:`KvckptReplayBuffer.admit_batch` (or ``ledger.reserve_group`` per prompt, then
``sampler.admit``) makes the cursor advance, the dataloader state and the batch's ledger entries
one transaction, and is the recommended path. ``sampler.admit`` with nothing staged followed by
one ``reserve`` per prompt is NeMo-RL's split admission: one transaction for the cursor, then one
per prompt, so a crash in between leaves a stamped admission that no prompt owns.

Every state change below is one kvckpt write transaction. Two of NeMo-RL's calls are deliberately
*not* state changes: ``ledger.reserve_group`` of a prompt not yet admitted only stages it in memory
(nothing durable owns it yet, and the dataloader state is not advanced either, so a crash loses
nothing: the restarted dataloader serves it again), and the in-memory record of which in-flight
groups a worker currently holds (the slot's *reservation*), which recovery rebuilds by redispatch.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvckpt import Batch, CheckpointResult, Lease, RecoveryPlan, ReplayBuffer, restore
from kvckpt.errors import BadArgument
from kvckpt.records import READY, Admission, Prompt

from .config import AdapterConfig, parse_config
from .ledger import KvckptLedger
from .meta import ReplayMeta
from .sampler import KvckptSampler

#: What ``commit`` takes as a record: all ``group_size`` rows (dicts of named tensors), in order.
Rows = Sequence[Mapping[str, Any]]


class KvckptReplayBuffer:
    """NeMo-RL's replay buffer, backed by one kvckpt store (see the module docstring).

    Build it with :func:`create_replay_buffer` or :func:`restore_replay_buffer`.

    Args:
        core: the open kvckpt buffer; this object owns it from now on (:meth:`close`).
        partition_id: the partition name reported in :class:`~.meta.ReplayMeta`. Defaults to
            ``rollout_data``.
        leases: in-flight prompts waiting for a worker (a recovery plan's leases).
    """

    def __init__(self, core: ReplayBuffer, *, partition_id: str = "rollout_data", leases: Iterable[Lease] = ()) -> None:
        self.core = core
        self.partition_id = partition_id
        self._lock = threading.Lock()
        self._idle: dict[str, Lease] = {lease.group_id: lease for lease in leases}  # in flight, no worker
        self._reserved: dict[str, Lease] = {}  # in flight, held by a worker (NeMo-RL's pending slots)
        self._staged: dict[str, Prompt] = {}  # ledger.reserve_group'd, not admitted: memory only
        self._admissions: dict[int | None, Admission] = {}  # the latest admission per stamp, for joins
        self.sampler = KvckptSampler(self)
        self.ledger = KvckptLedger(self)

    # -- admission -------------------------------------------------------------------------------
    def admit_batch(self, prompts: Sequence[Prompt | int | Mapping[str, Any]], *, dataloader_state: bytes | None = None,
                    weight_version: int | None = None, timeout: float | None = None) -> list[str]:
        """Admit a whole dataloader batch in one transaction: the recommended admission.

        The gate wait (gated samplers) happens outside any transaction; then the cursor advance,
        ``dataloader_state`` and one ledger entry per prompt are one transaction, so no checkpoint
        or crash can separate them. Returns the group ids; a worker takes each with
        ``reserve(group_id=..., target_step=..., weight_version=...)``. Equivalent to
        ``ledger.reserve_group`` per prompt followed by ``sampler.admit``, without the trainer
        version callback.

        Args:
            prompts: :class:`~kvckpt.Prompt` objects (``prompt_idx``, ``task_name``, ``group_id``),
                prompt indices, or dicts of those fields.
            dataloader_state: the dataloader state after this batch.
            weight_version: the prompts' ``start_weight``. Defaults to the store's weight version.
            timeout: seconds to wait for the gate and capacity. Defaults to forever.

        Raises:
            GateTimeout: still closed after ``timeout``. CapacityError: a batch larger than the
            capacity. BadArgument: a duplicate or already-used group id.
        """
        return [lease.group_id for lease in self._admit(prompts, dataloader_state, weight_version, timeout)]

    def _admit(self, prompts: Sequence[Prompt | int | Mapping[str, Any]], dataloader_state: bytes | None,
               weight_version: int | None, timeout: float | None) -> list[Lease]:
        leases = self.core.admit(prompts, dataloader_state, timeout=timeout, weight_version=weight_version)
        stamp = leases[0].target_step
        with self._lock:
            self._admissions[stamp] = Admission(leases[0].admission_id, self.core.state()["dispatch_index"], stamp)
            self._idle.update((lease.group_id, lease) for lease in leases)
        return leases

    # -- slots -----------------------------------------------------------------------------------
    def reserve(self, *, weight_version: int, target_step: int | None = None, group_id: str | None = None,
                prompt_idx: int = -1, task_name: str = "default") -> str:
        """Open a pending slot for one rollout attempt and return its group id.

        * ``group_id`` of an in-flight prompt (admitted through the ledger, or handed back by
          recovery or :meth:`remove_group`): the slot takes that prompt's lease; if
          ``weight_version`` differs from its ``start_weight`` it is re-stamped (one transaction).
        * otherwise a new prompt (``group_id`` or a fresh uuid) becomes a ledger entry in one
          transaction: for gated samplers it joins the admission the last ``sampler.admit`` made
          (NeMo-RL's split admission), for ``windowed`` it is admitted on its own.

        Args:
            weight_version: the rollout weight version the attempt generates with (``start_weight``).
            target_step: the step the slot is for (``in_order``'s admission stamp, else ``None``).
            group_id: the stable group id. Defaults to a fresh uuid4 hex.
            prompt_idx, task_name: the prompt's dataset identity (kvckpt records it in the ledger).

        Raises:
            BadArgument: the group is already reserved, its stamp differs from ``target_step``, or a
                gated sampler has made no admission for ``target_step``.
            GateTimeout: no capacity left (``max_buffered_rollouts``).
        """
        with self._lock:
            if group_id is not None and group_id in self._reserved:
                raise BadArgument(f"group {group_id!r} is already reserved; remove_group it before retrying")
            if group_id is not None and group_id in self._staged:
                raise BadArgument(f"group {group_id!r} is staged in the ledger; sampler.admit admits it")
            lease = self._idle.pop(group_id, None) if group_id is not None else None
        try:
            if lease is not None:
                if lease.target_step != target_step:
                    raise BadArgument(f"group {group_id!r} is stamped for step {lease.target_step}, not {target_step}")
                if lease.start_weight != weight_version:
                    lease = self.core.redispatch(lease.group_id, start_weight=weight_version)
            else:
                lease = self._admit_one(Prompt(prompt_idx, task_name, group_id or uuid.uuid4().hex),
                                        weight_version, target_step)
        except BaseException:
            if lease is not None:
                with self._lock:
                    self._idle.setdefault(lease.group_id, lease)
            raise
        with self._lock:
            self._reserved[lease.group_id] = lease
        return lease.group_id

    def _admit_one(self, prompt: Prompt, weight_version: int, target_step: int | None) -> Lease:
        if self.core.sampler.gate_window is None:
            [lease] = self.core.admit([prompt], timeout=0, weight_version=weight_version)
            return lease
        admission = self._admissions.get(target_step)
        if admission is None:
            raise BadArgument(f"no admission of this handle is stamped for target_step {target_step}; "
                              "call sampler.admit first")
        [lease] = self.core.admit([prompt], timeout=0, weight_version=weight_version, admission=admission)
        return lease

    async def commit(self, group_id: str, record: Rows, start_weight_version: int,
                     end_weight_version: int) -> ReplayMeta:
        """Commit a reserved group's rows; the slot becomes ready (one transaction: rows, group
        record, ledger entry released). Raises before any side effect on an unknown group.

        Args:
            group_id: a reserved group.
            record: its ``group_size`` rows, each a dict of named tensors matching the schema.
            start_weight_version: must equal the slot's ``start_weight``.
            end_weight_version: the weight version at commit (``end_weight``).

        Raises:
            BadArgument: unknown or unreserved group, or a ``start_weight_version`` mismatch.
            SchemaMismatch: wrong row count, field, or dtype (nothing written).
            StaleAttempt: the slot's attempt was fenced meanwhile.
        """
        with self._lock:
            lease = self._reserved.get(group_id)
        if lease is None:
            raise BadArgument(f"commit of unknown group {group_id!r}: reserve it first (nothing was written)")
        if lease.start_weight != start_weight_version:
            raise BadArgument(f"group {group_id!r} was reserved at weight {lease.start_weight}, "
                              f"not {start_weight_version} (nothing was written)")
        await asyncio.to_thread(self.core.commit_group, lease, list(record), end_weight=end_weight_version)
        with self._lock:
            self._reserved.pop(group_id, None)
        return ReplayMeta.of_groups(self.partition_id, [self.core.group(group_id)], self._fields())

    async def remove_group(self, group_id: str, *, remove_in_dp: bool = False) -> int:
        """Remove one slot; returns 1 if there was one, else 0.

        A pending slot (a failed or cancelled attempt) is fenced: the prompt's ``attempt`` is bumped
        in one transaction, so the failed worker can no longer commit, and the prompt stays owned by
        the ledger for the next :meth:`reserve` of that group id (or ``ledger.discard_group``). A
        ready slot is evicted with its rows (``remove_in_dp`` is implied: kvckpt never keeps rows
        that no slot owns).
        """
        return await asyncio.to_thread(self._remove, [group_id])

    async def remove(self, idxs: Sequence[int], remove_in_dp: bool = True) -> int:
        """Remove slots by position (pending and ready slots in dispatch order), as :meth:`remove_group`.

        All positions are validated before anything changes.

        Raises:
            BadArgument: a position is out of range or repeated.
        """
        slots = self._slots()
        if len(set(idxs)) != len(idxs) or any(not 0 <= i < len(slots) for i in idxs):
            raise BadArgument(f"slot positions {list(idxs)} must be distinct and in 0..{len(slots) - 1}")
        return await asyncio.to_thread(self._remove, [slots[i] for i in idxs])

    def _remove(self, group_ids: Sequence[str]) -> int:
        with self._lock:
            pending = [gid for gid in group_ids if gid in self._reserved]
        ready = [gid for gid in group_ids if gid not in pending and self._is_ready(gid)]
        if ready:
            self.core.evict(ready)
        for gid in pending:
            lease = self.core.redispatch(gid)
            with self._lock:
                self._reserved.pop(gid, None)
                self._idle[gid] = lease
        return len(pending) + len(ready)

    def _is_ready(self, group_id: str) -> bool:
        group = self.core.group(group_id)
        return group is not None and group.state == READY

    def _slots(self) -> list[str]:
        """Pending (reserved) and ready slots, in dispatch order."""
        ready = [(g.seq, g.group_id) for g in self.core.groups([READY])]
        with self._lock:
            reserved = set(self._reserved)
        pending = [(e.seq, e.group_id) for e in self.core.ledger() if e.group_id in reserved]
        return [gid for _, gid in sorted(ready + pending)]

    def count_for_target_step(self, target_step: int) -> int:
        """In-flight plus ready groups stamped for ``target_step`` (the rollout pump's top-up guard)."""
        return self.core.count_for_target_step(target_step)

    def promote_ready_group(self, to_target_step: int) -> int | None:
        """Re-stamp the ready group with the largest later ``target_step`` onto ``to_target_step``
        (one transaction); returns the lender's step, or ``None`` if there is none."""
        return self.core.promote_ready_group(to_target_step)

    def size(self) -> int:
        """Slots in the buffer: ready groups plus reserved pending slots."""
        with self._lock:
            reserved = len(self._reserved)
        return self.core.state()["ready"] + reserved

    def __len__(self) -> int:
        return self.size()

    # -- training side ---------------------------------------------------------------------------
    def _fields(self) -> list[str]:
        return list(self.core.schema.fields)

    def get_samples(self, meta: ReplayMeta, select_fields: Sequence[str] | None = None,
                    layout: str = "padded") -> Batch:
        """Read the rows of ``meta`` (claimed, or ready) as tensors; checksums verified.

        Raises:
            NotSelectable: a group's rows are gone (evicted, or dropped after its step).
        """
        return self.core.read_batch(meta.group_ids, fields=select_fields, layout=layout)

    def finish_train_step(self) -> int:
        """Close the current step: the groups ``select`` handed out are consumed and the trainer
        version advances (one transaction); returns the new trainer version."""
        return self.core.finish_step()

    def abort_stale_inflight(self) -> list[str]:
        """Abort the in-flight prompts the sampler says are useless now (``windowed`` only), in one
        transaction; their leases are dropped from this handle. Returns their group ids."""
        aborted = self.core.abort_stale_inflight()
        with self._lock:
            for gid in aborted:
                self._reserved.pop(gid, None)
                self._idle.pop(gid, None)
        return aborted

    # -- checkpoints -----------------------------------------------------------------------------
    def recover(self, resume_version: int | None = None) -> RecoveryPlan:
        """Recover the live store after a crash to the trainer version the run resumes from (one
        transaction, see :func:`kvckpt.recover`); this handle then holds the plan's leases."""
        plan = self.core.recover(resume_version)
        with self._lock:
            self._reserved.clear()
            self._staged.clear()
            self._idle = {lease.group_id: lease for lease in plan.leases}
            self._admissions.clear()
        return plan

    def save_checkpoint(self, dest: str, trainer_state: Mapping[str, Any] | None = None) -> CheckpointResult:
        """Write buffer, ledger and cursors of one instant to the file ``dest`` and wait for it.

        One stamp transaction, then a copy of that snapshot (commits keep landing meanwhile):
        NeMo-RL's exclusive cut and its ``replay_buffer_metadata.pt`` / ``rollout_recovery.pt`` /
        TQ snapshot in one consistent file. Staged, not yet admitted prompts are not in it (the
        dataloader state in it has not passed them).
        """
        return self.core.checkpoint(dest, trainer_state, overwrite=True).wait()

    def close(self) -> None:
        """Close the store. Idempotent."""
        self.core.close()

    def __enter__(self) -> KvckptReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def create_replay_buffer(config: Mapping[str, Any] | AdapterConfig) -> KvckptReplayBuffer:
    """The replay buffer a NeMo-RL-style config dict describes (see :func:`~.config.parse_config`).

    Creates the store file if it does not exist; reopens it otherwise (its stored sampler and
    capacity must match the config: switching them is a :func:`restore_replay_buffer` or
    :meth:`KvckptReplayBuffer.recover` decision, reported in the plan).

    Examples:
        >>> import tempfile
        >>> buf = create_replay_buffer({"path": tempfile.mkdtemp() + "/replay.kv",
        ...                             "num_generations_per_prompt": 4, "num_prompts_per_step": 2,
        ...                             "max_buffered_rollouts": 4,
        ...                             "sampler": {"name": "in_order", "max_lookahead_versions": 1}})
        >>> buf.sampler.name, buf.sampler.required_buffer_capacity(2), buf.sampler.dispatch_index
        ('in_order', 4, -1)
        >>> buf.close()

    Raises:
        BadArgument: an invalid config, or an existing store configured differently.
    """
    cfg = config if isinstance(config, AdapterConfig) else parse_config(config)
    if not os.path.exists(cfg.path):
        return KvckptReplayBuffer(ReplayBuffer.create(cfg.path, cfg.buffer), partition_id=cfg.partition_id)
    core = ReplayBuffer.open(cfg.path)
    stored, wanted = core.config.to_dict(), cfg.buffer.to_dict()
    differing = sorted(k for k in ("sampler", "max_buffered_rollouts", "group_size") if stored[k] != wanted[k])
    if differing:
        core.close()
        raise BadArgument(f"{cfg.path!r} is configured with {', '.join(f'{k}={stored[k]!r}' for k in differing)}; "
                          "the config asks otherwise. Switch them through restore_replay_buffer or recover")
    return KvckptReplayBuffer(core, partition_id=cfg.partition_id)


def restore_replay_buffer(config: Mapping[str, Any] | AdapterConfig,
                          checkpoint_file: str) -> tuple[KvckptReplayBuffer, RecoveryPlan]:
    """Restore the live store at ``config``'s ``path`` from a checkpoint file, in a fresh handle.

    The file is validated, copied over the live path and recovered at its stamped step (claims
    made after it return to ready; every in-flight prompt's attempt is bumped). The returned
    buffer holds the plan's leases: ``reserve(group_id=..., target_step=lease.target_step, ...)``
    redispatches each exactly once, without a new admission. A sampler or capacity different from
    the checkpoint's is applied and reported in ``plan.changes``. Restore never evicts.

    Raises:
        FormatError / CorruptRecord / RecoveryError: the file is not a valid checkpoint (the live
            store is left untouched), or it holds more ready groups than ``max_buffered_rollouts``.
    """
    cfg = config if isinstance(config, AdapterConfig) else parse_config(config)
    core, plan = restore(checkpoint_file, cfg.path, overwrite=True, sampler=cfg.buffer.sampler.config(),
                         max_buffered_rollouts=cfg.buffer.max_buffered_rollouts)
    return KvckptReplayBuffer(core, partition_id=cfg.partition_id, leases=plan.leases), plan
