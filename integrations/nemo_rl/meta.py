"""``ReplayMeta``: the ``KVBatchMeta``-shaped handle the adapter returns for committed groups.

NeMo-RL's controller passes ``KVBatchMeta`` between commit, select and the data-plane reads: a
partition, a task name, the row ids ``{group_id}_g{i}``, the field names, one sequence length and
one tag dict per row. This is the same shape (same attribute names, ``concat(*others)`` as an
instance method like ``KVBatchMeta.concat``), built from kvckpt's group records; the rows
themselves stay in the kvckpt store and are read with
:meth:`~.adapter.TQReplayBuffer.get_samples`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvckpt import row_id
from kvckpt.errors import BadArgument


@dataclass(frozen=True)
class ReplayMeta:
    """Rows of one or more committed groups, in group order then row order.

    ``tags[i]`` is NeMo-RL's row tag of ``sample_ids[i]``: ``{"weight_version": start_weight}``
    (the group's dispatch-time weight, as ``pack_payload`` tags it). ``sequence_lengths[i]`` is the
    row's ``input_lengths``. ``group_ids`` lists the groups, one per group, in order. The
    sequences are lists, as ``KVBatchMeta``'s, so NeMo-RL's ``meta.sample_ids == [...]`` holds.
    """

    partition_id: str
    group_ids: list[str]
    sample_ids: list[str]
    fields: list[str]
    sequence_lengths: list[int]
    tags: list[dict[str, Any]]
    task_name: str = "train"
    extra_info: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Number of rows."""
        return len(self.sample_ids)

    def __len__(self) -> int:
        return self.size

    @classmethod
    def of_group(cls, partition_id: str, group_id: str, start_weight: int, fields: Sequence[str],
                 lengths: Sequence[int]) -> ReplayMeta:
        """The metadata of one group's rows (``len(lengths)`` of them)."""
        n = len(lengths)
        return cls(partition_id, [group_id], [row_id(group_id, i) for i in range(n)], list(fields),
                   [int(x) for x in lengths], [{"weight_version": int(start_weight)} for _ in range(n)])

    def with_fields(self, field_names: Sequence[str]) -> ReplayMeta:
        """A copy with ``field_names`` appended to ``fields`` (deduplicated, order kept), as
        ``KVBatchMeta.with_fields``: the controller names the ``advantages`` it put this way."""
        return ReplayMeta(self.partition_id, list(self.group_ids), list(self.sample_ids),
                          list(dict.fromkeys((*self.fields, *field_names))), list(self.sequence_lengths),
                          [dict(t) for t in self.tags], self.task_name, dict(self.extra_info))

    def concat(self, *others: ReplayMeta) -> ReplayMeta:
        """This metadata followed by ``others`` (same partition and fields only, as ``KVBatchMeta.concat``).

        Raises:
            BadArgument: an other metadata of a different partition or fields.
        """
        for meta in others:
            if meta.partition_id != self.partition_id or meta.fields != self.fields:
                raise BadArgument(f"cannot concat metadata of partition {meta.partition_id!r} fields {meta.fields} "
                                  f"with partition {self.partition_id!r} fields {self.fields}")
        metas = (self, *others)
        return ReplayMeta(self.partition_id, [g for m in metas for g in m.group_ids],
                          [s for m in metas for s in m.sample_ids], list(self.fields),
                          [n for m in metas for n in m.sequence_lengths], [t for m in metas for t in m.tags],
                          self.task_name)
