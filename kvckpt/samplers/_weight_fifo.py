"""``weight_fifo``: drain the oldest in-window weight version completely before the next."""

from __future__ import annotations

from collections.abc import Iterator

from kvckpt.samplers.base import GatedStalenessSampler, window_floor
from kvckpt.tables.view import BufferView


class WeightFifoSampler(GatedStalenessSampler):
    """w* = the smallest lineage weight in ``[cur-W, cur]`` over ready *and in-flight* groups;
    eligible: ready groups with lineage weight ``w*`` in dispatch order. An in-flight group of
    the oldest weight therefore holds back younger weights ("waits for the oldest weight's batch
    to fill"). Gated by W; evicts ready groups below the window.

    After a rollback, groups forked onto the destroyed lineage are the stalest in the window (their
    tree distance is at least ``cur - fork``), so they drain first, and a forked in-flight prompt
    holds back on-lineage groups exactly as an on-lineage one of the oldest weight does, until it
    commits, is aborted or falls out of the window as the trainer advances (docs/buffer.md,
    "Samplers").

    Args:
        max_staleness_versions: W. Defaults to 1.
    """

    name = "weight_fifo"

    def eligible(self, view: BufferView, current: int) -> Iterator[str]:
        oldest = view.min_weight(window_floor(current, self.window), current, include_pending=True)
        if oldest is None:
            return iter(())
        return view.ready_with_weight(oldest)

    def evictable(self, view: BufferView, current: int) -> Iterator[str]:
        return view.ready_below_weight(window_floor(current, self.window))
