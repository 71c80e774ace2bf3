"""Formats 3 and 4 pinned to the bytes docs/format.md documents, below kvckpt's own layout code.

Format 4 is format 3 plus the ``progress`` table (suffix ``0x02`` under ``g``): a store without
progress records holds exactly format 3's keys, and only its format record's version differs.

Every other test writes and reads format 3 through ``kvckpt.storage.layout``, so a change to the
key layout that is consistent with itself (swapping the ledger and group suffix bytes, say) passes
them all and strands every file already written. Here the stored keys are read with raw LMDB calls
and compared with keys built by hand from the documented table, and the golden format-3 checkpoint
written by the version that introduced the format (``tests/golden/``, made by ``tests/_golden.py``)
must open, verify and read identically, as formats 1 and 2 still do.
"""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import _golden
import lmdb
import pytest
from _cli import kv

from kvckpt import ReplayBuffer, restore

GOLDEN = Path(_golden.HERE)


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def _i64(n: int) -> bytes:
    return (n + (1 << 63)).to_bytes(8, "big")


def _record_meta(value: bytes) -> dict:
    """The ``meta`` of a kvckpt record, parsed by the documented rules (magic, CRC-32, header)."""
    magic, crc, hlen = struct.unpack_from("<4sII", value)
    assert magic == b"KVR1" and crc == zlib.crc32(value[8:]), value[:16]
    return json.loads(value[12:12 + hlen])["meta"]


def _documented_keys(expected: dict, group_size: int) -> dict[bytes, str]:
    """Every key format 3 stores for the buffer ``expected`` describes (``_golden.read_everything``),
    built from docs/format.md's tables alone, each with the table it belongs to."""
    keys = {b"m" + name: "meta" for name in (b"format", b"config", b"state", b"dataloader", b"shortfall",
                                              b"shapes", b"checkpoint")}
    for g in expected["groups"]:
        gid, seq = g["group_id"].encode(), _u64(g["seq"])
        keys[b"g" + gid + b"\x00"] = "groups"
        if g["rows_stored"]:
            keys.update({b"r" + gid + b"\x00" + struct.pack(">I", i): "rows" for i in range(group_size)})
        if g["state"] == "ready":
            keys[b"irs" + seq] = keys[b"irw" + _i64(g["start_weight"]) + seq] = "index"
            if g["target_step"] is not None:
                keys[b"irt" + _i64(g["target_step"]) + seq] = "index"
        elif g["state"] == "claimed":
            keys[b"icl" + _i64(g["claimed_step"]) + seq] = "index"
        elif g["state"] == "consumed" and g["rows_stored"]:
            keys[b"ico" + _i64(g["consumed_step"]) + seq] = "index"
    for e in expected["ledger"]:
        gid = e["group_id"].encode()
        keys[b"g" + gid + b"\x01"] = "ledger"
        keys[b"ipw" + _i64(e["start_weight"]) + _u64(e["seq"])] = "index"
        keys.update({b"r" + gid + b"\x00" + struct.pack(">I", i): "rows" for i in e["siblings"]})
    return keys


def _raw_items(path: str) -> dict[bytes, bytes]:
    env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=0)
    try:
        with env.begin() as txn:
            return dict(txn.cursor())
    finally:
        env.close()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """The golden scenario written again by this version of kvckpt."""
    return _golden.build(str(tmp_path_factory.mktemp("fresh")))


@pytest.fixture
def golden(tmp_path: Path) -> tuple[str, dict]:
    """A copy of the committed golden checkpoint (the committed file is never opened) and what it reads as."""
    path = str(tmp_path / _golden.FILE)
    shutil.copyfile(GOLDEN / _golden.FILE, path)
    return path, json.loads((GOLDEN / _golden.EXPECTED).read_text())


@pytest.mark.parametrize("which", ["fresh", "golden"])
def test_format3_stores_exactly_the_documented_keys_in_the_main_database(which, written, golden):
    path, expected = written if which == "fresh" else golden
    items = _raw_items(path)
    keys = _documented_keys(expected, group_size=2)
    assert sorted(items) == sorted(keys)  # no named database, nothing else, every documented key
    fmt = _record_meta(items[b"mformat"])
    version = {"fresh": 4, "golden": 3}[which]  # the written file is format 4, the golden one format 3
    assert (fmt["format"], fmt["version"]) == ("kvckpt", version) and len(fmt["store_id"]) == 32
    for key, table in keys.items():
        value = items[key]
        if table == "index":
            assert value == key_owner(key, expected), key
            continue
        meta = _record_meta(value)
        if table == "groups":  # suffix 0x00: the group record, with its state
            assert meta["group_id"].encode() == key[1:-1] and "state" in meta and "siblings" not in meta, key
        elif table == "ledger":  # suffix 0x01: the in-flight entry, with its siblings
            assert meta["group_id"].encode() == key[1:-1] and "siblings" in meta and "state" not in meta, key
        elif table == "rows":
            assert meta == {"group_id": key[1:-5].decode(), "index": struct.unpack(">I", key[-4:])[0]}, key
    state = _record_meta(items[b"mstate"])
    assert {k: state[k] for k in ("trainer_version", "seq", "inflight", "ready", "claimed")} == \
        {k: expected["state"][k] for k in ("trainer_version", "seq", "inflight", "ready", "claimed")}


def key_owner(key: bytes, expected: dict) -> bytes:
    """The group id an index key points to (its value): the group or entry with the key's ``seq``."""
    seq = int.from_bytes(key[-8:], "big")
    [gid] = [d["group_id"] for d in (*expected["groups"], *expected["ledger"]) if d["seq"] == seq]
    return gid.encode()


def _as_written(now: dict, expected: dict) -> dict:
    """``now`` without the record fields a later kvckpt added, when they read as absent (``None``):
    format 4's ledger entries gained ``token_weight``, which a format-3 entry cannot hold. Any other
    difference (a value, a missing field, a new field with a value) stays and fails the comparison."""
    def trim(docs: list[dict], written: list[dict]) -> list[dict]:
        if len(docs) != len(written):
            return docs
        return [{k: v for k, v in d.items() if k in w or v is not None} for d, w in zip(docs, written, strict=True)]
    return {**now, "groups": trim(now["groups"], expected["groups"]), "ledger": trim(now["ledger"], expected["ledger"])}


def test_the_golden_format3_file_opens_verifies_and_reads_identically(golden, tmp_path):
    path, expected = golden
    with ReplayBuffer.open(path, readonly=True) as ro:
        assert ro.store.info["version"] == 3
        assert _as_written(json.loads(json.dumps(_golden.read_everything(ro))), expected) == expected
    assert kv("verify", "--deep", path).stdout.startswith(f"{path}: ok ")  # exit status 0, every row decoded
    buf, plan = restore(path, str(tmp_path / "live.kv"))  # and a trainer resumes from it
    try:
        now = _golden.read_everything(buf)
        assert now["rows"] == expected["rows"] and now["dataloader"] == expected["dataloader"]
        released = {"claimed": "ready"}  # a restore hands claimed groups back
        assert [(g["group_id"], g["state"]) for g in now["groups"]] == \
            [(g["group_id"], released.get(g["state"], g["state"])) for g in expected["groups"]]
        assert sorted(x.group_id for x in plan.leases) == sorted(e["group_id"] for e in expected["ledger"])
    finally:
        buf.close()
    assert (GOLDEN / _golden.FILE).stat().st_size < 100_000


def test_format4_progress_chunks_sit_between_the_group_record_and_the_ledger_entry(tmp_path):
    """A progress chunk's key is ``g`` + group id + ``0x00`` + row index (u32 BE) + start (u64 BE) +
    ``0x02``, its record meta names exactly that chunk, and it sorts between its prompt's group
    record (``0x00``) and ledger entry (``0x01``) (docs/format.md, "The layout")."""
    from _buffers import SCHEMA

    from kvckpt import BufferConfig, Prompt

    path = str(tmp_path / "p.kv")
    config = BufferConfig(group_size=2, sampler="in_order", max_buffered_rollouts=4, schema=SCHEMA)
    with ReplayBuffer.create(path, config) as buf:
        [lease] = buf.admit([Prompt(prompt_idx=0)])
        buf.record_progress(lease, 1, start=0, tokens=[5, 6], logprobs=[-0.5, -0.25], weight_version=0)
        buf.record_progress(lease, 1, start=2, tokens=[7], logprobs=[-1.0], weight_version=0)
    items = _raw_items(path)
    gid = lease.group_id.encode()
    chunk = {start: b"g" + gid + b"\x00" + struct.pack(">I", 1) + _u64(start) + b"\x02" for start in (0, 2)}
    assert set(chunk.values()) <= set(items)
    assert [k for k in sorted(items) if k.startswith(b"g" + gid)] == [chunk[0], chunk[2], b"g" + gid + b"\x01"]
    for start, length in ((0, 2), (2, 1)):
        assert _record_meta(items[chunk[start]]) == {"group_id": lease.group_id, "index": 1, "start": start,
                                                     "length": length, "version": 0}
    assert _record_meta(items[b"mformat"])["version"] == 4
