"""The read-only view of the buffer's indexes a sampler works on.

A :class:`BufferView` wraps the current transaction: a sampler's decision and the claim it leads
to are one transaction, and the sampler never holds a handle of its own. Every weight a query
takes or returns is a *lineage weight* (:func:`kvckpt.tables.records.lineage_weight`): the
``start_weight`` stamp on the trained lineage, ``2f - start_weight`` for a group a recovery to
``f`` left on a destroyed lineage, so ``current - weight`` is always the staleness. Such a weight is
negative whenever the stamp is more than twice the fork, and the keys order it correctly (signed,
offset: :func:`kvckpt.storage.keys.i64`), so a window's bounds are passed as they are, never
clamped at 0. Every query reads only
the indexes (seeks and short scans), so selecting a batch costs O(batch · log n) whatever the
number of buffered groups.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

from kvckpt.storage import keys
from kvckpt.tables.records import lineage_weight


class BufferView:
    """Index queries over one transaction. Every iterator yields group ids in dispatch order
    (insertion sequence) unless it says otherwise."""

    def __init__(self, txn: Any) -> None:
        self._txn = txn

    def _scan(self, prefix: bytes, start: bytes | None = None,
              stop: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        for key, value in self._txn.iter_prefix("index", prefix, start):
            if stop is not None and key >= stop:
                return
            yield key, value

    def ready_in_order(self) -> Iterator[str]:
        """Every ready group in dispatch order."""
        for _, gid in self._scan(keys.READY_BY_SEQ):
            yield gid.decode()

    def group_weight(self, group_id: str) -> int:
        """The lineage weight of a committed group (one record read)."""
        doc = self._txn.get_json("groups", keys.group_key(group_id))
        return lineage_weight(doc["start_weight"], doc.get("lineage_fork"), doc.get("lineage_newest"))

    def ready_with_weight(self, weight: int) -> Iterator[str]:
        """Ready groups whose lineage weight equals ``weight``."""
        for _, gid in self._scan(keys.READY_BY_WEIGHT + keys.i64(weight)):
            yield gid.decode()

    def ready_in_weight_range(self, lo: int, hi: int) -> Iterator[str]:
        """Ready groups with a lineage weight in ``[lo, hi]``, merged into dispatch order."""
        streams = []
        for weight in self._weights(keys.READY_BY_WEIGHT, lo, hi):
            streams.append(((key[-8:], gid.decode()) for key, gid in
                            self._scan(keys.READY_BY_WEIGHT + keys.i64(weight))))
        for _, gid in heapq.merge(*streams):
            yield gid

    def ready_below_weight(self, lo: int) -> Iterator[str]:
        """Ready groups with a lineage weight below ``lo`` (by weight, then dispatch order)."""
        stop = keys.READY_BY_WEIGHT + keys.i64(lo)
        for _, gid in self._scan(keys.READY_BY_WEIGHT, stop=stop):
            yield gid.decode()

    def ready_for_target(self, step: int) -> Iterator[str]:
        """Ready groups stamped with ``target_step == step``."""
        for _, gid in self._scan(keys.READY_BY_TARGET + keys.i64(step)):
            yield gid.decode()

    def ready_below_target(self, step: int) -> Iterator[str]:
        """Ready groups stamped with a ``target_step < step``."""
        for _, gid in self._scan(keys.READY_BY_TARGET, stop=keys.READY_BY_TARGET + keys.i64(step)):
            yield gid.decode()

    def pending_below_weight(self, lo: int) -> Iterator[str]:
        """In-flight (ledger) groups with a lineage weight below ``lo`` (by weight, then dispatch order)."""
        for _, gid in self._scan(keys.PENDING_BY_WEIGHT, stop=keys.PENDING_BY_WEIGHT + keys.i64(lo)):
            yield gid.decode()

    def min_weight(self, lo: int, hi: int, include_pending: bool) -> int | None:
        """The smallest lineage weight in ``[lo, hi]`` over ready (and optionally in-flight) groups."""
        found = [w for w in (self._first_weight(keys.READY_BY_WEIGHT, lo, hi),
                             self._first_weight(keys.PENDING_BY_WEIGHT, lo, hi) if include_pending else None)
                 if w is not None]
        return min(found) if found else None

    def _first_weight(self, prefix: bytes, lo: int, hi: int) -> int | None:
        for key, _ in self._scan(prefix, start=prefix + keys.i64(lo)):
            weight = keys.from_i64(key[len(prefix):len(prefix) + 8])
            return weight if weight <= hi else None
        return None

    def _weights(self, prefix: bytes, lo: int, hi: int) -> Iterator[int]:
        """Distinct weights present under ``prefix`` in ``[lo, hi]``, ascending, by seeking."""
        weight = self._first_weight(prefix, lo, hi)
        while weight is not None:
            yield weight
            if weight >= hi:
                return
            weight = self._first_weight(prefix, weight + 1, hi)
