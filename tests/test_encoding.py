"""Encode at the edge (issue 19): producers encode rows with the store's RowEncoder; the owner
checks the bytes without rebuilding them, and nothing a producer sends can damage the store."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from conftest import SCHEMA, dump_store, make_group

from kvckpt import BufferConfig, Prompt, ReplayBuffer, SchemaMismatch, check
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
