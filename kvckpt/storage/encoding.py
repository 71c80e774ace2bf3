"""Row encoding, wherever it runs: in the store's process, or at the edge in a producer's.

Encoding a row (schema validation and casts, zstd compression, the record checksum) is most of
what a commit costs. :class:`RowEncoder` does it exactly as the store would, from the store's
config alone, so a producer on another node encodes its own rows and sends only bytes
(:class:`EncodedRow`). The store's owner never trusts those bytes: :func:`check_encoded` verifies
each record (checksum, a bounded decompression, meta naming the group and row, field names,
dtypes and shapes against the schema compiled once, :attr:`RowSchema.rules`) without building
arrays, and derives the sizes and shapes it records from the verified header, never from what the
producer claims.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvckpt.errors import CorruptRecord, SchemaMismatch
from kvckpt.storage import codec, keys
from kvckpt.storage.schema import RowSchema


@dataclass(frozen=True)
class EncodedRow:
    """One encoded row on the wire: its index in the group and the record bytes."""

    index: int
    value: bytes

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (Ray, msgpack, JSON with the bytes base64-encoded by the caller)."""
        return {"index": self.index, "value": self.value}


@dataclass(frozen=True)
class CheckedRow(EncodedRow):
    """A row ready for the commit transaction: the record bytes and what the store records of them
    (its decoded size and field shapes). Only :meth:`to_dict`'s part travels to the store's owner."""

    raw_bytes: int = 0
    where: str = ""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # of the fields the store pins


class RowEncoder:
    """Validate and encode rows for one store (its schema, group size and compression level).

    Build it in any process from the store's config (:meth:`from_config`, e.g. the dict a buffer
    actor's ``info()`` returns) or take the store's own (:meth:`kvckpt.ReplayBuffer.row_encoder`).
    """

    def __init__(self, schema: RowSchema, group_size: int, compression_level: int = codec.DEFAULT_LEVEL) -> None:
        self.schema = schema
        self.group_size = group_size
        self.compression_level = compression_level

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RowEncoder:
        """From a buffer config dict (``BufferConfig.to_dict()``)."""
        schema = config["schema"]
        schema = schema if isinstance(schema, RowSchema) else RowSchema.from_dict(schema)
        return cls(schema, int(config["group_size"]), int(config.get("compression_level", codec.DEFAULT_LEVEL)))

    def encode(self, lease: Any, rows: Sequence[Mapping[str, Any]] | Mapping[int, Mapping[str, Any]],
               ) -> list[CheckedRow]:
        """The rows of one commit under ``lease``, validated and encoded.

        ``rows`` is all ``group_size`` rows, the rows of ``lease.missing`` in that order, or a dict
        ``{row index: row}``.

        Raises:
            SchemaMismatch: a wrong row count or index, or a row the schema refuses.
        """
        n = self.group_size  # the store's, never the lease's: the ledger entry is the authority
        out = []
        for index, row in rows_by_index(lease, rows, n):
            where = f"row {keys.row_id(lease.group_id, index)}"
            values = self.schema.validate(row, where)
            value = codec.encode(values, {"group_id": lease.group_id, "index": index},
                                 level=self.compression_level, dtypes=self.schema.dtypes)
            shapes = {name: values[name].shape for name in self.schema.pinned_fields if name in values}
            out.append(CheckedRow(index, value, sum(codec.value_nbytes(v) for v in values.values()), where, shapes))
        self.schema.pin({}, [(r.where, r.shapes) for r in out])  # the rows of one commit agree (before any txn)
        return out


def rows_by_index(lease: Any, rows: Sequence[Mapping[str, Any]] | Mapping[int, Mapping[str, Any]],
                  group_size: int) -> list[tuple[int, Mapping[str, Any]]]:
    """``(row index, row)`` of a commit's ``rows``: all ``group_size`` rows in order, the rows of ``lease.missing``
    in that order, or a dict ``{row index: row}`` (sorted); every index checked against ``group_size``.

    Raises:
        SchemaMismatch: a wrong row count or an index outside the group.
    """
    if isinstance(rows, Mapping):
        items = sorted(rows.items())
    elif len(rows) == group_size:
        items = list(enumerate(rows))
    elif lease.missing and len(rows) == len(lease.missing):
        items = list(zip(lease.missing, rows, strict=True))
    else:
        raise SchemaMismatch(f"group {lease.group_id!r} needs {group_size} rows (or the {len(lease.missing)} "
                             f"missing ones {list(lease.missing)}), got {len(rows)}")
    for index, _ in items:
        _check_index(lease.group_id, index, group_size)
    return items


def check_encoded(schema: RowSchema, group_size: int, group_id: str,
                  rows: Sequence[EncodedRow | Mapping[str, Any]]) -> list[CheckedRow]:
    """Verify rows a producer encoded, as the store's owner must before committing them.

    Raises:
        SchemaMismatch: a record that is damaged, names another group or row, or does not match
            the schema (the message names the row); nothing of the commit is written then.
    """
    out = []
    pinned = schema.pinned_names
    for item in rows:
        index, value = (item.index, item.value) if isinstance(item, EncodedRow) else (item["index"], item["value"])
        _check_index(group_id, index, group_size)
        where = f"row {keys.row_id(group_id, index)}"
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise SchemaMismatch(f"{where}: an encoded row is bytes, got {type(value).__name__}")
        value = bytes(value)  # the bytes checked are the bytes stored (a caller's buffer may change)
        try:
            checked = schema.check_row(value, where)  # the schema compiled once: one pass per header
        except CorruptRecord as exc:
            raise SchemaMismatch(f"{where}: the encoded record is refused: {exc.reason}") from None
        meta = checked.meta
        if meta != {"group_id": group_id, "index": index}:
            raise SchemaMismatch(f"{where}: the encoded record names group {meta.get('group_id')!r} "
                                 f"row {meta.get('index')!r}")
        shapes = {spec.name: spec.shape for spec in checked.fields if spec.name in pinned}
        out.append(CheckedRow(index, value, checked.nbytes, where, shapes))
    schema.pin({}, [(r.where, r.shapes) for r in out])
    return out


def _check_index(group_id: str, index: Any, group_size: int) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < group_size:
        raise SchemaMismatch(f"row index {index!r} of group {group_id!r} is outside 0..{group_size - 1}")
