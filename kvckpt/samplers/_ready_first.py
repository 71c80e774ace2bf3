"""``ready_first``: whatever is ready, oldest dispatch first; nothing is ever discarded."""

from __future__ import annotations

from collections.abc import Iterator

from kvckpt.samplers.base import GatedStalenessSampler
from kvckpt.tables.view import BufferView


class ReadyFirstSampler(GatedStalenessSampler):
    """Eligible: ready and ``lineage_weight <= cur`` (no lower bound); dispatch order. Gated by W;
    never evicts, never aborts. Needs importance-sampling correction in the trainer.

    A group forked by a rollback (its lineage weight is below the fork, so below ``cur``) is
    eligible at once in dispatch order, also when its stamp is ahead of ``cur``: its staleness is
    its tree distance, unbounded here as every staleness is.

    Args:
        max_staleness_versions: W, the admission gate. Defaults to 1.
    """

    name = "ready_first"

    def eligible(self, view: BufferView, current: int) -> Iterator[str]:
        # A lineage weight > current only happens after a rollback that kept a stamp of a lineage
        # it did not destroy (an explicit weight_version ahead of the trainer); those groups wait
        # (in place) until the trainer catches up. A destroyed lineage's groups are served at once,
        # with their tree distance as staleness (their lineage weight is below the fork).
        for gid in view.ready_in_order():
            if view.group_weight(gid) <= current:
                yield gid
