"""The sampler contract, and the read-only view of the buffer's indexes a sampler works on.

A sampler owns no LMDB handle and no state: the buffer hands it a :class:`BufferView` over the
current write transaction, so its decision and the claim it leads to are one transaction. All
four built-ins read only the indexes (never a scan of the buffer), so selecting a batch costs
O(batch · log n) whatever the number of buffered groups.

Writing a custom sampler: subclass :class:`Sampler`, set ``name``, implement :meth:`Sampler.eligible`
and :meth:`Sampler.evictable` (iterators over group ids, cheapest first), and optionally
``gate_window``, ``stamps_target_step``, :meth:`Sampler.should_abort_inflight`; register it with
:func:`kvckpt.samplers.register`. Its constructor takes its config keys as keyword arguments and
:meth:`Sampler.config` returns them, so the buffer can persist and re-create it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from kvckpt.errors import BadArgument, CapacityError
from kvckpt.tables.view import BufferView


class Sampler:
    """Base class of samplers; see the module docstring for the contract.

    Class attributes:
        name: the config name (``sampler: {name: ...}``).
        stamps_target_step: admission stamps each prompt with ``target_step = dispatch_index``.
    """

    name: ClassVar[str] = "base"
    stamps_target_step: ClassVar[bool] = False

    @property
    def gate_window(self) -> int | None:
        """Admission is allowed while ``dispatch_index < trainer_version + gate_window``;
        ``None`` means ungated (admission never waits and leaves ``dispatch_index`` alone)."""
        return None

    @property
    def window(self) -> int:
        """The sampler's version window W (staleness or lookahead)."""
        return 0

    def config(self) -> dict[str, Any]:
        """The constructor's keyword arguments plus ``name``; persisted in the store."""
        return {"name": self.name}

    def eligible(self, view: BufferView, current: int) -> Iterator[str]:
        """Selectable ready groups at trainer version ``current``, in the order to take them."""
        raise NotImplementedError

    def evictable(self, view: BufferView, current: int) -> Iterator[str]:
        """Ready groups this sampler can never select again at versions ``>= current``."""
        return iter(())

    def should_abort_inflight(self, start_weight: int, current: int) -> bool:
        """Whether an in-flight rollout whose lineage weight is ``start_weight`` (its stamp, unless a
        recovery forked it: :attr:`kvckpt.LedgerEntry.lineage_weight`) is useless at ``current``."""
        return False

    def inflight_to_abort(self, view: BufferView, current: int) -> Iterator[str]:
        """In-flight groups for which :meth:`should_abort_inflight` holds, from the index."""
        return iter(())

    def required_buffer_capacity(self, groups_per_step: int) -> int:
        """The smallest ``max_buffered_rollouts`` that cannot deadlock the rollout pump."""
        if groups_per_step < 1:
            raise BadArgument(f"groups_per_step must be >= 1, got {groups_per_step}")
        return groups_per_step * (self.window + 1)

    def check_capacity(self, capacity: int, groups_per_step: int) -> None:
        """Raise :class:`CapacityError` if ``capacity`` would deadlock this sampler."""
        need = self.required_buffer_capacity(groups_per_step)
        if capacity < need:
            raise CapacityError(
                f"max_buffered_rollouts={capacity} is below what {self.name} with window {self.window} "
                f"needs for {groups_per_step} groups per step ({need} = groups_per_step x (W+1)); "
                "the rollout pump would deadlock. Raise max_buffered_rollouts")

    def select(self, view: BufferView, current: int, min_groups: int, max_groups: int) -> list[str]:
        """NeMo-RL's shared finalisation: fewer than ``min_groups`` eligible -> ``[]``, else up to
        ``max_groups`` in eligibility order, without waiting."""
        if not 1 <= min_groups <= max_groups:
            raise BadArgument(f"need 1 <= min_groups <= max_groups, got {min_groups}, {max_groups}")
        chosen = []
        for gid in self.eligible(view, current):
            chosen.append(gid)
            if len(chosen) == max_groups:
                break
        return chosen if len(chosen) >= min_groups else []

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"


class GatedStalenessSampler(Sampler):
    """Shared shape of the samplers configured by ``max_staleness_versions`` alone, which is both
    their staleness window W and their admission gate.

    Args:
        max_staleness_versions: W. Defaults to 1.
    """

    def __init__(self, max_staleness_versions: int = 1) -> None:
        self.max_staleness_versions = check_window("max_staleness_versions", max_staleness_versions)

    @property
    def window(self) -> int:
        return self.max_staleness_versions

    @property
    def gate_window(self) -> int:
        return self.max_staleness_versions

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "max_staleness_versions": self.max_staleness_versions}


def window_floor(current: int, window: int) -> int:
    """The lowest selectable lineage weight: ``current - window``, never clamped at 0.

    Staleness is ``current - lineage_weight`` (:func:`kvckpt.tables.records.lineage_weight`), and a
    group a recovery to ``f`` left on a destroyed lineage has the lineage weight ``2f - v``, below 0
    whenever ``v > 2f``: a floor clamped at 0 would put every such group out of the window whatever
    its tree distance (issue 46). On the trained lineage every stamp is ``>= 0``, so the clamp never
    changed anything there."""
    return current - window


def check_window(name: str, value: Any) -> int:
    """Validate a window config key."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadArgument(f"{name} must be an integer >= 0, got {value!r}")
    return value
