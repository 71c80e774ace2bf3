"""TransferQueue values <-> kvckpt records, each stamped with its key and its write identity.

A TransferQueue value is one field of one sample: a row of a dense field, one component of a
jagged or strided nested field, or one element of a non-tensor field. It is stored as one
:mod:`kvckpt.storage.codec` record whose ``meta["t"]`` says what comes back, never by pickling:

* ``"torch"``: a strided torch tensor of a codec dtype (bfloat16 included; any strides or device
  in, a contiguous CPU tensor out), as the record's field ``v``.
* ``"numpy"``: a numpy array or numpy scalar (``meta["s"]``), its dtype in ``meta["d"]`` and
  its shape in ``meta["shape"]``. Numeric and boolean arrays are the field ``v`` itself;
  byte strings (``|S<n>``) are stored as their raw bytes (uint8) and unicode strings (``<U<n>``)
  as their UCS-4 code points (uint32); object arrays as the JSON of their elements, C order.
  Byte order comes back little-endian.
* ``"json"``: a plain Python value as UTF-8 JSON in ``v``: strings, finite numbers, booleans,
  ``None``, lists and string-keyed dicts of those (tuples come back as lists).
* ``"bytes"``: a Python ``bytes`` value, as is.

Anything else (a complex, datetime or masked array, a non-finite Python float, an arbitrary
object) is refused with :class:`~kvckpt.errors.BadArgument` before anything is written.

Every record's ``meta`` also carries ``k`` (the TransferQueue key) and ``w`` (the write identity
of the put that wrote it). :func:`decode_value` verifies the checksum, then that both match what
the caller expects, then every description against the stored bytes (dtype, item size, shape,
element count, code point range), and raises :class:`~kvckpt.errors.CorruptRecord` naming the key
for anything inconsistent: decoded metadata is never trusted.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

import numpy as np
from kvckpt.integrations.transferqueue.errors import WriteIdentityMismatch

from kvckpt import codec
from kvckpt.errors import BadArgument, CorruptRecord

#: Numpy dtypes of stored text arrays: ``|S<n>`` (bytes) and ``<U<n>`` (UCS-4), 0 < n < 10**10.
_TEXT_DTYPE = re.compile(r"(\|S|<U)([1-9][0-9]{0,9})")
#: The codec dtype each text kind is stored as (its item is that many bytes per character).
_TEXT_STORED = {"|S": "uint8", "<U": "uint32"}
_CHAR_BYTES = {"|S": 1, "<U": 4}
#: numpy's largest item size in bytes.
_MAX_ITEM_BYTES = (1 << 31) - 1
_MAX_CODE_POINT = 0x10FFFF


def new_write_id() -> str:
    """A fresh write identity: 64 random bits as hex, unique across puts, processes and restores."""
    return uuid.uuid4().hex[:16]


# -- encoding -------------------------------------------------------------------------------------
def _json_bytes(key: str, value: Any, what: str) -> np.ndarray:
    """``value`` as UTF-8 JSON, refused unless it comes back equal (up to tuples becoming lists)."""
    try:
        _check_keys(value)
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise BadArgument(f"TransferQueue value of {key!r} is {what}, which the kvckpt backend cannot store "
                          f"without pickling ({exc}); store tensors, numpy arrays, bytes or JSON-able values") from None
    return np.frombuffer(text.encode(), np.uint8)


def _check_keys(value: Any) -> None:
    """Refuse dicts with non-string keys anywhere in ``value`` (JSON would turn them into strings)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            bad = next((k for k in item if not isinstance(k, str)), None)
            if bad is not None:
                raise TypeError(f"dict key {bad!r} is not a string")
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)


def _encode_numpy(key: str, value: Any) -> tuple[Any, dict[str, Any]]:
    """The stored field and the description of a numpy array or scalar."""
    arr = np.asarray(value)
    desc: dict[str, Any] = {"shape": list(arr.shape), "s": isinstance(value, np.generic)}
    kind, size = arr.dtype.kind, arr.dtype.itemsize
    if kind in "SU":  # numpy has no zero-size S or U dtype: an empty string is still one item wide
        # tobytes() is C order for any strides or shape (0-d included); <U is normalised to little-endian.
        if kind == "S":
            return np.frombuffer(arr.tobytes(), np.uint8), {**desc, "d": f"|S{size}"}
        chars = size // 4
        return np.frombuffer(arr.astype(f"<U{chars}").tobytes(), "<u4"), {**desc, "d": f"<U{chars}"}
    if kind == "O":
        return _json_bytes(key, arr.reshape(-1).tolist(), "an object array with an element that is not JSON"), \
            {**desc, "d": "|O"}
    try:
        stored, dtype = codec.as_numpy(arr)
    except BadArgument:
        raise BadArgument(f"TransferQueue value of {key!r}: numpy dtype {arr.dtype} is not storable (kvckpt stores "
                          f"{sorted(codec.DTYPES)}, byte and unicode strings, and JSON-able object arrays)") from None
    return stored, {**desc, "d": dtype}


def encode_value(key: str, value: Any, write_id: str, level: int) -> bytes:
    """One value as a checksummed record stamped with ``key`` and ``write_id``.

    Raises:
        BadArgument: the value is none of the kinds the module docstring lists.
    """
    meta: dict[str, Any] = {"k": key, "w": write_id}
    if hasattr(value, "detach") and hasattr(value, "dtype"):  # a torch.Tensor, without importing torch
        if str(getattr(value, "layout", "torch.strided")) != "torch.strided" or getattr(value, "is_nested", False):
            raise BadArgument(f"TransferQueue value of {key!r} is a nested or sparse tensor ({value.layout}); the "
                              "kvckpt backend stores strided tensors (TransferQueue unbinds nested fields into them)")
        return codec.encode({"v": value}, {**meta, "t": "torch"}, level)
    if isinstance(value, np.ma.MaskedArray):
        raise BadArgument(f"TransferQueue value of {key!r} is a masked array; store its data and mask as two fields")
    if isinstance(value, (np.ndarray, np.generic)):
        field, desc = _encode_numpy(key, value)
        return codec.encode({"v": field}, {**meta, "t": "numpy", **desc}, level)
    if type(value) is bytes:
        return codec.encode({"v": np.frombuffer(value, np.uint8)}, {**meta, "t": "bytes"}, level)
    finite = not isinstance(value, float) or math.isfinite(value)
    what = f"of type {type(value).__name__}" if finite else "a non-finite float"
    return codec.encode({"v": _json_bytes(key, value, what)}, {**meta, "t": "json"}, level)


# -- decoding -------------------------------------------------------------------------------------
def _field(record: codec.Record, where: str, dtype: str) -> np.ndarray:
    """The record's one field ``v``, which must be an array of the codec dtype ``dtype``."""
    if set(record.arrays) != {"v"} or record.dtypes["v"] != dtype:
        raise CorruptRecord(where, f"a TransferQueue value record holds fields {record.dtypes}, expected one "
                                 f"{dtype} field 'v'")
    return record.arrays["v"]


def _shape(where: str, meta: dict[str, Any]) -> tuple[int, ...]:
    shape = meta.get("shape")
    if not (isinstance(shape, list) and len(shape) <= codec.MAX_NDIM
            and all(type(d) is int and 0 <= d < 1 << 48 for d in shape)):
        raise CorruptRecord(where, f"invalid numpy shape {str(shape)[:200]}")
    return tuple(shape)


def _loads(where: str, data: np.ndarray) -> Any:
    try:
        return json.loads(data.tobytes(), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptRecord(where, f"the stored JSON value does not parse: {str(exc)[:200]}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _decode_numpy(where: str, record: codec.Record) -> Any:
    meta = record.meta
    shape, dtype, scalar = _shape(where, meta), meta.get("d"), meta.get("s")
    count = math.prod(shape)
    if not isinstance(scalar, bool) or (scalar and shape != ()):
        raise CorruptRecord(where, f"invalid numpy scalar flag {scalar!r} for shape {shape}")
    if not isinstance(dtype, str):
        raise CorruptRecord(where, f"unknown numpy dtype {str(dtype)[:100]!r}")
    text = _TEXT_DTYPE.fullmatch(dtype)
    if text is not None:
        prefix, size = text.group(1), int(text.group(2))
        if size * _CHAR_BYTES[prefix] > _MAX_ITEM_BYTES:
            raise CorruptRecord(where, f"numpy dtype {dtype} is wider than numpy allows")
        flat = _field(record, where, _TEXT_STORED[prefix])
        if flat.ndim != 1 or flat.size != count * size:
            raise CorruptRecord(where, f"{flat.size} stored items for {count} values of {dtype}")
        if prefix == "<U" and flat.size and int(flat.max()) > _MAX_CODE_POINT:
            raise CorruptRecord(where, "a unicode value holds a code point beyond U+10FFFF")
        arr = flat.view(dtype).reshape(shape)
    elif dtype == "|O":
        elements = _loads(where, _field(record, where, "uint8").reshape(-1))
        if not isinstance(elements, list) or len(elements) != count:
            raise CorruptRecord(where, f"an object array of shape {shape} holds {str(elements)[:100]}")
        arr = np.empty(count, dtype=object)
        for i, element in enumerate(elements):
            arr[i] = element
        arr = arr.reshape(shape)
    elif dtype in codec.DTYPES and dtype != "bfloat16":
        arr = _field(record, where, dtype)
        if arr.shape != shape:
            raise CorruptRecord(where, f"a numpy value of shape {arr.shape} is described as {shape}")
    else:
        raise CorruptRecord(where, f"unknown numpy dtype {str(dtype)[:100]!r}")
    return arr[()] if scalar else arr


def decode_value(key: str, raw: bytes, expected_write_id: str | None) -> Any:
    """Verify a stored record and return its value (see the module docstring for the kinds).

    Raises:
        CorruptRecord: checksum, structure or description failure.
        WriteIdentityMismatch: the record was written by another put than ``expected_write_id``,
            or holds another key's value.
    """
    where = f"rows/{key}"
    record = codec.decode(raw, where)
    meta = record.meta
    if meta.get("k") != key or meta.get("w") != expected_write_id:
        raise WriteIdentityMismatch(key, expected_write_id, meta.get("w"))
    kind = meta.get("t")
    if kind == "torch":
        if set(record.arrays) != {"v"} or record.dtypes["v"] not in codec.DTYPES:
            raise CorruptRecord(where, f"a tensor record holds fields {record.dtypes}, expected one tensor 'v'")
        return record.tensors()["v"]
    if kind == "numpy":
        return _decode_numpy(where, record)
    if kind in ("json", "bytes"):
        data = _field(record, where, "uint8")
        if data.ndim != 1:
            raise CorruptRecord(where, f"a {kind} value is stored with shape {data.shape}, not as flat bytes")
        return _loads(where, data) if kind == "json" else data.tobytes()
    raise CorruptRecord(where, f"unknown TransferQueue value kind {str(kind)[:100]!r}")
