"""``in_order``: each step trains exactly the batch that was admitted for it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvckpt.samplers.base import Sampler, check_window
from kvckpt.tables.view import BufferView


class InOrderSampler(Sampler):
    """Admission stamps ``target_step = dispatch_index`` (after the increment); eligible: ready
    groups with ``target_step == cur`` in dispatch order (the weight window is ignored). Gated by
    W lookahead versions; evicts ready groups stamped for a past step.

    Args:
        max_lookahead_versions: W. Defaults to 1.
    """

    name = "in_order"
    stamps_target_step = True

    def __init__(self, max_lookahead_versions: int = 1) -> None:
        self.max_lookahead_versions = check_window("max_lookahead_versions", max_lookahead_versions)

    @property
    def window(self) -> int:
        return self.max_lookahead_versions

    @property
    def gate_window(self) -> int:
        return self.max_lookahead_versions

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "max_lookahead_versions": self.max_lookahead_versions}

    def eligible(self, view: BufferView, current: int) -> Iterator[str]:
        return view.ready_for_target(current)

    def evictable(self, view: BufferView, current: int) -> Iterator[str]:
        return view.ready_below_target(current)
