"""NeMo-RL's ownership-ledger lifecycle (``RolloutRecoveryLedger``) over kvckpt's ledger.

NeMo-RL's ledger owns a prompt from the moment it leaves the dataloader until its group is
committed (or deliberately discarded), and every mutation must hold a checkpoint-barrier cut. In
kvckpt the ledger *is* the store's ledger table and every mutation is one transaction, so there is
no cut to hold:

====================================  =============================================================================
NeMo-RL                               kvckpt
====================================  =============================================================================
``reserve_group`` (phase reserved)    staged in memory; durable at admission, with the dataloader state
``mark_group_admitted``               ``sampler.admit``: cursor + dataloader state + entries, one transaction
``reserve_group`` (admitted)          a ledger entry joining the current admission, one transaction
``discard_group`` (intentional)       :meth:`~kvckpt.ReplayBuffer.abort`: tombstone, shortfall credited
``discard_group`` (at commit)         nothing to do: the commit transaction released the entry
``state_dict`` / ``load_state_dict``  the store file (:meth:`~.adapter.TQReplayBuffer.save_checkpoint`)
====================================  =============================================================================
"""

from __future__ import annotations

from kvckpt.integrations.nemo_rl.handle import BufferHandle

from kvckpt import LedgerEntry, Prompt, ReplayBuffer
from kvckpt.errors import BadArgument, UnknownGroup


class KvckptLedger:
    """The ledger of a :class:`~.adapter.TQReplayBuffer` (``buffer.ledger``), over its handle."""

    def __init__(self, handle: BufferHandle) -> None:
        self._handle = handle

    @property
    def _core(self) -> ReplayBuffer:
        return self._handle.core  # load_state_dict may swap the store for a restored one

    def reserve_group(self, group_id: str, *, prompt_idx: int, task_name: str = "default",
                      expected_generations: int | None = None, target_step: int | None = None,
                      start_weight_version: int | None = None) -> None:
        """Take ownership of a prompt that left the dataloader (or the spare pool).

        Without ``target_step`` the prompt is staged: the next ``sampler.admit`` makes it a ledger
        entry in the admission's transaction. With ``target_step`` (its admission already happened,
        e.g. a replacement prompt) it becomes a ledger entry of that admission now, in one
        transaction.

        Raises:
            BadArgument: a duplicate group id, ``expected_generations`` other than the store's group
                size, or a ``target_step`` no admission of this handle is stamped with.
        """
        if expected_generations is not None and expected_generations != self._core.config.group_size:
            raise BadArgument(f"expected_generations {expected_generations} differs from the store's group size "
                              f"{self._core.config.group_size}")
        prompt = Prompt(int(prompt_idx), task_name, group_id)
        if target_step is None:
            self._handle.stage(prompt)
            return
        weight = self._core.state()["weight_version"] if start_weight_version is None else start_weight_version
        admission = None if self._core.sampler.gate_window is None else self._handle.admission_for(target_step)
        self._handle.own(self._core.admit([prompt], timeout=0, weight_version=weight, admission=admission))

    def discard_group(self, group_id: str, reason: str = "discarded") -> bool:
        """Release a prompt deliberately (budget spent, replaced): a staged prompt is dropped, an
        admitted one becomes an aborted tombstone with ``reason`` and its step's shortfall is
        credited (one transaction). Returns False if the ledger does not own it (e.g. committed)."""
        if self._handle.unstage(group_id):
            return True
        try:
            self._core.abort(group_id, reason)
        except UnknownGroup:
            return False
        self._handle.forget([group_id])
        return True

    def entries(self) -> list[LedgerEntry]:
        """The durable ledger (admitted, not yet committed prompts), in dispatch order."""
        return self._core.ledger()

    def staged(self) -> list[Prompt]:
        """Prompts reserved but not yet admitted (memory only), in reserve order."""
        return self._handle.staged()

    def __contains__(self, group_id: object) -> bool:
        return self._handle.is_staged(group_id) or any(e.group_id == group_id for e in self.entries())

    def __len__(self) -> int:
        return len(self.staged()) + len(self.entries())
