"""Hostile checkpoint files, built on purpose (not random flips), and a runner for one entry point.

:func:`build_all` writes one file per :data:`CASES` entry from two valid checkpoints
(:func:`kvckpt.testing.campaigns.fuzz.build_base`): valid LMDB with valid record checksums and hostile content,
and files with edited pages. Each case says what it attacks (the issue-20 class) and whether a
reader may accept it (``either``: the data must then be exactly right) or must refuse it
(``refuse``: a specific kvckpt error, or a CLI exit status with a named message).

``python tests/_crafted.py FILE WORKDIR`` runs the in-process entry points (``restore`` then a read
of everything restored; ``readonly``: ``ReplayBuffer.open(readonly=True)`` then ``read_batch`` of
every group with rows) and prints one JSON line per entry point: ``{"entry": ..., "outcome":
"ok"|"error", "type": ..., "message": ...}``; an exception that is not a specific kvckpt error is
reported with ``"generic": true``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lmdb
import numpy as np
import zstandard

from kvckpt.storage.layout import split, stored_key

PAGE = 4096
_BRANCH, _LEAF, _OVERFLOW, _BIGDATA = 0x01, 0x02, 0x04, 0x01
# MDB_meta: mm_last_pg sits after magic, version, address, mapsize and the two 48-byte MDB_db.
_LAST_PG_OFFSET = 16 + 4 + 4 + 8 + 8 + 48 + 48


@dataclass(frozen=True)
class Case:
    """One crafted file: its name, the attack class, what a reader may do, and how to make it."""

    name: str
    attack: str
    must_refuse: tuple[str, ...]  # entry points that must refuse it; the others may accept it
    base: str  # "small" or "large"
    build: Callable[[str], None]


# -- record crafting -----------------------------------------------------------------------------
def raw_json_record(meta_text: bytes) -> bytes:
    """A JSON-only record whose meta is exactly ``meta_text`` (even JSON Python cannot write),
    with a valid checksum."""
    header = b'{"z":0,"raw":0,"meta":' + meta_text + b',"fields":[]}'
    tail = struct.pack("<I", len(header)) + header
    return struct.pack("<4sI", b"KVR1", zlib.crc32(tail)) + tail


def json_record(doc: dict[str, Any]) -> bytes:
    return raw_json_record(json.dumps(doc, separators=(",", ":")).encode())


def zero_bomb_record(meta: dict[str, Any], name: str, dtype: str, count: int, itemsize: int) -> bytes:
    """A valid record with one field of ``count`` zeros, zstd-compressed (a few KB on disk)."""
    raw = count * itemsize
    cctx = zstandard.ZstdCompressor(level=1)
    chunk = bytes(1 << 24)
    out = cctx.compressobj(size=raw)
    parts, left = [], raw
    while left:
        n = min(left, len(chunk))
        parts.append(out.compress(chunk[:n]))
        left -= n
    parts.append(out.flush())
    body = b"".join(parts)
    header = json.dumps({"z": 1, "raw": raw, "meta": meta, "fields": [[name, dtype, [count], [], raw]]},
                        separators=(",", ":")).encode()
    tail = struct.pack("<I", len(header)) + header + body
    return struct.pack("<4sI", b"KVR1", zlib.crc32(tail)) + tail


def _meta(value: bytes) -> dict[str, Any]:
    hlen = struct.unpack_from("<I", value, 8)[0]
    return json.loads(value[12:12 + hlen])["meta"]


def _digest(value: bytes) -> str:
    return hashlib.blake2b(value, digest_size=8).hexdigest()


class _Edit:
    """Raw LMDB edits of a copy (no kvckpt code on the write path)."""

    def __init__(self, path: str) -> None:
        self.env = lmdb.open(path, subdir=False, lock=False, map_size=1 << 32)
        self.txn = self.env.begin(write=True)

    def get(self, table: str, key: bytes) -> bytes:
        return self.txn.get(stored_key(table, key))

    def doc(self, table: str, key: bytes) -> dict[str, Any]:
        return _meta(self.get(table, key))

    def put(self, table: str, key: bytes, value: bytes) -> None:
        self.txn.put(stored_key(table, key), value)

    def delete(self, table: str, key: bytes) -> None:
        assert self.txn.delete(stored_key(table, key))

    def items(self, table: str) -> list[tuple[bytes, bytes]]:
        return [(where[1], value) for stored, value in self.txn.cursor()
                if (where := split(stored)) is not None and where[0] == table]

    def ready_group(self) -> tuple[bytes, dict[str, Any]]:
        for key, value in self.items("groups"):
            doc = _meta(value)
            if doc["state"] in ("ready", "claimed", "consumed") and doc["rows_stored"]:
                return key, doc
        raise AssertionError("the base has no group with rows")

    def refresh_digest(self, gid: str, doc: dict[str, Any]) -> None:
        """Make the group's digest (and raw/stored sizes when asked) agree with its stored rows."""
        rows = [v for k, v in self.items("rows") if k.startswith(gid.encode() + b"\0")]
        doc["digest"] = _digest("".join(_digest(v) for v in rows).encode())
        self.put("groups", gid.encode(), json_record(doc))

    def close(self) -> None:
        self.txn.commit()
        self.env.close()


def _edited(fn: Callable[[_Edit], None]) -> Callable[[str], None]:
    def build(path: str) -> None:
        edit = _Edit(path)
        fn(edit)
        edit.close()
    build.edits_records = True  # type: ignore[attr-defined]  # format 3 records: see edits_records()
    return build


def edits_records(case: Case) -> bool:
    """Whether ``case`` edits records of a format-3 file through raw LMDB (so an old-format copy is
    rewritten after the edit), rather than its pages or the whole file (rewritten before)."""
    return getattr(case.build, "edits_records", False)


# -- the cases -----------------------------------------------------------------------------------
def _state_5000_digits(e: _Edit) -> None:
    text = json.dumps(e.doc("meta", b"state"), separators=(",", ":")).encode()
    text = re.sub(rb'"dispatch_index":\d+', b'"dispatch_index":1' + b"0" * 5000, text, count=1)
    e.put("meta", b"state", raw_json_record(text))


def _start_weight_2_70(e: _Edit) -> None:
    key, doc = e.ready_group()
    doc["start_weight"] = 2 ** 70
    e.put("groups", key, json_record(doc))


def _stamp_without_version(e: _Edit) -> None:
    doc = e.doc("meta", b"checkpoint")
    del doc["trainer_version"]
    e.put("meta", b"checkpoint", json_record(doc))


def _state_without_version(e: _Edit) -> None:
    doc = e.doc("meta", b"state")
    del doc["trainer_version"]
    e.put("meta", b"state", json_record(doc))


def _config(change: Callable[[dict[str, Any]], None]) -> Callable[[_Edit], None]:
    def edit(e: _Edit) -> None:
        doc = e.doc("meta", b"config")
        change(doc)
        e.put("meta", b"config", json_record(doc))
    return edit


def _group_size_1e12(e: _Edit) -> None:
    key, doc = e.ready_group()
    doc["group_size"] = 10 ** 12
    e.put("groups", key, json_record(doc))


def _row(e: _Edit, make: Callable[[str, int], bytes], sizes: bool = False) -> None:
    """Replace row 0 of a ready group, keep the group digest (and, with ``sizes``, the group's
    declared byte counts) consistent with it."""
    key, doc = e.ready_group()
    gid = key.decode()
    value = make(gid, 0)
    e.put("rows", gid.encode() + b"\0" + (0).to_bytes(4, "big"), value)
    if sizes:
        meta_len = struct.unpack_from("<I", value, 8)[0]
        doc["raw_bytes"] = json.loads(value[12:12 + meta_len])["raw"] * 4
        doc["stored_bytes"] = len(value) * 4
    e.refresh_digest(gid, doc)


def _shape_overflow(gid: str, index: int) -> bytes:
    header = json.dumps({"z": 0, "raw": 0, "meta": {"group_id": gid, "index": index},
                         "fields": [["input_ids", "int64", [2 ** 39] * 3, [], 0],
                                    ["logprobs", "float32", [2 ** 39] * 3, [], 0],
                                    ["reward", "float32", [], [], 0]]}, separators=(",", ":")).encode()
    tail = struct.pack("<I", len(header)) + header
    return struct.pack("<4sI", b"KVR1", zlib.crc32(tail)) + tail


def _bomb_row(gid: str, index: int) -> bytes:
    return zero_bomb_record({"group_id": gid, "index": index}, "logprobs", "float32", 2 ** 29, 4)


def _stale_digest(e: _Edit) -> None:
    from kvckpt.storage import codec

    key, _ = e.ready_group()
    gid = key.decode()
    row_key = gid.encode() + b"\0" + (1).to_bytes(4, "big")
    record = codec.decode(e.get("rows", row_key))
    arrays = dict(record.arrays)
    arrays["reward"] = arrays["reward"] + 1  # a different reward, a valid record checksum
    e.put("rows", row_key, codec.encode(arrays, record.meta))


def _wrong_dtype_row(gid: str, index: int) -> bytes:
    """The row's logprobs as float64 (the schema says float32): a valid record of the wrong type."""
    from kvckpt.storage import codec

    rng = np.random.default_rng(index)
    return codec.encode({"input_ids": rng.integers(0, 9, 4, dtype=np.int64), "logprobs": rng.random(4),
                         "reward": np.float32(0.5)}, {"group_id": gid, "index": index})


def _deep_header_row(gid: str, index: int) -> bytes:
    """A row whose header nests 100,000 JSON arrays (a recursion bomb for a JSON parser)."""
    meta = json.dumps({"group_id": gid, "index": index}, separators=(",", ":")).encode()
    header = b'{"z":0,"raw":0,"meta":' + meta + b',"fields":[],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    tail = struct.pack("<I", len(header)) + header
    return struct.pack("<4sI", b"KVR1", zlib.crc32(tail)) + tail


def _long_header_row(gid: str, index: int) -> bytes:
    """A row whose header is 2 MiB of JSON (the codec's limit is 1 MiB)."""
    meta = json.dumps({"group_id": gid, "index": index, "pad": "x" * (2 << 20)}, separators=(",", ":")).encode()
    return raw_json_record(meta)


def _durable_object(e: _Edit) -> None:
    doc = e.doc("meta", b"state")
    doc["durable"] = {str(v): v for v in doc["durable"]} or {"0": 0}
    e.put("meta", b"state", json_record(doc))


def _dataloader_bomb(e: _Edit) -> None:
    e.put("meta", b"dataloader", zero_bomb_record({}, "state", "uint8", 2 ** 31, 1))


def _control_chars(e: _Edit) -> None:
    """Rename an in-flight prompt without siblings to an id full of terminal escapes."""
    entries = [(k, _meta(v)) for k, v in e.items("ledger")]
    rename, doc = next((k, d) for k, d in entries if not d["siblings"])
    evil = "x\x1b]0;owned\x07\x1b[2J\x1b[31m"
    for ikey, ivalue in e.items("index"):
        if ivalue == rename:
            e.put("index", ikey, evil.encode())
    e.delete("ledger", rename)
    doc["group_id"] = evil
    e.put("ledger", evil.encode(), json_record(doc))


def _bigdata_node(path: str) -> None:
    """Set the data size of the first large-value node to 1.5 GiB (its overflow pages stay small)."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
    page = 2
    while page < len(data) // PAGE:
        off = page * PAGE
        flags, lower = struct.unpack_from("<HH", data, off + 10)
        if flags & _OVERFLOW:  # a run of pages: only the first has a header
            page += struct.unpack_from("<I", data, off + 12)[0]
            continue
        for i in range((lower - 16) // 2 if flags & _LEAF else 0):
            ptr = struct.unpack_from("<H", data, off + 16 + 2 * i)[0]
            if struct.unpack_from("<H", data, off + ptr + 4)[0] & _BIGDATA:
                size = 3 << 29
                struct.pack_into("<HH", data, off + ptr, size & 0xFFFF, size >> 16)
                with open(path, "r+b") as f:
                    f.write(data)
                return
        page += 1
    raise AssertionError("no large value in the base")


def _pages(path: str, want: int) -> tuple[bytearray, int]:
    """The file's bytes and the number of its first page whose flags are exactly ``want``,
    stepping over overflow runs (only a run's first page has a header)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    page = 2
    while page < len(data) // PAGE:
        flags = struct.unpack_from("<H", data, page * PAGE + 10)[0]
        if flags == want:
            return data, page
        page += struct.unpack_from("<I", data, page * PAGE + 12)[0] if flags & _OVERFLOW else 1
    raise AssertionError(f"no page with flags {want:#x} in the base")


def _write(path: str, data: bytearray) -> None:
    with open(path, "r+b") as f:
        f.write(data)


def _overflow_header_pages(path: str) -> None:
    """Make the first overflow run's header claim 5 pages more than its value needs: reads still
    work (they follow the node's size), but freeing the value (an eviction) would free 5 pages of
    other values."""
    data, page = _pages(path, _OVERFLOW)
    at = page * PAGE + 12
    struct.pack_into("<I", data, at, struct.unpack_from("<I", data, at)[0] + 5)
    _write(path, data)


def _branch_child_twice(path: str) -> None:
    """Point the second child of the first branch page at its first child (a page reachable twice:
    a lookup lands in the wrong leaf, and a write frees the page while it is still in use)."""
    data, page = _pages(path, _BRANCH)
    at = page * PAGE
    first, second = (struct.unpack_from("<H", data, at + 16 + 2 * i)[0] for i in (0, 1))
    data[at + second:at + second + 2] = data[at + first:at + first + 2]  # child page number, low 32 bits
    data[at + second + 4:at + second + 6] = data[at + first + 4:at + first + 6]  # and its high 16 bits
    _write(path, data)


def _branch_child_self(path: str) -> None:
    """Point the first child of the main tree's root (a branch page) at the root itself: a lookup
    through it descends until liblmdb's 32-level cursor stack is full (``MDB_CURSOR_FULL``). The
    root, not the file's first branch page: in a live file that may be a free page's old copy."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    main = 16 + 24 + 48  # the page header, magic ... mapsize, the freeDB's record
    metas = [(struct.unpack_from("<Q", data, m * PAGE + main + 56)[0], m) for m in (0, 1)]
    meta = max(metas)[1] * PAGE
    page = struct.unpack_from("<Q", data, meta + main + 40)[0]
    assert struct.unpack_from("<H", data, page * PAGE + 10)[0] == _BRANCH, "the main tree is one leaf"
    at = page * PAGE
    first = struct.unpack_from("<H", data, at + 16)[0]
    struct.pack_into("<HHH", data, at + first, page & 0xFFFF, (page >> 16) & 0xFFFF, page >> 32)
    _write(path, data)


def _sparse_tail(path: str) -> None:
    os.truncate(path, os.path.getsize(path) + (3 << 30))


def _million_pages(path: str) -> None:
    with open(path, "r+b") as f:
        for meta in (0, 1):
            f.seek(meta * PAGE + _LAST_PG_OFFSET)
            f.write(struct.pack("<Q", (1 << 20) - 1))
    os.truncate(path, (1 << 20) * PAGE)


def _foreign(path: str) -> None:
    os.unlink(path)
    env = lmdb.open(path, subdir=False, max_dbs=8, lock=False, map_size=1 << 24)
    db = env.open_db(b"users")
    with env.begin(write=True) as txn:
        txn.put(b"alice", b"x" * 100, db=db)
    env.close()


#: Every entry point the suite feeds each file to.
ENTRIES = ("restore", "readonly", "inspect", "verify", "verify --deep", "export", "diff", "compact")
#: Entry points that check (or use) the stamp, the cursors and every group record.
_META = ("restore", "verify", "verify --deep")
#: Entry points that decode rows.
_ROWS = ("restore", "readonly", "export", "verify --deep")
_CONFIG = ("restore", "readonly", "inspect", "verify", "verify --deep", "export")

CASES: tuple[Case, ...] = (
    Case("state-5000-digit-int", "hostile value: json ValueError", (*_META, "inspect", "diff"), "small",
         _edited(_state_5000_digits)),
    Case("start-weight-2**70", "hostile value: OverflowError", _META, "small", _edited(_start_weight_2_70)),
    Case("stamp-without-trainer-version", "hostile value: KeyError", _META, "small",
         _edited(_stamp_without_version)),
    Case("state-without-trainer-version", "hostile value: KeyError", _META, "small",
         _edited(_state_without_version)),
    Case("config-unknown-key", "hostile value: TypeError", tuple(e for e in _CONFIG if e != "export"), "small",
         _edited(_config(lambda d: d.update(bogus=1)))),
    Case("config-schema-list", "hostile value: AttributeError", _CONFIG, "small",
         _edited(_config(lambda d: d.update(schema=[["input_ids", "int64", "token"]])))),
    Case("config-group-size-1e12", "memory bomb: group_size", _META, "small",
         _edited(_config(lambda d: d.update(group_size=10 ** 12)))),
    Case("group-size-1e12", "memory bomb: group_size", (*_META, "readonly"), "small", _edited(_group_size_1e12)),
    Case("row-shape-overflow", "hostile value: element count overflow", _ROWS, "small",
         _edited(lambda e: _row(e, _shape_overflow))),
    Case("row-zstd-bomb", "decompression bomb: 2 GiB row, group sizes stale", _ROWS, "small",
         _edited(lambda e: _row(e, _bomb_row))),
    Case("row-zstd-bomb-declared", "decompression bomb: 2 GiB row, group sizes agree", _ROWS, "small",
         _edited(lambda e: _row(e, _bomb_row, sizes=True))),
    Case("dataloader-bomb", "decompression bomb: meta/dataloader 2 GiB", ("restore", "readonly", "inspect",
                                                                          "verify", "verify --deep"), "small",
         _edited(_dataloader_bomb)),
    Case("stale-group-digest", "wrong data: row changed, checksum fixed", _ROWS, "small",
         _edited(_stale_digest)),
    Case("row-wrong-dtype", "wrong data: float64 row where the schema says float32", _ROWS, "small",
         _edited(lambda e: _row(e, _wrong_dtype_row))),
    Case("row-header-100k-deep", "hostile value: JSON nested 100,000 deep in a row header", _ROWS, "small",
         _edited(lambda e: _row(e, _deep_header_row))),
    Case("row-header-2MiB", "hostile value: a row header over the codec's 1 MiB limit", _ROWS, "small",
         _edited(lambda e: _row(e, _long_header_row))),
    Case("state-durable-object", "hostile value: meta/state durable is an object", _META, "small",
         _edited(_durable_object)),
    Case("bigdata-node-1.5GiB", "edited page: SIGBUS", ENTRIES, "large", _bigdata_node),
    Case("overflow-header-pages", "edited page: an overflow header claiming 5 more pages", ENTRIES, "large",
         _overflow_header_pages),
    Case("branch-child-twice", "edited page: a branch page naming one child twice", ENTRIES, "large",
         _branch_child_twice),
    Case("sparse-tail-3GiB", "sparse file: truncate -s +3G", (), "small", _sparse_tail),
    Case("meta-claims-1M-pages", "sparse file: meta claims 1M pages", ENTRIES, "small", _million_pages),
    Case("control-chars-in-id", "terminal escapes in a group id", (), "small", _edited(_control_chars)),
    Case("foreign-lmdb", "another application's LMDB file", ENTRIES, "small", _foreign),
)


def build_all(directory: str) -> dict[str, str]:
    """Write the two bases and every case into ``directory``; returns case name -> file."""
    from kvckpt.testing.campaigns.fuzz import build_base

    bases = {}
    for kind in ("small", "large"):
        bases[kind] = os.path.join(directory, f"base-{kind}.kvckpt")
        build_base(bases[kind], kind == "large")
    out = {}
    for case in CASES:
        path = os.path.join(directory, f"{case.name}.kvckpt")
        shutil.copyfile(bases[case.base], path)
        case.build(path)
        out[case.name] = path
    out.update({f"base-{k}": v for k, v in bases.items()})
    return out


# -- running one in-process entry point ----------------------------------------------------------
def _read_each(buf: Any) -> tuple[int, list[tuple[str, BaseException]]]:
    """Read every group with rows, one ``read_batch`` each, going on past a group that fails (a
    trainer keeps using the others); then the ledger and the dataloader state. Returns the rows
    read and each failing group with its error."""
    gids = [g.group_id for g in buf.groups() if g.rows_stored and g.state not in ("evicted", "aborted")]
    rows, failed = 0, []
    for gid in gids:
        try:
            rows += len(buf.read_batch([gid], layout="list").rows)
        except Exception as exc:  # judged by the caller: a specific kvckpt error or not
            failed.append((gid, exc))
    buf.ledger()
    buf.dataloader_state()
    return rows, failed


def _error(exc: BaseException) -> dict[str, Any]:
    from kvckpt.errors import KvckptError

    return {"outcome": "error", "type": type(exc).__name__, "message": str(exc)[:400],
            "generic": not isinstance(exc, KvckptError) or type(exc) is KvckptError}


def run_entry(entry: str, path: str, workdir: str) -> dict[str, Any]:
    """Run one entry point on ``path``; never raises (the outcome is the return value).

    ``at`` says where a refusal came from: ``open`` (``restore()`` or the read-only open itself)
    or ``read`` (a ``read_batch`` after it; ``failed_groups`` then names every group whose read
    failed and ``rows`` counts the rows the other groups gave).
    """
    from kvckpt import ReplayBuffer, restore

    try:
        if entry == "restore":
            buf, plan = restore(path, os.path.join(workdir, "live.kv"))
            extra = {"redispatch": len(plan.leases)}
        elif entry == "readonly":
            buf, extra = ReplayBuffer.open(path, readonly=True), {}
        else:
            raise ValueError(f"unknown entry point {entry!r}")
    except BaseException as exc:  # the point: report any exception
        return {**_error(exc), "at": "open"}
    try:
        rows, failed = _read_each(buf)
        if entry == "restore":
            extra["live_bytes"] = os.path.getsize(buf.path)
    except BaseException as exc:
        return {**_error(exc), "at": "read"}
    finally:
        buf.close()
    if failed:
        return {**_error(failed[0][1]), "at": "read", "rows": rows,
                "failed_groups": [gid for gid, _ in failed],
                "generic": any(_error(exc)["generic"] for _, exc in failed)}
    return {"outcome": "ok", "rows": rows, **extra}


if __name__ == "__main__":
    for name in ("restore", "readonly"):
        print(json.dumps({"entry": name, **run_entry(name, sys.argv[1], sys.argv[2])}), flush=True)
