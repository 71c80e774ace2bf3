"""The record codec: named arrays and a small JSON document <-> checksummed bytes.

Every value kvckpt stores (rows, group metadata, ledger entries, cursors) is one *record*::

    magic   4 bytes  b"KVR1"
    crc32   u32 LE   zlib.crc32 of every byte after this field
    hlen    u32 LE   length of the header
    header  hlen bytes of UTF-8 JSON (see below)
    body    the concatenated encoded fields, as one zstd frame when header["z"] > 0
            (an empty body is never compressed: z is 0 then)

The header is ``{"z": level, "raw": body length before compression, "meta": {...},
"fields": [[name, dtype, shape, transforms, nbytes], ...]}``. Field bytes are little-endian and
C-ordered; ``transforms`` is an ordered list applied at encode time (and undone in reverse):
``"narrow:<dtype>"`` (integers stored in the smallest dtype that holds their range),
``"bitpack"`` (0/1 values as bits, ``np.packbits`` order) and ``"shuffle"`` (byte planes, which
lets zstd see the zero high bytes of small integers and float exponents). Booleans are always
bit-packed; the other transforms are used only when the body is compressed. Readers accept only
the (dtype, transforms) pairs the encoder writes (:data:`_STORED`). Text fields (dtype ``str``:
UTF-8, or ``bytes``) are 0-d: their bytes are the payload itself, ``nbytes`` its length.
``docs/format.md`` is the byte-exact specification.

Guarantees: nothing executable is ever decoded (no pickle, no ``torch.load``); the checksum is
verified before anything else is trusted; every length, dtype and shape is checked against the
actual bytes, and what the record would decode to against the caller's :class:`Limits`, before
anything is decompressed or an array is built; a violation raises
:class:`~kvckpt.errors.CorruptRecord` naming the key. Decoded values own their memory (they never
alias an LMDB page); only :func:`decode_views` leaves plain fields as read-only views, into ``bytes``
the caller owns (a received progress message).

The module is long on purpose: the writer, the generic reader and the compiled reader of one
known layout (:class:`RecordRules`, the owner's check of producers' rows) share one table of what
the encoder writes (:data:`_STORED`) and one set of size rules, so they cannot drift apart.
"""

from __future__ import annotations

import functools
import json
import re
import struct
import threading
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import zstandard

from kvckpt.errors import BadArgument, CorruptRecord

MAGIC = b"KVR1"
_PREFIX = struct.Struct("<4sII")
MAX_HEADER_BYTES = 1 << 20
MAX_BODY_BYTES = 1 << 32
MAX_NDIM = 64
MAX_LEVEL = 22
DEFAULT_LEVEL = 1
#: What one :func:`decode` may allocate unless the caller passes tighter (or looser) :class:`Limits`.
DEFAULT_MAX_BYTES = 1 << 30
#: The product of a shape's non-zero dimensions stays below this (no shape can overflow a size).
MAX_EXTENT = 1 << 48

#: Logical dtype name -> numpy dtype of the stored bytes. ``bfloat16`` is stored as its raw 16 bits.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(np_name)
    for name, np_name in {
        "bool": "bool",
        "uint8": "<u1",
        "int8": "<i1",
        "uint16": "<u2",
        "int16": "<i2",
        "uint32": "<u4",
        "int32": "<i4",
        "uint64": "<u8",
        "int64": "<i8",
        "float16": "<f2",
        "bfloat16": "<u2",
        "float32": "<f4",
        "float64": "<f8",
    }.items()
}
#: Logical dtypes of 0-d text fields: ``str`` (stored as UTF-8) and ``bytes`` (stored as is).
TEXT_DTYPES = ("str", "bytes")
_TEXT_TYPE = {"str": str, "bytes": bytes}
_NARROW_ORDER = ("uint8", "int8", "uint16", "int16", "uint32", "int32")
_NARROW_RANGES = tuple((name, int(np.iinfo(DTYPES[name]).min), int(np.iinfo(DTYPES[name]).max),
                        DTYPES[name].itemsize) for name in _NARROW_ORDER)
_INTEGER = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")
#: (numpy kind, itemsize) -> logical name, for inputs of any byte order (bfloat16 is torch-only).
_NAME_OF = {(DTYPES[name].kind, DTYPES[name].itemsize): name for name in DTYPES if name != "bfloat16"}


def _stored_sizes() -> dict[tuple[str, tuple[str, ...]], int]:
    """Every (dtype, transforms) pair the encoder writes, with the size of one stored element (0:
    bit-packed; 1 for text, whose stored bytes are the value); readers refuse any other pair.

    ``()`` for any dtype (the only one for text); ``("bitpack",)`` for bool and integers;
    ``("shuffle",)`` for dtypes wider than one byte; for integers, ``("narrow:N",)`` when N is one
    byte and ``("narrow:N", "shuffle")`` when N is wider, N strictly narrower than the dtype.
    """
    stored = {(dtype, ()): 1 for dtype in TEXT_DTYPES}
    for dtype, np_dtype in DTYPES.items():
        stored[(dtype, ())] = np_dtype.itemsize
        if dtype == "bool" or dtype in _INTEGER:
            stored[(dtype, ("bitpack",))] = 0
        if np_dtype.itemsize > 1:
            stored[(dtype, ("shuffle",))] = np_dtype.itemsize
        if dtype in _INTEGER:
            for narrow in _NARROW_ORDER:
                size = DTYPES[narrow].itemsize
                if size < np_dtype.itemsize:
                    stored[(dtype, (f"narrow:{narrow}", "shuffle") if size > 1 else (f"narrow:{narrow}",))] = size
    return stored


_STORED = _stored_sizes()
#: Logical dtype -> {transforms: stored element size}: :data:`_STORED` by dtype.
_SIZES = {dtype: {t: size for (d, t), size in _STORED.items() if d == dtype} for dtype in (*DTYPES, *TEXT_DTYPES)}
_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}
_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """A per-thread compressor for ``level`` (creating one per record costs more than a small row)."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


@dataclass(frozen=True)
class Limits:
    """What one :func:`decode` may allocate, checked against the header before anything is
    decompressed or built.

    Sizes are *decoded* bytes: a field's element count times its dtype's size (after bit-unpacking
    and widening, so an 8x or 64x expansion counts in full), a text field's byte length. The
    decompressed body is never larger than the decoded total, so it is bounded too.

    Args:
        max_bytes: the most all fields of one record may decode to. Defaults to
            :data:`DEFAULT_MAX_BYTES` (1 GiB).
        field_bytes: per-field caps by field name (e.g. from :meth:`kvckpt.RowSchema.limits`);
            a field not named is bounded by ``max_bytes`` alone. Defaults to none.
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    field_bytes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        values = [self.max_bytes, *self.field_bytes.values()]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise BadArgument(f"decode limits must be integers >= 0, got {self.max_bytes!r}, "
                              f"{dict(self.field_bytes)!r}")


@dataclass
class Record:
    """A decoded record: values by field name, their logical dtypes, and the JSON ``meta``.

    ``arrays`` hold numpy arrays of the stored bits (for ``bfloat16`` fields a ``uint16`` array,
    which :meth:`tensors` turns back into ``torch.bfloat16``), and Python ``str`` / ``bytes`` for
    text fields.
    """

    arrays: dict[str, Any] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> dict[str, Any]:
        """The fields as ``torch`` tensors (imports torch on first use); text stays ``str``/``bytes``."""
        import torch

        out = {}
        for name, arr in self.arrays.items():
            if self.dtypes[name] in TEXT_DTYPES:
                out[name] = arr
                continue
            tensor = torch.from_numpy(arr)
            if self.dtypes[name] == "bfloat16":
                tensor = tensor.view(torch.bfloat16)
            out[name] = tensor
        return out

    @property
    def nbytes(self) -> int:
        """The decoded size of every field (arrays' ``nbytes``, text fields' byte length)."""
        return sum(value_nbytes(v) for v in self.arrays.values())


def value_nbytes(value: Any) -> int:
    """The decoded size of one field value: an array's ``nbytes``, or a text value's byte length."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, bytes):
        return len(value)
    return int(value.nbytes)


def same_value(a: Any, b: Any) -> bool:
    """Bit-exact equality of two decoded field values (same dtype, shape and bytes; NaNs included)."""
    if isinstance(a, (str, bytes)) or isinstance(b, (str, bytes)):
        return type(a) is type(b) and a == b
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def as_numpy(value: Any) -> tuple[np.ndarray, str]:
    """Return ``(array, logical dtype name)`` for a numpy array, torch tensor, list or scalar.

    Raises:
        BadArgument: the dtype is not one the codec stores.
    """
    if hasattr(value, "detach") and hasattr(value, "dtype"):  # a torch.Tensor, without importing torch
        name = str(value.dtype).removeprefix("torch.")
        if name not in DTYPES:  # checked before .numpy(), which raises TypeError for e.g. float8
            raise BadArgument(f"dtype {value.dtype} is not storable; use one of {sorted(DTYPES)}")
        tensor = value.detach().cpu().contiguous()
        if name == "bfloat16":
            import torch

            return tensor.view(torch.int16).numpy().view("<u2"), name
        arr = tensor.numpy()
    else:
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as exc:  # ragged nested lists, unconvertible objects
            raise BadArgument(f"value is not an array: {exc}") from None
    name = _NAME_OF.get((arr.dtype.kind, arr.dtype.itemsize))  # dtype.name is slow
    if name is None:
        raise BadArgument(f"dtype {arr.dtype} is not storable; use one of {sorted(DTYPES)}")
    # Not np.ascontiguousarray: it turns 0-d scalars into shape (1,).
    return np.asarray(arr, dtype=DTYPES[name], order="C"), name


def _narrowest(lo: int, hi: int, itemsize: int) -> str | None:
    """The smallest integer dtype holding ``[lo, hi]``, if it is narrower than ``itemsize`` bytes."""
    for name, low, high, size in _NARROW_RANGES:
        if low <= lo and hi <= high:
            return name if size < itemsize else None
    return None


def encode_field(arr: np.ndarray, dtype: str, compress: bool) -> tuple[list[str], np.ndarray]:
    """The field's transforms and stored bytes as a flat uint8 array (``b"".join`` takes it as is)."""
    transforms: list[str] = []
    data = arr.reshape(-1)
    if dtype == "bool":
        return ["bitpack"], np.packbits(data.view(np.uint8))
    if compress and data.dtype.kind in "iu" and dtype != "bfloat16" and data.size:
        lo, hi = int(data.min()), int(data.max())
        narrow = _narrowest(lo, hi, data.dtype.itemsize)
        if narrow is not None and lo >= 0 and hi <= 1:  # 0/1 masks stored wider than a byte
            return ["bitpack"], np.packbits(data.astype(np.uint8))
        if narrow is not None:
            transforms.append(f"narrow:{narrow}")
            data = data.astype(DTYPES[narrow])
    if compress and data.dtype.itemsize > 1:
        transforms.append("shuffle")
        data = data.view(np.uint8).reshape(-1, data.dtype.itemsize).T
    return transforms, np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def _text_bytes(value: Any, dtype: str, name: str) -> bytes:
    """A text field's stored bytes: UTF-8 for ``str``, the value itself for ``bytes``."""
    if not isinstance(value, (str,) if dtype == "str" else (bytes, bytearray, memoryview)):
        raise BadArgument(f"field {name!r} of dtype {dtype} needs a {_TEXT_TYPE[dtype].__name__}, "
                          f"got {type(value).__name__}")
    if dtype == "bytes":
        return bytes(value)
    try:
        return str(value).encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates have no UTF-8 form
        raise BadArgument(f"field {name!r} is not encodable as UTF-8: {exc}") from None


def encode(fields: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None,
           level: int = DEFAULT_LEVEL, *, dtypes: Mapping[str, str] | None = None) -> bytes:
    """Encode named arrays (numpy, torch or array-likes), text and a JSON-able ``meta`` as one record.

    Args:
        fields: field name -> array, or a ``str`` / ``bytes`` (a text field). Any array shape,
            including empty; order is preserved.
        meta: a JSON-serialisable dict stored in the header. Defaults to ``{}``.
        level: zstd level (0..22) for the body; ``0`` stores it uncompressed (and skips every
            transform but bool bit-packing). Defaults to 1: on GRPO rollout rows level 3 stores
            under 1% fewer bytes and encodes 20-40% slower (``python -m benchmarks.codec_bench``).
        dtypes: field name -> logical dtype, for values whose dtype cannot be told from the value:
            a ``uint16`` array of ``bfloat16`` bits. The array must already hold the dtype's stored
            form (:data:`DTYPES`). Defaults to inferring every dtype.

    Raises:
        BadArgument: unstorable dtype, non-string field name, bad level or non-JSON ``meta``.
    """
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= MAX_LEVEL:
        raise BadArgument(f"level must be an int from 0 (uncompressed) to {MAX_LEVEL}, got {level!r}")
    specs, chunks = [], []
    for name, value in (fields or {}).items():
        if not isinstance(name, str):
            raise BadArgument(f"field names must be str, got {name!r}")
        declared = (dtypes or {}).get(name)
        if declared is None and isinstance(value, (str, bytes)):
            declared = "str" if isinstance(value, str) else "bytes"
        if declared in TEXT_DTYPES:
            data = _text_bytes(value, declared, name)
            specs.append([name, declared, [], [], len(data)])
            chunks.append(data)
            continue
        arr, dtype = as_numpy(value)
        if declared is not None:
            if declared not in DTYPES or arr.dtype != DTYPES[declared]:
                raise BadArgument(f"field {name!r} holds {arr.dtype} values, not the stored form of {declared!r}")
            dtype = declared
        transforms, data = encode_field(arr, dtype, level > 0)
        specs.append([name, dtype, list(arr.shape), transforms, data.nbytes])
        chunks.append(data)
    body = b"".join(chunks)
    raw_len = len(body)
    level = level if raw_len else 0  # an empty body is never compressed
    if level:
        body = _compressor(level).compress(body)
    return _sealed(level, raw_len, meta, specs, body)


def encode_stored(fields: Iterable[tuple[str, str, np.ndarray]], meta_json: str) -> bytes:
    """``encode(fields, meta, level=0, dtypes=...)`` of arrays already in their dtype's stored form
    (numpy arrays of :data:`DTYPES` ``[dtype]``, as :func:`decode` returns them), with ``meta``
    given as its JSON text (:func:`json_text`): the same bytes, without :func:`encode`'s per-value
    conversion and checks and without a generic JSON pass over the header. For an owner that
    re-encodes slices of a record it has just verified (a progress message's sequences);
    ``tests/core/test_progress_step.py`` holds it byte-equal to :func:`encode`.

    Raises:
        BadArgument: an array that is not its dtype's stored form.
    """
    specs, chunks, raw = [], [], 0
    for name, dtype, arr in fields:
        want = DTYPES.get(dtype)
        if want is None or arr.dtype != want:
            raise BadArgument(f"field {name!r} holds {arr.dtype} values, not the stored form of {dtype!r}")
        if dtype == "bool":
            data: Any = np.packbits(arr.reshape(-1).view(np.uint8))
            transforms = '["bitpack"]'
        else:
            data, transforms = np.ascontiguousarray(arr).data.cast("B"), "[]"
        shape = str(arr.shape[0]) if arr.ndim == 1 else ",".join(map(str, arr.shape))
        nbytes = data.nbytes
        raw += nbytes
        specs.append(f'[{_name_json(name)},"{dtype}",[{shape}],{transforms},{nbytes}]')
        chunks.append(data)
    header = f'{{"z":0,"raw":{raw},"meta":{meta_json},"fields":[{",".join(specs)}]}}'.encode()
    crc = zlib.crc32(header, zlib.crc32(_HEADER_LEN.pack(len(header))))
    for data in chunks:  # the checksum of header and body, without first joining them
        crc = zlib.crc32(data, crc)
    return b"".join((_MAGIC_CRC.pack(MAGIC, crc), _HEADER_LEN.pack(len(header)), header, *chunks))


#: The prefix of every record: the magic, then the crc32 of the rest; then the header's length.
_MAGIC_CRC = struct.Struct("<4sI")
_HEADER_LEN = struct.Struct("<I")


@functools.lru_cache(maxsize=1024)
def _name_json(name: str) -> str:
    """A field name as a header's JSON holds it (the same few names, record after record)."""
    return _HEADER_ENCODER.encode(name)


def json_text(value: Any) -> str:
    """The JSON text a record's header holds for ``value`` (a meta dict, or a part of one to build
    :func:`encode_stored`'s ``meta_json`` from).

    Raises:
        BadArgument: ``value`` is not JSON-serialisable.
    """
    try:
        return _HEADER_ENCODER.encode(value)
    except (TypeError, ValueError) as exc:
        raise BadArgument(f"record meta is not JSON-serialisable: {exc}") from None


#: One encoder for every header (``json.dumps`` with keywords builds a new one per call).
_HEADER_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def _sealed(level: int, raw_len: int, meta: Mapping[str, Any] | None, specs: list, body: bytes) -> bytes:
    """The record: prefix, checksum, header and ``body`` (already compressed at ``level``)."""
    try:
        header = _HEADER_ENCODER.encode({"z": level, "raw": raw_len, "meta": dict(meta or {}),
                                         "fields": specs}).encode()
    except (TypeError, ValueError) as exc:
        raise BadArgument(f"record meta is not JSON-serialisable: {exc}") from None
    tail = struct.pack("<I", len(header)) + header + body
    return struct.pack("<4sI", MAGIC, zlib.crc32(tail)) + tail


def encode_json(meta: Mapping[str, Any]) -> bytes:
    """Encode a JSON-only record (metadata, ledger entries, cursors): ``encode(None, meta, level=0)``.

    Raises:
        BadArgument: ``meta`` is not JSON-serialisable.
    """
    return _sealed(0, 0, meta, [], b"")


def _checked_header_bytes(buf: memoryview, key: str) -> bytes:
    """The header's JSON bytes, after the magic, the checksum and the header length are checked."""
    if len(buf) < _PREFIX.size:
        raise CorruptRecord(key, f"value of {len(buf)} bytes is shorter than the record prefix")
    magic, crc, hlen = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptRecord(key, f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if zlib.crc32(buf[8:]) != crc:
        raise CorruptRecord(key, "checksum mismatch")
    if hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen > len(buf):
        raise CorruptRecord(key, f"header length {hlen} exceeds the value")
    return bytes(buf[_PREFIX.size:_PREFIX.size + hlen])


#: The start of every header :func:`encode` writes; ``"meta"`` follows it.
_HEADER_START = re.compile(rb'\{"z":\d{1,2},"raw":\d{1,20},')


def has_meta(value: bytes | memoryview, meta: Mapping[str, Any], key: str = "?") -> bool:
    """Verify a record's checksum and tell whether its ``meta`` is exactly ``meta``.

    Nothing is decompressed. For a header laid out as :func:`encode` writes it the meta bytes
    are compared directly (no JSON parse); any other header is parsed.

    Raises:
        CorruptRecord: bad magic, checksum or header, naming ``key``.
    """
    raw = _checked_header_bytes(memoryview(value), key)
    start = _HEADER_START.match(raw)
    needle = b'"meta":' + json.dumps(dict(meta), separators=(",", ":")).encode() + b","
    if start is not None and raw.startswith(needle, start.end()):
        return True
    return _header_json(raw, key)["meta"] == dict(meta)


def meta_begins(value: bytes | memoryview, prefix_json: str, key: str = "?") -> bool:
    """Verify a record's checksum and tell whether its header, laid out as :func:`encode` writes it,
    holds a meta whose JSON text begins with ``prefix_json`` (compared as bytes, no JSON parse).
    ``False`` for a header laid out otherwise too: the caller then parses it (:func:`decode_meta`).

    Raises:
        CorruptRecord: bad magic, checksum or header, naming ``key``.
    """
    raw = _checked_header_bytes(memoryview(value), key)
    start = _HEADER_START.match(raw)
    return start is not None and raw.startswith(b'"meta":' + prefix_json.encode(), start.end())


def _parse_header(buf: memoryview, key: str) -> tuple[dict, int]:
    raw = _checked_header_bytes(buf, key)
    return _header_json(raw, key), _PREFIX.size + len(raw)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: One decoder for every header (``json.loads`` with a keyword builds a new one per call).
_HEADER_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _header_json(raw: bytes, key: str) -> dict:
    try:
        text = str(raw, "utf-8")  # the format's headers are UTF-8
        try:  # the headers encode() writes: no surrounding whitespace, so no regex pass around the parse
            header, end = _HEADER_DECODER.raw_decode(text)
        except (ValueError, RecursionError):
            end = -1
        if end != len(text):  # anything else: decode() accepts or refuses it, with its message
            header = _HEADER_DECODER.decode(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: also a >4300-digit int
        raise CorruptRecord(key, f"header is not JSON: {str(exc)[:200]}") from None
    if not isinstance(header, dict) or not isinstance(header.get("meta"), dict) \
            or not isinstance(header.get("fields"), list):
        raise CorruptRecord(key, "header lacks meta/fields")
    return header


def decode_meta(value: bytes | memoryview, key: str = "?") -> dict[str, Any]:
    """Verify a record and return only its JSON ``meta`` (fields are not decompressed)."""
    header, _ = _parse_header(memoryview(value), key)
    return header["meta"]


class FieldSpec(NamedTuple):
    """One field entry of a header, checked: its stored and its decoded sizes are consistent
    (``nbytes`` stored, ``count`` elements, ``decoded`` bytes the decoded value takes)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    transforms: tuple[str, ...]
    nbytes: int
    count: int
    decoded: int


class Checked(NamedTuple):
    """A record :meth:`RecordRules.check` verified: its JSON ``meta``, its field entries in record
    order and ``nbytes``, what all of them decode to (the sum of their ``decoded``)."""

    meta: dict[str, Any]
    fields: list[FieldSpec]
    nbytes: int

    def record(self) -> Record:
        """The :class:`Record` :func:`describe` returns for this record (shapes and sizes, no arrays)."""
        return _record_of(self.meta, self.fields)


#: Builds a :class:`FieldSpec` from a tuple of its values without the Python-level ``__new__`` a
#: NamedTuple's constructor adds (this runs for every field of every row a store's owner checks).
_new_spec = tuple.__new__
#: A field's rule as the reader holds it: its dtype, its number of dims (``None``: any), the
#: ``(index, extent)`` dims it fixes, and :data:`_SIZES` of its dtype.
_Rule = tuple[str, int | None, tuple[tuple[int, int], ...], dict[tuple[str, ...], int]]


def _check_specs(header: dict, raw: int, limits: Limits, key: str, rules: Mapping[str, _Rule] | None,
                 ) -> list[FieldSpec]:
    """Every field entry checked, without touching the body: against the format's rules (with
    ``rules=None``), or against its field's rule in ``rules``, which stands for the format's dtype
    and transform checks and also fixes the field's dtype and shape; and what the fields decode to
    held against ``limits``, before any decompression or allocation. One loop, no call per field:
    this runs for every row a store's owner checks."""
    specs, names, pos, total = [], set(), 0, 0
    caps, max_bytes = limits.field_bytes, limits.max_bytes
    for entry in header["fields"]:
        if type(entry) is not list or len(entry) != 5:
            raise CorruptRecord(key, f"malformed field spec {str(entry)[:200]}")
        name, dtype, shape, transforms, nbytes = entry
        if rules is None:
            if type(name) is not str or type(dtype) is not str or dtype not in _SIZES:
                raise CorruptRecord(key, f"field {str(name)[:100]!r} has unknown dtype {str(dtype)[:100]!r}")
            ndim, fixed, sizes = None, (), _SIZES[dtype]
        else:
            rule = rules.get(name) if type(name) is str else None
            if rule is None:
                raise CorruptRecord(key, f"field {str(name)[:100]!r} is not one the rules name")
            want, ndim, fixed, sizes = rule
            if dtype != want:
                raise CorruptRecord(key, f"field {name!r} is stored as {str(dtype)[:100]}, the rules say {want}")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise CorruptRecord(key, f"field {name!r} has invalid shape {str(shape)[:200]}")
        count = extent = 1
        for dim in shape:
            if type(dim) is not int or not 0 <= dim < 1 << 40:
                raise CorruptRecord(key, f"field {name!r} has invalid shape {str(shape)[:200]}")
            count *= dim
            extent *= dim or 1
        if ndim is not None and len(shape) != ndim:
            raise CorruptRecord(key, f"field {name!r} has shape {shape}, the rules say {ndim} dims")
        for i, want_dim in fixed:
            if shape[i] != want_dim:
                raise CorruptRecord(key, f"field {name!r} has shape {shape}, the rules fix dim {i} at {want_dim}")
        try:
            steps = tuple(transforms) if type(transforms) is list else None
            stored = sizes.get(steps)
        except TypeError:  # an unhashable element (a list, a dict): no transform the encoder writes
            stored = None
        if stored is None:
            raise CorruptRecord(key, f"field {name!r} of {dtype} has invalid transforms {str(transforms)[:200]}")
        if type(nbytes) is not int or nbytes < 0:
            raise CorruptRecord(key, f"field {name!r} has invalid length {str(nbytes)[:100]}")
        if dtype in TEXT_DTYPES:
            if shape:
                raise CorruptRecord(key, f"text field {name!r} has shape {shape}; text fields are 0-d")
            decoded = nbytes
            spec = _new_spec(FieldSpec, (name, dtype, (), (), nbytes, 1, nbytes))
        else:
            if stored == 0:  # bit-packed
                if nbytes != (count + 7) // 8:
                    raise CorruptRecord(key, f"field {name!r}: {nbytes} packed bytes for {count} values")
            elif nbytes != count * stored:
                raise CorruptRecord(key, f"field {name!r}: {nbytes} bytes for shape {tuple(shape)} of "
                                         f"{stored}-byte stored values")
            if extent >= MAX_EXTENT:  # an empty array numpy cannot even describe
                raise CorruptRecord(key, f"field {name!r}: shape {shape} spans {extent} elements, over 2**48")
            decoded = count * _ITEMSIZE[dtype]
            spec = _new_spec(FieldSpec, (name, dtype, tuple(shape), steps, nbytes, count, decoded))
        if name in names:
            raise CorruptRecord(key, f"field {name!r} appears twice")
        names.add(name)
        pos += nbytes
        if pos > raw:
            raise CorruptRecord(key, f"field {name!r} runs past the body")
        cap = caps.get(name)
        if cap is not None and decoded > cap:
            raise CorruptRecord(key, f"field {name!r} would decode to {decoded} bytes "
                                     f"(shape {list(spec.shape)} of {dtype}), over its limit of {cap}")
        total += decoded
        if total > max_bytes:
            raise CorruptRecord(key, f"fields up to {name!r} would decode to {total} bytes, over the "
                                     f"limit of {max_bytes}")
        specs.append(spec)
    if pos != raw:
        raise CorruptRecord(key, f"{raw - pos} trailing body bytes")
    return specs


def _decode_field(data: memoryview, spec: FieldSpec, key: str) -> Any:
    """One field's value from its (already size-checked) bytes; the value owns its memory."""
    if spec.dtype == "bytes":
        return bytes(data)
    if spec.dtype == "str":
        try:
            return str(data, "utf-8")
        except UnicodeDecodeError as exc:
            raise CorruptRecord(key, f"text field {spec.name!r} is not UTF-8: {exc}") from None
    target = DTYPES[spec.dtype]
    stored = target
    for t in spec.transforms:
        if t.startswith("narrow:"):
            stored = DTYPES[t.split(":", 1)[1]]
    if "bitpack" in spec.transforms:
        bits = np.unpackbits(np.frombuffer(data, np.uint8), count=spec.count)  # a new array, 0/1 uint8
        arr = bits.view(np.bool_) if spec.dtype == "bool" else bits.astype(target)
        return arr.reshape(spec.shape)
    # ``data`` may alias the caller's buffer (an LMDB page); exactly one copy makes the array own it.
    arr = np.frombuffer(data, np.uint8)
    if "shuffle" in spec.transforms:
        arr = arr.reshape(stored.itemsize, spec.count).T.copy().view(stored)  # C-order copy, even if count <= 1
        if stored != target:
            arr = arr.astype(target)
    else:
        arr = arr.view(stored).astype(target)  # astype always copies
    return arr.reshape(spec.shape)


def decode(value: bytes | memoryview, key: str = "?", *, limits: Limits | None = None) -> Record:
    """Verify and decode a record into a :class:`Record`.

    Every field entry is checked, and the record's decoded size held against ``limits``, before
    the body is decompressed (capped at the header's ``raw``, never at what the zstd frame
    claims) or any array is allocated.

    Args:
        value: the stored bytes.
        key: ``table/key``, named in every error.
        limits: what the record may decode to. Defaults to ``Limits()`` (1 GiB in all); readers
            of rows pass the store schema's :meth:`~kvckpt.RowSchema.limits`.

    Raises:
        CorruptRecord: checksum mismatch, truncation, any header/length inconsistency, or a record
            larger than ``limits``; the message names ``key`` and the offending value.
    """
    header, specs, body = _verified_body(memoryview(value), key, Limits() if limits is None else limits, None)
    record = Record(meta=header["meta"])
    pos = 0
    for spec in specs:
        record.arrays[spec.name] = _decode_field(body[pos:pos + spec.nbytes], spec, key)
        record.dtypes[spec.name] = spec.dtype
        pos += spec.nbytes
    return record


def decode_views(value: bytes, key: str = "?", *, limits: Limits | None = None) -> Record:
    """:func:`decode` of an immutable ``bytes`` record that leaves its plain fields where they are:
    every check is :func:`decode`'s, but an uncompressed field with no transform comes back as a
    read-only numpy view into ``value`` (no copy; it keeps ``value`` alive), and any other field is
    decoded as :func:`decode` decodes it. For an owner that only slices a message it just received
    (:func:`kvckpt.storage.progress_message.decode_message`); never for an LMDB page, whose bytes
    are not the caller's to keep.

    Raises:
        BadArgument: ``value`` is not ``bytes`` (a mutable buffer could change under the views).
        CorruptRecord: as :func:`decode`.
    """
    if type(value) is not bytes:
        raise BadArgument(f"decode_views needs an immutable bytes record, got {type(value).__name__}")
    buf = memoryview(value)
    header, specs, body = _verified_body(buf, key, Limits() if limits is None else limits, None)
    record = Record(meta=header["meta"])
    begins = len(value) - len(body) if header["z"] == 0 else None  # where the body lies in ``value``
    pos = 0
    for spec in specs:
        if begins is not None and not spec.transforms and spec.dtype not in TEXT_DTYPES:
            record.arrays[spec.name] = np.frombuffer(value, DTYPES[spec.dtype], spec.count,
                                                     begins + pos).reshape(spec.shape)
        else:
            record.arrays[spec.name] = _decode_field(body[pos:pos + spec.nbytes], spec, key)
        record.dtypes[spec.name] = spec.dtype
        pos += spec.nbytes
    return record


@dataclass(frozen=True)
class FieldInfo:
    """What a record's header says of one field, checked against its bytes: ``shape``, ``nbytes``
    (decoded bytes; a text field's length, also its ``len()``)."""

    shape: tuple[int, ...]
    nbytes: int

    def __len__(self) -> int:
        return self.nbytes


def describe(value: bytes | memoryview, key: str = "?", *, limits: Limits | None = None) -> Record:
    """Verify a record as :func:`decode` does, without building its arrays: a :class:`Record`
    whose ``arrays`` are :class:`FieldInfo` (shape and size) and whose ``dtypes`` and ``meta`` are
    the header's.

    What :func:`decode` would refuse, this refuses too (checksum, header, sizes against
    ``limits``, a body that does not decompress to the header's length, text that is not UTF-8),
    so a record that passes will decode. The cost is the checksum and one bounded decompression.
    For records of one known layout (a store's rows), :class:`RecordRules` checks the same and the
    layout in one pass.

    Raises:
        CorruptRecord: as :func:`decode`.
    """
    limits = Limits() if limits is None else limits
    return _described(*_verified_body(memoryview(value), key, limits, None), key)


def _described(header: dict, specs: list[FieldSpec], body: memoryview, key: str) -> Record:
    _check_text(specs, body, key)
    return _record_of(header["meta"], specs)


def _check_text(specs: list[FieldSpec], body: memoryview, key: str) -> None:
    """Refuse a ``str`` field whose bytes are not UTF-8 (what :func:`decode` would refuse)."""
    pos = 0
    for spec in specs:
        if spec.dtype == "str":
            _decode_field(body[pos:pos + spec.nbytes], spec, key)  # UTF-8 or CorruptRecord
        pos += spec.nbytes


def _record_of(meta: dict[str, Any], specs: list[FieldSpec]) -> Record:
    """:func:`describe`'s result from checked field entries."""
    record = Record(meta=meta)
    for spec in specs:
        record.arrays[spec.name] = FieldInfo(spec.shape, spec.decoded)
        record.dtypes[spec.name] = spec.dtype
    return record


@dataclass(frozen=True)
class FieldRule:
    """What one field of a record must be (for :class:`RecordRules`): its logical ``dtype``, its
    ``shape`` (``None``: any shape; a ``None`` dimension: any extent) and the most bytes its value
    may decode to."""

    dtype: str
    shape: tuple[int | None, ...] | None
    max_bytes: int


class RecordRules:
    """A record layout compiled once (per store): the fields a record may hold and what each must be.

    :meth:`describe` verifies a record exactly as :func:`describe` does with :class:`Limits` of the
    rules' caps (checksum, header, every length, a bounded decompression, UTF-8 text), and in the
    same pass over the header refuses a field the rules do not name, a dtype or shape other than
    its rule's, and a ``required`` field that is missing. The per-field work is one dict look-up
    and a few comparisons: the generic format checks (dtype known, transforms allowed) are
    answered by the field's rule, which was checked when the rules were built.

    Args:
        fields: field name -> :class:`FieldRule`.
        required: names every record must hold. Defaults to none.

    Raises:
        BadArgument: a rule of unknown dtype, a shape that is not a tuple of ints and ``None``, or
            a negative size.
    """

    def __init__(self, fields: Mapping[str, FieldRule], required: Iterable[str] = ()) -> None:
        self._fields: dict[str, _Rule] = {}
        for name, rule in fields.items():
            if rule.dtype not in DTYPES and rule.dtype not in TEXT_DTYPES:
                raise BadArgument(f"field rule {name!r} has unknown dtype {rule.dtype!r}")
            if rule.shape is not None and not (isinstance(rule.shape, tuple) and len(rule.shape) <= MAX_NDIM and all(
                    d is None or (type(d) is int and 0 <= d < 1 << 40) for d in rule.shape)):
                raise BadArgument(f"field rule {name!r} has invalid shape {rule.shape!r}")
            fixed = tuple((i, d) for i, d in enumerate(rule.shape or ()) if d is not None)
            ndim = None if rule.shape is None else len(rule.shape)
            self._fields[name] = (rule.dtype, ndim, fixed, _SIZES[rule.dtype])
        self.limits = Limits(max_bytes=sum(rule.max_bytes for rule in fields.values()),
                             field_bytes={name: rule.max_bytes for name, rule in fields.items()})
        self.required = frozenset(required)
        unknown = self.required - set(fields)
        if unknown:
            raise BadArgument(f"required fields {sorted(unknown)} have no rule")
        self._text = any(rule.dtype == "str" for rule in fields.values())  # fields whose UTF-8 is checked

    def describe(self, value: bytes | memoryview, key: str = "?") -> Record:
        """Verify a record against the rules; what :func:`describe` returns.

        Raises:
            CorruptRecord: what :func:`describe` refuses, and any field the rules refuse, naming
                ``key`` and the field.
        """
        return self.check(value, key).record()

    def check(self, value: bytes | memoryview, key: str = "?") -> Checked:
        """Verify a record against the rules exactly as :meth:`describe` does, and return what the
        check read (meta, field entries, decoded size) without building a :class:`Record`.

        Raises:
            CorruptRecord: as :meth:`describe`.
        """
        header, specs, body = _verified_body(memoryview(value), key, self.limits, self._fields)
        missing = self.required.difference([spec.name for spec in specs])
        if missing:
            raise CorruptRecord(key, f"required field {sorted(missing)[0]!r} is missing")
        if self._text:
            _check_text(specs, body, key)
        return Checked(header["meta"], specs, sum([spec.decoded for spec in specs]))


def _verified_body(buf: memoryview, key: str, limits: Limits, rules: Mapping[str, _Rule] | None,
                   ) -> tuple[dict, list[FieldSpec], memoryview]:
    """The checked header, its field specs (against ``rules`` when given, see :func:`_check_specs`)
    and the (decompressed) body of exactly ``raw`` bytes."""
    header, offset = _parse_header(buf, key)
    raw = header.get("raw")
    level = header.get("z")
    if type(raw) is not int or not 0 <= raw <= MAX_BODY_BYTES or type(level) is not int:
        raise CorruptRecord(key, f"header has invalid body length or level (raw {str(raw)[:100]}, "
                                 f"z {str(level)[:100]})")
    if level < 0 or level > MAX_LEVEL:
        raise CorruptRecord(key, f"header has invalid level {level}")
    body = buf[offset:]
    compressed = level > 0 and (raw or len(body))
    if not compressed and len(body) != raw:
        raise CorruptRecord(key, f"body is {len(body)} bytes, header says {raw}")
    specs = _check_specs(header, raw, limits, key, rules)
    if compressed:
        try:
            declared = zstandard.frame_content_size(body)
            if declared != raw:  # also refuses frames without a size: no unbounded allocation
                raise CorruptRecord(key, f"zstd frame declares {declared} bytes, header says {raw}")
            body = memoryview(_decompressor().decompress(body, max_output_size=raw,
                                                         allow_extra_data=False))
        except zstandard.ZstdError as exc:
            raise CorruptRecord(key, f"zstd frame does not decompress: {exc}") from None
    if len(body) != raw:
        raise CorruptRecord(key, f"body is {len(body)} bytes, header says {raw}")
    return header, specs, body
