"""``ready_first``: whatever is ready, oldest dispatch first; nothing is ever discarded."""

from __future__ import annotations

from collections.abc import Iterator

from kvckpt.samplers.base import GatedStalenessSampler
from kvckpt.tables.view import BufferView


class ReadyFirstSampler(GatedStalenessSampler):
    """Eligible: ready and ``start_weight <= cur`` (no lower bound); dispatch order. Gated by W;
    never evicts, never aborts. Needs importance-sampling correction in the trainer.

    Args:
        max_staleness_versions: W, the admission gate. Defaults to 1.
    """

    name = "ready_first"

    def eligible(self, view: BufferView, current: int) -> Iterator[str]:
        # start_weight > current only happens after a rollback to an older model; those groups
        # wait (in place) until the trainer catches up. They are skipped, not scanned twice.
        for gid in view.ready_in_order():
            if view.group_weight(gid) <= current:
                yield gid
