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
  in one transaction; ``select`` claims (rows stay readable until the step closes), and so does
  ``remove(..., remove_in_dp=False)`` of a ready slot; ``evict`` deletes rows.

The module is one class, NeMo-RL's whole ``TQReplayBuffer`` surface (constructor, slots and their
parallel lists, removal, the training side, the checkpoint calls, the hand-over by pickling), and
it is long (about 420 lines, half of them the docstrings that say each member's transactions and
deviations) because NeMo-RL puts all of it on one object. The work behind it is in the modules it
composes: :mod:`.handle` (the open store and this process's memory of it), :mod:`.steps` (the
transitions the samplers drive), :mod:`.checkpoints`, :mod:`.ledger`, :mod:`.sampler` and
:mod:`.dataplane`; :mod:`.factories` builds it from a config dict or a checkpoint file.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvckpt.integrations.nemo_rl.checkpoints import ReplayCheckpoints
from kvckpt.integrations.nemo_rl.config import AdapterConfig, configured, parse_config
from kvckpt.integrations.nemo_rl.dataplane import KvckptDataPlane
from kvckpt.integrations.nemo_rl.dispatch import bind_lease, bound_dispatch
from kvckpt.integrations.nemo_rl.handle import BufferHandle, open_store
from kvckpt.integrations.nemo_rl.hooks import install_if_importable
from kvckpt.integrations.nemo_rl.ledger import KvckptLedger
from kvckpt.integrations.nemo_rl.meta import ReplayMeta
from kvckpt.integrations.nemo_rl.records import record_to_rows
from kvckpt.integrations.nemo_rl.sampler import create_sampler
from kvckpt.integrations.nemo_rl.steps import UNIDENTIFIED_TASK, StepDriver

from kvckpt import READY, Batch, CheckpointResult, Lease, Prompt, RecoveryPlan, ReplayBuffer, register
from kvckpt.errors import BadArgument, SchemaMismatch


class RoutedExpertsMissing(SchemaMismatch, RuntimeError):
    """``require_routed_experts`` and no ``routed_experts`` to store: a kvckpt schema error that
    is also the ``RuntimeError`` NeMo-RL's commit raises."""


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
        #: The open store and this process's memory of it (shared by the ledger and the samplers).
        self.handle = BufferHandle(store if store is not None else open_store(cfg), partition_id, leases)
        self._config = cfg
        self._pickle_args = (partition_id, dict(pad_value_dict or {}), require_routed_experts)
        self.dp_client = dp_client
        if isinstance(dp_client, KvckptDataPlane):
            dp_client.bind(self)
        self.partition_id = partition_id
        self._pad_value_dict = dict(pad_value_dict or {})
        self.require_routed_experts = require_routed_experts
        #: The store transitions the samplers drive (:mod:`.steps`).
        self.steps = StepDriver(self.handle, dp_client)
        self.checkpoints = ReplayCheckpoints(self.handle, self.steps, (cfg.checkpoint_dir if cfg is not None else None)
                                             or f"{self.core.path}.checkpoints")
        self.sampler = create_sampler(self, self.core.sampler.config())
        self.ledger = KvckptLedger(self.handle)

    @property
    def core(self) -> ReplayBuffer:
        """The open kvckpt store (``load_state_dict`` may replace it with a restored one)."""
        return self.handle.core

    # -- admission --------------------------------------------------------------------------------
    def admit_batch(self, prompts: Sequence[Prompt | int | Mapping[str, Any]], *, dataloader_state: bytes | None = None,
                    weight_version: int | None = None, timeout: float | None = None) -> list[str]:
        """Admit a whole dataloader batch in one transaction (cursor, dataloader state, one ledger
        entry per prompt); returns the group ids, each then taken with ``reserve(group_id=...)``.

        Raises:
            GateTimeout: still closed after ``timeout``. CapacityError: a batch larger than the
            capacity. BadArgument: a duplicate or already-used group id.
        """
        return [lease.group_id for lease in self.steps.admit(prompts, dataloader_state, weight_version, timeout)]

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
        * with neither ``group_id`` nor ``prompt_idx`` (NeMo-RL's ``generate_and_push``), inside
          :func:`~.dispatch.dispatching`: the prompt (and a re-issue's recovered group id) bound there.
          The attempt's lease is then bound for the engine proxy's sequence key (:mod:`.engine`).

        Raises:
            BadArgument: the group is already reserved, its stamp differs from ``target_step``, a
                ``target_step`` under a sampler that stamps none (the store could not record it), or
                a gated sampler has no admission for ``target_step`` (NeMo-RL's buffer appends the
                slot; here it would slip past the store's gate and ledger, so the message says why).
            GateTimeout: no capacity left (``max_buffered_rollouts``).
        """
        bound = bound_dispatch() if group_id is None and prompt_idx is None else None
        if bound is not None:  # NeMo-RL's generate_and_push inside dispatching(): the prompt it works for
            group_id, prompt_idx, task_name = bound.group_id, bound.prompt_idx, bound.task_name
        lease = self.handle.take_idle(group_id)
        try:
            if lease is not None:
                if lease.target_step != target_step:
                    raise BadArgument(f"group {group_id!r} is stamped for step {lease.target_step}, not {target_step}")
                if lease.start_weight != weight_version:
                    lease = self.core.redispatch(lease.group_id, start_weight=weight_version)
            else:
                if target_step is not None and not self.core.sampler.stamps_target_step:
                    raise BadArgument(f"target_step={target_step}, but {self.core.sampler.name} stamps no admission "
                                      "with a step (in_order does), so the store has nowhere to record it: pass "
                                      "what sampler.admit returned (None)")
                prompt = Prompt(0 if prompt_idx is None else prompt_idx,
                                task_name or (UNIDENTIFIED_TASK if prompt_idx is None else "default"),
                                group_id or str(uuid.uuid4()))
                admission = None if self.core.sampler.gate_window is None else self.handle.admission_for(target_step)
                [lease] = self.core.admit([prompt], timeout=0, weight_version=weight_version, admission=admission)
        except BaseException:
            if lease is not None:
                self.handle.untake(lease)
            raise
        self.handle.hold(lease)
        bind_lease(lease)
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
        lease = self.handle.held(group_id)
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
                                   [self.handle.row_length(row) for row in rows])
        self.handle.committed(group_id, meta)
        return meta

    async def remove_group(self, group_id: str, *, remove_in_dp: bool = False) -> int:
        """Remove the slot of ``group_id``; returns 1.

        A pending slot reserve created (a failed or cancelled attempt) is aborted in one
        transaction: its capacity is released and ``count_for_target_step`` drops; a pending slot
        of a ledger-owned prompt is fenced (``attempt`` + 1) and handed back to the ledger. A
        ready slot is evicted with its rows (``remove_in_dp=True`` only): the rollout manager
        removes the slots of failed attempts, so a committed group reaching it without
        ``remove_in_dp`` is refused rather than claimed for a step that will not train it (a
        batch for training leaves through ``sampler.select`` or :meth:`remove`).

        Raises:
            BadArgument (a ValueError): ``group_id`` has no live slot, or is ready and
                ``remove_in_dp`` is False.
        """
        pending = self.handle.held(group_id) is not None
        group = None if pending else self.core.group(group_id)
        if not pending and (group is None or group.state != READY):
            raise BadArgument(f"unknown group_id={group_id!r}")
        if not pending and not remove_in_dp:
            raise BadArgument(f"ready group {group_id!r} is committed, not a failed attempt: it leaves the buffer "
                              "through sampler.select or remove(idxs, remove_in_dp=False) (trained), or "
                              "remove_group(..., remove_in_dp=True) (discarded with its rows)")
        # by id, not position: other prompts' commits finish in worker threads and move positions
        return await self._remove([] if pending else [group_id], [group_id] if pending else [], remove_in_dp)

    async def remove(self, idxs: Sequence[int], remove_in_dp: bool) -> int:
        """Remove slots by position (reserve order); pending slots as :meth:`remove_group`, and all
        positions are validated before anything changes. Returns how many slots were removed.

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
        slots = self.handle.slots()
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
            await self.steps.publish(claimed)
        return len(ready) + len(pending)

    def _remove_slots(self, ready: list[str], pending: list[str], remove_in_dp: bool) -> ReplayMeta | None:
        """Evict or claim ``ready`` (one transaction), release ``pending`` (one each); the claimed
        batch's metadata, if any."""
        claimed = None
        if ready and remove_in_dp:
            self.handle.drop_meta(self.core.evict(ready))
        elif ready:
            claimed = self.steps.claim(ready)
        for gid in pending:
            self.handle.release_attempt(gid)
        return claimed

    @property
    def _group_ids(self) -> list[str]:
        """Per slot: its group id (NeMo-RL's private parallel list, read by its tests)."""
        return [slot[0] for slot in self.handle.slots()]

    @property
    def meta_list(self) -> list[ReplayMeta | None]:
        """Per slot: its metadata, ``None`` while pending."""
        return [slot[5] for slot in self.handle.slots()]

    @property
    def start_weight_list(self) -> list[int]:
        """Per slot: ``start_weight`` (the weight version at reserve)."""
        return [slot[2] for slot in self.handle.slots()]

    @property
    def end_weight_list(self) -> list[int]:
        """Per slot: ``end_weight`` (-1 while pending)."""
        return [slot[3] for slot in self.handle.slots()]

    @property
    def target_step_list(self) -> list[int | None]:
        """Per slot: ``target_step`` (``in_order``'s stamp, else ``None``)."""
        return [slot[4] for slot in self.handle.slots()]

    @property
    def ready_list(self) -> list[bool]:
        """Per slot: whether it is committed."""
        return [slot[1] for slot in self.handle.slots()]

    def count_for_target_step(self, target_step: int) -> int:
        """In-flight plus ready groups stamped ``target_step`` (NeMo-RL's top-up guard)."""
        return self.core.count_for_target_step(target_step)

    def promote_ready_group(self, *, to_target_step: int) -> int | None:
        """Re-stamp the ready group with the largest later ``target_step`` onto ``to_target_step``
        (one transaction); returns the lender's step, or ``None`` if no later ready group exists."""
        return self.core.promote_ready_group(to_target_step)

    def size(self) -> int:
        """The number of slots: ready groups plus pending slots held by workers."""
        return self.core.state()["ready"] + self.handle.pending()

    def __len__(self) -> int:
        return self.size()

    # -- training side ----------------------------------------------------------------------------
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
        return self.steps.finish_step()

    def abort_stale_inflight(self) -> list[str]:
        """Abort the in-flight prompts the sampler says are useless now (``windowed`` only), in one
        transaction; their slots and leases are dropped from this handle. Returns their group ids."""
        aborted = self.core.abort_stale_inflight()
        self.handle.forget(aborted)
        return aborted

    # -- checkpoints ------------------------------------------------------------------------------
    def recover(self, resume_version: int | None = None) -> RecoveryPlan:
        """Recover the live store to the trainer version the run resumes from (one transaction, see
        :func:`kvckpt.recover`); the ledger then owns the plan's leases."""
        return self.steps.recover(resume_version)

    def save_checkpoint(self, dest: str, trainer_state: Mapping[str, Any] | None = None) -> CheckpointResult:
        """Write buffer, ledger and cursors of one instant to the file ``dest`` and wait for it
        (one stamp transaction, then a snapshot copy while commits keep landing)."""
        return self.checkpoints.save(dest, trainer_state)

    async def state_dict(self, *, saved_capacity: int) -> dict[str, Any]:
        """NeMo-RL's checkpoint call: write a kvckpt checkpoint file and return its small envelope.

        The store first closes the steps the trainer finished since it last looked (the version
        ``sampler.admit``'s ``trainer_version_fn`` returns now). The file
        (``checkpoint_dir/step_<trainer_version>.kv``) then holds rows, ledger, cursors and
        dataloader state of one instant; the returned dict (:mod:`.envelope`) names it and lists
        its groups, tensor-free (``torch.load(weights_only=True)`` reads it). In-flight prompts are
        in the file's ledger, not dropped.
        """
        return await self.checkpoints.state_dict(saved_capacity=saved_capacity)

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
        return await self.checkpoints.load_state_dict(state, max_groups=max_groups,
                                                      expected_partition_id=expected_partition_id,
                                                      expected_group_size=expected_group_size)

    @property
    def progress_every_tokens(self) -> int:
        """The token-progress interval its config sets (``progress_every_tokens``; 0: off)."""
        return 0 if self._config is None else int(self._config.progress_every_tokens)

    def on_close(self, callback: Any) -> None:
        """Call ``callback()`` when this buffer closes, before the store does (the progress desk stops there)."""
        self.__dict__.setdefault("_closing", []).append(callback)

    def close(self) -> None:
        """Close the store (after the :meth:`on_close` callbacks). Idempotent."""
        for callback in self.__dict__.pop("_closing", []):
            callback()
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
    register(sampler_class)  # a custom sampler's class travels by reference; the store names it
    buffer = TQReplayBuffer(dp_client, partition_id, pad_value_dict=pad_value_dict,
                            require_routed_experts=require_routed_experts, config=config)
    install_if_importable()
    return buffer
