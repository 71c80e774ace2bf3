"""Format 3's layout (every table in one B-tree) and the formats 1 and 2 it replaces.

Old files are made from new ones with raw LMDB calls (``tests/_old_format.py``). Every test
closes and reopens the file: what it asserts is what the next process finds.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
from _buffers import dump_store, make_group
from _cli import kv
from _old_format import rewrite_as_named_tables

from kvckpt import FormatError, Prompt, ReplayBuffer, check, restore
from kvckpt.storage import codec
from kvckpt.storage import store as store_module
from kvckpt.storage.layout import NamedTables, OneTree, partial_copy_key, split, stored_key
from kvckpt.storage.store import FORMAT_VERSION, MAX_DBS, Store


def _busy_buffer(buffer_factory) -> tuple[str, dict]:
    """A closed buffer file with ready, in-flight and partially committed prompts, and its dump."""
    buf = buffer_factory(group_size=2, capacity=8)
    leases = buf.admit([Prompt(prompt_idx=i) for i in range(5)])
    for i, lease in enumerate(leases[:3]):
        buf.commit_group(lease, make_group(2, i))
    buf.commit_sample(leases[3], 0, make_group(2, 3)[0])
    before = dump_store(buf)
    buf.close()
    return buf.path, before


def _without_format(dump: dict) -> dict:
    """A dump less ``meta/format`` (its version is what a rewrite and an upgrade change)."""
    return {**dump, "meta": [(k, v) for k, v in dump["meta"] if k != b"format"]}


def _main_keys(path: str) -> list[bytes]:
    env = lmdb.open(path, subdir=False, max_dbs=MAX_DBS, lock=False, readonly=True)
    try:
        with env.begin() as txn:
            return [key for key, _ in txn.cursor()]
    finally:
        env.close()


def test_a_new_store_keeps_every_table_in_the_main_database(buffer_factory):
    path, _ = _busy_buffer(buffer_factory)
    tables = {split(key)[0] for key in _main_keys(path)}
    assert tables == {"meta", "groups", "rows", "ledger", "index"}
    with Store(path, readonly=True) as store:
        assert isinstance(store.layout, OneTree) and store.info["version"] == FORMAT_VERSION == 4


@pytest.mark.parametrize("version", [1, 2])
def test_an_old_store_reads_as_it_is_and_upgrades_in_one_transaction(buffer_factory, version):
    path, before = _busy_buffer(buffer_factory)
    rewrite_as_named_tables(path, version)
    with ReplayBuffer.open(path, readonly=True) as ro:  # a reader changes nothing
        assert isinstance(ro.store.layout, NamedTables) and ro.store.info["version"] == version
        assert len(ro.ledger()) == 2 and ro.state()["ready"] == 3
        if version == 2:
            assert _without_format(dump_store(ro)) == _without_format(before)
            assert ro.store.read(lambda t: check(t, deep=True)).ok
    with ReplayBuffer.open(path) as up:
        assert isinstance(up.store.layout, OneTree)
        assert (up.store.info["version"], up.store.info["upgraded_from"]) == (FORMAT_VERSION, version)
        assert up.store.read(lambda t: check(t, deep=True)).ok
        if version == 2:  # format 1's upgrade also fences its leases, so only format 2 is byte-identical
            assert _without_format(dump_store(up)) == _without_format(before)
    assert all(split(key) is not None for key in _main_keys(path))  # the named databases are gone
    with ReplayBuffer.open(path) as again:  # and the next process trains on as before
        [entry, _partial] = sorted(again.ledger(), key=lambda e: e.prompt_idx)
        assert again.commit_group(entry.lease(again.store.store_id), make_group(2, 4)).ready
        assert len(again.select(4, 4).group_ids) == 4
        assert again.store.read(lambda t: check(t, deep=True)).ok


_CRASH_AT_THE_SWITCH = """
import os, signal, sys
from kvckpt.storage.store import Store
store = Store(sys.argv[1])
store.upgrade_layout(prepare=lambda txn: os.kill(os.getpid(), signal.SIGKILL))
"""


def test_a_crash_at_the_switch_leaves_the_old_store_and_the_next_open_upgrades(buffer_factory):
    path, before = _busy_buffer(buffer_factory)
    rewrite_as_named_tables(path, 2)
    child = subprocess.run([sys.executable, "-c", _CRASH_AT_THE_SWITCH, path], capture_output=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    with ReplayBuffer.open(path, readonly=True) as ro:  # every record was copied; none of it counts yet
        assert ro.store.info["version"] == 2 and _without_format(dump_store(ro)) == _without_format(before)
        assert ro.store.read(lambda t: check(t, deep=True)).ok
    assert {split(key)[0] for key in _main_keys(path) if partial_copy_key(key)} == \
        {"meta", "groups", "rows", "ledger", "index"}
    with ReplayBuffer.open(path) as up:
        assert up.store.info["version"] == FORMAT_VERSION
        assert _without_format(dump_store(up)) == _without_format(before)
        assert up.store.read(lambda t: check(t, deep=True)).ok


def test_a_stale_partial_copy_is_cleared_and_the_copy_goes_in_small_batches(buffer_factory, monkeypatch):
    path, before = _busy_buffer(buffer_factory)
    rewrite_as_named_tables(path, 2)
    env = lmdb.open(path, subdir=False, max_dbs=MAX_DBS, lock=False)
    with env.begin(write=True) as txn:  # what an upgrade interrupted at an older state left behind
        for key, value in before["groups"]:
            txn.put(stored_key("groups", key), value[:-1] + b"?")
        txn.put(stored_key("ledger", b"a-prompt-since-gone"), codec.encode_json({"gone": True}))
    env.close()
    monkeypatch.setattr(store_module, "UPGRADE_BATCH_BYTES", 512)  # a batch per record or two
    with ReplayBuffer.open(path) as up:
        assert _without_format(dump_store(up)) == _without_format(before)
        assert up.store.read(lambda t: check(t, deep=True)).ok


@pytest.mark.parametrize("layout, says", [("one tree", 2), ("named tables", 3)])
def test_a_format_record_that_disagrees_with_the_layout_is_refused(buffer_factory, layout, says):
    path, _ = _busy_buffer(buffer_factory)
    env = lmdb.open(path, subdir=False, max_dbs=MAX_DBS, lock=False)
    with env.begin(write=True) as txn:
        doc = codec.decode_meta(txn.get(stored_key("meta", b"format")))
        txn.put(stored_key("meta", b"format"), codec.encode_json({**doc, "version": says}))
    env.close()
    if layout == "named tables":
        rewrite_as_named_tables(path, says)
    for readonly in (True, False):
        with pytest.raises(FormatError, match=f"version {says} but is laid out as"):
            Store(path, readonly=readonly)


def test_a_key_no_table_owns_is_a_finding(buffer_factory):
    path, _ = _busy_buffer(buffer_factory)
    env = lmdb.open(path, subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"zebra", codec.encode_json({"a": 1}))
        txn.put(b"gno-suffix", codec.encode_json({"a": 1}))
    env.close()
    with Store(path, readonly=True) as store:
        report = store.read(check)
    assert sorted(p.key for p in report.problems if p.code == "stray-key") == ["b'gno-suffix'", "b'zebra'"]


@pytest.mark.parametrize("old", [False, True])
def test_txn_scans_mean_the_same_in_both_layouts(tmp_path, old):
    path = str(tmp_path / "s.db")
    with Store(path, create=True) as store:
        def fill(txn):
            for gid in (b"a", b"ab", b"b"):
                txn.put_json("groups", gid, {"g": gid.decode()})
                txn.put_json("ledger", gid + b"x", {"l": gid.decode()})
                for i in range(3):
                    txn.put("rows", gid + b"\x00" + i.to_bytes(4, "big"), b"row")
            for n in (1, 5, 9):
                txn.put("index", b"rt" + bytes([n]), b"g%d" % n)
            txn.put("index", b"rw\x00", b"other")
        store.write(fill)
    if old:
        rewrite_as_named_tables(path, 2)
    with Store(path) as store:
        def scans(txn):
            return {"groups": [k for k, _ in txn.iter_prefix("groups", b"")],
                    "ledger": list(txn.iter_keys("ledger", b"")),
                    "from ab": [k for k, _ in txn.iter_prefix("groups", b"", start=b"ab")],
                    "rows of a": list(txn.iter_keys("rows", b"a\x00")),
                    "counts": [txn.count(t) for t in ("groups", "ledger", "rows", "index")],
                    "last rt": txn.last("index", b"rt"), "last rz": txn.last("index", b"rz"),
                    "has": [txn.has("groups", b"ab"), txn.has("groups", b"abx"), txn.has("ledger", b"abx")]}
        assert store.read(scans) == {
            "groups": [b"a", b"ab", b"b"], "ledger": [b"abx", b"ax", b"bx"], "from ab": [b"ab", b"b"],
            "rows of a": [b"a\x00" + i.to_bytes(4, "big") for i in range(3)], "counts": [3, 3, 9, 4],
            "last rt": (b"rt\x09", b"g9"), "last rz": None, "has": [True, False, True]}
        assert store.write(lambda txn: txn.delete_prefix("rows", b"ab\x00")) == 3
        assert store.read(lambda txn: (txn.count("rows"), txn.count("rows", b"a"))) == (6, 3)


def test_a_format_2_checkpoint_restores_into_a_format_3_store(buffer_factory, tmp_path):
    buf = buffer_factory(group_size=2, capacity=8)
    leases = buf.admit([Prompt(prompt_idx=i) for i in range(4)])
    for i, lease in enumerate(leases[:2]):
        buf.commit_group(lease, make_group(2, i))
    ckpt = str(tmp_path / "old.kvckpt")
    buf.checkpoint(ckpt, background=False).wait()
    buf.close()
    rewrite_as_named_tables(ckpt, 2)
    restored, plan = restore(ckpt, str(tmp_path / "live.kv"))
    try:
        assert isinstance(restored.store.layout, OneTree) and restored.store.info["upgraded_from"] == 2
        assert sorted(lease.prompt_idx for lease in plan.leases) == [2, 3]  # the in-flight prompts come back
        assert restored.state()["ready"] == 2 and restored.store.read(lambda t: check(t, deep=True)).ok
    finally:
        restored.close()
    with Store(ckpt, readonly=True) as store:  # the checkpoint itself is only read
        assert isinstance(store.layout, NamedTables) and store.info["version"] == 2


def test_every_cli_verb_reads_a_format_2_file_as_it_is(buffer_factory, tmp_path):
    path, _ = _busy_buffer(buffer_factory)
    rewrite_as_named_tables(path, 2)
    before = Path(path).read_bytes()
    inspect = json.loads(kv("inspect", path, "--json").stdout)
    assert inspect["identity"]["version"] == 2 and inspect["counts"]["rows"] == 7
    assert json.loads(kv("verify", path, "--deep", "--json").stdout)["ok"]
    kv("export", path, str(tmp_path / "rows.jsonl"), "--format", "jsonl")
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 6
    assert Path(path).read_bytes() == before


def test_a_reader_whose_file_a_writer_upgraded_is_told_to_open_it_again(buffer_factory):
    path, _ = _busy_buffer(buffer_factory)
    rewrite_as_named_tables(path, 2)
    with ReplayBuffer.open(path, readonly=True) as ro:
        assert len(ro.ledger()) == 2
        writer = "import sys; from kvckpt import ReplayBuffer; ReplayBuffer.open(sys.argv[1]).close()"
        subprocess.run([sys.executable, "-c", writer, path], check=True, timeout=120)
        with pytest.raises(FormatError, match=rf"upgraded it to format {FORMAT_VERSION}.*open it again"):
            ro.ledger()
    with ReplayBuffer.open(path, readonly=True) as again:
        assert len(again.ledger()) == 2
