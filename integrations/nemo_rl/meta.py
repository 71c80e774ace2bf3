"""``ReplayMeta``: the KVBatchMeta-shaped handle the adapter returns for committed groups.

NeMo-RL's controller passes ``KVBatchMeta`` between commit, select and the data-plane reads: a
partition, the row ids ``{group_id}_g{i}``, the field names and one tag dict per row. This is the
same shape, built from kvckpt's group records (no row payload is read to build it); the rows
themselves are read with :meth:`~.adapter.KvckptReplayBuffer.get_samples`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvckpt import GroupInfo, keys
from kvckpt.errors import BadArgument


@dataclass(frozen=True)
class ReplayMeta:
    """Rows of one or more committed groups, in group order then row order.

    ``tags[i]`` describes row ``sample_ids[i]``: its ``group_id``, ``weight_version`` (the group's
    ``start_weight``, as NeMo-RL tags every row), ``end_weight``, ``target_step``, ``prompt_idx``
    and ``task_name``.
    """

    partition_id: str
    group_ids: tuple[str, ...]
    sample_ids: tuple[str, ...]
    fields: tuple[str, ...]
    tags: tuple[dict[str, Any], ...]
    task_name: str = "train"
    extra_info: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Number of rows."""
        return len(self.sample_ids)

    def __len__(self) -> int:
        return self.size

    @classmethod
    def of_groups(cls, partition_id: str, groups: Iterable[GroupInfo], fields: Sequence[str]) -> ReplayMeta:
        """The metadata of ``groups``' rows."""
        group_ids, sample_ids, tags = [], [], []
        for group in groups:
            group_ids.append(group.group_id)
            for i in range(group.group_size):
                sample_ids.append(keys.row_id(group.group_id, i))
                tags.append({"group_id": group.group_id, "weight_version": group.start_weight,
                             "end_weight": group.end_weight, "target_step": group.target_step,
                             "prompt_idx": group.prompt_idx, "task_name": group.task_name})
        return cls(partition_id, tuple(group_ids), tuple(sample_ids), tuple(fields), tuple(tags))

    @classmethod
    def concat(cls, metas: Sequence[ReplayMeta]) -> ReplayMeta:
        """One metadata of several (same partition only, as KVBatchMeta.concat).

        Raises:
            BadArgument: no metas, or metas of different partitions or fields.
        """
        if not metas:
            raise BadArgument("concat needs at least one ReplayMeta")
        first = metas[0]
        for meta in metas[1:]:
            if meta.partition_id != first.partition_id or meta.fields != first.fields:
                raise BadArgument(f"cannot concat metadata of partition {meta.partition_id!r} fields {meta.fields} "
                                  f"with partition {first.partition_id!r} fields {first.fields}")
        return cls(first.partition_id, sum((m.group_ids for m in metas), ()), sum((m.sample_ids for m in metas), ()),
                   first.fields, sum((m.tags for m in metas), ()), first.task_name)
