"""Value-preserving casts: what trainers produce, turned into a field's declared dtype.

Trainers hand rows over as torch tensors, numpy arrays, numpy scalars, Python scalars and lists;
:func:`cast` turns any of them into the stored form of the declared dtype (see
:data:`kvckpt.storage.codec.DTYPES`; ``bfloat16`` as its raw ``uint16`` bits) when that keeps every value,
and refuses with a :class:`~kvckpt.errors.SchemaMismatch` naming the field, the dtypes and the
first offending value when it does not. The rules ("value-preserving"):

* the declared dtype itself: taken as is;
* ``bool`` -> any integer or float (0/1); integers holding only 0/1 -> ``bool``;
* integer -> integer: every value inside the target's range (``int32`` -> ``int64`` always);
* integer -> float: every value exactly representable (``2**24 + 1`` is refused for float32);
* float -> wider float (``float16``/``bfloat16`` -> ``float32`` -> ``float64``): always exact;
* float -> narrower float (``float64`` -> ``float32``, a Python reward ``0.3``, float32 ->
  ``bfloat16`` where declared): rounded to nearest, which is what declaring the narrower dtype
  asks for, but never losing the value: NaN stays NaN, infinities stay infinite, and a finite
  value must stay within the target's relative precision (``finfo.eps``). So a value that would
  overflow to infinity, flush to zero or lose precision as a subnormal is refused;
* float -> integer or ``bool``: refused (a float where an integer is declared is a type mix-up,
  e.g. logprobs in ``input_ids``; cast it explicitly if the values are integral).

Text fields (``str``, ``bytes``) take exactly one ``str`` (or ``bytes``/``bytearray``/
``memoryview``) value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvckpt.errors import SchemaMismatch
from kvckpt.storage.codec import DTYPES, TEXT_DTYPES, as_numpy

#: Significand bits (with the implicit one) of each float dtype: integers up to 2**p are exact.
_PRECISION = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}
_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}
_WIDENS_TO = {"float16": {"float32", "float64"}, "bfloat16": {"float32", "float64"},
              "float32": {"float64"}, "float64": set()}


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float values to bfloat16 (nearest, ties to even) and return the raw ``uint16`` bits."""
    f32 = np.asarray(values, dtype=np.float32, order="C")  # not ascontiguousarray: keeps 0-d
    bits = f32.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():  # keep the sign, force a quiet NaN (rounding could carry into the exponent)
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """The float32 values of raw bfloat16 bits (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _refuse(where: str, name: str, src: str, dtype: str, values: np.ndarray, bad: np.ndarray, why: str) -> None:
    idx = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(bad)[0]), values.shape)) if values.ndim else ()
    value = values[idx] if values.ndim else values[()]  # a numpy scalar prints shortest in its own dtype
    at = f" at index {list(idx)}" if values.ndim else ""
    raise SchemaMismatch(f"{where}: field {name!r} is {src}, the schema says {dtype}, and value {value!s}{at} "
                         f"{why}; nothing was written")


def _float_values(arr: np.ndarray, src: str) -> np.ndarray:
    return bf16_values(arr) if src == "bfloat16" else arr


def _to_float(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` rounded to float ``dtype``, in its stored form."""
    if dtype == "bfloat16":
        return bf16_bits(values)
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(DTYPES[dtype])


def _cast_int_to_float(arr: np.ndarray, src: str, dtype: str, where: str, name: str) -> np.ndarray:
    limit = 2 ** _PRECISION[dtype]
    big = (arr > limit) | (arr < -limit)  # smaller magnitudes are always exact
    out = _to_float(arr, dtype)
    for flat in np.flatnonzero(big):
        exact = int(arr.reshape(-1)[flat])
        rounded = float(_float_values(out.reshape(-1)[flat:flat + 1], dtype)[0])
        if not np.isfinite(rounded) or int(rounded) != exact:
            mask = np.zeros(arr.size, bool)
            mask[flat] = True
            _refuse(where, name, src, dtype, arr, mask.reshape(arr.shape), "is not exactly representable")
    return out


def _cast_float_to_float(arr: np.ndarray, src: str, dtype: str, where: str, name: str) -> np.ndarray:
    values = _float_values(arr, src)
    out = _to_float(values, dtype)
    if dtype in _WIDENS_TO[src]:
        return out
    x = values.astype(np.float64)
    y = _float_values(out, dtype).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        same_class = (np.isnan(x) == np.isnan(y)) & (np.isinf(x) == np.isinf(y)) & ((x == y) | ~np.isfinite(x))
        close = np.abs(y - x) <= _EPS[dtype] * np.abs(x)
    ok = np.where(np.isfinite(x), np.isfinite(y) & close, same_class)
    if not ok.all():
        _refuse(where, name, src, dtype, values, ~ok,
                f"does not survive rounding to {dtype} (it would become {_float_values(out, dtype)[~ok][0]!s})")
    return out


def cast(value: Any, dtype: str, where: str, name: str) -> np.ndarray | str | bytes:
    """``value`` in the stored form of ``dtype``, if every value survives (see the module rules).

    Returns:
        A C-contiguous numpy array of ``DTYPES[dtype]`` (``bfloat16``: its ``uint16`` bits), or the
        ``str`` / ``bytes`` of a text field.

    Raises:
        SchemaMismatch: the value cannot be held by ``dtype`` without changing; the message names
            ``where``, the field, both dtypes and the first offending value.
        BadArgument: the value is not an array of a storable dtype at all (e.g. complex, ragged).
    """
    if dtype in TEXT_DTYPES:
        if dtype == "str" and isinstance(value, str):
            return str(value)
        if dtype == "bytes" and isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value)
        want = "str" if dtype == "str" else "bytes"
        raise SchemaMismatch(f"{where}: field {name!r} is a {dtype} field and takes one {want}, "
                             f"got {type(value).__name__}")
    if isinstance(value, (str, bytes)):
        raise SchemaMismatch(f"{where}: field {name!r} is {dtype}, got a {type(value).__name__}")
    arr, src = as_numpy(value)
    if src == dtype:
        return arr
    src_kind = "f" if src == "bfloat16" else DTYPES[src].kind
    kind = "f" if dtype == "bfloat16" else DTYPES[dtype].kind
    if src_kind == "f" and kind != "f":
        raise SchemaMismatch(f"{where}: field {name!r} is {src}, the schema says {dtype}: floats are not cast to "
                             "integers or bool (cast explicitly if the values are integral); nothing was written")
    if kind == "b":
        bad = (arr != 0) & (arr != 1)
        if bad.any():
            _refuse(where, name, src, dtype, arr, bad, "is not 0 or 1")
        return arr.astype(np.bool_)
    if kind in "iu":
        if src_kind in "iu":
            info = np.iinfo(DTYPES[dtype])
            bad = (arr < info.min) | (arr > info.max)
            if bad.any():
                _refuse(where, name, src, dtype, arr, bad, f"is outside {dtype}'s range {info.min}..{info.max}")
        return arr.astype(DTYPES[dtype])
    if src_kind == "b":
        return _to_float(arr.astype(np.float32), dtype)
    if src_kind in "iu":
        return _cast_int_to_float(arr, src, dtype, where, name)
    return _cast_float_to_float(arr, src, dtype, where, name)
