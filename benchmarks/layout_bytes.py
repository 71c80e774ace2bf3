"""Bytes per durable commit of store layouts, measured by replaying kvckpt's own writes (issue 19,
item 3: what a format change buys, measured before and after building it).

    python -m benchmarks.layout_bytes [--groups 200] [--rows realistic|tiny]

One producer commits ``groups`` edge-encoded groups with ``groups`` prompts in flight, one durable
transaction per commit, as in :mod:`benchmarks.commit_bytes`. Every ``put`` and ``delete`` the
real buffer makes is recorded (table, key, value), transaction by transaction. The trace is then
replayed into fresh LMDB files, one durable transaction per recorded one, under each layout:

* **format 3** (what kvckpt writes, :mod:`kvckpt.storage.layout`): every table in the main
  database under its prefix. Its figure checks the replay against the real buffer's, measured in
  the same run;
* **format 2**: each table its own named database, as kvckpt wrote before format 3;
* **format 3, one key per prompt**: a prompt's ledger entry and its group record are one key
  (the commit overwrites the entry instead of deleting it beside the record it writes);
* **format 3, no state write in a commit**: the commit's rewrite of ``meta/state`` left out (what
  deriving the counts a commit changes would save);
* **bare**: :class:`benchmarks.baselines.BareLmdb` putting the same rows under the same keys.

A second table replays format 2 with one kind of write left out (the ledger entry's delete, the
index entries, the group record, the state record): what each of its trees cost a commit.

Bytes are the process's ``/proc/self/io`` ``wchar`` (the pages and meta page LMDB writes) per
commit. A layout here is a replay, not a store: it shows where the pages go, nothing more. The
replay of format 3 matches the real buffer to within a few percent, which is what lets the other
rows stand for the layouts they model.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import lmdb

from benchmarks import baselines
from benchmarks.commit_bytes import bare_bytes, commit_setup
from benchmarks.ingest_bench import proc_io
from kvckpt.tooling import Txn, meta, stored_key

#: One recorded write: ``(table, key, value)``, ``value`` ``None`` for a delete.
Op = tuple[str, bytes, "bytes | None"]
#: A layout maps a recorded write to ``(database name, key, value)`` (name ``None``: the main
#: database), or ``None`` to drop it.
Layout = Callable[[Op, list[Op]], "tuple[str | None, bytes, bytes | None] | None"]


@contextlib.contextmanager
def recording(log: list[Op]) -> Iterator[None]:
    """Append every ``Txn.put``/``Txn.delete`` made while active to ``log`` (nested transactions
    included: a batch of one commit writes what its nested transaction wrote)."""
    put, delete = Txn.put, Txn.delete

    def traced_put(self: Txn, table: str, key: bytes, value: bytes) -> None:
        log.append((table, bytes(key), bytes(value)))
        put(self, table, key, value)

    def traced_delete(self: Txn, table: str, key: bytes) -> bool:
        log.append((table, bytes(key), None))
        return delete(self, table, key)

    Txn.put, Txn.delete = traced_put, traced_delete  # type: ignore[method-assign]
    try:
        yield
    finally:
        Txn.put, Txn.delete = put, delete  # type: ignore[method-assign]


def format_3(op: Op, txn_ops: list[Op]) -> tuple[str | None, bytes, bytes | None]:
    """What kvckpt writes: the main database, each table under its prefix."""
    table, key, value = op
    return None, stored_key(table, key), value


def format_2(op: Op, txn_ops: list[Op]) -> tuple[str | None, bytes, bytes | None]:
    """Each table its own named database."""
    return op


def one_key_per_prompt(op: Op, txn_ops: list[Op]) -> tuple[str | None, bytes, bytes | None] | None:
    """Format 3 with a prompt's ledger entry and group record one key: a commit's delete of the
    entry is the overwrite by the group record that follows it in the same transaction."""
    table, key, value = op
    if table in ("ledger", "groups"):
        if value is None and ("groups", key) in {(t, k) for t, k, v in txn_ops if v is not None}:
            return None
        return None, stored_key("groups", key), value
    return format_3(op, txn_ops)


def no_state_write(op: Op, txn_ops: list[Op]) -> tuple[str | None, bytes, bytes | None] | None:
    """Format 3, the commit's state-record write left out."""
    if op[0] == "meta" and op[1] == meta.STATE_KEY:
        return None
    return format_3(op, txn_ops)


LAYOUTS: dict[str, Layout] = {"format 3": format_3, "format 2": format_2,
                              "format 3, one key per prompt": one_key_per_prompt,
                              "format 3, no state write in a commit": no_state_write}

#: Format 2 with one kind of write left out: what each of its trees cost a commit.
SHARES: dict[str, Callable[[Op], bool]] = {
    "the ledger entry's delete": lambda op: op[0] == "ledger" and op[2] is None,
    "the pending index entry's delete": lambda op: op[0] == "index" and op[2] is None,
    "the ready index entries": lambda op: op[0] == "index" and op[2] is not None,
    "the group record": lambda op: op[0] == "groups",
    "the state record": lambda op: op[0] == "meta" and op[1] == meta.STATE_KEY,
    "everything but the rows": lambda op: op[0] != "rows",
}


def without(dropped: Callable[[Op], bool]) -> Layout:
    """Format 2, the writes ``dropped`` selects left out (of the measured commits only)."""
    return lambda op, txn_ops: None if dropped(op) else op


def replay(path: str, setup: list[list[Op]], measured: list[list[Op]], layout: Layout,
           setup_layout: Layout | None = None) -> float:
    """Replay ``setup`` (under ``setup_layout``, by default ``layout``) then ``measured`` (one
    durable transaction per recorded one) into a fresh file under ``layout``; ``wchar`` per
    measured transaction."""
    env = lmdb.open(path, subdir=False, map_size=baselines.MAP_SIZE, max_dbs=8)
    dbs: dict[str | None, Any] = {}

    def apply(txn_ops: list[Op], layout: Layout) -> None:
        with env.begin(write=True) as txn:
            for op in txn_ops:
                mapped = layout(op, txn_ops)
                if mapped is None:
                    continue
                name, key, value = mapped
                if name not in dbs:
                    dbs[name] = env.open_db(None if name is None else name.encode(), txn=txn)
                if value is None:
                    txn.delete(key, db=dbs[name])
                else:
                    txn.put(key, value, db=dbs[name])

    for txn_ops in setup:
        apply(txn_ops, setup_layout or layout)
    before = proc_io()["wchar"]
    for txn_ops in measured:
        apply(txn_ops, layout)
    per_commit = (proc_io()["wchar"] - before) / len(measured)
    env.close()
    return per_commit


def measure(groups: int, rows: str = "realistic", directory: str | None = None) -> dict[str, Any]:
    """``wchar`` per commit: the real buffer, each layout's replay of its trace, and the bare loop."""
    work = tempfile.mkdtemp(dir=directory)
    try:
        setup: list[Op] = []  # creation, admission and the first commit: replayed as one transaction
        with recording(setup):
            buf, leases, encoded = commit_setup(os.path.join(work, "real.kv"), groups, rows)
            buf.commit_encoded(leases[0], encoded[0])
        measured: list[list[Op]] = []
        before = proc_io()["wchar"]
        for lease, rows_ in zip(leases[1:], encoded[1:], strict=True):
            measured.append([])
            with recording(measured[-1]):
                buf.commit_encoded(lease, rows_)
        out: dict[str, Any] = {"groups": groups, "rows": rows, "real": (proc_io()["wchar"] - before) / groups}
        buf.close()
        for name, layout in LAYOUTS.items():
            out[name] = replay(os.path.join(work, f"{len(out)}.mdb"), [setup], measured, layout)
        for name, dropped in SHARES.items():
            out[f"without {name}"] = replay(os.path.join(work, f"{len(out)}.mdb"), [setup], measured, without(dropped),
                                                  setup_layout=format_2)
        out["bare"] = bare_bytes(os.path.join(work, "bare.mdb"), leases, encoded)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.layout_bytes", description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--rows", choices=("realistic", "tiny"), default="realistic")
    parser.add_argument("--dir", default=None, help="where the files go (default: the temp dir)")
    opts = parser.parse_args(argv)
    r = measure(opts.groups, opts.rows, opts.dir)
    print(f"{r['groups']} durable commits of one {r['rows']} group each, {r['groups']} prompts in flight\n")
    print("| layout | bytes written per commit (wchar) | / bare |\n| --- | ---: | ---: |")
    for name in ("bare", "real", *LAYOUTS):
        label = "kvckpt (format 3), the real buffer" if name == "real" else name
        label = f"{label} (replayed)" if name in LAYOUTS else label
        print(f"| {label} | {r[name] / 1e3:.1f} KB | {r[name] / r['bare']:.2f}× |")
    print("\nWhat each tree cost format 2: its replay with one kind of write left out\n")
    print("| left out | bytes per commit | saves |\n| --- | ---: | ---: |")
    for name in SHARES:
        kept = r[f"without {name}"]
        print(f"| {name} | {kept / 1e3:.1f} KB | {(r['format 2'] - kept) / 1e3:.1f} KB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
