"""NeMo-RL's sampler protocol over the kvckpt store's sampler and cursors.

The eligibility, eviction and gate rules are kvckpt's samplers (``in_order``, ``weight_fifo``,
``windowed``, ``ready_first``: NeMo-RL's four, same config keys); this object adds NeMo-RL's
calling convention. The trainer's version is the store's ``trainer_version``, advanced by
:meth:`~.adapter.KvckptReplayBuffer.finish_train_step`; every call that is handed a version checks
that the two agree and raises if the trainer forgot to close a step, instead of selecting for the
wrong one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvckpt.errors import BadArgument, GateTimeout, RecoveryError

from .meta import ReplayMeta

if TYPE_CHECKING:
    from .adapter import KvckptReplayBuffer

#: NeMo-RL's gate poll interval (seconds).
POLL_SECONDS = 0.005


class KvckptSampler:
    """The sampler of a :class:`~.adapter.KvckptReplayBuffer` (``buffer.sampler``)."""

    #: Every kvckpt sampler's state (stamps and cursor) is in the store, so it checkpoints.
    supports_buffer_checkpoint = True

    def __init__(self, buffer: KvckptReplayBuffer) -> None:
        self._buffer = buffer
        self._core = buffer.core

    @property
    def name(self) -> str:
        """The config ``name`` (``in_order``, ``weight_fifo``, ``windowed``, ``ready_first``)."""
        return self._core.sampler.name

    def config(self) -> dict[str, Any]:
        """The sampler's config section (``name`` plus its keys)."""
        return self._core.sampler.config()

    @property
    def is_on_policy(self) -> bool:
        """Whether the version window is 0 (only the current weight's rollouts train)."""
        return self._core.sampler.window == 0

    def required_buffer_capacity(self, groups_per_step: int) -> int:
        """``groups_per_step x (W + 1)``: the smallest ``max_buffered_rollouts`` that cannot deadlock."""
        return self._core.sampler.required_buffer_capacity(groups_per_step)

    def should_abort_inflight(self, start_weight_version: int, current_weight_version: int) -> bool:
        """Whether a rollout started at ``start_weight_version`` is useless at the current version."""
        return self._core.sampler.should_abort_inflight(start_weight_version, current_weight_version)

    @property
    def dispatch_index(self) -> int:
        """The admission cursor (-1 before the first admission), read from the store."""
        return self._core.state()["dispatch_index"]

    def restore_dispatch_index(self, index: int) -> None:
        """Check the trainer's saved cursor against the restored store's (they are one file, so
        they must be equal); NeMo-RL's restore call.

        Raises:
            RecoveryError: they differ (the trainer state and the buffer checkpoint are from
                different saves; resuming would skip or repeat a batch).
        """
        if not isinstance(index, int) or index < -1:
            raise BadArgument(f"dispatch_index must be an integer >= -1, got {index!r}")
        current = self.dispatch_index
        if index != current:
            raise RecoveryError(f"the trainer's saved dispatch_index {index} differs from the store's {current}: "
                                "the trainer state and the replay checkpoint are from different saves")

    set_dispatch_index = restore_dispatch_index

    def _check_version(self, version: int, what: str) -> None:
        current = self._core.trainer_version
        if version != current:
            raise BadArgument(f"{what} at version {version}, but the store's trainer_version is {current}: "
                              "call buffer.finish_train_step() once per optimizer step")

    def admit(self, trainer_version_fn: Callable[[], int], *, dataloader_state: bytes | None = None,
              weight_version: int | None = None, timeout: float | None = None) -> int | None:
        """Admit the next dataloader batch and return its stamp (``target_step`` for ``in_order``,
        else ``None``).

        Gated samplers first wait, polling every 5 ms outside any transaction, while
        ``dispatch_index >= trainer_version_fn() + W``. Then, in one transaction: the cursor advance,
        ``dataloader_state`` and a ledger entry for every prompt ``ledger.reserve_group`` staged
        (NeMo-RL's ``commit_admission`` plus ``mark_group_admitted`` in one cut). With nothing
        staged, the prompts join later through ``buffer.reserve`` (NeMo-RL's split admission: a
        second transaction per prompt; see ``docs/integrations.md``). ``windowed`` is ungated and
        has no cursor: it returns at once, writing only the staged prompts and the dataloader state
        (nothing at all when there are neither).

        Args:
            trainer_version_fn: returns the trainer's current version.
            dataloader_state: the dataloader state after this batch, saved with the cursor.
            weight_version: ``start_weight`` of staged prompts. Defaults to the store's.
            timeout: seconds to wait for the gate (and capacity). Defaults to forever.

        Raises:
            GateTimeout: still closed after ``timeout``.
            BadArgument: ``trainer_version_fn()`` disagrees with the store's trainer version.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        gate = self._core.sampler.gate_window
        if gate is not None:
            while self.dispatch_index >= trainer_version_fn() + gate:
                if deadline is not None and time.monotonic() >= deadline:
                    raise GateTimeout(f"{self.name} gate still closed after {timeout}s: dispatch_index "
                                      f"{self.dispatch_index} >= trainer version {trainer_version_fn()} + {gate}")
                time.sleep(POLL_SECONDS)
            self._check_version(trainer_version_fn(), "admit")
        staged = self._buffer.ledger._take_staged()
        if not staged:
            if gate is None and dataloader_state is None:
                return None
            admission = self._core.advance_dispatch(dataloader_state, timeout=0)
            self._buffer._admissions[admission.target_step] = admission
            return admission.target_step
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            leases = self._buffer._admit(staged, dataloader_state, weight_version, remaining)
        except BaseException:
            self._buffer.ledger._restage(staged)
            raise
        return leases[0].target_step

    def select(self, current_train_weight: int, min_prompt_groups: int,
               max_prompt_groups: int) -> tuple[ReplayMeta | None, int]:
        """Claim up to ``max_prompt_groups`` eligible groups for the current step (one transaction).

        Fewer than ``min_prompt_groups`` eligible: ``(None, 0)`` and nothing written. The groups
        leave the buffer; their rows stay readable until the step finishes.

        Raises:
            BadArgument: not ``1 <= min <= max``, or a version the store is not at.
        """
        self._check_version(current_train_weight, "select")
        selection = self._core.select(min_prompt_groups, max_prompt_groups)
        if not selection.groups:
            return None, 0
        meta = ReplayMeta.of_groups(self._buffer.partition_id, selection.groups, list(self._core.schema.fields))
        return meta, len(selection.groups)

    def evict(self, current_train_weight: int) -> int:
        """Evict the ready groups this sampler can never select again (one transaction); returns how many."""
        self._check_version(current_train_weight, "evict")
        return len(self._core.evict())
