"""NeMo-RL's ``PromptGroupSampler`` protocol over the kvckpt store's sampler and cursors.

:func:`create_sampler` is NeMo-RL's ``create_sampler(buffer, cfg)``: it returns the class NeMo-RL
would (:class:`InOrderSampler`, :class:`WeightFifoSampler`, :class:`WindowedSampler`,
:class:`ReadyFirstSampler`), with the same keyword-only, awaited ``admit`` / ``select`` /
``evict`` and the same attributes; the classes also build directly, as NeMo-RL's tests build
them (``InOrderSampler(buffer, max_lookahead_versions=1)``). The eligibility, eviction and gate
rules are kvckpt's samplers (NeMo-RL's four, same config keys) applied inside one transaction
each; the dispatch cursor is the store's, so it is checkpointed with everything else.

The gate wait is an :class:`asyncio.Event` per waiter, set (thread-safely, from whichever thread
or loop) by every call that tells the buffer the trainer's version (``select``, ``evict``,
``should_abort_inflight``, ``state_dict``, ``finish_train_step``) and by every restore or
recovery; the waiter then re-reads ``trainer_version_fn()``. A version that moves only inside
``trainer_version_fn`` (NeMo-RL's ``self._trainer_version += 1``, read by nobody until the train
pump's next ``evict``) cannot notify anyone, so each wait also re-reads it after
:data:`~.gate.RECHECK_SECONDS`, NeMo-RL's own gate period. Transactions run in a worker thread
(``asyncio.to_thread``), so the train step that opens the gate keeps running.

The trainer's version is NeMo-RL's ``trainer_version_fn()`` / ``current_train_weight``: when it is
ahead of the store's ``trainer_version``, the store first closes the steps in between
(``finish_step``, one transaction each: that step's selected groups become consumed), so the
controller drives the store without a call NeMo-RL does not make. The transitions themselves are
the buffer's :class:`~.steps.StepDriver`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvckpt.integrations.nemo_rl.config import sampler_config_dict
from kvckpt.integrations.nemo_rl.meta import ReplayMeta
from kvckpt.integrations.nemo_rl.steps import StepDriver

from kvckpt import ReplayBuffer
from kvckpt.errors import BadArgument, GateTimeout, RecoveryError


class SampledBuffer(Protocol):
    """What :func:`create_sampler` needs of a buffer (a :class:`~.adapter.TQReplayBuffer`)."""

    @property
    def core(self) -> ReplayBuffer: ...

    @property
    def steps(self) -> StepDriver: ...


class KvckptSampler:
    """The sampler over a :class:`~.adapter.TQReplayBuffer`'s store (its :class:`~.steps.StepDriver`).

    Build it with :func:`create_sampler`, or directly as NeMo-RL's tests do,
    ``InOrderSampler(buffer, max_lookahead_versions=1)``. The store was created with its sampler,
    so the class and keywords must be the store's (a keyword left out is the store's value).

    Raises:
        BadArgument: another class or other keywords than the store's sampler (a ``ValueError``, as
            NeMo-RL raises for a negative window).
    """

    #: Every kvckpt sampler's state (stamps and cursor) is in the store, so it checkpoints.
    supports_buffer_checkpoint = True

    def __init__(self, buffer: SampledBuffer, **keys: Any) -> None:
        if type(self) is not KvckptSampler and adapter_class(buffer.core.sampler) is not type(self):
            raise BadArgument(f"the store {buffer.core.path!r} is configured with sampler "
                              f"{buffer.core.sampler.config()}, not a {type(self).__name__}: build the store's "
                              "(create_sampler(buffer, cfg)), or switch samplers through restore_replay_buffer")
        require_stored_sampler(buffer, {**buffer.core.sampler.config(), **keys})
        self._steps = buffer.steps

    @property
    def _core(self) -> Any:
        return self._steps.handle.core.sampler  # load_state_dict may swap the store for a restored one

    @property
    def name(self) -> str:
        """The config ``name`` (``in_order``, ``weight_fifo``, ``windowed``, ``ready_first``)."""
        return self._core.name

    def config(self) -> dict[str, Any]:
        """The sampler's config section (``name`` plus its keys), as stored."""
        return self._core.config()

    @property
    def is_on_policy(self) -> bool:
        """Whether the version window is 0 (only the current weight's rollouts train)."""
        return self._core.window == 0

    def required_buffer_capacity(self, groups_per_step: int) -> int:
        """``groups_per_step x (W + 1)``: the smallest ``max_buffered_rollouts`` that cannot deadlock."""
        return self._core.required_buffer_capacity(groups_per_step)

    def should_abort_inflight(self, *, start_weight_version: int, current_train_weight: int) -> bool:
        """Whether a rollout started at ``start_weight_version`` can no longer be selected
        (``windowed`` below its window; the gated samplers never). Wakes the gate waiters."""
        self._steps.handle.gate.wake()
        return self._core.should_abort_inflight(start_weight_version, current_train_weight)

    @property
    def dispatch_index(self) -> int:
        """The admission cursor (-1 before the first admission), read from the store."""
        return self._steps.handle.core.state()["dispatch_index"]

    def set_dispatch_index(self, resume_from_step: int | None = None, *,
                           resume_from_trainer_version: int | None = None) -> None:
        """NeMo-RL's start-of-run call: ``resume_from_step`` is 0 on a fresh run, else the step resumed
        (``resume_from_trainer_version``, #3480's name for it, is accepted too).

        kvckpt keeps the store's exact cursor instead of writing ``resume_from_step - 1`` (which
        would re-stamp a batch the ledger already holds). A store at or ahead of that step is
        recovered to it (one transaction: claims of that step and later return to ready, every
        in-flight attempt of the previous process is fenced and its prompt handed to the ledger
        for redispatch; on a fresh store this changes nothing). In-flight prompts reserved without
        an identity (main's ``reserve``) cannot be regenerated and are aborted, one transaction
        each; ``admit`` then re-admits the steps left short. A store behind it waits for
        ``load_state_dict`` to restore the checkpoint of that step, and admission refuses until then.

        Raises:
            BadArgument (a ValueError): ``resume_from_step`` negative or not an integer.
        """
        if resume_from_step is None:
            resume_from_step = resume_from_trainer_version
        if isinstance(resume_from_step, bool) or not isinstance(resume_from_step, int) or resume_from_step < 0:
            raise BadArgument(f"resume_from_step must be non-negative, got {resume_from_step!r}")
        self._steps.resume_at(resume_from_step)

    def restore_dispatch_index(self, index: int) -> None:
        """NeMo-RL #3480's exact-cursor restore: check the trainer's saved cursor against the store's.

        Raises:
            BadArgument: ``index`` below -1. RecoveryError: they differ (the trainer state and the
            replay checkpoint are from different saves; resuming would skip or repeat a batch).
        """
        if isinstance(index, bool) or not isinstance(index, int) or index < -1:
            raise BadArgument(f"dispatch_index must be an integer >= -1, got {index!r}")
        current = self.dispatch_index
        if index != current:
            raise RecoveryError(f"the trainer's saved dispatch_index {index} differs from the store's {current}: "
                                "the trainer state and the replay checkpoint are from different saves")

    async def admit(self, *, trainer_version_fn: Callable[[], int], dataloader_state: bytes | None = None,
                    weight_version: int | None = None, timeout: float | None = None) -> int | None:
        """Wait until the next prompt batch may dispatch, admit it, and return its ``target_step``
        stamp (``in_order``; the others return ``None``).

        Gated samplers wait (an event, see the module docstring) while ``dispatch_index >=
        trainer_version_fn() + W``; then, in one transaction, the cursor advance,
        ``dataloader_state`` and a ledger entry for every prompt ``ledger.reserve_group`` staged.
        With nothing staged the prompts join later, one ``reserve`` each. After a restart that
        gave up anonymous in-flight prompts, gated samplers first re-admit the batches left short
        (``in_order``: the stamps of the short steps; no cursor move, no gate wait), as NeMo-RL's
        rewound cursor would. ``windowed`` never gates
        and has no cursor: it returns ``None`` at once, writing only staged prompts or a
        ``dataloader_state`` if given (nothing otherwise).

        Args:
            trainer_version_fn: the trainer's live version (polled).
            dataloader_state, weight_version, timeout: kvckpt extensions: the dataloader state after
                this batch (saved with the cursor), the staged prompts' ``start_weight``, and
                seconds to wait (defaults to forever).

        Raises:
            GateTimeout: still closed after ``timeout``. RecoveryError: the run resumes from a step
            the store has not been restored to yet (``load_state_dict`` first).
        """
        self._steps.version_fn = trainer_version_fn
        refilled, stamp = self._steps.next_refill()
        if refilled:
            return stamp
        deadline = None if timeout is None else time.monotonic() + timeout
        gate = self._core.gate_window
        version = trainer_version_fn()
        if gate is not None:
            def is_open() -> bool:
                nonlocal version
                version = trainer_version_fn()
                return self.dispatch_index < version + gate

            if not await self._steps.handle.gate.wait_until(is_open, deadline):
                raise GateTimeout(f"{self.name} gate still closed after {timeout}s: dispatch_index "
                                  f"{self.dispatch_index} >= trainer version {version} + {gate}")
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return await asyncio.to_thread(self._steps.admit_batch, version, dataloader_state, weight_version, remaining)

    @staticmethod
    def _validate_group_bounds(min_prompt_groups: int, max_prompt_groups: int) -> None:
        for name, value in (("min_prompt_groups", min_prompt_groups), ("max_prompt_groups", max_prompt_groups)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise BadArgument(f"{name} must be an integer, got {value!r}")
        if min_prompt_groups < 1:
            raise BadArgument(f"min_prompt_groups must be >= 1, got {min_prompt_groups}")
        if max_prompt_groups < min_prompt_groups:
            raise BadArgument(f"max_prompt_groups ({max_prompt_groups}) must be >= min_prompt_groups "
                              f"({min_prompt_groups})")

    async def select(self, *, current_train_weight: int, min_prompt_groups: int,
                     max_prompt_groups: int) -> tuple[ReplayMeta | None, int]:
        """Take up to ``max_prompt_groups`` eligible groups for ``current_train_weight`` (one
        transaction: they are claimed, leave the buffer, and their rows stay readable), then
        publish them to the data plane's ``inner`` client and wait for it.

        Fewer than ``min_prompt_groups`` eligible: ``(None, 0)`` and nothing written.

        Raises:
            BadArgument (a ValueError): not ``1 <= min <= max``, or a version behind the store's.
            Whatever publishing raises: the claims are then back to ready (one ``release_claims``).
        """
        self._validate_group_bounds(min_prompt_groups, max_prompt_groups)
        meta, count = await asyncio.to_thread(self._steps.select, current_train_weight, min_prompt_groups,
                                              max_prompt_groups)
        if meta is not None:
            await self._steps.publish(meta)
        return meta, count

    async def evict(self, *, current_train_weight: int) -> int:
        """Evict the ready groups this sampler can never select again, rows included (one
        transaction); returns how many. In-flight prompts are never evicted."""
        return await asyncio.to_thread(self._steps.evict, current_train_weight)


class InOrderSampler(KvckptSampler):
    """``in_order``: each admitted batch is stamped ``target_step = dispatch_index``; ``select``
    takes the batch stamped with the trainer's version; ``evict`` drops ready groups stamped for a
    past step."""

    def __init__(self, buffer: SampledBuffer, *, max_lookahead_versions: int | None = None) -> None:
        super().__init__(buffer, **given(max_lookahead_versions=max_lookahead_versions))

    @property
    def max_lookahead_versions(self) -> int:
        """How many batches generation may run ahead of the trainer."""
        return self._core.max_lookahead_versions


class _StalenessWindow(KvckptSampler):
    def __init__(self, buffer: SampledBuffer, *, max_staleness_versions: int | None = None) -> None:
        super().__init__(buffer, **given(max_staleness_versions=max_staleness_versions))

    @property
    def max_staleness_versions(self) -> int:
        """The sampler's weight-version window (and, gated, its lookahead)."""
        return self._core.max_staleness_versions


class WeightFifoSampler(_StalenessWindow):
    """``weight_fifo``: gated; ``select`` drains the oldest in-window ``start_weight`` first and
    waits for that weight's pending groups."""


class ReadyFirstSampler(_StalenessWindow):
    """``ready_first``: gated; ``select`` takes every ready group not newer than the trainer, in
    dispatch order; nothing is ever evicted."""


class WindowedSampler(_StalenessWindow):
    """``windowed``: never gates; ``select`` takes ready groups within the window (optionally
    freshest first); ``evict`` and ``should_abort_inflight`` drop what fell below it."""

    def __init__(self, buffer: SampledBuffer, *, max_staleness_versions: int | None = None,
                 sample_freshest_first: bool | None = None) -> None:
        KvckptSampler.__init__(self, buffer, **given(max_staleness_versions=max_staleness_versions,
                                                     sample_freshest_first=sample_freshest_first))

    @property
    def sample_freshest_first(self) -> bool:
        """Whether ``select`` orders by weight gap instead of dispatch order."""
        return self._core.sample_freshest_first


def create_sampler(buffer: SampledBuffer, cfg: Any) -> KvckptSampler:
    """NeMo-RL's ``create_sampler(buffer, cfg)`` for a kvckpt buffer.

    The store was created with its sampler (it stamps admissions and keeps the indexes), so
    ``cfg`` must name the same one with the same keys; switching samplers is a restore or
    recovery decision (``restore_replay_buffer(..., sampler=...)``), reported in its plan.

    A ``custom`` config (``target: "module:Class"``) names a kvckpt ``Sampler`` subclass; the
    returned object is then a :class:`KvckptSampler` (the same awaited calls).

    Raises:
        BadArgument: ``cfg`` differs from the store's sampler, names no known sampler, or a custom
            target that cannot be imported or is not a kvckpt ``Sampler``.
    """
    require_stored_sampler(buffer, sampler_config_dict(cfg))
    return adapter_class(buffer.core.sampler)(buffer)


def given(**keys: Any) -> dict[str, Any]:
    """The keywords a sampler constructor was given (``None``: left out, the store's value)."""
    return {key: value for key, value in keys.items() if value is not None}


def require_stored_sampler(buffer: SampledBuffer, cfg: dict[str, Any]) -> None:
    """Refuse a sampler config other than the one the store was created with.

    Raises:
        BadArgument: ``cfg`` names no known sampler, has a bad value, or differs from the store's.
    """
    from kvckpt import create_sampler as core_sampler

    wanted = core_sampler(cfg).config()
    stored = buffer.core.sampler.config()
    if wanted != stored:
        raise BadArgument(f"the store {buffer.core.path!r} is configured with sampler {stored}, the config asks "
                          f"for {wanted}: switch samplers through restore_replay_buffer or recover")


def adapter_class(core: Any) -> type[KvckptSampler]:
    """The NeMo-RL sampler class for a kvckpt sampler: its built-in's (a custom subclass of
    ``in_order`` gets :class:`InOrderSampler`'s attributes), else :class:`KvckptSampler`."""
    from kvckpt import samplers

    for base, cls in ((samplers.InOrderSampler, InOrderSampler), (samplers.WeightFifoSampler, WeightFifoSampler),
                      (samplers.ReadyFirstSampler, ReadyFirstSampler), (samplers.WindowedSampler, WindowedSampler)):
        if isinstance(core, base):
            return cls
    return KvckptSampler
