"""Encode at the edge (issue 19): producers encode rows with the store's RowEncoder; the owner
checks the bytes without rebuilding them, and nothing a producer sends can damage the store."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from _buffers import SCHEMA, dump_store, make_group, make_row
from _codec_bytes import body_of, header_of, seal

from kvckpt import BufferConfig, Prompt, ReplayBuffer, RowSchema, SchemaMismatch, check
from kvckpt.storage import codec
from kvckpt.storage.encoding import EncodedRow, RowEncoder


def wire(rows) -> list[dict]:
    return [EncodedRow(r.index, r.value).to_dict() for r in rows]


def refused(buf, fn, *args, match: str, **kwargs) -> None:
    before = dump_store(buf)
    with pytest.raises(SchemaMismatch, match=match):
        fn(*args, **kwargs)
    assert dump_store(buf) == before


def test_edge_encoded_commits_store_exactly_what_the_owner_would(buffer_factory):
    here, edge = buffer_factory(name="here.kv"), buffer_factory(name="edge.kv")
    encoder = RowEncoder.from_config(edge.config.to_dict())  # what a producer builds from the actor's info()
    ours, theirs = (buf.admit([Prompt(prompt_idx=seed) for seed in range(3)]) for buf in (here, edge))
    for seed, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        here.commit_group(a, make_group(2, seed))
        assert edge.commit_encoded(b, wire(encoder.encode(b, make_group(2, seed)))).ready
    rows = lambda buf: buf.store.read(lambda t: list(t.iter_prefix("rows", b"")))  # noqa: E731
    assert rows(here) == rows(edge)
    assert [(g.raw_bytes, g.stored_bytes, g.digest) for g in here.groups()] == [
        (g.raw_bytes, g.stored_bytes, g.digest) for g in edge.groups()]
    again = edge.commit_encoded(b, wire(encoder.encode(b, make_group(2, 2))))  # an identical retry
    assert again.replayed
    assert edge.store.read(lambda t: check(t, deep=True)).ok


def _refix_crc(value: bytes) -> bytes:
    return value[:4] + struct.pack("<I", zlib.crc32(value[8:])) + value[8:]


def test_hostile_encoded_rows_are_refused_and_write_nothing(buffer_factory, tmp_path):
    buf = buffer_factory()
    [lease] = buf.admit([Prompt(prompt_idx=0)])
    good = buf.row_encoder().encode(lease, make_group(2, 1))
    other = ReplayBuffer.create(str(tmp_path / "other.kv"), BufferConfig(
        group_size=2, schema={**SCHEMA, "total_reward": ("float64", "row")}))
    [foreign] = other.admit([Prompt(prompt_idx=0, group_id=lease.group_id)])
    wrong_dtype = other.row_encoder().encode(foreign, make_group(2, 1))
    other.close()
    swapped = [EncodedRow(0, good[1].value), EncodedRow(1, good[0].value)]
    flipped = bytearray(good[1].value)
    flipped[-1] ^= 1
    body = 12 + struct.unpack_from("<I", good[1].value, 8)[0]  # magic, crc, header length, header
    z_garbage = _refix_crc(good[1].value[:body] + b"\x00" * 4 + good[1].value[body + 4:])  # no zstd frame
    vector = buf.row_encoder().encode(lease, {1: {**make_group(2, 1)[1], "total_reward": torch.rand(3)}})
    bomb = codec.encode({"input_ids": torch.zeros(1 << 21, dtype=torch.int64).numpy(),
                         "generation_logprobs": torch.zeros(1 << 21).numpy(),
                         "total_reward": torch.tensor(1.0).numpy()},
                        {"group_id": lease.group_id, "index": 1}, level=1)
    cases = {
        "names group": [good[0], swapped[0]],
        "checksum mismatch": [good[0], EncodedRow(1, bytes(flipped))],
        "does not decompress": [good[0], EncodedRow(1, z_garbage)],
        "is stored as float64": wrong_dtype,
        "shape": [good[0], vector[0]],
        "would decode to 16777216 bytes": [good[0], EncodedRow(1, bomb)],
        "outside 0..1": [good[0], EncodedRow(2, good[1].value)],
        "encoded row is bytes": [good[0], {"index": 1, "value": "text"}],
    }
    for match, rows in cases.items():
        refused(buf, buf.commit_encoded, lease, [r if isinstance(r, dict) else r.to_dict() for r in rows],
                match=match)
    assert buf.commit_encoded(lease, wire(good)).ready
    assert buf.read_batch([lease.group_id]).tensors["input_ids"].shape[0] == 2
    assert buf.store.read(lambda t: check(t, deep=True)).ok


def _resealed(value: bytes, edit=None, body: bytes | None = None) -> bytes:
    """``value`` with its header edited by ``edit`` (in place) and/or another (stored) body, its
    checksum fixed: what a hostile producer can send."""
    header = header_of(value)
    if edit is not None:
        edit(header)
    return seal(header, body_of(value) if body is None else body)


def _append_duplicate(header: dict) -> None:
    header["fields"].append(header["fields"][-1])
    header["raw"] += header["fields"][-1][4]


def test_each_compiled_check_refuses_a_record_through_commit_encoded(buffer_factory):
    """One hostile row per check the owner's compiled rules make (RowSchema.rules): each refused for
    that commit alone, naming the row, with the store unchanged; the good rows then commit."""
    schema = RowSchema({**SCHEMA, "note": ("str", "row")}, optional=("note",), max_tokens=8, max_text_bytes=4)
    buf = buffer_factory(schema=schema)
    [lease] = buf.admit([Prompt(prompt_idx=0)])
    good = buf.row_encoder().encode(lease, make_group(2, 1))
    meta = {"group_id": lease.group_id, "index": 1}

    def crafted(level: int = 1, **change) -> bytes:
        fields = {**make_row(5, 7), **change}
        return codec.encode({k: v for k, v in fields.items() if v is not None}, meta, level=level,
                            dtypes=schema.dtypes)

    plain = crafted(level=0, note="abcd")  # uncompressed: header edits keep the body as stored
    frame = crafted(level=1)
    cases = {
        "'extra' is not one the rules name": crafted(extra=torch.zeros(1)),
        "required field 'generation_logprobs' is missing": crafted(generation_logprobs=None),
        "'input_ids' has shape \\[5, 2\\], the rules say 1 dims":
            crafted(input_ids=torch.zeros(5, 2, dtype=torch.int64)),
        "'generation_logprobs' has 6 tokens, other token fields have 5":
            crafted(generation_logprobs=torch.zeros(6)),
        "'input_ids' would decode to 72 bytes .* over its limit of 64":
            crafted(input_ids=torch.zeros(9, dtype=torch.int64), generation_logprobs=torch.zeros(9)),
        "'note' would decode to 6 bytes": crafted(note="ééé"),
        "'note' is not UTF-8": _resealed(plain, body=body_of(plain)[:-4] + b"\xff\xfe\xfd\xfc"),
        "'note' appears twice": _resealed(plain, _append_duplicate, body_of(plain) + b"abcd"),
        "'generation_logprobs' of float32 has invalid transforms": _resealed(
            plain, lambda h: h["fields"][1].__setitem__(3, ["bitpack"])),
        "'input_ids': 40 bytes for shape \\(4,\\)": _resealed(plain, lambda h: h["fields"][0].__setitem__(2, [4])),
        "zstd frame does not decompress": _resealed(frame, body=zstandard_truncated(frame)),
    }
    for match, value in cases.items():
        refused(buf, buf.commit_encoded, lease, [good[0].to_dict(), EncodedRow(1, value).to_dict()],
                match=f"row {lease.group_id}_g1: .*{match}")
    assert buf.commit_encoded(lease, wire(good)).ready
    assert buf.store.read(lambda t: check(t, deep=True)).ok


def zstandard_truncated(value: bytes) -> bytes:
    """The stored zstd frame of ``value`` without its last 3 bytes: a valid frame header (its content
    size is right) over an incomplete block, which only decompressing it finds."""
    stored = value[12 + struct.unpack_from("<I", value, 8)[0]:]
    assert codec.zstandard.frame_content_size(stored) == header_of(value)["raw"]
    return stored[:-3]
