"""The value codec of the TransferQueue backend: every value kind TransferQueue hands a KV backend
round-trips without pickle, the rest is refused before anything is written, and a record whose
description lies about its bytes is refused naming the key (decoded metadata is never trusted).

No Ray and no TransferQueue process: :mod:`kvckpt.integrations.transferqueue.values` on its own,
plus the value store's format check on real files.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("transfer_queue")
pytest.importorskip("kvckpt.integrations.ray")  # before ray: keeps Ray on loopback

import kvckpt.integrations.transferqueue as ktq
import torch
from _old_format import rewrite_as_named_tables
from kvckpt.integrations.transferqueue.values import decode_value, encode_value

from kvckpt.errors import BadArgument, CorruptRecord, FormatError
from kvckpt.storage import codec
from kvckpt.storage.layout import NamedTables, OneTree
from kvckpt.storage.store import Store
from kvckpt.values import records as owner  # the value store moved into the core

KEY, WID = "3@field", "0123456789abcdef"

#: One value per kind, the way TransferQueue's KV manager hands them over (a row, a component of
#: a nested field, an element of a non-tensor field); big-endian and strided inputs included.
VALUES: dict[str, Any] = {
    "f32 with nan/inf": torch.tensor([float("inf"), float("nan"), 1.5]),
    "i64": torch.arange(5),
    "bf16": torch.arange(5, dtype=torch.bfloat16),
    "f16": torch.arange(5, dtype=torch.float16),
    "bool tensor": torch.tensor([True, False, True]),
    "0-d tensor": torch.tensor(7),
    "transposed tensor": torch.arange(20).view(4, 5).t(),
    "strided component": torch.full((3, 4), 2.0),
    "np f64": np.arange(3, dtype=np.float64),
    "np strided": np.arange(24.0).reshape(4, 6)[::2, 1::2],
    "np big-endian i4": np.arange(4, dtype=">i4"),
    "np bool": np.array([True, False]),
    "np scalar f64": np.float64(2.5),
    "np scalar i32": np.int32(-7),
    "np |S10": np.array([b"bs_0", b"b\x00s"], dtype="|S10"),
    "np |S scalar": np.bytes_(b"bs_0"),
    "np |S empty": np.zeros((0, 3), dtype="|S2"),
    "np <U": np.array(["héllo", "x", "\U0001f600"]),
    "np >U": np.array(["ab", "c"], dtype=">U2"),
    "np <U scalar": np.str_("ü"),
    "np <U strided 2-d": np.array([["a", "bb"], ["ccc", "d"]])[:, ::-1],
    "np object": np.array(["obj_0", 1, None, {"a": [1, 2.5]}], dtype=object),
    "np object 2-d": np.array([[1, "x"], [[2], True]], dtype=object),
    "np object empty": np.array([], dtype=object),
    "bytes": b"raw\x00bytes\xff",
    "empty bytes": b"",
    "str": "sample_0 ü",
    "int": 10**30,
    "float": 0.1,
    "bool": True,
    "None": None,
    "dict": {"idx": 1, "text": "non_tensor_1", "nested": {"x": [1, None]}},
    "list": [1, "x", [2.5, False]],
}


def bits(tensor: torch.Tensor) -> bytes:
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).contiguous().numpy().tobytes()


def same(got: Any, want: Any) -> bool:
    """Exact equality: type, dtype, shape and bytes (so NaN equals NaN); numpy byte order aside."""
    if isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
                and bits(got) == bits(want))
    if isinstance(want, (np.ndarray, np.generic)):
        want_arr = np.asarray(want)
        le = want_arr.dtype.newbyteorder("<") if want_arr.dtype.kind in "iufU" else want_arr.dtype
        return (type(got) is type(want) and np.asarray(got).dtype == le and np.shape(got) == want_arr.shape
                and (np.asarray(got).tolist() == want_arr.tolist() if want_arr.dtype.kind == "O"
                     else np.asarray(got).tobytes() == want_arr.astype(le).tobytes()))
    return type(got) is type(want) and got == want


@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("name", sorted(VALUES))
def test_every_value_kind_round_trips_exactly(name: str, level: int) -> None:
    got = decode_value(KEY, encode_value(KEY, VALUES[name], WID, level), WID)
    assert same(got, VALUES[name]), (got, VALUES[name])
    if isinstance(got, np.ndarray):
        got.flat[0:1] = got.flat[0:1]  # writable, and owns its memory
        assert got.flags.owndata or (got.base is not None and got.base.flags.writeable)


def test_the_comparison_can_fail() -> None:
    assert not same(np.array([b"a"], "|S2"), np.array([b"a"], "|S1"))
    assert not same(np.bytes_(b"a"), np.array(b"a"))
    assert not same(torch.arange(3, dtype=torch.int32), torch.arange(3))
    assert not same([1], (1,))
    assert not same(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 2.0]))


def test_tuples_come_back_as_lists() -> None:
    assert decode_value(KEY, encode_value(KEY, (1, ("a",)), WID, 0), WID) == [1, ["a"]]


def test_a_json_value_larger_than_a_record_header_round_trips() -> None:
    text = "x" * (codec.MAX_HEADER_BYTES + 10)  # JSON lives in the record body, not its 1 MiB header
    assert decode_value(KEY, encode_value(KEY, {"t": text}, WID, 1), WID) == {"t": text}


@pytest.mark.parametrize(("value", "why"), [
    (np.array([1 + 2j]), "numpy dtype complex128 is not storable"),
    (np.array(["2020-01-01"], dtype="datetime64[D]"), "numpy dtype datetime64\\[D\\] is not storable"),
    (np.ma.masked_array([1, 2], mask=[0, 1]), "is a masked array"),
    (float("nan"), "is a non-finite float"),
    ([1.0, float("inf")], "is of type list.*Out of range float"),
    (object(), "is of type object"),
    ({1: "a"}, "dict key 1 is not a string"),
    ([{"a": {2: 0}}], "dict key 2 is not a string"),
    (bytearray(b"x"), "is of type bytearray"),
    (np.array([object()], dtype=object), "an object array with an element that is not JSON"),
    (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged), "nested or sparse tensor"),
    (torch.eye(2).to_sparse(), "nested or sparse tensor"),
    (torch.ones(2, dtype=torch.complex64), "dtype torch.complex64 is not storable"),
])
def test_unstorable_values_are_refused_naming_the_key(value: Any, why: str) -> None:
    with pytest.raises(BadArgument, match=why) as err:
        encode_value(KEY, value, WID, 0)
    assert KEY in str(err.value) or "not storable" in str(err.value)


def record(kind: str, fields: dict[str, Any] | None = None, **meta: Any) -> bytes:
    """A well-checksummed record with the given description: what a damaged or hostile file holds."""
    return codec.encode(fields, {"k": KEY, "w": WID, "t": kind, **meta}, 0)


U8, U32 = np.zeros(6, np.uint8), np.zeros(6, np.uint32)


@pytest.mark.parametrize(("raw", "why"), [
    (record("numpy", {"v": U8}, d="|S4", shape=[2], s=False), "6 stored items for 2 values of \\|S4"),
    (record("numpy", {"v": U8}, d="|S3", shape=[2], s=True), "invalid numpy scalar flag True for shape \\(2,\\)"),
    (record("numpy", {"v": U8}, d="|S3", shape=[2], s="yes"), "invalid numpy scalar flag"),
    (record("numpy", {"v": U8}, d="|S3", shape=[-2], s=False), "invalid numpy shape \\[-2\\]"),
    (record("numpy", {"v": U8}, d="|S3", shape=[2.0], s=False), "invalid numpy shape"),
    (record("numpy", {"v": U8}, d="|S3", shape=[1] * 65, s=False), "invalid numpy shape"),
    (record("numpy", {"v": U8}, d="|S3", s=False), "invalid numpy shape None"),
    (record("numpy", {"v": U8}, d="|S0", shape=[2], s=False), "unknown numpy dtype '\\|S0'"),
    (record("numpy", {"v": U8}, d="|S99999999999", shape=[2], s=False), "unknown numpy dtype"),
    (record("numpy", {"v": U8[:0]}, d="|S2147483648", shape=[0], s=False), "wider than numpy allows"),
    (record("numpy", {"v": U32[:0]}, d="<U536870912", shape=[0], s=False), "wider than numpy allows"),
    (record("numpy", {"v": U8}, d="<U3", shape=[2], s=False), "holds fields \\{'v': 'uint8'\\}, expected one uint32"),
    (record("numpy", {"v": np.full(6, 0x110000, np.uint32)}, d="<U3", shape=[2], s=False),
     "code point beyond U\\+10FFFF"),
    (record("numpy", {"v": U32}, d="|V24", shape=[1], s=False), "unknown numpy dtype '\\|V24'"),
    (record("numpy", {"v": U32}, d="|O8", shape=[1], s=False), "unknown numpy dtype"),
    (record("numpy", {"v": U32}, d="bfloat16", shape=[6], s=False), "unknown numpy dtype 'bfloat16'"),
    (record("numpy", {"v": U32}, d="uint32", shape=[2, 2], s=False), "shape \\(6,\\) is described as \\(2, 2\\)"),
    (record("numpy", {"v": U32}, d="float32", shape=[6], s=False), "expected one float32 field"),
    (record("numpy", {"v": np.frombuffer(b"[1,2]", np.uint8)}, d="|O", shape=[3], s=False),
     "object array of shape \\(3,\\) holds \\[1, 2\\]"),
    (record("numpy", {"v": np.frombuffer(b"[1,", np.uint8)}, d="|O", shape=[1], s=False), "does not parse"),
    (record("json", {"v": np.frombuffer(b"NaN", np.uint8)}), "does not parse: NaN is not JSON"),
    (record("json", {"v": np.frombuffer(b"\xff", np.uint8)}), "does not parse"),
    (record("json", {"v": np.zeros((2, 2), np.uint8)}), "stored with shape \\(2, 2\\)"),
    (record("json", None, v=1), "holds fields \\{\\}, expected one uint8 field"),
    (record("bytes", {"v": U8, "w": U8}), "holds fields"),
    (record("torch", {"v": U8, "x": U8}), "expected one tensor 'v'"),
    (record("pickle", {"v": U8}), "unknown TransferQueue value kind 'pickle'"),
    (record(None, {"v": U8}), "unknown TransferQueue value kind 'None'"),
])
def test_a_record_whose_description_lies_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(CorruptRecord, match=why) as err:
        decode_value(KEY, raw, WID)
    assert err.value.key == f"rows/{KEY}"


ODD = [None, 0, -1, 1.5, True, "x", [], [2], [[1]], {"a": 1}, 2**70, [2**70], ["2"], [0, 2**60], [-1],
       "|S2", "<U1", "<U0", "|S01", " |S2", "|S2\n", "|O", "uint8", "int64", "bool", "float16", "bfloat16"]
FIELDS = [None, {"v": U8}, {"v": U32}, {"v": np.zeros((2, 2), np.int64)}, {"v": np.frombuffer(b'["a",1]', np.uint8)},
          {"v": np.array(True)}, {"v": U8, "x": U8}]


def test_no_description_makes_a_read_fail_with_anything_but_corrupt_record() -> None:
    outcomes = {"value": 0, "refused": 0}
    cases = [("numpy", f, d, shape, s) for f in FIELDS for d in ODD for shape in ODD[:15] for s in (True, False, 1)]
    cases += [(t, f, None, None, None) for t in ("json", "bytes", "torch", *ODD) for f in FIELDS]
    for kind, fields, d, shape, s in cases:
        try:
            decode_value(KEY, record(kind, fields, d=d, shape=shape, s=s), WID)
            outcomes["value"] += 1
        except CorruptRecord:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0.9 * len(cases) and outcomes["value"] > 0  # both branches were reached


def test_another_keys_or_writes_record_is_refused_before_its_description_is_read() -> None:
    raw = record("pickle", {"v": U8})
    with pytest.raises(ktq.WriteIdentityMismatch):
        decode_value(KEY, raw, "another-write")
    with pytest.raises(ktq.WriteIdentityMismatch):
        decode_value("4@field", raw, WID)


def test_a_value_store_of_another_format_version_is_refused(tmp_path: Any) -> None:
    path = str(tmp_path / "v1.kv")
    with Store(path, create=True) as store:  # what version 1 of this backend wrote
        store.write(lambda t: t.put_json("meta", owner.FORMAT_KEY, {"kind": "transferqueue-values", "version": 1}))
    with pytest.raises(FormatError, match=r"'transferqueue-values' version 1; this backend reads .* version 2"):
        ktq.ValueStore(path)
    live = ktq.ValueStore(str(tmp_path / "live.kv"))
    (tmp_path / "ckpt").mkdir()
    live.checkpoint(str(tmp_path / "ckpt" / "v.kv"))
    with Store(str(tmp_path / "ckpt" / "v.kv")) as store:
        store.write(lambda t: t.put_json("meta", owner.FORMAT_KEY, {"kind": "transferqueue-values", "version": 1}))
    with pytest.raises(FormatError, match="version 1; this backend reads"):
        live.load(str(tmp_path / "ckpt" / "v.kv"))
    live.close()


def test_a_value_store_written_by_kvckpt_format_2_opens_and_moves_into_format_3(tmp_path: Any) -> None:
    path = str(tmp_path / "old.kv")
    old = ktq.ValueStore(path)
    values = [encode_value(f"{i}@field", torch.arange(i + 3), WID, 0) for i in range(4)]
    old.put([f"{i}@field" for i in range(4)], values)
    old.close()
    rewrite_as_named_tables(path, 2)
    with Store(path, readonly=True) as store:
        assert isinstance(store.layout, NamedTables)
    again = ktq.ValueStore(path)
    assert again.count() == 4 and again.get([f"{i}@field" for i in range(4)]) == values
    again.close()
    with Store(path, readonly=True) as store:
        assert isinstance(store.layout, OneTree) and store.info["upgraded_from"] == 2
