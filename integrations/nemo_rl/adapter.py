"""NeMo-RL's ``TQReplayBuffer`` over one kvckpt store: same constructor, calls, awaits and errors.

``TQReplayBuffer(dp_client, partition_id=..., pad_value_dict=...)`` is how NeMo-RL's ``setup.py``
builds it; the store it opens comes from ``config=`` or from :func:`~.config.configure` (the
``async_rl.replay_buffer`` section). The rows live in the store, not in ``dp_client``.

How NeMo-RL's slots map onto the store (see ``docs/integrations.md`` for every member):

* a *pending slot* is a kvckpt ledger entry held by a worker; a *ready slot* a ready group. The
  parallel lists (``meta_list``, ``start_weight_list``, ...) are read from the store in dispatch
  order, so they are the checkpointed truth, not a second copy of it;
* ``reserve`` without a ledger-owned ``group_id`` is one transaction: a new ledger entry joining
  the admission ``sampler.admit`` made for ``target_step``. ``remove_group`` of such a slot (the
  rollout manager's failed attempt) aborts it in one transaction, releasing its capacity; the
  retry reserves a fresh group id. Exactly one entry owns the prompt at any time.
* ``reserve(group_id=...)`` of a prompt the ledger owns (``ledger.reserve_group`` +
  ``sampler.admit``, or a recovery plan's lease) takes that entry; ``remove_group`` then fences
  the attempt (``attempt`` + 1) and hands the prompt back to the ledger, still owned;
* ``commit`` tensorises the ``PromptGroupRecord`` and writes rows, group record and ledger release
  in one transaction; ``select`` claims (rows stay readable until the step closes), ``evict``
  deletes rows.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvckpt.integrations.nemo_rl import envelope
from kvckpt.integrations.nemo_rl.config import AdapterConfig, configured, parse_config
from kvckpt.integrations.nemo_rl.dataplane import KvckptDataPlane
from kvckpt.integrations.nemo_rl.ledger import KvckptLedger
from kvckpt.integrations.nemo_rl.meta import ReplayMeta
from kvckpt.integrations.nemo_rl.records import record_to_rows
from kvckpt.integrations.nemo_rl.sampler import GateSignal, create_sampler

from kvckpt import Batch, CheckpointResult, Lease, Prompt, RecoveryPlan, ReplayBuffer, restore
from kvckpt.errors import BadArgument, CapacityError, RecoveryError, SchemaMismatch
from kvckpt.tables.records import READY, Admission, GroupInfo

log = logging.getLogger("kvckpt.integrations.nemo_rl")

#: ``task_name`` of a prompt NeMo-RL reserved without saying which prompt it is (main's
#: ``reserve`` carries no identity; pass ``prompt_idx=``/``task_name=`` or use the ledger).
UNIDENTIFIED_TASK = "nemo_rl.unidentified"


class RoutedExpertsMissing(SchemaMismatch, RuntimeError):
    """``require_routed_experts`` and no ``routed_experts`` to store: a kvckpt schema error that
    is also the ``RuntimeError`` NeMo-RL's commit raises."""


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


class TQReplayBuffer:
    """NeMo-RL's replay buffer, backed by one kvckpt store (see the module docstring).

    Args:
        dp_client: NeMo-RL's data-plane client. A :class:`~.dataplane.KvckptDataPlane` is bound to
            this buffer and answers the controller's ``get_samples`` / ``put_samples`` /
            ``clear_samples`` from the store; any other client is kept but never called (the rows
            are written to and read from the kvckpt store).
        partition_id: the partition reported in :class:`~.meta.ReplayMeta` and checked by
            ``load_state_dict``.
        pad_value_dict: pad values by field; ``input_ids``'s pads :meth:`get_samples`.
        require_routed_experts: every ``commit`` refuses (before writing) unless the store schema
            has ``routed_experts`` and the record carries it, as NeMo-RL's does.
        config: the store's config (a :func:`~.config.parse_config` dict or an
            :class:`~.config.AdapterConfig`). Defaults to what :func:`~.config.configure` set.
        store: an open kvckpt buffer to own instead of opening ``config``'s (the factories below
            pass it; ``config`` then only supplies ``checkpoint_dir``).
        leases: in-flight prompts the ledger owns (a recovery plan's leases).

    Raises:
        BadArgument: no config, or an invalid one.
    """

    def __init__(self, dp_client: Any, partition_id: str = "rollout_data", *,
                 pad_value_dict: Mapping[str, int] | None = None, require_routed_experts: bool = False,
                 config: Mapping[str, Any] | AdapterConfig | None = None, store: ReplayBuffer | None = None,
                 leases: Iterable[Lease] = ()) -> None:
        cfg = config if isinstance(config, AdapterConfig) else parse_config(config) if config is not None \
            else configured() if store is None else None
        self.core = store if store is not None else open_store(cfg)
        self._config = cfg
        self._pickle_args = (partition_id, dict(pad_value_dict or {}), require_routed_experts)
        self.dp_client = dp_client
        if isinstance(dp_client, KvckptDataPlane):
            dp_client.bind(self)
        self.partition_id = partition_id
        self._pad_value_dict = dict(pad_value_dict or {})
        self._checkpoint_dir = (cfg.checkpoint_dir if cfg is not None else None) or f"{self.core.path}.checkpoints"
        self.require_routed_experts = require_routed_experts
        self._lock = threading.Lock()
        self._version_lock = threading.Lock()
        self._idle: dict[str, Lease] = {lease.group_id: lease for lease in leases}  # ledger-owned, no worker
        self._owned: set[str] = set(self._idle)  # slots of ledger-owned prompts (fenced, not aborted, on removal)
        self._reserved: dict[str, Lease] = {}  # pending slots, held by a worker
        self._staged: dict[str, Prompt] = {}  # ledger.reserve_group'd, not admitted: memory only
        self._admissions: dict[int | None, Admission] = {}  # the latest admission per stamp, for joins
        self._meta: dict[str, ReplayMeta] = {}
        self._resume_step: int | None = None
        self._refill: list[int | None] = []  # stamps of batches a restart left short, re-admitted first
        self._trainer_version_fn: Callable[[], int] | None = None  # the controller's, from sampler.admit
        self.gate = GateSignal()  # the gate waiters of every sampler object over this buffer
        self.sampler = create_sampler(self, self.core.sampler.config())
        self.ledger = KvckptLedger(self)

    # -- versions ---------------------------------------------------------------------------------
    def _resume_at(self, step: int) -> None:
        if self.core.trainer_version < step:
            self._resume_step = step  # load_state_dict restores the store to it
            return
        # a (re)start: claims of steps >= step return to ready and every in-flight attempt is fenced
        plan = self.recover(step)
        cursor = self.sampler.dispatch_index
        if self.core.sampler.gate_window is not None and cursor < step - 1:
            raise RecoveryError(f"the store is at step {step} but its dispatch_index {cursor} "
                                f"is behind {step - 1}: it was not written by this run")
        self._settle(plan)

    def _settle(self, plan: RecoveryPlan) -> None:
        """After a restart or a restore: prompts main's ``reserve`` left anonymous cannot be
        generated again by anyone, so they are given up (one abort each) and nothing waits for
        them; ``admit`` then hands out the stamps of the steps left short first, as NeMo-RL's
        rewound cursor would (its top-up guard fills them)."""
        lost = 0
        for lease in plan.leases:
            if lease.task_name == UNIDENTIFIED_TASK:
                self.core.abort(lease.group_id, "in flight at a restart, reserved without a prompt identity")
                lost += 1
                with self._lock:
                    self._idle.pop(lease.group_id, None)
                    self._owned.discard(lease.group_id)
        per_step = self.core.config.groups_per_step
        if self.core.sampler.stamps_target_step:
            self._refill = [t for t in range(plan.resume_version, self.sampler.dispatch_index + 1)
                            if self.core.count_for_target_step(t) < per_step]
        elif self.core.sampler.gate_window is not None:  # a closed gate would wait for them forever
            self._refill = [None] * -(-lost // per_step)

    def _next_refill(self) -> tuple[bool, int | None]:
        """``(True, stamp)`` for the next batch a restart left short, admitted again without moving
        the cursor (its prompts join an admission of that stamp); ``(False, None)`` once none is left."""
        if not self._refill:
            return False, None
        step = self._refill.pop(0)
        admission = self._admission_for(step)
        with self._lock:
            self._admissions[step] = admission
        return True, step

    def _advance_to(self, version: int) -> None:
        """Close the store's steps up to the trainer's ``version`` (one ``finish_step`` each)."""
        if self._resume_step is not None:
            raise RecoveryError(f"the run resumes from step {self._resume_step} but the store is at step "
                                f"{self.core.trainer_version}: await load_state_dict(<that step's state>) first")
        with self._version_lock:
            current = self.core.trainer_version
            if version < current:
                raise BadArgument(f"trainer version {version} is behind the store's {current}: a resumed run "
                                  "calls sampler.set_dispatch_index(step) first")
            while current < version:
                current = self.core.finish_step()
        self.gate.wake()  # a waiting admit re-reads the trainer's version

    # -- admission --------------------------------------------------------------------------------
    def admit_batch(self, prompts: Sequence[Prompt | int | Mapping[str, Any]], *, dataloader_state: bytes | None = None,
                    weight_version: int | None = None, timeout: float | None = None) -> list[str]:
        """Admit a whole dataloader batch in one transaction (cursor, dataloader state, one ledger
        entry per prompt); returns the group ids, each then taken with ``reserve(group_id=...)``.

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
            self._owned.update(lease.group_id for lease in leases)
        return leases

    def _admit_batch(self, version: int, dataloader_state: bytes | None, weight_version: int | None,
                     timeout: float | None) -> int | None:
        """``sampler.admit``'s transaction, once the gate is open (runs in a worker thread)."""
        self._advance_to(version)
        staged = self.ledger._take_staged()
        if not staged:
            if self.core.sampler.gate_window is None and dataloader_state is None:
                return None
            admission = self.core.advance_dispatch(dataloader_state, timeout=timeout)
            with self._lock:
                self._admissions[admission.target_step] = admission
            return admission.target_step
        try:
            leases = self._admit(staged, dataloader_state, weight_version, timeout)
        except BaseException:
            self.ledger._restage(staged)
            raise
        return leases[0].target_step

    def _admission_for(self, target_step: int | None) -> Admission:
        with self._lock:
            admission = self._admissions.get(target_step)
        if admission is not None:
            return admission
        for record in [*self.core.ledger(), *self.core.groups()]:  # one made before a restart: its records name it
            if record.target_step == target_step:
                return Admission(record.admission_id, self.sampler.dispatch_index, target_step)
        raise BadArgument(f"no admission is stamped for target_step {target_step}: await sampler.admit first")

    # -- slots ------------------------------------------------------------------------------------
    def reserve(self, *, weight_version: int, target_step: int | None = None, group_id: str | None = None,
                prompt_idx: int | None = None, task_name: str | None = None) -> str:
        """Open a pending slot for one rollout attempt and return its group id (NeMo-RL's call).

        * ``group_id`` of a prompt the ledger owns: the slot takes its lease (re-stamped with
          ``weight_version`` in one transaction if that differs from its ``start_weight``);
        * otherwise a new ledger entry (one transaction) with ``group_id`` or a fresh uuid4,
          joining the admission stamped ``target_step`` (gated samplers) or admitted on its own
          (``windowed``). ``prompt_idx`` / ``task_name`` (kvckpt extensions) record which prompt
          it is; without them the entry is task :data:`UNIDENTIFIED_TASK`, prompt 0.

        Raises:
            BadArgument: the group is already reserved, its stamp differs from ``target_step``, or
                a gated sampler has no admission for ``target_step``.
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
                prompt = Prompt(0 if prompt_idx is None else prompt_idx,
                                task_name or (UNIDENTIFIED_TASK if prompt_idx is None else "default"),
                                group_id or str(uuid.uuid4()))
                admission = None if self.core.sampler.gate_window is None else self._admission_for(target_step)
                [lease] = self.core.admit([prompt], timeout=0, weight_version=weight_version, admission=admission)
        except BaseException:
            if lease is not None:
                with self._lock:
                    self._idle.setdefault(lease.group_id, lease)
            raise
        with self._lock:
            self._reserved[lease.group_id] = lease
        return lease.group_id

    async def commit(self, group_id: str, record: Any, start_weight_version: int,
                     end_weight_version: int) -> ReplayMeta:
        """Tensorise ``record`` and commit it to the reserved slot (one transaction: rows, group
        ready with ``end_weight``, ledger entry released); returns the group's metadata with
        ``sequence_lengths``. A failed commit writes nothing and leaves the slot pending.

        Args:
            group_id: the group ``reserve`` returned.
            record: a ``PromptGroupRecord`` (or its tensorised batch, or row dicts; see
                :func:`~.records.record_to_rows`).
            start_weight_version: must equal the slot's ``start_weight``.
            end_weight_version: the weight version at commit (``end_weight``).

        Raises:
            BadArgument (a ValueError): unknown or unreserved group (raised before any side
                effect), or a ``start_weight_version`` other than the slot's.
            RoutedExpertsMissing (a RuntimeError, as NeMo-RL raises): ``require_routed_experts`` and
                the schema or the record lacks ``routed_experts``; nothing is written.
            SchemaMismatch: the record does not tensorise to the schema's rows.
            StaleAttempt: the slot's attempt was fenced meanwhile.
        """
        with self._lock:
            lease = self._reserved.get(group_id)
        if lease is None:
            raise BadArgument(f"commit called with unknown group_id={group_id!r}; reserve() must precede commit() "
                              "(or the slot was already removed); nothing was written")
        if lease.start_weight != start_weight_version:
            raise BadArgument(f"group {group_id!r} was reserved at weight {lease.start_weight}, "
                              f"not {start_weight_version} (nothing was written)")
        rows = record_to_rows(record, self.core.schema.token_fields)
        if self.require_routed_experts and ("routed_experts" not in self.core.schema.fields
                                            or any("routed_experts" not in row for row in rows)):
            where = "the kvckpt store schema (async_rl.replay_buffer.schema)" \
                if "routed_experts" not in self.core.schema.fields else "the committed record"
            raise RoutedExpertsMissing(f"policy.router_replay.enabled=true requires routed_experts in {where}; "
                                       f"group {group_id!r} was not written")
        await asyncio.to_thread(self.core.commit_group, lease, rows, end_weight=end_weight_version)
        meta = ReplayMeta.of_group(self.partition_id, group_id, lease.start_weight, list(self.core.schema.fields),
                                   [self._row_length(row) for row in rows])
        with self._lock:
            self._reserved.pop(group_id, None)
            self._owned.discard(group_id)
            self._meta[group_id] = meta
        return meta

    def _row_length(self, row: Mapping[str, Any]) -> int:
        if "input_lengths" in row:
            return int(row["input_lengths"])
        token = self.core.schema.token_fields
        return len(row[token[0]]) if token else 0

    async def remove_group(self, group_id: str, *, remove_in_dp: bool = False) -> int:
        """Remove the slot of ``group_id``; returns 1.

        A pending slot reserve created (a failed or cancelled attempt) is aborted in one
        transaction: its capacity is released and ``count_for_target_step`` drops; a pending slot
        of a ledger-owned prompt is fenced (``attempt`` + 1) and handed back to the ledger. A
        ready slot leaves as in :meth:`remove`: evicted with its rows (``remove_in_dp=True``) or
        claimed by the current step, rows kept (``remove_in_dp=False``).

        Raises:
            BadArgument (a ValueError): ``group_id`` has no live slot.
        """
        with self._lock:
            pending = group_id in self._reserved
        group = None if pending else self.core.group(group_id)
        if not pending and (group is None or group.state != READY):
            raise BadArgument(f"unknown group_id={group_id!r}")
        # by id, not position: other prompts' commits finish in worker threads and move positions
        return await self._remove([] if pending else [group_id], [group_id] if pending else [], remove_in_dp)

    async def remove(self, idxs: Sequence[int], remove_in_dp: bool) -> int:
        """Remove slots by position (reserve order), as :meth:`remove_group`; all positions are
        validated before anything changes. Returns how many slots were removed.

        Ready slots with ``remove_in_dp=True`` are evicted with their rows (one ``evict``). With
        ``remove_in_dp=False`` (what NeMo-RL's samplers do with the groups they select) they are
        claimed by the current step in one ``claim`` transaction, all or none: they leave the
        buffer, their rows stay readable until the step closes (``finish_step`` consumes them),
        and the batch is published to the data plane's ``inner`` client as after ``select`` (a
        failed publish returns the claims to ready, one ``release_claims``).

        Raises:
            IndexError: a position out of range. BadArgument: a repeated position, or a ready slot
            that stopped being ready meanwhile (nothing is claimed then).
        """
        if len(idxs) == 0:
            return 0
        slots = self._slots()
        bad = [i for i in idxs if not 0 <= i < len(slots)]
        if bad:
            raise IndexError(f"TQReplayBuffer.remove: indices out of range: {bad[0]}; size={len(slots)}")
        if len(set(idxs)) != len(idxs):
            raise BadArgument(f"TQReplayBuffer.remove: repeated indices in {list(idxs)}")
        chosen = [slots[i] for i in idxs]
        ready = [gid for gid, is_ready, *_ in chosen if is_ready]
        pending = [gid for gid, is_ready, *_ in chosen if not is_ready]
        return await self._remove(ready, pending, remove_in_dp)

    async def _remove(self, ready: list[str], pending: list[str], remove_in_dp: bool) -> int:
        claimed = await asyncio.to_thread(self._remove_slots, ready, pending, remove_in_dp)
        if claimed is not None:
            await self._publish(claimed)
        return len(ready) + len(pending)

    def _remove_slots(self, ready: list[str], pending: list[str], remove_in_dp: bool) -> ReplayMeta | None:
        """Evict or claim ``ready`` (one transaction), release ``pending`` (one each); the claimed
        batch's metadata, if any."""
        claimed = None
        if ready and remove_in_dp:
            self.core.evict(ready)
            with self._lock:
                for gid in ready:
                    self._meta.pop(gid, None)
        elif ready:
            claimed = self._handed_over(self.core.claim(ready).groups)
        for gid in pending:
            with self._lock:
                owned = gid in self._owned
            if owned:
                lease = self.core.redispatch(gid)
                with self._lock:
                    self._reserved.pop(gid, None)
                    self._idle[gid] = lease
            else:
                self.core.abort(gid, "attempt released by remove_group")
                with self._lock:
                    self._reserved.pop(gid, None)
        return claimed

    def _slots(self) -> list[tuple[str, bool, int, int, int | None, ReplayMeta | None]]:
        """``(group_id, ready, start_weight, end_weight, target_step, meta)`` per slot, in reserve
        (dispatch) order: the ready groups and the pending slots this handle's workers hold."""
        with self._lock:
            reserved = dict(self._reserved)
        rows: list[tuple[int, tuple[str, bool, int, int, int | None, ReplayMeta | None]]] = []
        for entry in self.core.ledger():
            if entry.group_id in reserved:
                lease = reserved[entry.group_id]
                rows.append((entry.seq, (entry.group_id, False, lease.start_weight, -1, lease.target_step, None)))
        for group in self.core.groups([READY]):
            rows.append((group.seq, (group.group_id, True, group.start_weight, group.end_weight, group.target_step,
                                     self._meta_of(group))))
        return [slot for _, slot in sorted(rows, key=lambda r: r[0])]

    def _meta_of(self, group: GroupInfo) -> ReplayMeta:
        with self._lock:
            meta = self._meta.get(group.group_id)
        if meta is None:  # committed before this handle existed (restored): lengths from its rows
            batch = self.core.read_batch([group.group_id], layout="list")
            meta = ReplayMeta.of_group(self.partition_id, group.group_id, group.start_weight,
                                       list(self.core.schema.fields), [self._row_length(r) for r in batch.rows])
            with self._lock:
                self._meta[group.group_id] = meta
        return meta

    @property
    def _group_ids(self) -> list[str]:
        """Per slot: its group id (NeMo-RL's private parallel list, read by its tests)."""
        return [slot[0] for slot in self._slots()]

    @property
    def meta_list(self) -> list[ReplayMeta | None]:
        """Per slot: its metadata, ``None`` while pending."""
        return [slot[5] for slot in self._slots()]

    @property
    def start_weight_list(self) -> list[int]:
        """Per slot: ``start_weight`` (the weight version at reserve)."""
        return [slot[2] for slot in self._slots()]

    @property
    def end_weight_list(self) -> list[int]:
        """Per slot: ``end_weight`` (-1 while pending)."""
        return [slot[3] for slot in self._slots()]

    @property
    def target_step_list(self) -> list[int | None]:
        """Per slot: ``target_step`` (``in_order``'s stamp, else ``None``)."""
        return [slot[4] for slot in self._slots()]

    @property
    def ready_list(self) -> list[bool]:
        """Per slot: whether it is committed."""
        return [slot[1] for slot in self._slots()]

    def count_for_target_step(self, target_step: int) -> int:
        """In-flight plus ready groups stamped ``target_step`` (NeMo-RL's top-up guard)."""
        return self.core.count_for_target_step(target_step)

    def promote_ready_group(self, *, to_target_step: int) -> int | None:
        """Re-stamp the ready group with the largest later ``target_step`` onto ``to_target_step``
        (one transaction); returns the lender's step, or ``None`` if no later ready group exists."""
        return self.core.promote_ready_group(to_target_step)

    def size(self) -> int:
        """The number of slots: ready groups plus pending slots held by workers."""
        with self._lock:
            pending = len(self._reserved)
        return self.core.state()["ready"] + pending

    def __len__(self) -> int:
        return self.size()

    # -- training side ----------------------------------------------------------------------------
    def _select(self, version: int, min_groups: int, max_groups: int) -> tuple[ReplayMeta | None, int]:
        self._advance_to(version)
        selection = self.core.select(min_groups, max_groups)
        if not selection.groups:
            return None, 0
        return self._handed_over(selection.groups), len(selection.groups)

    def _handed_over(self, groups: Sequence[GroupInfo]) -> ReplayMeta:
        """The one metadata of groups just claimed for training (they leave this handle's slots)."""
        metas = [self._meta_of(group) for group in groups]
        with self._lock:
            for group in groups:
                self._meta.pop(group.group_id, None)
        return metas[0].concat(*metas[1:])

    async def _publish(self, meta: ReplayMeta) -> None:
        """Publish a claimed batch to NeMo-RL's own data plane (its trainer workers read it there);
        if that fails, the claims go back to ready (one ``release_claims``) before the error is
        raised, so the next ``finish_step`` cannot consume groups nobody trained."""
        if not isinstance(self.dp_client, KvckptDataPlane):
            return
        try:
            await self.dp_client.publish(meta)
        except BaseException as exc:
            try:
                await asyncio.to_thread(self.core.release_claims, meta.group_ids)
            except BaseException as undo:
                raise undo from exc
            raise

    def _evict(self, version: int) -> int:
        self._advance_to(version)
        evicted = self.core.evict()
        with self._lock:
            for gid in evicted:
                self._meta.pop(gid, None)
        return len(evicted)

    def get_samples(self, meta: ReplayMeta, select_fields: Sequence[str] | None = None, *,
                    layout: str = "padded") -> Batch:
        """The rows ``meta`` names (selected, ready or retained), as torch tensors; token fields are
        padded with 0, ``input_ids`` with ``pad_value_dict["input_ids"]``.

        Raises:
            NotSelectable: a group's rows are gone (evicted, or dropped after its step).
        """
        batch = self.core.read_batch(meta.group_ids, fields=select_fields, layout=layout)
        pad = self._pad_value_dict.get("input_ids", 0)
        if layout == "padded" and pad and "input_ids" in batch.tensors:
            import torch

            ids = batch.tensors["input_ids"]
            beyond = torch.arange(ids.shape[1]).unsqueeze(0) >= batch.lengths.unsqueeze(1)
            batch.tensors["input_ids"] = ids.masked_fill(beyond, pad)
        return batch

    def finish_train_step(self) -> int:
        """Close the current step explicitly (claimed -> consumed, ``trainer_version`` + 1, one
        transaction); the samplers do it themselves when the trainer's version moves on."""
        version = self.core.finish_step()
        self.gate.wake()
        return version

    def abort_stale_inflight(self) -> list[str]:
        """Abort the in-flight prompts the sampler says are useless now (``windowed`` only), in one
        transaction; their slots and leases are dropped from this handle. Returns their group ids."""
        aborted = self.core.abort_stale_inflight()
        with self._lock:
            for gid in aborted:
                self._reserved.pop(gid, None)
                self._idle.pop(gid, None)
                self._owned.discard(gid)
        return aborted

    # -- checkpoints ------------------------------------------------------------------------------
    def _adopt(self, plan: RecoveryPlan) -> RecoveryPlan:
        with self._lock:
            self._reserved.clear()
            self._staged.clear()
            self._idle = {lease.group_id: lease for lease in plan.leases}
            self._owned = set(self._idle)
            self._admissions.clear()
            self._meta.clear()
        self._resume_step = None
        self._refill = []
        self.gate.wake()  # the cursor and the trainer version may both have moved
        return plan

    def recover(self, resume_version: int | None = None) -> RecoveryPlan:
        """Recover the live store to the trainer version the run resumes from (one transaction, see
        :func:`kvckpt.recover`); the ledger then owns the plan's leases."""
        return self._adopt(self.core.recover(resume_version))

    def save_checkpoint(self, dest: str, trainer_state: Mapping[str, Any] | None = None) -> CheckpointResult:
        """Write buffer, ledger and cursors of one instant to the file ``dest`` and wait for it
        (one stamp transaction, then a snapshot copy while commits keep landing)."""
        return self.core.checkpoint(dest, trainer_state, overwrite=True).wait()

    async def state_dict(self, *, saved_capacity: int) -> dict[str, Any]:
        """NeMo-RL's checkpoint call: write a kvckpt checkpoint file and return its small envelope.

        The store first closes the steps the trainer finished since it last looked (the version
        ``sampler.admit``'s ``trainer_version_fn`` returns now). The file
        (``checkpoint_dir/step_<trainer_version>.kv``) then holds rows, ledger, cursors and
        dataloader state of one instant; the returned dict (:mod:`.envelope`) names it and lists
        its groups, tensor-free (``torch.load(weights_only=True)`` reads it). In-flight prompts are
        in the file's ledger, not dropped.
        """
        if self._trainer_version_fn is not None:  # NeMo-RL saves right after `trainer_version += 1`
            await asyncio.to_thread(self._advance_to, self._trainer_version_fn())
        os.makedirs(self._checkpoint_dir, exist_ok=True)
        dest = os.path.join(self._checkpoint_dir, f"step_{self.core.trainer_version}.kv")
        result = await asyncio.to_thread(self.save_checkpoint, dest)
        # the manifest is read from the file itself (one snapshot), not from the moving live store
        snapshot = await asyncio.to_thread(ReplayBuffer.open, result.path, readonly=True)
        try:
            return envelope.build(snapshot, result, self.partition_id, saved_capacity)
        finally:
            snapshot.close()

    async def load_state_dict(self, state: Mapping[str, Any], *, max_groups: int, expected_partition_id: str,
                              expected_group_size: int) -> int:
        """NeMo-RL's restore call: restore the kvckpt checkpoint ``state`` names; returns the number
        of ready groups restored.

        The envelope is validated first (keys, backend, partition, group size, duplicates,
        capacity). If the live store already descends from that checkpoint (its last stamp is
        ``checkpoint_id``: the crash path, recovered by ``set_dispatch_index``), it is kept, with
        the rollouts committed after the checkpoint; otherwise the file is restored into the live
        path through a fresh handle. Either way every group of the envelope must be there with its
        stamps. Staleness is not applied: the first ``sampler.evict`` does.

        More groups than ``max_groups`` (a smaller capacity on resume), none target-stamped: as
        NeMo-RL, the freshest ``max_groups`` are kept in order and the oldest dropped (one
        ``evict``, recorded as evicted), then the capacity switches (one recovery) and a warning
        says so. Both steps are idempotent, so a crash between them is finished by the next call.

        Raises:
            BadArgument (a ValueError, as NeMo-RL raises): a malformed envelope, one another
            backend wrote, a partition or group size mismatch, duplicate sample ids. CapacityError:
            more target-stamped groups than ``max_groups`` (each is owed to its step), or a
            ``max_groups`` the sampler would deadlock under. RecoveryError: the file holds another
            checkpoint (a later save of the same step), or the store does not hold the envelope's
            groups as stamped.
        """
        envelope.check(state, expected_partition_id, expected_group_size)
        groups, dropped = state["groups"], []
        if len(groups) > max_groups:
            if any(doc["target_step"] is not None for doc in groups):
                raise CapacityError(f"the checkpoint holds {len(groups)} groups with target_step stamps but "
                                    f"async_rl.max_buffered_rollouts is {max_groups}: a stamped group is owed to its "
                                    f"step and cannot be dropped; resume with max_buffered_rollouts >= {len(groups)}")
            self.core.sampler.check_capacity(max_groups, self.core.config.groups_per_step)
            dropped = [doc["group_id"] for doc in groups[:len(groups) - max_groups]]
            groups = groups[len(groups) - max_groups:]
        stamp = self.core.store.read(lambda t: t.get_json("meta", b"checkpoint")) or {}
        resume_step = self._resume_step
        if stamp.get("checkpoint_id") != state["checkpoint_id"] or resume_step is not None:
            await asyncio.to_thread(self._restore_file, state["checkpoint_file"], state["checkpoint_id"],
                                    None if dropped else max_groups)
            if resume_step is not None and self.core.trainer_version != resume_step:
                self._resume_step = resume_step
                raise RecoveryError(f"the run resumes from step {resume_step} but the replay checkpoint is of step "
                                    f"{self.core.trainer_version}")
        held = {g.group_id: g for g in self.core.groups([READY])}
        for doc in groups:
            group = held.get(doc["group_id"])
            if group is None or (group.start_weight, group.end_weight, group.target_step) != \
                    (doc["start_weight"], doc["end_weight"], doc["target_step"]):
                raise RecoveryError(f"checkpointed group {doc['group_id']!r} is not ready in the store as stamped "
                                    f"({'absent' if group is None else group.state}); the envelope and the store "
                                    "are from different runs")
        if dropped:
            await asyncio.to_thread(self._truncate, dropped, max_groups)
        return len(groups)

    def _truncate(self, dropped: list[str], max_groups: int) -> None:
        """Drop the oldest restored groups (one evict) and switch the capacity (one recovery)."""
        ready = {g.group_id for g in self.core.groups([READY])}
        gone = [gid for gid in dropped if gid in ready]
        if gone:
            self.core.evict(gone)
        log.warning("replay buffer capacity changed to max_buffered_rollouts=%d: dropped the %d oldest restored "
                    "groups %s", max_groups, len(dropped), dropped[:4])
        refill = self._refill
        self._adopt(self.core.recover(self.core.trainer_version, max_buffered_rollouts=max_groups))
        self._refill = refill

    def _restore_file(self, checkpoint_file: str, checkpoint_id: str, max_groups: int | None) -> None:
        path = self.core.path
        self.core.close()
        core, plan = restore(checkpoint_file, path, overwrite=True, max_buffered_rollouts=max_groups)
        self.core = core
        self._adopt(plan)
        if plan.checkpoint_id != checkpoint_id:
            raise RecoveryError(f"{checkpoint_file!r} holds checkpoint {plan.checkpoint_id}, not the envelope's "
                                f"{checkpoint_id}: a later save of the same step replaced it")
        self._settle(plan)

    def close(self) -> None:
        """Close the store. Idempotent."""
        self.core.close()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickling hands the store over to the process that unpickles it (NeMo-RL ships the buffer
        in its actor args to the ``SingleControllerActor``): this handle closes, the copy reopens
        the same file from its config (one writer at a time), binds ``dp_client`` again and, if
        that process can import NeMo-RL, installs kvckpt's sampler factory there. Memory-only
        state (prompts staged but not admitted) does not travel; a staged prompt refuses it.

        Raises:
            BadArgument: the buffer was built around an open store without a config, or prompts
                are staged (admit them first).
        """
        if self._config is None:
            raise BadArgument("this TQReplayBuffer wraps an open store without a config; it cannot be handed over")
        if self.ledger.staged():
            raise BadArgument("prompts are staged in the ledger but not admitted; sampler.admit them before "
                              "handing the buffer to another process")
        self.close()
        return _reopen, (self.dp_client, self._config, type(self.core.sampler), *self._pickle_args)

    def __enter__(self) -> TQReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reopen(dp_client: Any, config: AdapterConfig, sampler_class: type, partition_id: str,
            pad_value_dict: dict[str, int], require_routed_experts: bool) -> TQReplayBuffer:
    """Unpickle a :class:`TQReplayBuffer` (see its ``__reduce__``)."""
    from kvckpt.integrations.nemo_rl.swap import install_if_importable

    from kvckpt.samplers import register

    register(sampler_class)  # a custom sampler's class travels by reference; the store names it
    buffer = TQReplayBuffer(dp_client, partition_id, pad_value_dict=pad_value_dict,
                            require_routed_experts=require_routed_experts, config=config)
    install_if_importable()
    return buffer


def create_replay_buffer(config: Mapping[str, Any] | AdapterConfig, *, pad_value_dict: Mapping[str, int] | None = None,
                         ) -> TQReplayBuffer:
    """The replay buffer a kvckpt config dict describes (see :func:`~.config.parse_config`),
    without a data-plane client: ``TQReplayBuffer(None, cfg.partition_id, config=cfg)``.

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
    return TQReplayBuffer(None, cfg.partition_id, pad_value_dict=pad_value_dict, config=cfg)


def restore_replay_buffer(config: Mapping[str, Any] | AdapterConfig,
                          checkpoint_file: str) -> tuple[TQReplayBuffer, RecoveryPlan]:
    """Restore the live store at ``config``'s ``path`` from a checkpoint file, in a fresh handle.

    The file is validated, copied over the live path and recovered at its stamped step (claims
    made after it return to ready; every in-flight prompt is fenced). The buffer's ledger owns
    the plan's leases: ``reserve(group_id=lease.group_id, target_step=lease.target_step, ...)``
    redispatches each exactly once, without a new admission. A sampler or capacity other than the
    checkpoint's is applied and reported in ``plan.changes``. Restore never evicts.

    Raises:
        FormatError / CorruptRecord / RecoveryError: the file is not a valid checkpoint (the live
            store is left untouched), or it holds more ready groups than ``max_buffered_rollouts``.
    """
    cfg = config if isinstance(config, AdapterConfig) else parse_config(config)
    core, plan = restore(checkpoint_file, cfg.path, overwrite=True, sampler=cfg.buffer.sampler.config(),
                         max_buffered_rollouts=cfg.buffer.max_buffered_rollouts)
    return TQReplayBuffer(None, cfg.partition_id, config=cfg, store=core, leases=plan.leases), plan
