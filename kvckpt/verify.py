"""The verifier: every invariant of a buffer store, checked in both directions.

:func:`check` walks one transaction's snapshot and returns a :class:`Report` listing each problem
with the key it concerns. It never repairs anything. What it checks:

* every record decodes and its checksum matches (``meta``, ``groups``, ``ledger``; with
  ``deep=True`` also every row payload, its schema and its self-declared identity);
* single owner: no prompt is both a ledger entry and a committed group;
* group sizes: a group whose rows are stored has exactly rows ``0..n-1``, no more, no fewer;
  a ledger entry's stored siblings are exactly its recorded progress; no row belongs to nobody;
* index <-> data agreement in both directions (ready, pending, claimed, consumed indexes);
* counters in ``meta/state`` equal the real counts; sequence numbers are unique and below the
  allocator; the dispatch cursor is not behind the largest stamped ``target_step``.

Cost: one pass over the keys of every table and a JSON decode per group and ledger entry (about
a second per 100,000 groups here); ``deep`` also reads and decompresses every row payload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import codec, keys
from .errors import CorruptRecord, KvckptError
from .records import CLAIMED, CONSUMED, GROUP_STATES, READY
from .schema import RowSchema


@dataclass(frozen=True)
class Problem:
    """One finding: a stable ``code``, the ``key`` it concerns, and a sentence."""

    code: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.key}: {self.message}"


@dataclass
class Report:
    """The verifier's findings and what it looked at."""

    problems: list[Problem] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def add(self, code: str, key: str, message: str) -> None:
        """Record a problem."""
        self.problems.append(Problem(code, key, message))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (``kvckpt verify --json``)."""
        return {"ok": self.ok, "counts": self.counts,
                "problems": [{"code": p.code, "key": p.key, "message": p.message} for p in self.problems]}


def _decode_table(txn: Any, table: str, report: Report) -> dict[str, dict[str, Any]]:
    docs = {}
    for key, value in txn.iter_prefix(table, b""):
        name = key.decode(errors="replace")
        try:
            doc = codec.decode_meta(value, f"{table}/{name}")
        except CorruptRecord as exc:
            report.add("corrupt-record", f"{table}/{name}", exc.reason)
            continue
        if doc.get("group_id") != name:
            report.add("key-mismatch", f"{table}/{name}", f"record names group {doc.get('group_id')!r}")
            continue
        docs[name] = doc
    return docs


def check(txn: Any, *, deep: bool = False, progress: Callable[[int], None] | None = None) -> Report:
    """Check every invariant on one snapshot (a :class:`kvckpt.store.Txn`); see the module doc.

    Args:
        txn: an open transaction of the store.
        deep: also decode every row payload (checksums, schema, identity). Defaults to False.
        progress: called with the number of rows checked so far (for progress bars).
    """
    report = Report()
    try:
        config = txn.get_json("meta", b"config")
        state = txn.get_json("meta", b"state")
    except CorruptRecord as exc:
        report.add("corrupt-record", exc.key, exc.reason)
        return report
    if config is None or state is None:
        report.add("missing-meta", "meta", "meta/config or meta/state is missing: not a replay buffer store")
        return report
    n = config["group_size"]
    schema = RowSchema.from_dict(config["schema"])
    groups = _decode_table(txn, "groups", report)
    ledger = _decode_table(txn, "ledger", report)
    report.counts.update(groups=len(groups), ledger=len(ledger))

    for gid in sorted(set(groups) & set(ledger)):
        report.add("double-owner", gid, "prompt is both a committed group and a ledger entry")

    rows: dict[str, set[int]] = {}
    row_count = 0
    for key, value in txn.iter_prefix("rows", b""):
        gid, index = key[:-5].decode(errors="replace"), int.from_bytes(key[-4:], "big")
        rows.setdefault(gid, set()).add(index)
        row_count += 1
        if deep:
            _check_row(value, gid, index, schema, report)
            if progress is not None:
                progress(row_count)
    report.counts["rows"] = row_count

    expected_index: dict[bytes, str] = {}
    seqs: dict[int, str] = {}
    by_state = dict.fromkeys(GROUP_STATES, 0)
    max_target = -1
    for gid, doc in groups.items():
        state_name = doc.get("state")
        if state_name not in GROUP_STATES:
            report.add("bad-state", gid, f"unknown state {state_name!r}")
            continue
        by_state[state_name] += 1
        _check_seq(doc, gid, seqs, state["seq"], report)
        if doc.get("group_size") != n:
            report.add("group-size", gid, f"group_size {doc.get('group_size')} != store's {n}")
        stored = rows.pop(gid, set())
        if doc.get("rows_stored"):
            if stored != set(range(n)):
                report.add("row-set", gid, f"stored rows {sorted(stored)} != 0..{n - 1}")
        elif stored:
            report.add("row-set", gid, f"{len(stored)} rows stored for a group marked rows_stored=false")
        seq = doc["seq"]
        if state_name == READY:
            expected_index[keys.index_key(keys.READY_BY_SEQ, None, seq)] = gid
            expected_index[keys.index_key(keys.READY_BY_WEIGHT, doc["start_weight"], seq)] = gid
            if doc.get("target_step") is not None:
                expected_index[keys.index_key(keys.READY_BY_TARGET, doc["target_step"], seq)] = gid
        elif state_name == CLAIMED:
            expected_index[keys.index_key(keys.CLAIMED_BY_STEP, doc["claimed_step"], seq)] = gid
        elif state_name == CONSUMED and doc.get("rows_stored"):
            expected_index[keys.index_key(keys.CONSUMED_BY_STEP, doc["consumed_step"], seq)] = gid
        if state_name in (READY, CLAIMED) and doc.get("target_step") is not None:
            max_target = max(max_target, doc["target_step"])

    for gid, doc in ledger.items():
        _check_seq(doc, gid, seqs, state["seq"], report)
        if doc.get("group_size") != n:
            report.add("group-size", gid, f"ledger entry expects {doc.get('group_size')} rows, store's n is {n}")
        stored = rows.pop(gid, set())
        if stored != set(doc.get("siblings", ())):
            report.add("row-set", gid, f"stored siblings {sorted(stored)} != recorded {doc.get('siblings')}")
        expected_index[keys.index_key(keys.PENDING_BY_WEIGHT, doc["start_weight"], doc["seq"])] = gid
        if doc.get("target_step") is not None:
            max_target = max(max_target, doc["target_step"])

    for gid, stored in sorted(rows.items()):
        report.add("orphan-rows", gid, f"rows {sorted(stored)} belong to no group or ledger entry")

    actual_index = {key: value.decode(errors="replace") for key, value in txn.iter_prefix("index", b"")}
    for key in sorted(set(expected_index) | set(actual_index)):
        want, have = expected_index.get(key), actual_index.get(key)
        if want != have:
            report.add("index", key.hex(), f"index entry points to {have!r}, the records say {want!r}")
    report.counts["index"] = len(actual_index)

    for name, real in (("inflight", len(ledger)), ("ready", by_state[READY]), ("claimed", by_state[CLAIMED])):
        if state.get(name) != real:
            report.add("counter", f"meta/state.{name}", f"says {state.get(name)}, the records hold {real}")
    if config["sampler"].get("name") == "in_order" and max_target > state["dispatch_index"]:
        report.add("cursor", "meta/state.dispatch_index",
                   f"dispatch_index {state['dispatch_index']} is behind the largest target_step {max_target}")
    report.counts.update({f"groups_{k}": v for k, v in by_state.items()})
    return report


def _check_seq(doc: dict[str, Any], gid: str, seqs: dict[int, str], allocated: int, report: Report) -> None:
    seq = doc.get("seq")
    if not isinstance(seq, int) or not 0 <= seq < allocated:
        report.add("seq", gid, f"sequence number {seq!r} is outside 0..{allocated - 1}")
    elif seq in seqs:
        report.add("seq", gid, f"sequence number {seq} is also used by {seqs[seq]!r}")
    else:
        seqs[seq] = gid


def _check_row(value: bytes, gid: str, index: int, schema: RowSchema, report: Report) -> None:
    key = f"rows/{keys.row_id(gid, index)}"
    try:
        record = codec.decode(value, key)
    except CorruptRecord as exc:
        report.add("corrupt-record", key, exc.reason)
        return
    if record.meta.get("group_id") != gid or record.meta.get("index") != index:
        report.add("key-mismatch", key, f"payload says group {record.meta.get('group_id')!r} "
                                        f"row {record.meta.get('index')!r}")
    try:
        schema.validate(dict(record.tensors()), key)
    except KvckptError as exc:
        report.add("schema", key, str(exc))


def verify_path(path: str, *, deep: bool = False, progress: Callable[[int], None] | None = None) -> Report:
    """Open ``path`` read-only (no lock file unless a writer holds it) and :func:`check` it.

    A file that cannot be opened at all yields a report with one ``open`` problem instead of an
    exception.
    """
    from .store import Store

    try:
        store = Store(path, readonly=True)
    except KvckptError as exc:
        report = Report()
        report.add("open", path, str(exc))
        return report
    try:
        return store.read(lambda txn: check(txn, deep=deep, progress=progress))
    finally:
        store.close()
