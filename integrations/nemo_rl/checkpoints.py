"""NeMo-RL's replay-buffer checkpoint calls (``state_dict`` / ``load_state_dict``) over kvckpt files.

``state_dict`` writes a kvckpt checkpoint file of one instant (rows, ledger, cursors, dataloader
state) and returns its small tensor-free envelope (:mod:`.envelope`); ``load_state_dict`` checks the
envelope and restores that file into the live path, or keeps the live store if it already
descends from it (the crash path). :class:`ReplayCheckpoints` does both for one buffer's handle.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from kvckpt.integrations.nemo_rl import envelope
from kvckpt.integrations.nemo_rl.handle import BufferHandle
from kvckpt.integrations.nemo_rl.steps import StepDriver

from kvckpt import READY, CheckpointResult, ReplayBuffer, restore
from kvckpt.errors import CapacityError, RecoveryError

log = logging.getLogger("kvckpt.integrations.nemo_rl")


class ReplayCheckpoints:
    """The checkpoints of one buffer: files under ``checkpoint_dir``, restored through ``steps``."""

    def __init__(self, handle: BufferHandle, steps: StepDriver, checkpoint_dir: str) -> None:
        self._handle = handle
        self._steps = steps
        self.checkpoint_dir = checkpoint_dir

    def save(self, dest: str, trainer_state: Mapping[str, Any] | None = None) -> CheckpointResult:
        """Write buffer, ledger and cursors of one instant to the file ``dest`` and wait for it
        (one stamp transaction, then a snapshot copy while commits keep landing)."""
        return self._handle.core.checkpoint(dest, trainer_state, overwrite=True).wait()

    async def state_dict(self, *, saved_capacity: int) -> dict[str, Any]:
        """NeMo-RL's checkpoint call (see ``TQReplayBuffer.state_dict``)."""
        if self._steps.version_fn is not None:  # NeMo-RL saves right after `trainer_version += 1`
            await asyncio.to_thread(self._steps.advance_to, self._steps.version_fn())
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        dest = os.path.join(self.checkpoint_dir, f"step_{self._handle.core.trainer_version}.kv")
        result = await asyncio.to_thread(self.save, dest)
        # the manifest is read from the file itself (one snapshot), not from the moving live store
        snapshot = await asyncio.to_thread(ReplayBuffer.open, result.path, readonly=True)
        try:
            return envelope.build(snapshot, result, self._handle.partition_id, saved_capacity)
        finally:
            snapshot.close()

    async def load_state_dict(self, state: Mapping[str, Any], *, max_groups: int, expected_partition_id: str,
                              expected_group_size: int) -> int:
        """NeMo-RL's restore call (see ``TQReplayBuffer.load_state_dict``)."""
        envelope.check(state, expected_partition_id, expected_group_size)
        core = self._handle.core
        groups, dropped = state["groups"], []
        if len(groups) > max_groups:
            if any(doc["target_step"] is not None for doc in groups):
                raise CapacityError(f"the checkpoint holds {len(groups)} groups with target_step stamps but "
                                    f"async_rl.max_buffered_rollouts is {max_groups}: a stamped group is owed to its "
                                    f"step and cannot be dropped; resume with max_buffered_rollouts >= {len(groups)}")
            core.sampler.check_capacity(max_groups, core.config.groups_per_step)
            dropped = [doc["group_id"] for doc in groups[:len(groups) - max_groups]]
            groups = groups[len(groups) - max_groups:]
        stamp = core.store.read(lambda t: t.get_json("meta", b"checkpoint")) or {}
        resume_step = self._steps.resume_step
        if stamp.get("checkpoint_id") != state["checkpoint_id"] or resume_step is not None:
            await asyncio.to_thread(self._restore_file, state["checkpoint_file"], state["checkpoint_id"],
                                    None if dropped else max_groups)
            if resume_step is not None and self._handle.core.trainer_version != resume_step:
                self._steps.await_restore(resume_step)
                raise RecoveryError(f"the run resumes from step {resume_step} but the replay checkpoint is of step "
                                    f"{self._handle.core.trainer_version}")
        held = {g.group_id: g for g in self._handle.core.groups([READY])}
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
        core = self._handle.core
        ready = {g.group_id for g in core.groups([READY])}
        gone = [gid for gid in dropped if gid in ready]
        if gone:
            core.evict(gone)
        log.warning("replay buffer capacity changed to max_buffered_rollouts=%d: dropped the %d oldest restored "
                    "groups %s", max_groups, len(dropped), dropped[:4])
        self._steps.recover(core.trainer_version, keep_refill=True, max_buffered_rollouts=max_groups)

    def _restore_file(self, checkpoint_file: str, checkpoint_id: str, max_groups: int | None) -> None:
        path = self._handle.core.path
        self._handle.core.close()
        core, plan = restore(checkpoint_file, path, overwrite=True, max_buffered_rollouts=max_groups)
        self._handle.core = core
        self._steps.adopt(plan)
        if plan.checkpoint_id != checkpoint_id:
            raise RecoveryError(f"{checkpoint_file!r} holds checkpoint {plan.checkpoint_id}, not the envelope's "
                                f"{checkpoint_id}: a later save of the same step replaced it")
        self._steps.settle(plan)
