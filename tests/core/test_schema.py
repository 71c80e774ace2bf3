"""The data layer: value-preserving casts, text fields, shapes (declared or pinned per store), limits.

Every store here is a real LMDB file; restarts reopen it through fresh objects.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _buffers import dump_store, make_group
from hypothesis import given, settings
from hypothesis import strategies as st

from kvckpt import CorruptRecord, Field, ReplayBuffer, RowSchema, SchemaMismatch, checkpoint, restore
from kvckpt.errors import BadArgument
from kvckpt.storage import codec
from kvckpt.storage.casts import bf16_bits, bf16_values, cast


def refused(buf: ReplayBuffer, fn, *args, match: str) -> SchemaMismatch:
    """Run ``fn``, expect a SchemaMismatch matching ``match``, and prove every table is unchanged."""
    before = dump_store(buf)
    with pytest.raises(SchemaMismatch, match=match) as info:
        fn(*args)
    assert dump_store(buf) == before
    return info.value


# -- casts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "dtype", "expected"), [
    (0.3, "float32", np.float32(0.3)),                                   # a Python float reward
    (np.float64(-1.25), "float32", np.float32(-1.25)),
    ([-0.5, -1.0, -2.0], "float32", np.float32([-0.5, -1.0, -2.0])),     # vLLM logprobs as a list
    (np.int32([1, 2, 151_000]), "int64", np.int64([1, 2, 151_000])),
    (torch.tensor([5, 6], dtype=torch.int32), "int64", np.int64([5, 6])),
    ([1, 2, 3], "int64", np.int64([1, 2, 3])),
    (7, "int32", np.int32(7)),
    (np.int64([0, 255]), "uint8", np.uint8([0, 255])),
    (True, "float32", np.float32(1.0)),
    (np.array([True, False]), "int64", np.int64([1, 0])),
    ([0, 1, 1], "bool", np.array([False, True, True])),
    (torch.tensor([1.5, -2.0], dtype=torch.float16), "float32", np.float32([1.5, -2.0])),
    (torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "float64", np.float64([1.5, -2.0])),
    (2 ** 24, "float32", np.float32(2 ** 24)),
    (2 ** 40, "float32", np.float32(2 ** 40)),                           # large but exact
    (float("nan"), "float16", np.float16("nan")),
    (float("-inf"), "float32", np.float32("-inf")),
    (np.float64(65504.0), "float16", np.float16(65504.0)),
])
def test_value_preserving_casts_are_accepted(value, dtype, expected):
    out = cast(value, dtype, "row g_0", "f")
    assert out.dtype == codec.DTYPES[dtype] and out.shape == np.shape(expected)
    assert np.array_equal(out, expected, equal_nan=True)


@pytest.mark.parametrize(("value", "dtype", "match"), [
    (1e300, "float32", "value 1e\\+300 does not survive rounding to float32 \\(it would become inf\\)"),
    (1e-300, "float32", "value 1e-300 does not survive rounding to float32 \\(it would become 0.0\\)"),
    (70000.0, "float16", "value 70000.0 does not survive rounding to float16"),
    (np.float32([1.0, 1e-42]), "float16", "float32, the schema says float16, and value 1e-42 at index \\[1\\]"),
    (2 ** 24 + 1, "float32", "value 16777217 is not exactly representable"),
    (np.int64([1, -3]), "uint32", "value -3 at index \\[1\\] is outside uint32's range"),
    ([300], "uint8", "value 300 at index \\[0\\] is outside uint8's range 0..255"),
    (np.int64([[0, 2**40]]), "int32", "value 1099511627776 at index \\[0, 1\\]"),
    ([2, 0], "bool", "value 2 at index \\[0\\] is not 0 or 1"),
    ([1.0, 2.0], "int64", "floats are not cast to integers"),
    (torch.tensor([0.5]), "bool", "floats are not cast to integers or bool"),
    ("text", "int64", "is int64, got a str"),
    (b"x", "str", "takes one str, got bytes"),
    (5, "bytes", "takes one bytes, got int"),
])
def test_lossy_casts_name_field_dtype_and_first_offending_value(value, dtype, match):
    with pytest.raises(SchemaMismatch, match=match) as info:
        cast(value, dtype, "row g_0", "total_reward")
    assert "row g_0" in str(info.value) and "'total_reward'" in str(info.value)


def test_unstorable_values_stay_bad_arguments():
    with pytest.raises(BadArgument):
        cast(np.zeros(2, np.complex64), "float32", "row g_0", "f")
    with pytest.raises(BadArgument):
        cast([[1, 2], [3]], "int64", "row g_0", "f")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True), min_size=1, max_size=50))
def test_bf16_rounding_matches_torch(values):
    src = torch.tensor(values, dtype=torch.float32)
    ours = bf16_bits(src.numpy())
    theirs = src.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(src.numpy())
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(bf16_values(ours[nan])).all()


def test_bf16_from_float32_is_cast_where_declared():
    tensor = torch.randn(16)
    stored = cast(tensor, "bfloat16", "row g_0", "f")
    assert np.array_equal(stored, tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


# -- schema declarations -------------------------------------------------------------------------
def test_every_field_form_reads_and_round_trips():
    schema = RowSchema({"a": "int64", "b": ("float32", "row"), "c": ("float32", "row", (3,)),
                        "d": {"dtype": "float32", "kind": "token", "shape": [2]}, "e": Field("str", "row"),
                        "f": ["bytes", "row"]}, max_tokens=64)
    assert schema.fields["c"].shape == (3,) and schema.fields["d"].shape == (2,) and schema.fields["e"].shape == ()
    doc = schema.to_dict()
    assert doc["fields"]["b"] == ["float32", "row"] and doc["fields"]["c"] == ["float32", "row", [3]]
    assert doc["max_tokens"] == 64 and "max_text_bytes" not in doc
    assert RowSchema.from_dict(doc) == schema
    plain = {"fields": {"a": ["int64", "token"]}, "optional": []}
    assert RowSchema.from_dict(plain).to_dict() == plain  # a store's old config is unchanged


@pytest.mark.parametrize(("fields", "match"), [
    ({"t": ("str", "token")}, "must be of kind 'row'"),
    ({"t": ("str", "row", (2,))}, "one value per row"),
    ({"x": ("float32", "row", (-1,))}, "a shape holds"),
    ({"x": ("float32", "row", "3")}, "a shape is a sequence"),
    ({"x": {"dtype": "float32", "size": 3}}, "a dict spec has the keys"),
    ({"x": ("float32", "row", (), "extra")}, "cannot read a field spec"),
    ({"x": ("complex64", "row")}, "unknown dtype"),
    ([("x", "int64")], "a mapping"),
])
def test_bad_declarations_are_schema_mismatches(fields, match):
    with pytest.raises(SchemaMismatch, match=match):
        RowSchema(fields)


@pytest.mark.parametrize("doc", [["fields"], {"fields": []}, {"fields": {"a": 5}}, {"fields": {}, "x": 1},
                                 {"fields": {"a": ["int64"]}, "optional": "a"}, {"fields": {"a": ["int64"]},
                                                                                 "max_tokens": -1}])
def test_stored_schema_documents_are_untrusted(doc):
    with pytest.raises(SchemaMismatch):
        RowSchema.from_dict(doc)


def test_limits_follow_the_schema_and_the_pins():
    schema = RowSchema({"ids": ("int64", "token"), "top": ("float32", "token", (4,)), "r": ("float32", "row"),
                        "v": ("float32", "row", (3,)), "p": ("str", "row")}, max_tokens=100, max_text_bytes=50)
    unpinned = schema.limits()
    assert unpinned.field_bytes == {"ids": 800, "top": 1600, "r": 400, "v": 12, "p": 50}
    assert unpinned.max_bytes == 2862
    assert schema.limits({"r": []}).field_bytes["r"] == 4
    with pytest.raises(SchemaMismatch, match="meta/shapes"):
        schema.limits({"nope": []})
    with pytest.raises(SchemaMismatch, match="meta/shapes"):
        schema.limits({"r": "oops"})
    row = {"ids": np.arange(100), "top": np.zeros((100, 4), np.float32), "r": np.float32(1),
           "v": np.zeros(3, np.float32), "p": "x" * 50}
    assert codec.decode(codec.encode(row), limits=schema.limits({"r": []})).arrays["p"] == "x" * 50
    row["v"] = np.zeros(4, np.float32)  # one element more than the schema allows
    with pytest.raises(CorruptRecord, match="field 'v' would decode to 16 bytes"):
        codec.decode(codec.encode(row), limits=schema.limits({"r": []}))


# -- through the buffer: casts and text ------------------------------------------------------------
TEXT_SCHEMA = {"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"),
               "total_reward": ("float32", "row"), "prompt": ("str", "row"), "trace": ("bytes", "row"),
               "half": ("bfloat16", "token")}


def trainer_rows(n: int) -> list[dict]:
    """Rows the way trainers hand them over: Python floats, numpy scalars, lists, int32, text."""
    return [{"input_ids": np.arange(3 + i, dtype=np.int32), "generation_logprobs": [-0.5] * (3 + i),
             "total_reward": 0.1 * i if i % 2 else np.float64(1.5), "prompt": f"what is {i}+1? ✓",
             "trace": bytes([i, 0, 255]), "half": torch.linspace(0, 1, 3 + i)} for i in range(n)]


@pytest.mark.parametrize("layout", ["padded", "packed", "list"])
def test_trainer_values_and_text_commit_and_read_back(buffer_factory, layout):
    buf = buffer_factory(schema=TEXT_SCHEMA, group_size=3)
    [lease] = buf.admit([0])
    assert buf.commit_group(lease, trainer_rows(3)).ready
    path = buf.path
    buf.close()
    with ReplayBuffer.open(path) as fresh:  # a fresh handle: nothing comes from memory
        batch = fresh.read_batch([lease.group_id], layout=layout)
    rows = batch.rows if layout == "list" else [
        {k: v[i] for k, v in batch.tensors.items()} for i in range(3)]
    assert [r["prompt"] for r in rows] == ["what is 0+1? ✓", "what is 1+1? ✓", "what is 2+1? ✓"]
    assert [r["trace"] for r in rows] == [b"\x00\x00\xff", b"\x01\x00\xff", b"\x02\x00\xff"]
    if layout != "list":
        assert isinstance(batch.tensors["prompt"], list)
    if layout == "packed":
        assert batch.tensors["input_ids"].dtype == torch.int64 and batch.tensors["input_ids"].shape == (12,)
        assert batch.tensors["half"].dtype == torch.bfloat16
    else:
        first = rows[0]
        assert first["input_ids"].dtype == torch.int64 and first["input_ids"][:3].tolist() == [0, 1, 2]
        assert first["total_reward"].dtype == torch.float32 and first["total_reward"].item() == 1.5
        assert rows[1]["total_reward"].item() == pytest.approx(0.1, rel=1e-7)
        assert first["half"].dtype == torch.bfloat16
        assert torch.equal(first["half"][:3], torch.linspace(0, 1, 3).to(torch.bfloat16))


def test_a_lossy_value_is_refused_by_row_field_and_value_and_writes_nothing(buffer_factory):
    buf = buffer_factory(schema=TEXT_SCHEMA, group_size=3)
    [lease] = buf.admit([0])
    rows = trainer_rows(3)
    rows[2]["total_reward"] = 1e39
    error = refused(buf, buf.commit_group, lease, rows, match="value 1e\\+39 does not survive rounding to float32")
    assert "row a0-p0_g2" in str(error) and "'total_reward'" in str(error)
    rows[2]["total_reward"] = 1.0
    rows[1]["prompt"] = b"not text"
    refused(buf, buf.commit_group, lease, rows, match="row a0-p0_g1: field 'prompt' is a str field")
    rows[1]["prompt"] = "ok"
    assert buf.commit_group(lease, rows).ready


def test_sizes_are_capped_at_commit(buffer_factory):
    schema = RowSchema({"input_ids": ("int64", "token"), "note": ("str", "row")}, max_tokens=8, max_text_bytes=4)
    buf = buffer_factory(schema=schema, group_size=1)
    [lease] = buf.admit([0])
    refused(buf, buf.commit_group, lease, [{"input_ids": list(range(9)), "note": "ok"}],
            match="has 9 tokens, over the schema's max_tokens 8")
    refused(buf, buf.commit_group, lease, [{"input_ids": [1], "note": "ééé"}],
            match="holds 6 bytes, over the schema's max_text_bytes 4")
    assert buf.commit_group(lease, [{"input_ids": list(range(8)), "note": "é"}]).ready


# -- through the buffer: shapes ------------------------------------------------------------------
def _reward_rows(shapes: list[tuple[int, ...]], seed: int = 1) -> list[dict]:
    rows = make_group(len(shapes), seed)
    for row, shape in zip(rows, shapes, strict=True):
        row["total_reward"] = torch.ones(shape)
    return rows


def test_issue_15_case_4_mixed_row_shapes_in_one_group_are_refused(buffer_factory):
    """A scalar reward in one row and shape [3] in another: refused naming row and field; nothing written."""
    buf = buffer_factory(group_size=2)
    [lease] = buf.admit([0])
    error = refused(buf, buf.commit_group, lease, _reward_rows([(), (3,)]),
                    match="row a0-p0_g1: field 'total_reward' has shape \\[3\\], but row a0-p0_g0 fixes it at \\[\\]")
    assert "meta/shapes" not in str(error)
    assert buf.commit_group(lease, _reward_rows([(3,), (3,)])).ready
    assert buf.read_batch([lease.group_id]).tensors["total_reward"].shape == (2, 3)


def test_commit_sample_siblings_meet_the_pin_in_the_transaction(buffer_factory):
    buf = buffer_factory(group_size=2)
    [lease] = buf.admit([0])
    rows = _reward_rows([(), (3,)])
    assert not buf.commit_sample(lease, 0, rows[0]).ready
    refused(buf, buf.commit_sample, lease, 1, rows[1],
            match="row a0-p0_g1: field 'total_reward' has shape \\[3\\], but the store's pin fixes it at \\[\\]")
    assert buf.commit_sample(lease, 1, _reward_rows([(), ()])[1]).ready


def test_the_pin_survives_restart_and_checkpoint_restore(buffer_factory, tmp_path):
    buf = buffer_factory(group_size=2)
    first, second = buf.admit([0, 1])
    assert buf.commit_group(first, _reward_rows([(2,), (2,)])).ready
    assert buf.store.read(lambda t: t.get_json("meta", b"shapes")) == {"total_reward": [2]}
    checkpoint(buf, str(tmp_path / "ck.kv"), background=False)
    path = buf.path
    buf.close()
    with ReplayBuffer.open(path) as fresh:  # restart: the pin comes from the file
        refused(fresh, fresh.commit_group, second, _reward_rows([(), ()]), match="the store's pin fixes it at \\[2\\]")
    restored, plan = restore(str(tmp_path / "ck.kv"), str(tmp_path / "restored.kv"))
    with restored:
        [lease] = plan.leases
        refused(restored, restored.commit_group, lease, _reward_rows([(), ()]), match="fixes it at \\[2\\]")
        assert restored.commit_group(lease, _reward_rows([(2,), (2,)])).ready


def test_declared_shapes_are_checked_without_a_pin(buffer_factory):
    schema = {"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token", (2,)),
              "total_reward": {"dtype": "float32", "kind": "row", "shape": [3]}}
    buf = buffer_factory(schema=schema, group_size=1)
    [lease] = buf.admit([0])
    good = {"input_ids": [1, 2, 3], "generation_logprobs": np.zeros((3, 2), np.float32), "total_reward": [1, 2, 3]}
    refused(buf, buf.commit_group, lease, [{**good, "total_reward": [1, 2]}],
            match="field 'total_reward' has shape \\[2\\], the schema declares \\[3\\]")
    refused(buf, buf.commit_group, lease, [{**good, "generation_logprobs": np.zeros(3, np.float32)}],
            match="field 'generation_logprobs' has trailing dims \\[\\], the schema declares \\[2\\]")
    assert buf.commit_group(lease, [good]).ready
    assert buf.store.read(lambda t: t.get_json("meta", b"shapes")) is None  # declared shapes need no pin
    batch = buf.read_batch([lease.group_id])
    assert batch.tensors["generation_logprobs"].shape == (1, 3, 2) and batch.tensors["total_reward"].shape == (1, 3)


def test_token_fields_are_1d_unless_declared(buffer_factory):
    buf = buffer_factory(group_size=1)
    [lease] = buf.admit([0])
    row = make_group(1, 3)[0]
    row["generation_logprobs"] = row["generation_logprobs"].reshape(-1, 1)
    refused(buf, buf.commit_group, lease, [row], match="trailing dims \\[1\\], the schema declares \\[\\]")


def test_read_batch_of_rows_a_pin_never_covered_is_a_kvckpt_error(buffer_factory):
    """A store written before shapes were pinned may hold rows that do not stack: read_batch says so
    (naming both rows and the field) instead of torch.stack's RuntimeError; the list layout reads them."""
    buf = buffer_factory(group_size=1)
    first, second = buf.admit([0, 1])
    assert buf.commit_group(first, _reward_rows([()])).ready
    buf.store.write(lambda t: t.delete("meta", b"shapes"))  # what a store of the previous version looks like
    assert buf.commit_group(second, _reward_rows([(3,)])).ready
    gids = [first.group_id, second.group_id]
    with pytest.raises(SchemaMismatch, match="rows a0-p0_g0 and a0-p1_g0: field 'total_reward' has shape \\[\\] "
                                             "and \\[3\\], which do not stack"):
        buf.read_batch(gids)
    assert [r["total_reward"].shape for r in buf.read_batch(gids, layout="list").rows] == [(), (3,)]


# -- export of text fields -----------------------------------------------------------------------
def test_text_fields_export_as_text(buffer_factory, tmp_path):
    pytest.importorskip("pyarrow")
    import json

    import pyarrow.parquet as pq
    from kvckpt.tools.export import export

    schema = {"input_ids": ("int64", "token"), "total_reward": ("float32", "row"), "prompt": ("str", "row"),
              "raw": ("bytes", "row")}
    buf = buffer_factory(schema=schema, group_size=2)
    [lease] = buf.admit([0])
    assert buf.commit_group(lease, [{"input_ids": [1, 2], "total_reward": 0.5, "prompt": "héllo", "raw": b"\x00\x01"},
                                    {"input_ids": [3], "total_reward": 1.0, "prompt": "", "raw": b""}]).ready
    path = buf.path
    buf.close()
    export(path, str(tmp_path / "o.jsonl"), fmt="jsonl")
    lines = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(r["prompt"], r["raw"]) for r in lines] == [("héllo", "AAE="), ("", "")]  # bytes as base64
    export(path, str(tmp_path / "o.parquet"), fmt="parquet")
    table = pq.read_table(tmp_path / "o.parquet")
    assert str(table.schema.field("prompt").type) == "string" and str(table.schema.field("raw").type) == "binary"
    assert table.column("prompt").to_pylist() == ["héllo", ""] and table.column("raw").to_pylist() == [b"\x00\x01", b""]


def test_a_whole_commit_replaces_a_text_sibling_and_keeps_byte_counts(buffer_factory):
    buf = buffer_factory(schema=TEXT_SCHEMA, group_size=3)
    [lease] = buf.admit([0])
    rows = trainer_rows(3)
    assert not buf.commit_sample(lease, 0, {**rows[0], "prompt": "a much longer first draft"}).ready
    assert buf.commit_group(lease, rows).ready  # regenerates row 0: its old bytes leave the counts
    raw = sum(codec.decode(v).nbytes for _, v in buf.store.read(lambda t: list(t.iter_prefix("rows", b""))))
    assert buf.group(lease.group_id).raw_bytes == raw == buf.stats()["raw_bytes"]


def test_deep_verify_holds_rows_to_the_pins(buffer_factory):
    from kvckpt import check

    buf = buffer_factory(schema=TEXT_SCHEMA, group_size=3)
    [lease] = buf.admit([0])
    assert buf.commit_group(lease, trainer_rows(3)).ready
    assert buf.store.read(lambda t: check(t, deep=True)).ok
    buf.store.write(lambda t: t.put_json("meta", b"shapes", {"total_reward": [5]}))  # a pin no row matches
    problems = buf.store.read(lambda t: check(t, deep=True)).problems
    assert [(p.code, p.key) for p in problems] == [("schema", f"rows/a0-p0_g{i}") for i in range(3)]
    assert "fixes it at [5]" in problems[0].message
    buf.store.write(lambda t: t.put_json("meta", b"shapes", {"nope": []}))
    assert [(p.code, p.key) for p in buf.store.read(lambda t: check(t, deep=True)).problems] == [
        ("schema", "meta/shapes")]


def test_the_in_memory_baseline_buffer_reads_text_and_bfloat16_like_the_store():
    from kvckpt import BufferConfig
    from kvckpt.testing.fixtures.memory_buffer import MemoryReplayBuffer

    mem = MemoryReplayBuffer(BufferConfig(group_size=3, schema=TEXT_SCHEMA))
    [lease] = mem.admit([0])
    assert mem.commit_group(lease, trainer_rows(3)).ready
    batch = mem.read_batch([lease.group_id])
    assert batch.tensors["prompt"] == ["what is 0+1? ✓", "what is 1+1? ✓", "what is 2+1? ✓"]
    assert batch.tensors["half"].dtype == torch.bfloat16 and batch.tensors["input_ids"].dtype == torch.int64


def test_read_batch_decodes_rows_under_the_schema_limits(buffer_factory):
    """A stored row whose checksums and group digest are all valid but whose zstd body would
    decode far past max_tokens is refused before it is decompressed (a crafted checkpoint)."""
    from kvckpt.storage import keys
    from kvckpt.tables.digest import group_digest, row_digest

    schema = RowSchema({"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"),
                        "total_reward": ("float32", "row")}, max_tokens=1000)
    buf = buffer_factory(schema=schema, group_size=1)
    [lease] = buf.admit([0])
    assert buf.commit_group(lease, [make_group(1, 1)[0]]).ready
    tokens = 1 << 22  # 4M tokens: 48 MiB decoded, a few KB stored
    bomb = codec.encode({"input_ids": np.zeros(tokens, np.int64), "generation_logprobs": np.zeros(tokens, np.float32),
                         "total_reward": np.float32(1)}, {"group_id": lease.group_id, "index": 0}, level=19)
    assert len(bomb) < 100_000

    def forge(txn):
        txn.put("rows", keys.row_key(lease.group_id, 0), bomb)
        doc = txn.get_json("groups", keys.group_key(lease.group_id))
        txn.put_json("groups", keys.group_key(lease.group_id), {**doc, "digest": group_digest([row_digest(bomb)])})

    buf.store.write(forge)
    with pytest.raises(CorruptRecord, match=r"field 'input_ids' would decode to 33554432 bytes .*over its limit "
                                            r"of 8000") as info:
        buf.read_batch([lease.group_id])
    assert info.value.key == f"rows/{lease.group_id}_g0"
