"""Row schemas: the named values every row of a store carries, declared once per store.

A field is either ``token`` (an array whose first dimension is the row's sequence; every token
field of a row has the same length) or ``row`` (an array of one fixed shape per row, e.g. a scalar
reward, or one ``str`` / ``bytes`` value: prompt text, a tool trace, JSON metadata).

Shapes: a field may declare its shape (a row field's whole shape, a token field's trailing dims
after the token dimension; undeclared, a token field is 1-D). A row field's shape left undeclared
is pinned by the store at the first commit that carries the field (:meth:`RowSchema.pin`,
persisted under ``meta/shapes`` in that commit's own transaction); every later row must match, and
the rows of one commit must agree with each other. So every stored row of a field has one shape,
and batches stack.

Dtypes: a committed value is cast to the declared dtype when that keeps every value, and refused
otherwise (the rules are in :mod:`kvckpt.storage.casts`). Stored rows are checked exactly
(:meth:`RowSchema.check_record`): a stored dtype other than the declared one is damage.

Sizes: ``max_tokens`` caps a row's token count and ``max_text_bytes`` a text value's length, at
commit; :meth:`RowSchema.limits` turns the schema (and the store's pins) into the decode limits
that bound what reading one stored row may allocate.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from kvckpt.errors import SchemaMismatch
from kvckpt.storage.casts import cast
from kvckpt.storage.codec import DTYPES, TEXT_DTYPES, Checked, FieldRule, Limits, Record, RecordRules

KINDS = ("token", "row")
#: Default cap on a row's tokens (1,048,576), for rows committed and rows read back.
DEFAULT_MAX_TOKENS = 1 << 20
#: Default cap on one text value's UTF-8 bytes (16 MiB).
DEFAULT_MAX_TEXT_BYTES = 1 << 24
_MAX_DIM = 1 << 40


def _shape(value: Any, where: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise SchemaMismatch(f"{where}: a shape is a sequence of ints, got {value!r}")
    dims = tuple(value)
    if len(dims) > 64 or not all(type(d) is int and 0 <= d < _MAX_DIM for d in dims):
        raise SchemaMismatch(f"{where}: a shape holds at most 64 ints in 0..2**40, got {value!r}")
    return dims


@dataclass(frozen=True)
class Field:
    """One declared field: its dtype (see :data:`kvckpt.storage.codec.DTYPES`, or ``str`` / ``bytes``),
    its kind, and optionally its shape (``row``: the whole shape; ``token``: the dims after the
    token dimension). ``shape=None``: a row field's shape is pinned by the store at its first
    commit; a token field is 1-D (declare its trailing dims, e.g. ``(k,)``, for ``[T, k]`` values).

    Text fields are ``row`` fields holding one value per row (their shape is ``()``).
    """

    dtype: str
    kind: str = "token"
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) or (self.dtype not in DTYPES and self.dtype not in TEXT_DTYPES):
            raise SchemaMismatch(f"unknown dtype {self.dtype!r}; use one of {sorted(DTYPES) + list(TEXT_DTYPES)}")
        if self.kind not in KINDS:
            raise SchemaMismatch(f"unknown field kind {self.kind!r}; use one of {KINDS}")
        object.__setattr__(self, "shape", _shape(self.shape, f"field of dtype {self.dtype}"))
        if self.dtype in TEXT_DTYPES:
            if self.kind != "row":
                raise SchemaMismatch(f"a {self.dtype} field must be of kind 'row' (one value per row)")
            if self.shape not in (None, ()):
                raise SchemaMismatch(f"a {self.dtype} field holds one value per row; its shape is (), "
                                     f"not {self.shape}")
            object.__setattr__(self, "shape", ())

    @classmethod
    def of(cls, spec: Any, name: str = "?") -> Field:
        """A field from any declared form: a :class:`Field`, a dtype string (kind ``token``, or
        ``row`` for ``str`` / ``bytes``), a
        ``(dtype, kind)`` or ``(dtype, kind, shape)`` tuple or list, or a dict with the keys
        ``dtype``, ``kind`` and ``shape``.

        Raises:
            SchemaMismatch: any other form, or an invalid dtype, kind or shape.
        """
        if isinstance(spec, Field):
            return spec
        if isinstance(spec, str):
            return cls(spec, "row" if spec in TEXT_DTYPES else "token")
        if isinstance(spec, Mapping):
            unknown = set(spec) - {"dtype", "kind", "shape"}
            if unknown or "dtype" not in spec:
                raise SchemaMismatch(f"field {name!r}: a dict spec has the keys dtype, kind and shape, "
                                     f"got {sorted(map(str, spec))}")
            return cls(spec["dtype"], spec.get("kind", "token"), spec.get("shape"))
        if isinstance(spec, (tuple, list)) and 1 <= len(spec) <= 3:
            return cls(*spec)
        raise SchemaMismatch(f"field {name!r}: cannot read a field spec from {spec!r}")

    def to_list(self) -> list[Any]:
        """The JSON form: ``[dtype, kind]``, plus the shape when one is declared."""
        return [self.dtype, self.kind] if self.shape is None else [self.dtype, self.kind, list(self.shape)]


class RowSchema:
    """The fields of a row, in declaration order.

    Args:
        fields: name -> :class:`Field` or any form :meth:`Field.of` reads.
        optional: names that rows may omit. Defaults to none.
        max_tokens: the most tokens a row may hold. Defaults to :data:`DEFAULT_MAX_TOKENS`.
        max_text_bytes: the most UTF-8 bytes one text value may hold. Defaults to
            :data:`DEFAULT_MAX_TEXT_BYTES`.

    Examples:
        >>> s = RowSchema({"input_ids": ("int64", "token"), "total_reward": ("float32", "row", ()),
        ...                "prompt": ("str", "row")})
        >>> s.token_fields
        ['input_ids']
        >>> s.validate({"input_ids": [1, 2], "total_reward": 0.5, "prompt": "1+1="}, "row g_0")["total_reward"]
        array(0.5, dtype=float32)
    """

    def __init__(self, fields: Mapping[str, Any], optional: tuple[str, ...] = (), *,
                 max_tokens: int = DEFAULT_MAX_TOKENS, max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES) -> None:
        if not isinstance(fields, Mapping) or not fields:
            raise SchemaMismatch(f"a row schema needs a mapping of at least one field, got {fields!r:.200}")
        self.fields: dict[str, Field] = {}
        for name, spec in fields.items():
            if not isinstance(name, str) or not name:
                raise SchemaMismatch(f"field names are non-empty strings, got {name!r}")
            self.fields[name] = Field.of(spec, name)
        if isinstance(optional, (str, bytes)) or not all(isinstance(n, str) for n in optional):
            raise SchemaMismatch(f"optional is a sequence of field names, got {optional!r}")
        unknown = set(optional) - set(self.fields)
        if unknown:
            raise SchemaMismatch(f"optional fields {sorted(unknown)} are not declared")
        self.optional = tuple(optional)
        for label, value in (("max_tokens", max_tokens), ("max_text_bytes", max_text_bytes)):
            if type(value) is not int or not 1 <= value < _MAX_DIM:
                raise SchemaMismatch(f"{label} must be an int from 1 to 2**40, got {value!r}")
        self.max_tokens = max_tokens
        self.max_text_bytes = max_text_bytes

    @property
    def token_fields(self) -> list[str]:
        """Names of the token-aligned (jagged) fields."""
        return [n for n, f in self.fields.items() if f.kind == "token"]

    @property
    def dtypes(self) -> dict[str, str]:
        """Field name -> declared dtype."""
        return {n: f.dtype for n, f in self.fields.items()}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description, stored in the buffer's config (the sizes only when not default)."""
        doc: dict[str, Any] = {"fields": {n: f.to_list() for n, f in self.fields.items()},
                               "optional": list(self.optional)}
        if self.max_tokens != DEFAULT_MAX_TOKENS:
            doc["max_tokens"] = self.max_tokens
        if self.max_text_bytes != DEFAULT_MAX_TEXT_BYTES:
            doc["max_text_bytes"] = self.max_text_bytes
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> RowSchema:
        """Inverse of :meth:`to_dict`.

        Raises:
            SchemaMismatch: ``doc`` is not a schema document (a stored config is untrusted input).
        """
        if not isinstance(doc, Mapping) or not isinstance(doc.get("fields"), Mapping) \
                or not set(doc) <= {"fields", "optional", "max_tokens", "max_text_bytes"}:
            raise SchemaMismatch(f"not a row schema document: {doc!r:.200}")
        optional = doc.get("optional", ())
        if not isinstance(optional, (list, tuple)):
            raise SchemaMismatch(f"a row schema's optional is a list of names, got {optional!r:.200}")
        return cls(dict(doc["fields"]), tuple(optional), max_tokens=doc.get("max_tokens", DEFAULT_MAX_TOKENS),
                   max_text_bytes=doc.get("max_text_bytes", DEFAULT_MAX_TEXT_BYTES))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowSchema) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"RowSchema({self.to_dict()['fields']})"

    # -- checks ----------------------------------------------------------------------------------
    def validate(self, row: Mapping[str, Any], where: str) -> dict[str, Any]:
        """Check one row a caller commits and return it in stored form.

        Values are cast to the declared dtypes when every value survives (:mod:`kvckpt.storage.casts`):
        numpy arrays of the dtypes' stored form (``bfloat16``: its ``uint16`` bits, see
        :attr:`dtypes`), ``str`` / ``bytes`` for text fields.

        Raises:
            SchemaMismatch: a missing or undeclared field, a lossy cast, a token field that is
                0-d, token fields of different lengths or over ``max_tokens``, a text value over
                ``max_text_bytes``, or a shape other than the declared one. The message names
                ``where`` and the field.
        """
        if not isinstance(row, Mapping):
            raise SchemaMismatch(f"{where}: a row is a mapping of field name to value, got {type(row).__name__}")
        self._check_names(row, where)
        out = {name: cast(row[name], self.fields[name].dtype, where, name) for name in self.fields if name in row}
        self._check_sizes(out, where)
        return out

    def check_record(self, record: Record, where: str) -> None:
        """Check a stored row exactly: the declared fields, dtypes, declared shapes and sizes.

        Raises:
            SchemaMismatch: any difference; the message names ``where`` and the field.
        """
        self._check_names(record.arrays, where)
        for name, dtype in record.dtypes.items():
            if dtype != self.fields[name].dtype:
                raise SchemaMismatch(f"{where}: field {name!r} is stored as {dtype}, the schema says "
                                     f"{self.fields[name].dtype}")
        self._check_sizes(record.arrays, where)

    def _check_names(self, row: Mapping[str, Any], where: str) -> None:
        extra = set(row) - set(self.fields)
        if extra:
            raise SchemaMismatch(f"{where}: fields {sorted(map(str, extra))} are not in the store's schema")
        missing = [n for n in self.fields if n not in row and n not in self.optional]
        if missing:
            raise SchemaMismatch(f"{where}: required field {missing[0]!r} is missing")

    def _check_sizes(self, values: Mapping[str, Any], where: str) -> None:
        length = None
        for name, value in values.items():
            spec = self.fields[name]
            if spec.dtype in TEXT_DTYPES:
                size = len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else len(value)
                if size > self.max_text_bytes:
                    raise SchemaMismatch(f"{where}: text field {name!r} holds {size} bytes, over the schema's "
                                         f"max_text_bytes {self.max_text_bytes}")
                continue
            shape = tuple(value.shape)
            if spec.kind == "token":
                length = self._token_length(name, shape, length, where)
                shape = shape[1:]
            declared = spec.shape if spec.shape is not None or spec.kind == "row" else ()
            if declared is not None and shape != declared:
                part = "trailing dims" if spec.kind == "token" else "shape"
                raise SchemaMismatch(f"{where}: field {name!r} has {part} {list(shape)}, the schema declares "
                                     f"{list(declared)}")

    def _token_length(self, name: str, shape: tuple[int, ...], length: int | None, where: str) -> int:
        """A token field's token count, held against ``length`` (the row's other token fields', or
        ``None`` for the first) and ``max_tokens``."""
        if not shape:
            raise SchemaMismatch(f"{where}: token field {name!r} must have a token dimension, got a scalar")
        if length is None:
            if shape[0] > self.max_tokens:
                raise SchemaMismatch(f"{where}: token field {name!r} has {shape[0]} tokens, over the "
                                     f"schema's max_tokens {self.max_tokens}")
        elif shape[0] != length:
            raise SchemaMismatch(f"{where}: token field {name!r} has {shape[0]} tokens, "
                                 f"other token fields have {length}")
        return shape[0]

    # -- the owner's check of encoded rows, compiled once ----------------------------------------
    @functools.cached_property
    def rules(self) -> RecordRules:
        """The schema compiled into the rules every stored row meets (built once per schema): each
        field's dtype, its shape (a token field: any token count, then its declared trailing dims
        or none; a row field: its declared shape, or any until the store pins one; text: 0-d), its
        decode cap from :meth:`limits` (no pins), and which fields are required."""
        caps = self.limits().field_bytes
        return RecordRules({name: FieldRule(spec.dtype, (None, *(spec.shape or ())) if spec.kind == "token"
                                            else spec.shape, caps[name]) for name, spec in self.fields.items()},
                           [name for name in self.fields if name not in self.optional])

    def check_row(self, value: bytes | memoryview, where: str) -> Checked:
        """Verify one encoded row against the schema in one pass over its header (:attr:`rules`):
        everything ``check_record(codec.describe(value, where, limits=self.limits()), where)`` checks.
        Returns what the check read (:meth:`RecordRules.check <kvckpt.storage.codec.RecordRules.check>`:
        meta, field entries, decoded size; ``.record()`` is ``describe``'s result). The store owner
        runs it on every row a producer encoded.

        Raises:
            CorruptRecord: the record is damaged, or holds a field, dtype, shape or size the schema
                refuses (the message names ``where`` and the field).
            SchemaMismatch: its token fields differ in length or hold over ``max_tokens``.
        """
        checked = self.rules.check(value, where)
        length = None
        tokens = self._token_names
        for spec in checked.fields:  # the record's order; the encoder writes the schema's
            if spec.name in tokens:
                length = self._token_length(spec.name, spec.shape, length, where)
        return checked

    @functools.cached_property
    def _token_names(self) -> frozenset[str]:
        return frozenset(self.token_fields)

    @functools.cached_property
    def pinned_fields(self) -> tuple[str, ...]:
        """The fields whose shape the store pins (:meth:`pin`): row fields that declare no shape."""
        return tuple(n for n, f in self.fields.items() if f.kind == "row" and f.shape is None)

    @functools.cached_property
    def pinned_names(self) -> frozenset[str]:
        """:attr:`pinned_fields` as a set."""
        return frozenset(self.pinned_fields)

    # -- shapes the store pins -------------------------------------------------------------------
    @staticmethod
    def shape_of(spec: Field, value: Any) -> tuple[int, ...]:
        """The shape the schema keeps for a value: a row field's shape, a token field's trailing dims."""
        if spec.dtype in TEXT_DTYPES:
            return ()
        return tuple(value.shape[1:]) if spec.kind == "token" else tuple(value.shape)

    def pin(self, pins: Mapping[str, Any], rows: list[tuple[str, Mapping[str, tuple[int, ...]]]],
            ) -> dict[str, list[int]] | None:
        """Check rows' shapes against the store's pins and pin the fields seen for the first time.

        Args:
            pins: field name -> pinned shape, as stored (``meta/shapes``); may be empty.
            rows: ``(where, {field: shape})`` per row, shapes as :meth:`shape_of` gives them.

        Returns:
            The new pins to store, or ``None`` when nothing new was pinned. Declared shapes and
            token fields are never pinned (:meth:`validate` checks them).

        Raises:
            SchemaMismatch: a row whose shape differs from the pin, or from an earlier row of the
                same call; the message names the row and the field.
        """
        current = self._read_pins(pins)
        first = dict.fromkeys(current, "the store's pin")
        added = False
        pinned = self.pinned_names
        for where, shapes in rows:
            for name, shape in shapes.items():
                if name not in pinned:
                    continue
                if name not in current:
                    current[name], first[name], added = shape, where, True
                elif current[name] != shape:
                    raise SchemaMismatch(f"{where}: field {name!r} has shape {list(shape)}, but {first[name]} "
                                         f"fixes it at {list(current[name])}; every row of a store has one "
                                         "shape per field (declare it in the schema to fix it up front)")
        return {n: list(s) for n, s in current.items()} if added else None

    def _read_pins(self, pins: Any) -> dict[str, tuple[int, ...]]:
        """Stored pins, checked: a map of declared field names to shapes."""
        if not isinstance(pins, Mapping) or not set(pins) <= set(self.fields):
            raise SchemaMismatch(f"meta/shapes is not a map of the schema's fields to shapes: {pins!r:.200}")
        return {n: _shape(s, f"meta/shapes[{n!r}]") for n, s in pins.items()}

    def limits(self, pins: Mapping[str, Any] | None = None) -> Limits:
        """The most one stored row of this schema may decode to, for :func:`kvckpt.storage.codec.decode`.

        A token field: ``max_tokens`` times its trailing dims (declared, pinned, or none); a row
        field: its declared or pinned shape, or ``max_tokens`` elements when neither is known (a
        store written before shapes were pinned); a text field: ``max_text_bytes``.
        """
        pins = self._read_pins(pins or {})
        caps = {}
        for name, spec in self.fields.items():
            if spec.dtype in TEXT_DTYPES:
                caps[name] = self.max_text_bytes
                continue
            shape = spec.shape if spec.shape is not None else pins.get(name)
            if spec.kind == "token":
                count = self.max_tokens * prod(shape or ())
            else:
                count = self.max_tokens if shape is None else prod(shape)
            caps[name] = count * DTYPES[spec.dtype].itemsize
        return Limits(max_bytes=sum(caps.values()), field_bytes=caps)


def split_padded(batch: Mapping[str, Any], lengths: Any, schema: RowSchema) -> list[dict[str, Any]]:
    """Turn padded ``[N, L]`` token tensors and per-row values into ``N`` jagged row dicts.

    Args:
        batch: field name -> tensor (or list, for text fields) with a leading row dimension ``N``.
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
