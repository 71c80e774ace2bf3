"""The store transitions NeMo-RL's samplers drive, and the store following the trainer's clock.

:class:`StepDriver` is what the sampler objects (:mod:`.sampler`) call, one transaction per
transition, each in the worker thread the sampler hands it to:

* the trainer's version is NeMo-RL's ``trainer_version_fn()`` / ``current_train_weight``; when it
  is ahead of the store's ``trainer_version`` the store first closes the steps in between
  (:meth:`StepDriver.advance_to`: one ``finish_step`` each, that step's claims consumed), so the
  controller drives the store without a call NeMo-RL does not make;
* ``admit``: the cursor, the dataloader state and the prompts the ledger staged, one transaction;
* ``select`` claims a batch, which is then published to NeMo-RL's own data plane; a failed publish
  returns the claims (one ``release_claims``), so no later ``finish_step`` consumes them;
* a (re)start at step ``s`` recovers the store to ``s`` (claims of ``s`` and later back to ready,
  every attempt fenced) and gives up the prompts nobody can regenerate, refilling their steps.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvckpt.integrations.nemo_rl.dataplane import KvckptDataPlane
from kvckpt.integrations.nemo_rl.handle import BufferHandle
from kvckpt.integrations.nemo_rl.meta import ReplayMeta

from kvckpt import Admission, Lease, Prompt, RecoveryPlan
from kvckpt.errors import BadArgument, RecoveryError

#: ``task_name`` of a prompt NeMo-RL reserved without saying which prompt it is (main's
#: ``reserve`` carries no identity; pass ``prompt_idx=``/``task_name=`` or use the ledger).
UNIDENTIFIED_TASK = "nemo_rl.unidentified"


class StepDriver:
    """The transitions of one buffer's samplers over ``handle`` (see the module docstring);
    ``dp_client``: the buffer's data-plane client (a :class:`~.dataplane.KvckptDataPlane` is
    published to)."""

    def __init__(self, handle: BufferHandle, dp_client: Any) -> None:
        self.handle = handle
        self.dp_client = dp_client
        #: The controller's trainer version (``sampler.admit``'s ``trainer_version_fn``), once known.
        self.version_fn: Callable[[], int] | None = None
        self._version_lock = threading.Lock()
        self._resume_step: int | None = None
        self._refill: list[int | None] = []  # stamps of batches a restart left short, re-admitted first

    # -- the run's start --------------------------------------------------------------------------
    @property
    def resume_step(self) -> int | None:
        """The step a resumed run waits for ``load_state_dict`` to restore (None: not waiting)."""
        return self._resume_step

    def await_restore(self, step: int) -> None:
        """Refuse admissions until a restore brings the store to ``step``."""
        self._resume_step = step

    def resume_at(self, step: int) -> None:
        """``sampler.set_dispatch_index(step)``: a store behind ``step`` waits for its restore; one
        at or ahead of it is recovered to it (one transaction) and :meth:`settle` d.

        Raises:
            RecoveryError: a gated store whose cursor is behind ``step - 1`` (another run wrote it).
        """
        core = self.handle.core
        if core.trainer_version < step:
            self._resume_step = step  # load_state_dict restores the store to it
            return
        plan = self.recover(step)
        cursor = core.state()["dispatch_index"]
        if core.sampler.gate_window is not None and cursor < step - 1:
            raise RecoveryError(f"the store is at step {step} but its dispatch_index {cursor} "
                                f"is behind {step - 1}: it was not written by this run")
        self.settle(plan)

    def settle(self, plan: RecoveryPlan) -> None:
        """After a restart or a restore: prompts main's ``reserve`` left anonymous cannot be
        generated again by anyone, so they are given up (one abort each) and nothing waits for
        them; ``admit`` then hands out the stamps of the steps left short first, as NeMo-RL's
        rewound cursor would (its top-up guard fills them)."""
        core, lost = self.handle.core, 0
        for lease in plan.leases:
            if lease.task_name == UNIDENTIFIED_TASK:
                core.abort(lease.group_id, "in flight at a restart, reserved without a prompt identity")
                lost += 1
                self.handle.forget([lease.group_id])
        per_step = core.config.groups_per_step
        if core.sampler.stamps_target_step:
            self._refill = [t for t in range(plan.resume_version, core.state()["dispatch_index"] + 1)
                            if core.count_for_target_step(t) < per_step]
        elif core.sampler.gate_window is not None:  # a closed gate would wait for them forever
            self._refill = [None] * -(-lost // per_step)

    def adopt(self, plan: RecoveryPlan, *, keep_refill: bool = False) -> RecoveryPlan:
        """The handle forgets all but the store; the ledger owns ``plan``'s leases."""
        self.handle.adopt(plan.leases)
        self._resume_step = None
        if not keep_refill:
            self._refill = []
        return plan

    def recover(self, resume_version: int | None = None, *, keep_refill: bool = False,
                **changes: Any) -> RecoveryPlan:
        """Recover the live store to ``resume_version`` (one transaction, see :func:`kvckpt.recover`;
        ``changes`` such as ``max_buffered_rollouts=``) and :meth:`adopt` its plan."""
        return self.adopt(self.handle.core.recover(resume_version, **changes), keep_refill=keep_refill)

    # -- the trainer's clock ----------------------------------------------------------------------
    def advance_to(self, version: int) -> None:
        """Close the store's steps up to the trainer's ``version`` (one ``finish_step`` each).

        Raises:
            RecoveryError: the run waits for a restore. BadArgument: ``version`` is behind the store's.
        """
        core = self.handle.core
        if self._resume_step is not None:
            raise RecoveryError(f"the run resumes from step {self._resume_step} but the store is at step "
                                f"{core.trainer_version}: await load_state_dict(<that step's state>) first")
        with self._version_lock:
            current = core.trainer_version
            if version < current:
                raise BadArgument(f"trainer version {version} is behind the store's {current}: a resumed run "
                                  "calls sampler.set_dispatch_index(step) first")
            while current < version:
                current = core.finish_step()
        self.handle.gate.wake()  # a waiting admit re-reads the trainer's version

    def finish_step(self) -> int:
        """Close the current step (one transaction); returns the new trainer version."""
        version = self.handle.core.finish_step()
        self.handle.gate.wake()
        return version

    # -- admission --------------------------------------------------------------------------------
    def next_refill(self) -> tuple[bool, int | None]:
        """``(True, stamp)`` for the next batch a restart left short, admitted again without moving
        the cursor (its prompts join an admission of that stamp); ``(False, None)`` once none is left."""
        if not self._refill:
            return False, None
        step = self._refill.pop(0)
        self.handle.note_admission(self.handle.admission_for(step))
        return True, step

    def admit(self, prompts: Sequence[Prompt | int | Mapping[str, Any]], dataloader_state: bytes | None,
              weight_version: int | None, timeout: float | None) -> list[Lease]:
        """Admit ``prompts`` in one transaction; the ledger owns them."""
        core = self.handle.core
        leases = core.admit(prompts, dataloader_state, timeout=timeout, weight_version=weight_version)
        stamp = leases[0].target_step
        self.handle.note_admission(Admission(leases[0].admission_id, core.state()["dispatch_index"], stamp))
        self.handle.own(leases)
        return leases

    def admit_batch(self, version: int, dataloader_state: bytes | None, weight_version: int | None,
                    timeout: float | None) -> int | None:
        """``sampler.admit``'s transaction, once the gate is open: the staged prompts (or a bare
        cursor advance) with ``dataloader_state``; returns the stamp."""
        self.advance_to(version)
        core, staged = self.handle.core, self.handle.take_staged()
        if not staged:
            if core.sampler.gate_window is None and dataloader_state is None:
                return None
            admission = core.advance_dispatch(dataloader_state, timeout=timeout)
            self.handle.note_admission(admission)
            return admission.target_step
        try:
            leases = self.admit(staged, dataloader_state, weight_version, timeout)
        except BaseException:
            self.handle.restage(staged)
            raise
        return leases[0].target_step

    # -- training ---------------------------------------------------------------------------------
    def select(self, version: int, min_groups: int, max_groups: int) -> tuple[ReplayMeta | None, int]:
        """Claim a batch for ``version`` (one transaction); ``(None, 0)`` below ``min_groups``."""
        self.advance_to(version)
        selection = self.handle.core.select(min_groups, max_groups)
        if not selection.groups:
            return None, 0
        return self.handle.handed_over(selection.groups), len(selection.groups)

    def claim(self, group_ids: Sequence[str]) -> ReplayMeta:
        """Claim exactly these ready groups for the current step (one transaction, all or none)."""
        return self.handle.handed_over(self.handle.core.claim(group_ids).groups)

    async def publish(self, meta: ReplayMeta) -> None:
        """Publish a claimed batch to NeMo-RL's own data plane (its trainer workers read it there);
        if that fails, the claims go back to ready (one ``release_claims``) before the error is
        raised, so the next ``finish_step`` cannot consume groups nobody trained."""
        if not isinstance(self.dp_client, KvckptDataPlane):
            return
        try:
            await self.dp_client.publish(meta)
        except BaseException as exc:
            try:
                await asyncio.to_thread(self.handle.core.release_claims, meta.group_ids)
            except BaseException as undo:
                raise undo from exc
            raise

    def evict(self, version: int) -> int:
        """Evict the ready groups the sampler can no longer select at ``version``, rows included,
        in one transaction; returns how many."""
        self.advance_to(version)
        evicted = self.handle.core.evict()
        self.handle.drop_meta(evicted)
        return len(evicted)
