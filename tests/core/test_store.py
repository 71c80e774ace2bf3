"""The single-file LMDB store: durability of commits, all-or-nothing writes, one writer, identity."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import lmdb
import numpy as np
import pytest

from kvckpt.durability.safe_open import check_structure
from kvckpt.errors import FormatError, KvckptError, ReadOnlyStore, StoreLocked, StoreNotFound
from kvckpt.storage import codec
from kvckpt.storage.layout import stored_key
from kvckpt.storage.store import FORMAT_VERSION, Snapshot, Store

CHILD_ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}


def make_store(path, rows: int = 3, **kwargs) -> str:
    """A closed store at ``path`` with ``rows`` row records and a cursor in ``meta``."""
    with Store(path, create=True, **kwargs) as store:
        def fill(txn):
            for i in range(rows):
                txn.put("rows", b"g_%d" % i, codec.encode({"ids": np.arange(100 * (i + 1))}, {"i": i}))
            txn.put_json("meta", b"cursor", {"dispatch_index": rows})
        store.write(fill)
    return os.fspath(path)


def read_all(store: Store) -> dict[bytes, codec.Record]:
    return store.read(lambda txn: {k: codec.decode(v, k.decode()) for k, v in txn.iter_prefix("rows", b"")})


def run_child(code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=timeout, env=CHILD_ENV)


# -- commits and reopen --------------------------------------------------------------------------
def test_reopen_after_close_sees_committed_data(tmp_path):
    path = tmp_path / "live.db"
    with Store(path, create=True) as store:
        store_id = store.store_id
        assert store.info["version"] == FORMAT_VERSION
        store.write(lambda txn: txn.put_json("meta", b"cursor", {"dispatch_index": 5}))
        store.write(lambda txn: txn.put("rows", b"g_0", codec.encode({"x": np.arange(10)})))
    assert sorted(os.listdir(tmp_path)) == ["live.db", "live.db-lock"]
    with Store(path) as store:  # writable reopen, no create
        assert store.store_id == store_id
        assert store.read(lambda txn: txn.get_json("meta", b"cursor")) == {"dispatch_index": 5}
        assert np.array_equal(read_all(store)[b"g_0"].arrays["x"], np.arange(10))
        store.write(lambda txn: txn.put_json("meta", b"cursor", {"dispatch_index": 6}))
    with Store(path, readonly=True) as store:
        assert store.read(lambda txn: txn.get_json("meta", b"cursor")) == {"dispatch_index": 6}
        assert store.store_id == store_id


def test_create_on_an_existing_store_keeps_it(tmp_path):
    path = make_store(tmp_path / "s.db")
    with Store(path) as store:
        store_id = store.store_id
    with Store(path, create=True) as store:
        assert store.store_id == store_id and len(read_all(store)) == 3


def test_write_returns_the_function_result_and_txn_helpers(tmp_path):
    with Store(tmp_path / "s.db", create=True) as store:
        def fn(txn):
            txn.put("ledger", b"a", codec.encode_json({"n": 1}))
            txn.put("ledger", b"b", codec.encode_json({"n": 2}))
            txn.put("index", b"a", codec.encode_json({}))
            return txn.delete("ledger", b"b"), txn.delete("ledger", b"zz")
        assert store.write(fn) == (True, False)
        assert store.read(lambda txn: [k for k, _ in txn.iter_prefix("ledger", b"")]) == [b"a"]
        assert store.read(lambda txn: txn.get("ledger", b"b")) is None
        assert store.read(lambda txn: txn.get_json("ledger", b"nope")) is None
        with pytest.raises(KvckptError, match="511"):
            store.write(lambda txn: txn.put("rows", b"k" * 512, b""))


def test_exception_inside_write_leaves_nothing_behind(tmp_path):
    path = make_store(tmp_path / "s.db")
    with Store(path) as store:
        before = read_all(store)

        def half_done(txn):
            txn.put("rows", b"g_new", codec.encode({"x": np.ones(1000)}))
            txn.delete("rows", b"g_0")
            txn.put_json("meta", b"cursor", {"dispatch_index": 99})
            raise RuntimeError("worker died mid-commit")

        with pytest.raises(RuntimeError, match="mid-commit"):
            store.write(half_done)
        assert read_all(store).keys() == before.keys()
        assert store.read(lambda txn: txn.get_json("meta", b"cursor")) == {"dispatch_index": 3}
        store.write(lambda txn: txn.put_json("meta", b"cursor", {"dispatch_index": 4}))  # still usable
    with Store(path, readonly=True) as store:  # and nothing reached the file
        assert b"g_new" not in read_all(store) and b"g_0" in read_all(store)
        assert store.read(lambda txn: txn.get_json("meta", b"cursor")) == {"dispatch_index": 4}


@pytest.mark.parametrize("alone", [True, False], ids=["one function", "in a batch"])
def test_write_each_refusal_writes_nothing_and_other_errors_propagate(tmp_path, alone):
    """A refused function (a KvckptError) writes nothing, alone (no nested transaction: the durable
    one is aborted, so LMDB commits nothing) or beside others (its nested one is); its error is its
    result. Any other exception, or a failure of the store itself, still propagates."""
    path = make_store(tmp_path / "s.db")
    with Store(path) as store:
        before = read_all(store)

        def refused(txn):
            txn.put("rows", b"g_new", codec.encode({"x": np.ones(1000)}))
            txn.delete("rows", b"g_0")
            raise KvckptError("stale lease")

        def ok(txn):
            txn.put_json("meta", b"cursor", {"dispatch_index": 7})
            return "ok"

        last = store.env.info()["last_txnid"]
        results = store.write_each([refused] if alone else [ok, refused, ok])
        assert [type(r).__name__ for r in results] == (["KvckptError"] if alone else ["str", "KvckptError", "str"])
        assert str(results[0 if alone else 1]) == "stale lease"
        assert read_all(store).keys() == before.keys()
        assert store.env.info()["last_txnid"] == last + (0 if alone else 1)
        assert store.write_each([ok]) == ["ok"] and store.env.info()["last_txnid"] == last + (1 if alone else 2)

        def crash(txn):
            txn.put("rows", b"g_crash", b"x")
            raise RuntimeError("worker died")

        with pytest.raises(RuntimeError, match="worker died"):
            store.write_each([crash] if alone else [ok, crash])
        store.close()
        with pytest.raises(KvckptError, match="closed"):  # the store's own failure is not a result
            store.write_each([ok] if alone else [ok, ok])
    with Store(path, readonly=True) as store:
        rows = read_all(store)
        assert b"g_new" not in rows and b"g_crash" not in rows and b"g_0" in rows
        assert store.read(lambda txn: txn.get_json("meta", b"cursor")) == {"dispatch_index": 7}


def test_map_grows_under_a_large_write_without_losing_the_transaction(tmp_path):
    path = tmp_path / "s.db"
    payload = np.random.default_rng(0).integers(0, 256, 20 << 20, dtype=np.uint8)  # incompressible
    calls = []
    with Store(path, create=True, map_size=1 << 20) as store:
        store.write(lambda txn: txn.put_json("meta", b"before", {"ok": True}))

        def big(txn):
            calls.append(1)
            txn.put_json("meta", b"cursor", {"dispatch_index": 1})
            txn.put("rows", b"big", codec.encode({"blob": payload}, level=0))
            txn.put("rows", b"small", codec.encode({"x": np.arange(3)}))
            return len(calls)

        assert store.write(big) > 1  # replayed after each growth
        assert store.env.info()["map_size"] >= 20 << 20
        rows = read_all(store)
        assert np.array_equal(rows[b"big"].arrays["blob"], payload)
        assert store.read(lambda txn: txn.get_json("meta", b"before")) == {"ok": True}
    with Store(path, readonly=True) as store:  # the default map is large enough to reopen it
        rows = read_all(store)
        assert np.array_equal(rows[b"big"].arrays["blob"], payload)
        assert rows.keys() == {b"big", b"small"}
        assert store.read(lambda txn: txn.get_json("meta", b"cursor")) == {"dispatch_index": 1}


def test_growth_waits_for_open_readers(tmp_path):
    with Store(tmp_path / "s.db", create=True, map_size=1 << 20) as store:
        store.write(lambda txn: txn.put_json("meta", b"a", {"v": 1}))
        reader_open, done, seen = threading.Event(), threading.Event(), []

        def reader():
            with store.reader() as txn:
                reader_open.set()
                time.sleep(0.3)  # a resize now would invalidate this snapshot
                seen.append(txn.get_json("meta", b"a"))
            done.set()

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        assert reader_open.wait(5)
        store.write(lambda txn: txn.put("rows", b"big", bytes(4 << 20)))
        assert done.is_set()  # the write could only finish after the reader let go
        thread.join(5)
        assert seen == [{"v": 1}]
        assert len(store.read(lambda txn: txn.get("rows", b"big"))) == 4 << 20


def test_writes_from_threads_are_serialised(tmp_path):
    with Store(tmp_path / "s.db", create=True) as store:
        store.write(lambda txn: txn.put_json("meta", b"n", {"n": 0}))

        def bump(txn):
            n = txn.get_json("meta", b"n")["n"]
            txn.put_json("meta", b"n", {"n": n + 1})

        threads = [threading.Thread(target=lambda: [store.write(bump) for _ in range(20)]) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.read(lambda txn: txn.get_json("meta", b"n")) == {"n": 80}


def test_get_json_names_the_damaged_key(tmp_path):
    with Store(tmp_path / "s.db", create=True) as store:
        store.write(lambda txn: txn.put("ledger", b"g_1", b"KVR1 not a record"))
        with pytest.raises(codec.CorruptRecord, match="ledger/g_1"):
            store.read(lambda txn: txn.get_json("ledger", b"g_1"))


# -- one writer ----------------------------------------------------------------------------------
def test_second_writer_in_the_same_process_is_refused(tmp_path):
    path = make_store(tmp_path / "s.db")
    first = Store(path)
    try:
        with pytest.raises(StoreLocked, match="one writer"):
            Store(path)
        with pytest.raises(StoreLocked):
            Store(path, create=True)
        first.write(lambda txn: txn.put_json("meta", b"x", {"still": "works"}))
    finally:
        first.close()
    first.close()  # idempotent
    with Store(path) as second:  # released on close
        assert second.read(lambda txn: txn.get_json("meta", b"x")) == {"still": "works"}


CHILD_OPEN = """
import sys
from kvckpt.storage.store import Store
try:
    Store(sys.argv[1]).close()
    print("opened")
except Exception as exc:
    print(type(exc).__name__)
"""

CHILD_HOLD = """
import sys
from kvckpt.storage.store import Store
with Store(sys.argv[1]) as store:
    store.write(lambda txn: txn.put_json("meta", b"child", {"pid": 1}))
    print("holding", flush=True)
    sys.stdin.readline()
"""


def test_second_writer_in_another_process_is_refused(tmp_path):
    path = make_store(tmp_path / "s.db")
    with Store(path):
        result = run_child(CHILD_OPEN, path)
        assert result.stdout.strip() == "StoreLocked", result.stderr

    # After close a child may open for writing; while it holds the store, this process is refused.
    child = subprocess.Popen([sys.executable, "-c", CHILD_HOLD, path], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=CHILD_ENV)
    try:
        assert child.stdout.readline().strip() == "holding"
        with pytest.raises(StoreLocked):
            Store(path)
    finally:
        child.communicate("\n", timeout=30)
    assert child.returncode == 0
    with Store(path) as store:  # the child's exit released the lock; its commit is durable
        assert store.read(lambda txn: txn.get_json("meta", b"child")) == {"pid": 1}


# -- identity and damaged files ------------------------------------------------------------------
def rewrite_format(path: str, **changes) -> None:
    """Rewrite the ``meta/format`` record of a closed store through the raw LMDB API."""
    env = lmdb.open(path, subdir=False, lock=False)
    try:
        with env.begin(write=True) as txn:
            doc = codec.decode_meta(txn.get(stored_key("meta", b"format")))
            doc.update(changes)
            doc = {k: v for k, v in doc.items() if v is not None}
            txn.put(stored_key("meta", b"format"), codec.encode_json(doc))
    finally:
        env.close()


def test_other_format_version_is_refused(tmp_path):
    original = make_store(tmp_path / "s.db")
    copy = str(tmp_path / "v999.db")
    shutil.copy(original, copy)  # a closed store: a plain copy is safe
    rewrite_format(copy, version=999)
    for readonly in (False, True):
        with pytest.raises(FormatError, match="version 999"):
            Store(copy, readonly=readonly)
    with Store(original, readonly=True) as store:  # the original is untouched
        assert store.info["version"] == FORMAT_VERSION


@pytest.mark.parametrize("changes", [{"format": "other"}, {"format": None}])
def test_other_format_name_is_refused(tmp_path, changes):
    path = make_store(tmp_path / "s.db")
    rewrite_format(path, **changes)
    with pytest.raises(FormatError, match="not a kvckpt store"):
        Store(path)


def test_missing_format_record_is_refused(tmp_path):
    path = make_store(tmp_path / "s.db")
    env = lmdb.open(path, subdir=False, lock=False)
    with env.begin(write=True) as txn:
        assert txn.delete(stored_key("meta", b"format"))
    env.close()
    with pytest.raises(FormatError, match=r"not a kvckpt store.*neither a format record"):
        Store(path, readonly=True)


def test_foreign_lmdb_files_are_refused(tmp_path):
    plain = str(tmp_path / "plain.db")
    env = lmdb.open(plain, subdir=False)
    with env.begin(write=True) as txn:
        txn.put(b"meta", b"not a table")
        txn.put(b"hello", b"world")
    env.close()
    named = str(tmp_path / "named.db")
    env = lmdb.open(named, subdir=False, max_dbs=4)
    with env.begin(write=True) as txn:
        env.open_db(b"things", txn=txn)
    env.close()
    for path in (plain, named):
        for readonly in (False, True):
            with pytest.raises(FormatError, match="not a kvckpt store"):
                Store(path, readonly=readonly)


def test_non_lmdb_and_empty_files_are_refused(tmp_path):
    cases = {"text.db": b"hello world\n" * 1000, "empty.db": b"", "tiny.db": b"\x00" * 10,
             "zeros.db": bytes(16384), "pickle.db": b"\x80\x04\x95" + bytes(8192)}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        for readonly in (False, True):
            with pytest.raises(FormatError):
                Store(tmp_path / name, readonly=readonly)
            with pytest.raises(FormatError):
                Store(tmp_path / name, create=True)
        assert (tmp_path / name).read_bytes() == content  # never modified
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(FormatError, match="regular file"):
        Store(tmp_path / "dir.db", create=True)


def test_other_lmdb_data_format_is_refused(tmp_path):
    path = make_store(tmp_path / "s.db")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    for page in (0, 4096):
        data[page + 20:page + 24] = (3).to_bytes(4, "little")  # mm_version: LMDB 1.0's format
    (tmp_path / "v3.db").write_bytes(bytes(data))
    with pytest.raises(FormatError, match="LMDB data format 3"):
        Store(tmp_path / "v3.db", readonly=True)


TRUNCATE_CHILD = """
import sys
from kvckpt.storage import codec
from kvckpt.storage.store import Store
src, dst = sys.argv[1], sys.argv[2]
data = open(src, "rb").read()
for n in map(int, sys.argv[3:]):
    with open(dst, "wb") as f:
        f.write(data[:n])
    try:
        with Store(dst, readonly=True) as store:
            store.read(lambda txn: [codec.decode(v) for _, v in txn.iter_prefix("rows", b"")])
        print(n, "opened", flush=True)
    except Exception as exc:
        print(n, type(exc).__name__, flush=True)
"""


def test_truncated_store_files_are_refused(tmp_path):
    """Mapping a truncated file would crash with SIGBUS: the store must refuse it up front.

    Runs in a child process so that a regression shows up as a failed test, not a dead test run.
    """
    path = make_store(tmp_path / "s.db", rows=30)
    size = os.path.getsize(path)
    assert size % 4096 == 0 and size >= 8 * 4096
    cuts = sorted({1, 23, 100, 4095, 4096, 4097, 8191, 8192, 8193, *range(12288, size, 4096), size - 1})
    result = run_child(TRUNCATE_CHILD, path, str(tmp_path / "cut.db"), *map(str, [*cuts, size]))
    assert result.returncode == 0, f"child died (rc {result.returncode}): {result.stderr[-2000:]}"
    outcome = dict(line.split() for line in result.stdout.splitlines())
    assert outcome == {**{str(n): "FormatError" for n in cuts}, str(size): "opened"}


# -- read-only opens -----------------------------------------------------------------------------
def test_readonly_open_of_a_copy_creates_no_lock_file(tmp_path):
    live = tmp_path / "live"
    ckpt = tmp_path / "ckpt"
    live.mkdir()
    ckpt.mkdir()
    path = make_store(live / "s.db")
    with Store(path) as store, store.reader() as txn:
        store.copy_snapshot(str(ckpt / "step_10.db"), txn)
    assert os.listdir(ckpt) == ["step_10.db"]
    before = (ckpt / "step_10.db").read_bytes()
    with Store(ckpt / "step_10.db", readonly=True) as store:
        assert os.listdir(ckpt) == ["step_10.db"]
        assert store.readonly and "readonly" in repr(store)
        rows = read_all(store)
        assert sorted(rows) == [b"g_0", b"g_1", b"g_2"]
        assert np.array_equal(rows[b"g_2"].arrays["ids"], np.arange(300))
        with pytest.raises(ReadOnlyStore, match="read-only"):
            store.write(lambda txn: txn.put_json("meta", b"x", {}))
        with pytest.raises(PermissionError):  # ReadOnlyStore is a PermissionError
            store.write(lambda txn: None)
    assert os.listdir(ckpt) == ["step_10.db"]
    assert (ckpt / "step_10.db").read_bytes() == before  # a read-only open writes nothing


def test_copy_snapshot_is_a_consistent_point_in_time(tmp_path):
    path = make_store(tmp_path / "s.db")
    with Store(path) as store:
        with store.reader() as txn:
            store.write(lambda w: w.put_json("meta", b"cursor", {"dispatch_index": 100}))  # after the snapshot
            store.copy_snapshot(str(tmp_path / "snap.db"), txn)
        with pytest.raises(KvckptError), store.reader() as txn:  # the target must not exist
            store.copy_snapshot(str(tmp_path / "snap.db"), txn)
    with Store(tmp_path / "snap.db", readonly=True) as snap:
        assert snap.read(lambda txn: txn.get_json("meta", b"cursor")) == {"dispatch_index": 3}
        assert not list(snap.read(lambda txn: list(txn.stray_keys())))


def test_copy_pinned_is_the_pinned_state_page_for_page_whatever_commits_after_it(tmp_path):
    path = make_store(tmp_path / "s.db", rows=40)
    with Store(path) as store:
        _, snapshot = store.write_then_snapshot(lambda txn: txn.put_json("meta", b"cursor", {"dispatch_index": 41}))
        try:
            def churn(txn, i):  # frees pages the snapshot still sees, reuses the ones it does not
                txn.delete("rows", b"g_%d" % i)
                txn.put("rows", b"n_%d" % i, codec.encode({"ids": np.arange(5000)}, {"i": i}))
                txn.put_json("meta", b"cursor", {"dispatch_index": 100 + i})
            for i in range(40):
                store.write(lambda txn, i=i: churn(txn, i))
            fd = os.open(tmp_path / "snap.db", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                assert store.copy_pinned(fd, snapshot) == "copy"  # ext4/tmpfs here: no clone
            finally:
                os.close(fd)
        finally:
            snapshot.close()
        plain = Snapshot(store)  # a read transaction without the meta pages of its commit
        try:
            with pytest.raises(KvckptError, match="pinned by write_then_snapshot"):
                store.copy_pinned(-1, plain)
        finally:
            plain.close()
    check_structure(tmp_path / "snap.db")  # every page parsed, free and live pages cover the file
    with Store(tmp_path / "snap.db", readonly=True) as snap:
        assert snap.read(lambda txn: txn.get_json("meta", b"cursor")) == {"dispatch_index": 41}
        rows = read_all(snap)
        assert sorted(rows) == sorted(b"g_%d" % i for i in range(40))
        assert np.array_equal(rows[b"g_39"].arrays["ids"], np.arange(4000))


def test_missing_store_is_store_not_found(tmp_path):
    missing = tmp_path / "nope.db"
    for kwargs in ({}, {"readonly": True}, {"readonly": True, "create": True}):
        with pytest.raises(StoreNotFound, match="create=True"):
            Store(missing, **kwargs)
    with pytest.raises(FileNotFoundError):
        Store(missing)
    assert os.listdir(tmp_path) == []  # refusing created nothing
    with Store(missing, create=True) as store:
        assert store.file_size() > 0
    assert sorted(os.listdir(tmp_path)) == ["nope.db", "nope.db-lock"]
