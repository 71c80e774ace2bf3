"""The record codec: round trips, exact bytes, and refusal of every damaged or crafted record."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
import zstandard
from _codec_bytes import body_of, header_of, seal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvckpt.errors import BadArgument, CorruptRecord
from kvckpt.storage import codec
from kvckpt.storage.codec import DTYPES, Record, as_numpy, decode, decode_meta, encode, encode_json

LEVELS = [0, 1, 3, 19]
NUMPY_DTYPES = [name for name in DTYPES if name != "bfloat16"]  # numpy has no bfloat16
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


# -- helpers -------------------------------------------------------------------------------------
def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact equality (NaN payloads and -0.0 included), same dtype and shape."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def sample_array(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    np_dtype = DTYPES[dtype]
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if np_dtype.kind == "f":
        return (rng.standard_normal(shape) * 100).astype(np_dtype)
    info = np.iinfo(np_dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=np_dtype, endpoint=True)


SMALL = {"ids": np.array([1, 2, 300], dtype=np.int64), "mask": np.array([True, False, True])}


# -- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (2, 3, 4)])
def test_numpy_round_trip_every_dtype_and_shape(dtype, shape, level):
    arr = sample_array(dtype, shape, seed=len(shape))
    rec = decode(encode({"x": arr}, level=level))
    assert rec.dtypes == {"x": dtype}
    assert same(rec.arrays["x"], arr)


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3)])
def test_torch_round_trip_every_dtype(dtype, shape, level):
    tdtype = TORCH_DTYPES[dtype]
    if dtype == "bool":
        tensor = torch.rand(shape) < 0.5
    elif tdtype.is_floating_point:
        tensor = (torch.randn(shape) * 50).to(tdtype)
    else:
        tensor = torch.from_numpy(sample_array(dtype, shape))
    rec = decode(encode({"t": tensor}, level=level))
    assert rec.dtypes == {"t": dtype}
    out = rec.tensors()["t"]
    assert out.dtype == tdtype and tuple(out.shape) == shape
    if dtype == "bfloat16":
        assert rec.arrays["t"].dtype == np.dtype("<u2")  # the raw bits
        assert torch.equal(out.view(torch.int16), tensor.view(torch.int16))
    else:
        assert same(out.numpy(), tensor.numpy())


def test_torch_non_contiguous_and_grad_inputs():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    src = {"t": base.T, "g": torch.ones(3, requires_grad=True), "s": base[:, ::2]}
    out = decode(encode(src)).tensors()
    assert torch.equal(out["t"], base.T) and out["t"].is_contiguous()
    assert torch.equal(out["g"], torch.ones(3)) and not out["g"].requires_grad
    assert torch.equal(out["s"], base[:, ::2])


def test_numpy_non_contiguous_and_big_endian_inputs():
    arr = np.arange(40, dtype=">i4").reshape(5, 8)[:, ::3]
    rec = decode(encode({"a": arr}))
    assert rec.dtypes["a"] == "int32" and rec.arrays["a"].dtype == np.dtype("<i4")
    assert np.array_equal(rec.arrays["a"], arr)


@pytest.mark.parametrize("level", [0, 1])
def test_scalars_stay_zero_dimensional(level):
    src = {"f": np.float32(1.5), "i": np.int64(-3), "b": np.bool_(True), "t": torch.tensor(7),
           "py_int": 5, "py_float": 2.5, "py_bool": False}
    rec = decode(encode(src, level=level))
    for name, value in rec.arrays.items():
        assert value.shape == (), name
    assert rec.arrays["f"] == np.float32(1.5) and rec.arrays["i"] == -3 and rec.arrays["t"] == 7
    assert rec.dtypes["py_int"] == "int64" and rec.dtypes["py_float"] == "float64"
    assert rec.dtypes["py_bool"] == "bool" and not rec.arrays["py_bool"]


@pytest.mark.parametrize("level", LEVELS)
def test_empty_fields_and_empty_records(level):
    only_empty = {"e": np.zeros(0, np.float32), "f": np.zeros((0, 3), np.int64), "b": np.zeros(0, bool)}
    rec = decode(encode(only_empty, level=level))
    for name, arr in only_empty.items():
        assert same(rec.arrays[name], arr)
    assert header_of(encode(only_empty, level=level))["z"] == 0  # an empty body is never compressed
    assert decode(encode(level=level)) == Record()
    assert decode(encode({}, {"a": 1}, level=level)).meta == {"a": 1}


@pytest.mark.parametrize("level", [0, 1, 3])
def test_jagged_rows_round_trip(level):
    """How the buffer stores a group: one record per row, each row its own (unpadded) length."""
    rng = np.random.default_rng(1)
    rows = []
    for i, length in enumerate([0, 1, 17, 300, 4096]):
        rows.append({
            "input_ids": rng.integers(0, 151_936, length),
            "generation_logprobs": -rng.exponential(0.5, length).astype(np.float32),
            "token_mask": (np.arange(length) >= length // 3).astype(np.int64),
            "total_reward": np.float32(i),
            "input_lengths": np.int64(length),
        })
    for row in rows:
        rec = decode(encode(row, {"row": 1}, level=level))
        assert list(rec.arrays) == list(row)
        for name, value in row.items():
            assert same(rec.arrays[name], np.asarray(value)), name
    lists = decode(encode({"ids": [1, 2, 3], "lp": [-0.5, -1.0], "nested": [[1, 2], [3, 4]]}))
    assert lists.arrays["ids"].tolist() == [1, 2, 3] and lists.dtypes["lp"] == "float64"
    assert lists.arrays["nested"].shape == (2, 2)


def test_integer_extremes_round_trip():
    for dtype in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
        info = np.iinfo(DTYPES[dtype])
        for values in ([info.min, info.max], [0, 1], [info.min], [info.max, info.max], [0, 255, 256]):
            arr = np.array([v for v in values if info.min <= v <= info.max], dtype=DTYPES[dtype])
            for level in (0, 1):
                assert same(decode(encode({"a": arr}, level=level)).arrays["a"], arr), (dtype, values)


def test_float_specials_are_bit_exact():
    arr = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, np.finfo(np.float32).max],
                   dtype=np.float32)
    arr = np.concatenate([arr, np.array([0x7FC00001], np.uint32).view(np.float32)])  # NaN payload
    for level in (0, 1):
        assert same(decode(encode({"a": arr}, level=level)).arrays["a"], arr)


def test_meta_round_trip_and_decode_meta():
    meta = {"group_id": "g-7", "unicode": "ναι ✓", "nested": {"a": [1, 2.5, None, True]}, "n": 2**62}
    value = encode(SMALL, meta)
    assert decode(value).meta == meta
    assert decode_meta(value, "k") == meta
    assert decode_meta(encode_json(meta)) == meta
    assert decode(encode_json(meta)).arrays == {}


def test_field_order_is_preserved():
    first = {"b": np.zeros(2), "a": np.ones(3), "c": np.arange(4)}
    second = {"a": np.ones(3), "c": np.arange(4), "b": np.zeros(2)}
    assert list(decode(encode(first)).arrays) == ["b", "a", "c"]
    assert list(decode(encode(second)).arrays) == ["a", "c", "b"]
    assert [f[0] for f in header_of(encode(first))["fields"]] == ["b", "a", "c"]
    assert encode(first) != encode(second)  # order is part of the bytes


@pytest.mark.parametrize("level", [0, 1])
def test_decoded_arrays_own_their_memory(level):
    src = {"f": np.arange(64, dtype=np.float32), "i": np.arange(64, dtype=np.int64),
           "u": np.arange(64, dtype=np.uint8), "b": np.ones(9, bool), "s": np.float64(2.0),
           "m": np.tile([0, 1], 8)}
    buf = bytearray(encode(src, level=level))
    rec = decode(memoryview(buf))
    whole = np.frombuffer(buf, np.uint8)
    for name, arr in rec.arrays.items():
        assert arr.flags.writeable, name
        assert arr.flags.c_contiguous, name
        assert not np.shares_memory(arr, whole), name
    buf[:] = bytes(len(buf))  # the input buffer (an LMDB page, say) is reused
    for name, arr in rec.arrays.items():
        assert same(arr, np.asarray(src[name])), name
    rec.arrays["f"][0] = 42.0  # and the arrays may be written
    tensors = rec.tensors()
    assert tensors["f"][0] == 42.0


def test_decode_accepts_bytes_bytearray_memoryview():
    value = encode(SMALL)
    for form in (value, bytearray(value), memoryview(value)):
        assert same(decode(form).arrays["ids"], SMALL["ids"])


# -- exact bytes ---------------------------------------------------------------------------------
GOLDEN = bytes.fromhex(
    "4b565231fbf0aca5690000007b227a223a302c22726177223a32352c226d657461223a7b2273746570223a377d2c2266"
    "69656c6473223a5b5b22696473222c22696e743634222c5b335d2c5b5d2c32345d2c5b226d61736b222c22626f6f6c22"
    "2c5b335d2c5b226269747061636b225d2c315d5d7d010000000000000002000000000000002c01000000000000a0"
)


def test_golden_bytes_level0():
    value = encode(SMALL, {"step": 7}, level=0)
    header = (b'{"z":0,"raw":25,"meta":{"step":7},"fields":[["ids","int64",[3],[],24],'
              b'["mask","bool",[3],["bitpack"],1]]}')
    body = struct.pack("<3q", 1, 2, 300) + b"\xa0"  # bits 1,0,1 in np.packbits (MSB-first) order
    tail = struct.pack("<I", len(header)) + header + body
    assert value == b"KVR1" + struct.pack("<I", zlib.crc32(tail)) + tail
    assert value == GOLDEN
    rec = decode(GOLDEN)
    assert same(rec.arrays["ids"], SMALL["ids"]) and same(rec.arrays["mask"], SMALL["mask"])


def test_golden_transforms_level1():
    """The transformed body (before zstd) is fixed by the format; zstd's own bytes may vary by version."""
    value = encode({"ids": np.array([1, 2, 300], dtype=np.int64), "m": np.array([0, 1, 1, 0, 1, 1, 1, 1, 1]),
                    "lp": np.array([-0.5, 0.0], dtype=np.float32), "b16": torch.tensor([1.0], dtype=torch.bfloat16),
                    "u": np.array([5, 250], dtype=np.int32), "neg": np.array([-1, 100], dtype=np.int64)}, level=1)
    header = header_of(value)
    assert header["z"] == 1
    assert header["fields"] == [
        ["ids", "int64", [3], ["narrow:uint16", "shuffle"], 6],
        ["m", "int64", [9], ["bitpack"], 2],
        ["lp", "float32", [2], ["shuffle"], 8],
        ["b16", "bfloat16", [1], ["shuffle"], 2],
        ["u", "int32", [2], ["narrow:uint8"], 2],
        ["neg", "int64", [2], ["narrow:int8"], 2],
    ]
    assert header["raw"] == 22
    assert body_of(value) == (
        bytes([1, 2, 0x2C, 0, 0, 1])                # uint16 LE 1, 2, 300 as byte planes: lows, highs
        + bytes([0b01101111, 0b10000000])           # 9 bits, MSB first, zero-padded
        + bytes([0, 0, 0, 0, 0, 0, 0xBF, 0])        # -0.5 = 0xBF000000, 0.0: planes 0,1,2,3
        + bytes([0x80, 0x3F])                       # bfloat16 1.0 = 0x3F80
        + bytes([5, 250]) + bytes([0xFF, 100])
    )


def test_level0_stores_plain_little_endian_bytes():
    arr = np.arange(5, dtype=np.int64)
    value = encode({"a": arr, "f": np.float32([1.0])}, level=0)
    assert header_of(value)["fields"] == [["a", "int64", [5], [], 40], ["f", "float32", [1], [], 4]]
    assert body_of(value) == arr.astype("<i8").tobytes() + np.float32([1.0]).tobytes()


def test_unrepresentable_range_is_not_narrowed():
    value = encode({"a": np.array([0, 2**63 - 1]), "u": np.array([2**64 - 1], np.uint64),
                    "s": np.array([-200, 200], np.int16)}, level=1)
    assert [f[3] for f in header_of(value)["fields"]] == [["shuffle"], ["shuffle"], ["shuffle"]]


# -- property tests ------------------------------------------------------------------------------
any_array = st.sampled_from(NUMPY_DTYPES).flatmap(
    lambda name: hnp.arrays(DTYPES[name], hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays=st.lists(any_array, min_size=0, max_size=4))
def test_property_round_trip_level0(arrays):
    fields = {f"f{i}": arr for i, arr in enumerate(arrays)}
    rec = decode(encode(fields, level=0))
    assert list(rec.arrays) == list(fields)
    for name, arr in fields.items():
        assert same(rec.arrays[name], arr.astype(arr.dtype.newbyteorder("<")))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays=st.lists(any_array, min_size=0, max_size=4), level=st.integers(1, 9))
def test_property_round_trip_compressed(arrays, level):
    fields = {f"f{i}": arr for i, arr in enumerate(arrays)}
    rec = decode(encode(fields, level=level))
    for name, arr in fields.items():
        assert same(rec.arrays[name], arr.astype(arr.dtype.newbyteorder("<")))


@settings(max_examples=200, deadline=None)
@given(arr=any_array, level=st.sampled_from([0, 1]), data=st.data())
def test_property_random_flip_is_detected(arr, level, data):
    value = bytearray(encode({"a": arr}, {"m": 1}, level=level))
    pos = data.draw(st.integers(0, len(value) - 1))
    value[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptRecord) as info:
        decode(bytes(value), "rows/k")
    assert info.value.key == "rows/k"


# -- damage --------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", [0, 1])
def test_every_single_byte_flip_is_detected(level):
    value = encode({"ids": np.arange(6), "lp": np.float32([-0.25, -3.0]), "b": np.ones(3, bool)},
                   {"g": "x"}, level=level)
    for pos in range(len(value)):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(value)
            damaged[pos] ^= mask
            with pytest.raises(CorruptRecord) as info:
                decode(bytes(damaged), "rows/g_0")
            assert info.value.key == "rows/g_0" and "rows/g_0" in str(info.value)
            with pytest.raises(CorruptRecord):
                decode_meta(bytes(damaged), "rows/g_0")


@pytest.mark.parametrize("level", [0, 1])
def test_truncation_at_every_length_is_detected(level):
    value = encode({"ids": np.arange(40), "m": np.ones(5, bool)}, {"g": 1}, level=level)
    for n in range(len(value)):
        with pytest.raises(CorruptRecord, match="groups/a"):
            decode(value[:n], "groups/a")


@pytest.mark.parametrize("garbage", [b"\x00", b"garbage", bytes(4096)])
def test_appended_garbage_is_detected(garbage):
    with pytest.raises(CorruptRecord, match="checksum"):
        decode(encode(SMALL) + garbage, "k")


def test_bad_magic_is_detected():
    value = encode(SMALL)
    for magic in (b"KVR2", b"\x00\x00\x00\x00", b"PK\x03\x04", b"\x80\x04\x95\x00"):  # incl. pickle
        with pytest.raises(CorruptRecord, match="magic") as info:
            decode(magic + value[4:], "meta/format")
        assert info.value.key == "meta/format"


def test_short_and_empty_values():
    for value in (b"", b"KVR1", b"KVR1\x00\x00\x00\x00\x00\x00\x00"):
        with pytest.raises(CorruptRecord, match="shorter"):
            decode(value, "k")


# -- crafted records (valid checksum, invalid content): the reader rules ---------------------------
def field_header(fields, raw, z=0, meta=None):
    return {"z": z, "raw": raw, "meta": meta or {}, "fields": fields}


CRAFTED = [
    (b"not json", b"", "not JSON"),
    (b"\xff\xfe", b"", "not JSON"),
    (b"[1,2]", b"", "lacks meta"),
    ({"z": 0, "raw": 0, "fields": []}, b"", "lacks meta"),
    ({"z": 0, "raw": 0, "meta": [], "fields": []}, b"", "lacks meta"),
    ({"z": 0, "raw": 0, "meta": {}}, b"", "lacks meta"),
    (field_header([], raw=-1), b"", "invalid body length"),
    (field_header([], raw=(1 << 32) + 1), b"", "invalid body length"),
    (field_header([], raw=0, z=23), b"", "invalid level"),
    (field_header([], raw=0, z=-1), b"", "invalid level"),
    (field_header([], raw=0, z="1"), b"", "invalid body length or level"),
    (field_header([], raw=4), b"abc", "body is 3 bytes"),
    (field_header([], raw=3), b"abc", "trailing body bytes"),
    (field_header([["a", "complex64", [1], [], 8]], raw=8), bytes(8), "unknown dtype"),
    (field_header([["a", "object", [1], [], 8]], raw=8), bytes(8), "unknown dtype"),
    (field_header([[1, "int8", [1], [], 1]], raw=1), bytes(1), "unknown dtype"),
    (field_header([["a", "int8", [1], [], 1, 9]], raw=1), bytes(1), "malformed field spec"),
    (field_header([["a", "int8", [-1], [], 1]], raw=1), bytes(1), "invalid shape"),
    (field_header([["a", "int8", [1.0], [], 1]], raw=1), bytes(1), "invalid shape"),
    (field_header([["a", "int8", [1 << 40], [], 1]], raw=1), bytes(1), "invalid shape"),
    (field_header([["a", "int8", [1] * 65, [], 1]], raw=1), bytes(1), "invalid shape"),
    (field_header([["a", "int8", 1, [], 1]], raw=1), bytes(1), "invalid shape"),
    (field_header([["a", "int8", [1], ["pickle"], 1]], raw=1), bytes(1), "invalid transforms"),
    (field_header([["a", "float32", [1], ["narrow:uint8"], 1]], raw=1), bytes(1), "invalid transforms"),
    (field_header([["a", "int16", [1], ["narrow:int32"], 4]], raw=4), bytes(4), "invalid transforms"),
    (field_header([["a", "int64", [1], ["narrow:uint8", "shuffle"], 1]], raw=1), bytes(1), "invalid transforms"),
    (field_header([["a", "int64", [1], ["shuffle", "narrow:int32"], 4]], raw=4), bytes(4), "invalid transforms"),
    (field_header([["a", "int8", [1], ["shuffle"], 1]], raw=1), bytes(1), "invalid transforms"),
    (field_header([["a", "float32", [1], ["bitpack"], 1]], raw=1), bytes(1), "invalid transforms"),
    (field_header([["a", "int8", [1], "shuffle", 1]], raw=1), bytes(1), "invalid transforms"),
    (field_header([["a", "int8", [1], [], -1]], raw=1), bytes(1), "invalid length"),
    (field_header([["a", "int8", [2], [], 2]], raw=1), bytes(1), "runs past the body"),
    (field_header([["a", "int32", [2], [], 4]], raw=4), bytes(4), "4 bytes for shape"),
    (field_header([["a", "int32", [1 << 39, 1 << 39], [], 4]], raw=4), bytes(4), "4 bytes for shape"),
    (field_header([["a", "bool", [9], ["bitpack"], 1]], raw=1), bytes(1), "1 packed bytes for 9"),
    (field_header([["a", "int8", [1], [], 1], ["a", "int8", [1], [], 1]], raw=2), bytes(2), "twice"),
]


@pytest.mark.parametrize(("header", "body", "match"), CRAFTED)
def test_crafted_records_are_refused(header, body, match):
    with pytest.raises(CorruptRecord, match=match) as info:
        decode(seal(header, body), "ledger/x")
    assert info.value.key == "ledger/x"


@pytest.mark.parametrize(("header", "body", "match"), CRAFTED)
def test_compiled_rules_refuse_every_crafted_record(header, body, match):
    """RecordRules answers the generic dtype/transform checks from its rule: a rule that lets field
    "a" be any shape of the crafted dtype still refuses each crafted record, for the same reason
    (an unknown dtype or name is refused by the rule itself)."""
    spec = header["fields"][0] if isinstance(header, dict) and header.get("fields") else None
    dtype = spec[1] if spec and spec[1] in DTYPES else "int8"
    rules = codec.RecordRules({"a": codec.FieldRule(dtype, None, 1 << 30)})
    with pytest.raises(CorruptRecord, match="is not one the rules name|is stored as complex64|is stored as object"
                       if match == "unknown dtype" else match) as info:
        rules.describe(seal(header, body), "rows/x")
    assert info.value.key == "rows/x"


def test_compiled_rules_check_names_dtypes_shapes_and_caps():
    rules = codec.RecordRules({"t": codec.FieldRule("int32", (None, 2), 64), "r": codec.FieldRule("float32", (), 4),
                               "s": codec.FieldRule("str", (), 3), "o": codec.FieldRule("uint8", None, 8)},
                              required=["t", "r"])
    ok = {"t": np.zeros((3, 2), np.int32), "r": np.float32(1), "s": "abc"}
    for level in (0, 1):
        info = rules.describe(encode(ok, {"m": 1}, level=level), "k")
        assert info.meta == {"m": 1} and info.arrays["t"].shape == (3, 2) and len(info.arrays["s"]) == 3
        assert rules.describe(encode({**ok, "o": np.zeros((2, 2, 2), np.uint8)}, level=level)).arrays["o"].nbytes == 8
    cases = {
        "'x' is not one the rules name": {**ok, "x": np.zeros(1, np.int32)},
        "required field 'r' is missing": {"t": ok["t"]},
        "'r' is stored as float64, the rules say float32": {**ok, "r": np.float64(1)},
        "'t' has shape \\[3\\], the rules say 2 dims": {**ok, "t": np.zeros(3, np.int32)},
        "'t' has shape \\[3, 4\\], the rules fix dim 1 at 2": {**ok, "t": np.zeros((3, 4), np.int32)},
        "'t' would decode to 72 bytes .* over its limit of 64": {**ok, "t": np.zeros((9, 2), np.int32)},
        "'s' would decode to 4 bytes": {**ok, "s": "abcd"},
        "'o' would decode to 9 bytes": {**ok, "o": np.zeros(9, np.uint8)},
    }
    for match, fields in cases.items():
        with pytest.raises(CorruptRecord, match=match):
            rules.describe(encode(fields, level=1), "k")
    text = encode({**ok, "s": "abc"}, level=0)
    with pytest.raises(CorruptRecord, match="'s' is not UTF-8"):
        rules.describe(seal(header_of(text), body_of(text)[:-3] + b"\xff\xfe\xfd"), "k")
    with pytest.raises(BadArgument, match="unknown dtype"):
        codec.RecordRules({"a": codec.FieldRule("complex64", None, 1)})
    with pytest.raises(BadArgument, match="invalid shape"):
        codec.RecordRules({"a": codec.FieldRule("int8", (-1,), 1)})
    with pytest.raises(BadArgument, match="no rule"):
        codec.RecordRules({"a": codec.FieldRule("int8", None, 1)}, required=["b"])


def test_rules_check_reads_what_describe_reads():
    """RecordRules.check is describe's verification without the Record: the same meta, the same
    fields in record order with their shapes and decoded sizes, and their total."""
    rules = codec.RecordRules({"t": codec.FieldRule("int64", (None,), 1 << 20), "r": codec.FieldRule("float32", (), 4),
                               "b": codec.FieldRule("bool", None, 64), "s": codec.FieldRule("str", (), 16)})
    for level in (0, 1):
        value = encode({"t": np.arange(7) * 3, "r": np.float32(2), "b": np.ones((2, 3), bool), "s": "héllo"},
                       {"group_id": "g", "index": 1}, level=level)
        checked, described = rules.check(value, "k"), rules.describe(value, "k")
        assert checked.meta == described.meta == {"group_id": "g", "index": 1}
        assert [(f.name, f.dtype, f.shape, f.decoded) for f in checked.fields] == [
            (name, described.dtypes[name], info.shape, info.nbytes) for name, info in described.arrays.items()]
        assert checked.nbytes == 56 + 4 + 6 + 6 == sum(info.nbytes for info in described.arrays.values())
        assert checked.record() == described


@pytest.mark.parametrize(("text", "ok"), [
    (b' {"z":0,"raw":0,"meta":{},"fields":[]}', True),    # JSON with whitespace around: still a header
    (b'{"z":0,"raw":0,"meta":{},"fields":[]}\n', True),
    (b'{"z":0,"raw":0,"meta":{},"fields":[]} x', False),  # anything after the document is refused
    (b'{"z":0,"raw":0,"meta":{},"fields":[]}{}', False),
    (b'{"z":0,"raw":0,"meta":{"a":NaN},"fields":[]}', False),
])
def test_headers_are_exactly_json(text, ok):
    """The header parse takes what json.loads takes for one document (encode() writes it with no
    whitespace; other spellings still parse) and refuses trailing data and non-JSON constants."""
    if ok:
        assert decode(seal(text), "k").meta == {}
    else:
        with pytest.raises(CorruptRecord, match="header is not JSON"):
            decode(seal(text), "k")


def test_header_length_caps():
    with pytest.raises(CorruptRecord, match="header length"):
        decode(seal(b"{}", hlen=codec.MAX_HEADER_BYTES + 1), "k")
    with pytest.raises(CorruptRecord, match="header length"):
        decode(seal(b"{}", hlen=100), "k")  # longer than the value


def test_deeply_nested_header_is_refused():
    with pytest.raises(CorruptRecord, match="not JSON"):
        decode(seal(b"[" * 100_000 + b"]" * 100_000), "k")


def test_crafted_zstd_bodies_are_refused():
    payload = bytes(range(100))
    frame = zstandard.ZstdCompressor(level=1).compress(payload)
    spec = [["a", "uint8", [100], [], 100]]
    assert decode(seal(field_header(spec, raw=100, z=1), frame)).arrays["a"].tobytes() == payload
    with pytest.raises(CorruptRecord, match="declares 100 bytes, header says 50"):
        decode(seal(field_header([["a", "uint8", [50], [], 50]], raw=50, z=1), frame), "k")
    sizeless = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(payload)
    with pytest.raises(CorruptRecord, match="declares"):  # no size: would allocate unbounded
        decode(seal(field_header(spec, raw=100, z=1), sizeless), "k")
    with pytest.raises(CorruptRecord, match="zstd"):  # data after the frame
        decode(seal(field_header(spec, raw=100, z=1), frame + b"\x00\x01"), "k")
    with pytest.raises(CorruptRecord, match="zstd"):  # two frames
        decode(seal(field_header(spec, raw=100, z=1), frame + frame), "k")
    with pytest.raises(CorruptRecord, match="zstd"):
        decode(seal(field_header(spec, raw=100, z=1), b"not a zstd frame at all"), "k")
    with pytest.raises(CorruptRecord, match="zstd"):
        decode(seal(field_header(spec, raw=100, z=1), frame[:-3]), "k")


def test_empty_body_with_level_is_accepted():
    """Older writers stamped z>0 on records whose body was empty; such records still decode."""
    rec = decode(seal(field_header([["a", "float32", [0], [], 0]], raw=0, z=1), b""))
    assert rec.arrays["a"].shape == (0,)


# -- arguments -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [
    np.zeros(2, np.complex64), np.zeros(2, np.complex128), np.array([object(), 1], dtype=object),
    np.array(["a", "b"]), np.array([b"a"]), np.zeros(2, "datetime64[s]"), np.zeros(2, np.float128)
    if hasattr(np, "float128") else np.zeros(2, np.complex64),
    torch.zeros(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.float8_e4m3fn),
    [[1, 2], [3]], None,
])
def test_unsupported_values_are_bad_arguments(value):
    with pytest.raises(BadArgument):
        encode({"x": value})
    with pytest.raises(BadArgument):
        as_numpy(value)


@pytest.mark.parametrize("meta", [
    {"a": object()}, {"a": float("nan")}, {"a": float("inf")}, {"a": b"bytes"}, {"a": {1, 2}},
    {("t",): 1}, [1, 2], "text",
])
def test_non_json_meta_is_bad_argument(meta):
    with pytest.raises(BadArgument, match="JSON"):
        encode(SMALL, meta)
    with pytest.raises(BadArgument):
        encode_json(meta)


@pytest.mark.parametrize("level", [-1, 23, 1.5, True, "1", None])
def test_bad_levels_are_bad_arguments(level):
    with pytest.raises(BadArgument, match="level"):
        encode(SMALL, level=level)


def test_non_string_field_names_are_bad_arguments():
    with pytest.raises(BadArgument, match="field names"):
        encode({1: np.zeros(2)})
    with pytest.raises(BadArgument, match="field names"):
        encode({b"ids": np.zeros(2)})


def test_bad_argument_is_a_value_error():
    with pytest.raises(ValueError):
        encode({"x": np.zeros(1, np.complex64)})


# -- text fields ---------------------------------------------------------------------------------
@pytest.mark.parametrize("level", [0, 1])
def test_text_fields_round_trip(level):
    src = {"prompt": "1+1=", "unicode": "ναι ✓ \U0001f600", "empty": "", "trace": b"\x00\xff\x00",
           "nul": "a\x00b", "ids": np.arange(3)}
    rec = decode(encode(src, level=level))
    assert rec.arrays == {**src, "ids": rec.arrays["ids"]} and type(rec.arrays["trace"]) is bytes
    assert rec.dtypes == {"prompt": "str", "unicode": "str", "empty": "str", "trace": "bytes", "nul": "str",
                          "ids": "int64"}
    assert rec.tensors()["prompt"] == "1+1=" and rec.nbytes == 4 + len(src["unicode"].encode()) + 3 + 3 + 24


def test_golden_text_bytes():
    """A text field is 0-d and its bytes are the UTF-8 payload; ``nbytes`` is its length."""
    value = encode({"p": "é", "b": b"\x01"}, level=0)
    header = b'{"z":0,"raw":3,"meta":{},"fields":[["p","str",[],[],2],["b","bytes",[],[],1]]}'
    tail = struct.pack("<I", len(header)) + header + b"\xc3\xa9\x01"
    assert value == b"KVR1" + struct.pack("<I", zlib.crc32(tail)) + tail


def test_text_values_refused_where_they_cannot_be_encoded():
    with pytest.raises(BadArgument, match="UTF-8"):
        encode({"p": "\ud800"})  # a lone surrogate
    with pytest.raises(BadArgument, match="needs a str"):
        encode({"p": b"x"}, dtypes={"p": "str"})
    with pytest.raises(BadArgument, match="stored form"):
        encode({"p": np.zeros(2, np.float32)}, dtypes={"p": "bfloat16"})


def test_dtypes_override_stores_bfloat16_bits():
    bits = torch.tensor([1.0, -2.5], dtype=torch.bfloat16).view(torch.int16).numpy().view("<u2")
    rec = decode(encode({"b": bits}, dtypes={"b": "bfloat16"}))
    assert rec.dtypes == {"b": "bfloat16"} and rec.tensors()["b"].tolist() == [1.0, -2.5]


@pytest.mark.parametrize(("spec", "body", "match"), [
    (["t", "str", [2], [], 2], b"ab", "text fields are 0-d"),
    (["t", "str", [], ["shuffle"], 2], b"ab", "invalid transforms"),
    (["t", "str", [], [], 2], b"\xff\xfe", "not UTF-8"),
])
def test_crafted_text_fields_are_refused(spec, body, match):
    with pytest.raises(CorruptRecord, match=match):
        decode(seal(field_header([spec], raw=len(body)), body), "rows/g_0")


# -- decode limits: bombs are refused before anything is decompressed or allocated ----------------
def zstd_bomb(size: int) -> bytes:
    """A small zstd frame of ``size`` zero bytes (with its content size, as encode writes it)."""
    return zstandard.ZstdCompressor(level=19).compress(bytes(size))


def test_decompression_bomb_is_refused_by_the_limit_before_decompressing():
    size = 64 << 20
    frame = zstd_bomb(size)
    assert len(frame) < 4096
    value = seal(field_header([["a", "uint8", [size], [], size]], raw=size, z=1), frame)
    with pytest.raises(CorruptRecord, match=f"would decode to {size} bytes.*limit of {1 << 20}") as info:
        decode(value, "rows/g_0", limits=codec.Limits(max_bytes=1 << 20))
    assert info.value.key == "rows/g_0"
    assert decode(value, limits=codec.Limits(max_bytes=size)).arrays["a"].nbytes == size  # the limit is the bound


def test_default_limit_refuses_a_4_gib_claim():
    """The header may claim up to 2**32 body bytes; the default limit (1 GiB) refuses that outright."""
    count = 1 << 32
    header = field_header([["a", "uint8", [count], [], count]], raw=count, z=1)
    frame = zstandard.ZstdCompressor(level=1).compress(b"")  # never looked at
    with pytest.raises(CorruptRecord, match="over the limit of 1073741824"):
        decode(seal(header, frame), "rows/g_0")


@pytest.mark.parametrize(("dtype", "factor"), [("bool", 8), ("uint8", 8), ("int64", 64)])
def test_bitpacked_bomb_counts_the_unpacked_size(dtype, factor):
    packed = 1 << 20
    count = packed * 8
    value = seal(field_header([["m", dtype, [count], ["bitpack"], packed]], raw=packed, z=1), zstd_bomb(packed))
    with pytest.raises(CorruptRecord, match=f"would decode to {packed * factor} bytes"):
        decode(value, "rows/g_0", limits=codec.Limits(max_bytes=packed * factor - 1))
    with pytest.raises(CorruptRecord, match="over its limit of 1000"):
        decode(value, "rows/g_0", limits=codec.Limits(field_bytes={"m": 1000}))


def test_narrowed_field_counts_the_widened_size():
    count = 1 << 16
    value = seal(field_header([["ids", "int64", [count], ["narrow:uint8"], count]], raw=count), bytes(count))
    with pytest.raises(CorruptRecord, match=f"would decode to {count * 8} bytes"):
        decode(value, "k", limits=codec.Limits(field_bytes={"ids": count * 8 - 1}))
    assert decode(value, "k", limits=codec.Limits(field_bytes={"ids": count * 8})).arrays["ids"].dtype == np.int64


def test_per_field_limits_and_totals():
    value = encode({"a": np.zeros(100, np.float32), "b": np.zeros(100, np.float32), "t": "x" * 50})
    assert decode(value, limits=codec.Limits(max_bytes=850, field_bytes={"a": 400, "t": 50})).arrays["t"] == "x" * 50
    with pytest.raises(CorruptRecord, match="fields up to 't' would decode to 850 bytes, over the limit of 849"):
        decode(value, limits=codec.Limits(max_bytes=849))
    with pytest.raises(CorruptRecord, match="field 't' would decode to 50 bytes"):
        decode(value, limits=codec.Limits(field_bytes={"t": 49}))
    with pytest.raises(BadArgument):
        codec.Limits(max_bytes=-1)


@pytest.mark.parametrize("shape", [[0, 1 << 39, 1 << 39], [0] + [1 << 20] * 10, [1 << 24, 1 << 24, 0]])
def test_empty_shapes_that_overflow_are_refused(shape):
    """Zero elements, but numpy cannot describe the shape: refused by name, not numpy's ValueError."""
    with pytest.raises(CorruptRecord, match="over 2\\*\\*48"):
        decode(seal(field_header([["a", "int32", shape, [], 0]], raw=0)), "rows/g_0")


@pytest.mark.parametrize(("meta", "match"), [
    (b'{"n":' + b"1" * 5000 + b"}", "not JSON"),  # json's int digit limit is a ValueError
    (b'{"n":NaN}', "NaN is not JSON"),
    (b'{"n":-Infinity}', "Infinity is not JSON"),
])
def test_hostile_meta_json_is_a_corrupt_record(meta, match):
    header = b'{"z":0,"raw":0,"meta":' + meta + b',"fields":[]}'
    for reader in (decode, decode_meta):
        with pytest.raises(CorruptRecord, match=match):
            reader(seal(header), "meta/state")


def test_decode_views_checks_what_decode_checks_and_aliases_only_immutable_bytes():
    """``decode_views`` (the owner's zero-copy read of a progress message): the same values as
    ``decode``; plain fields of an uncompressed record are read-only views into the given bytes, a
    transformed field (bit-packed, narrowed, shuffled) or a compressed record's fields are decoded
    copies; the same refusals; a mutable buffer is refused (the views could change under the owner)."""
    fields = {"ids": np.arange(6, dtype=np.int64).reshape(2, 3), "lp": np.float32([-0.5, -1.0]),
              "acc": np.array([True, False, True]), "txt": "h\u00e9", "raw": b"\x00\x01", "none": np.zeros(0, np.int16)}
    for level in (0, 3):
        value = encode(fields, {"k": level}, level=level)
        views, copies = codec.decode_views(value), decode(value)
        assert views.meta == copies.meta and views.dtypes == copies.dtypes
        for name in fields:
            assert codec.same_value(views.arrays[name], copies.arrays[name]), (level, name)
        for name in ("ids", "lp"):
            shared = np.shares_memory(views.arrays[name], np.frombuffer(value, np.uint8))
            assert shared == (level == 0) and views.arrays[name].flags.writeable is (level != 0), (level, name)
        assert not np.shares_memory(views.arrays["acc"], np.frombuffer(value, np.uint8))  # bit-packed: decoded
    value = encode(fields, {}, level=0)
    with pytest.raises(BadArgument, match="immutable bytes"):
        codec.decode_views(bytearray(value))
    with pytest.raises(CorruptRecord, match="checksum"):
        codec.decode_views(value[:-1] + bytes([value[-1] ^ 1]))
