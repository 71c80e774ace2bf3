"""``windowed``: any ready group whose weight is inside the staleness window."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvckpt.samplers.base import Sampler, check_window, window_floor
from kvckpt.tables.view import BufferView


class WindowedSampler(Sampler):
    """Eligible: ready and ``cur-W <= lineage_weight <= cur`` (staleness, the distance in the version
    tree, within W; no clamp at 0: a group forked by a rollback has a negative lineage weight
    whenever its stamp is more than twice the fork); dispatch order, or freshest first
    (``sample_freshest_first``). Ungated. Evicts and aborts below the window.

    Args:
        max_staleness_versions: W. Defaults to 1.
        sample_freshest_first: order by ``(cur - lineage_weight, dispatch order)``. Defaults to False.
    """

    name = "windowed"

    def __init__(self, max_staleness_versions: int = 1, sample_freshest_first: bool = False) -> None:
        self.max_staleness_versions = check_window("max_staleness_versions", max_staleness_versions)
        self.sample_freshest_first = bool(sample_freshest_first)

    @property
    def window(self) -> int:
        return self.max_staleness_versions

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "max_staleness_versions": self.max_staleness_versions,
                "sample_freshest_first": self.sample_freshest_first}

    def eligible(self, view: BufferView, current: int) -> Iterator[str]:
        lo = window_floor(current, self.window)
        if not self.sample_freshest_first:
            yield from view.ready_in_weight_range(lo, current)
            return
        for weight in range(current, lo - 1, -1):
            yield from view.ready_with_weight(weight)

    def evictable(self, view: BufferView, current: int) -> Iterator[str]:
        return view.ready_below_weight(window_floor(current, self.window))

    def should_abort_inflight(self, start_weight: int, current: int) -> bool:
        return start_weight < window_floor(current, self.window)

    def inflight_to_abort(self, view: BufferView, current: int) -> Iterator[str]:
        return view.pending_below_weight(window_floor(current, self.window))
