"""Row schemas: the named tensors every row of a store carries, declared once per store.

A field is either ``token`` (a 1-D tensor as long as the row's sequence; every token field of a
row has the same length) or ``row`` (a tensor of any fixed shape per row, e.g. a scalar reward or
a padded prompt). Dtypes are exact: a row whose tensor has another dtype is refused, not cast.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .codec import DTYPES, as_numpy
from .errors import SchemaMismatch

KINDS = ("token", "row")


@dataclass(frozen=True)
class Field:
    """One declared field: its dtype name (see :data:`kvckpt.codec.DTYPES`) and its kind."""

    dtype: str
    kind: str = "token"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise SchemaMismatch(f"unknown dtype {self.dtype!r}; use one of {sorted(DTYPES)}")
        if self.kind not in KINDS:
            raise SchemaMismatch(f"unknown field kind {self.kind!r}; use one of {KINDS}")


class RowSchema:
    """The fields of a row, in declaration order.

    Args:
        fields: name -> :class:`Field`, or ``(dtype, kind)`` tuple, or a dtype string (kind token).
        optional: names that rows may omit. Defaults to none.

    Examples:
        >>> s = RowSchema({"input_ids": ("int64", "token"), "total_reward": ("float32", "row")})
        >>> s.token_fields
        ['input_ids']
    """

    def __init__(self, fields: Mapping[str, Field | tuple[str, str] | str],
                 optional: tuple[str, ...] = ()) -> None:
        if not fields:
            raise SchemaMismatch("a row schema needs at least one field")
        self.fields: dict[str, Field] = {}
        for name, spec in fields.items():
            if isinstance(spec, Field):
                self.fields[name] = spec
            elif isinstance(spec, str):
                self.fields[name] = Field(spec)
            else:
                self.fields[name] = Field(*spec)
        unknown = set(optional) - set(self.fields)
        if unknown:
            raise SchemaMismatch(f"optional fields {sorted(unknown)} are not declared")
        self.optional = tuple(optional)

    @property
    def token_fields(self) -> list[str]:
        """Names of the token-aligned (jagged) fields."""
        return [n for n, f in self.fields.items() if f.kind == "token"]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description, stored in the buffer's config."""
        return {"fields": {n: [f.dtype, f.kind] for n, f in self.fields.items()},
                "optional": list(self.optional)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> RowSchema:
        """Inverse of :meth:`to_dict`."""
        return cls({n: tuple(v) for n, v in doc["fields"].items()}, tuple(doc.get("optional", ())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowSchema) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"RowSchema({self.to_dict()['fields']})"

    def validate(self, row: Mapping[str, Any], where: str) -> dict[str, np.ndarray]:
        """Check one row against the schema and return it as contiguous numpy arrays.

        Raises:
            SchemaMismatch: a missing or undeclared field, a wrong dtype, a token field that is
                not 1-D, or token fields of different lengths. The message names ``where``.
        """
        extra = set(row) - set(self.fields)
        if extra:
            raise SchemaMismatch(f"{where}: fields {sorted(extra)} are not in the store's schema")
        out: dict[str, np.ndarray] = {}
        length = None
        for name, spec in self.fields.items():
            if name not in row:
                if name in self.optional:
                    continue
                raise SchemaMismatch(f"{where}: required field {name!r} is missing")
            arr, dtype = as_numpy(row[name])
            if dtype != spec.dtype:
                raise SchemaMismatch(f"{where}: field {name!r} has dtype {dtype}, the schema says {spec.dtype}")
            if spec.kind == "token":
                if arr.ndim != 1:
                    raise SchemaMismatch(f"{where}: token field {name!r} must be 1-D, got shape {arr.shape}")
                if length is None:
                    length = arr.shape[0]
                elif arr.shape[0] != length:
                    raise SchemaMismatch(f"{where}: token field {name!r} has {arr.shape[0]} tokens, "
                                         f"other token fields have {length}")
            out[name] = arr
        return out


def split_padded(batch: Mapping[str, Any], lengths: Any, schema: RowSchema) -> list[dict[str, Any]]:
    """Turn padded ``[N, L]`` token tensors and per-row tensors into ``N`` jagged row dicts.

    Args:
        batch: field name -> tensor with a leading row dimension ``N``.
        lengths: ``N`` valid token counts (e.g. ``input_lengths``); token fields are cut to them.
        schema: tells which fields are token-aligned.
    """
    lens = np.asarray(lengths.detach().cpu() if hasattr(lengths, "detach") else lengths).reshape(-1)
    rows: list[dict[str, Any]] = [{} for _ in range(len(lens))]
    for name, value in batch.items():
        token = name in schema.fields and schema.fields[name].kind == "token"
        for i, row in enumerate(rows):
            row[name] = value[i, : int(lens[i])] if token else value[i]
    return rows
