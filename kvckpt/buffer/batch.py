"""Reading: rows of selected groups, checked and assembled into torch tensors.

:func:`read_groups` takes the stored rows of some groups in one read transaction; everything
else runs outside it: :func:`decode_rows` checks every row against its group digest, the
store's limits and schema and its own key, and :func:`assemble_batch` lays the rows out
(``padded``, ``packed`` or ``list``). A row that fails a check is an error, never wrong data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvckpt.errors import CorruptRecord, InvariantViolation, NotSelectable, SchemaMismatch
from kvckpt.storage import codec, keys
from kvckpt.storage.schema import RowSchema
from kvckpt.tables.access import Tables
from kvckpt.tables.digest import check_group_rows
from kvckpt.tables.records import ABORTED, EVICTED, GroupInfo

#: ``(group id, row index, stored value)`` of one row.
RawRow = tuple[str, int, bytes]
LAYOUTS = ("padded", "packed", "list")


@dataclass
class Batch:
    """Rows of selected groups, ready for training. Owns its memory (no open transaction).

    ``tensors`` maps field names to torch tensors: ``padded`` gives ``[N, L_max]`` token fields
    (right-padded with ``pad_value``) and stacked row fields; ``packed`` gives 1-D concatenated
    token fields with ``cu_seqlens``. Text fields are lists of ``N`` ``str`` / ``bytes``. ``rows``
    (layout ``list``) keeps one dict per row.
    """

    group_ids: list[str]
    row_indices: list[int]
    lengths: Any
    tensors: dict[str, Any] = field(default_factory=dict)
    cu_seqlens: Any = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    groups: list[GroupInfo] = field(default_factory=list)


def read_groups(t: Tables, group_ids: Sequence[str]) -> tuple[list[GroupInfo], list[RawRow], dict[str, Any]]:
    """The records and stored rows of ``group_ids``, and the shape pins, from one transaction.

    Raises:
        NotSelectable: a group has no stored rows (evicted, aborted, dropped or unknown).
    """
    infos, raw = [], []
    for gid in group_ids:
        group = t.group(gid)
        if group is None or not group.rows_stored or group.state in (EVICTED, ABORTED):
            state = "unknown" if group is None else f"{group.state}, rows stored: {group.rows_stored}"
            raise NotSelectable(f"group {gid!r} has no readable rows ({state})")
        infos.append(group)
        raw += [(gid, index, value) for index, value in t.rows(gid)]
    return infos, raw, t.shape_pins()


def decode_rows(schema: RowSchema, infos: list[GroupInfo], raw: list[RawRow], pins: dict[str, Any],
                fields: Sequence[str] | None) -> list[dict[str, Any]]:
    """Check and decode stored rows (only ``fields``, if given) into dicts of torch tensors.

    Raises:
        CorruptRecord: a row fails its group digest, its checksum or the store's schema, or the
            shape pins are not what a writer stores.
        InvariantViolation: a row's payload names another group or index than its key.
    """
    check_group_rows(infos, raw)
    try:
        limits = schema.limits(pins)
    except SchemaMismatch as exc:  # meta/shapes is checksummed JSON, but not what a writer stores
        raise CorruptRecord("meta/shapes", str(exc)) from None
    decoded = []
    for gid, index, value in raw:
        where = f"rows/{keys.row_id(gid, index)}"
        record = codec.decode(value, where, limits=limits)
        if record.meta.get("group_id") != gid or record.meta.get("index") != index:
            raise InvariantViolation(f"row {keys.row_id(gid, index)} holds the payload of "
                                     f"{record.meta.get('group_id')!r} row {record.meta.get('index')!r}")
        try:
            schema.check_record(record, where)
        except SchemaMismatch as exc:  # a stored row the store's own schema refuses is damage
            raise CorruptRecord(where, str(exc)) from None
        decoded.append({k: v for k, v in record.tensors().items() if fields is None or k in fields})
    return decoded


def assemble_batch(schema: RowSchema, infos: list[GroupInfo], raw: list[RawRow], decoded: list[dict[str, Any]],
                   layout: str, pad_value: float) -> Batch:
    """Lay decoded rows out as a :class:`Batch` (``layout`` is one of :data:`LAYOUTS`).

    Raises:
        InvariantViolation: a group has another number of stored rows than its size.
        SchemaMismatch: rows whose shapes do not stack (only in a store written before shapes
            were pinned); the list layout reads them.
    """
    import torch

    by_gid = {g.group_id: g for g in infos}
    for gid, group in by_gid.items():
        count = sum(1 for g, _, _ in raw if g == gid)
        if count != group.group_size:
            raise InvariantViolation(f"group {gid!r} has {count} stored rows, expected {group.group_size}")
    token = [f for f in schema.token_fields if decoded and f in decoded[0]]
    lengths = torch.tensor([int(row[token[0]].shape[0]) if token else 0 for row in decoded], dtype=torch.int64)
    batch = Batch([g for g, _, _ in raw], [i for _, i, _ in raw], lengths, groups=infos)
    if layout == "list":
        batch.rows = decoded
        return batch
    if not decoded:
        return batch
    for name in decoded[0]:
        values = [row[name] for row in decoded if name in row]
        if len(values) != len(decoded):
            continue  # an optional field some rows lack: only available in the list layout
        if schema.fields[name].dtype in codec.TEXT_DTYPES:
            batch.tensors[name] = values  # text: one str / bytes per row
            continue
        _check_stackable(name, name in token, values, raw)
        if name in token:
            if layout == "packed":
                batch.tensors[name] = torch.cat(values)
            else:
                batch.tensors[name] = torch.nn.utils.rnn.pad_sequence(values, batch_first=True,
                                                                      padding_value=pad_value)
        else:
            batch.tensors[name] = torch.stack(values)
    if layout == "packed":
        batch.cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    return batch


def _check_stackable(name: str, token: bool, values: list[Any], raw: list[RawRow]) -> None:
    """Refuse (instead of a torch error) rows whose shapes cannot be stacked: only a store written
    before shapes were pinned can hold them."""
    first = tuple(values[0].shape[1:] if token else values[0].shape)
    for value, (gid, index, _) in zip(values, raw, strict=True):
        shape = tuple(value.shape[1:] if token else value.shape)
        if shape != first:
            part = "trailing dims" if token else "shape"
            raise SchemaMismatch(f"rows {keys.row_id(raw[0][0], raw[0][1])} and {keys.row_id(gid, index)}: field "
                                 f"{name!r} has {part} {list(first)} and {list(shape)}, which do not stack (the "
                                 "store predates shape pinning); read them with layout='list'")
