"""The verifier: every invariant of a buffer store, checked in both directions.

Each store kind is checked by its ``verify`` hook (:mod:`kvckpt.durability.kinds`, where both
built-in kinds are registered from here): a value store (:mod:`kvckpt.values`) by
:func:`kvckpt.values.records.problems`: its kind marker and meta keys, the key layout, and
every record's checksum (the whole record with ``checksums`` or ``deep``) and the key it names;
the layout and lookup checks below apply to both kinds.

:func:`check` walks one transaction's snapshot and returns a :class:`Report` listing each problem
with the key it concerns. It never repairs anything. What it checks:

* every record decodes and its checksum matches (``meta``, ``groups``, ``ledger``; with
  ``checksums=True`` also every row payload's checksum and the group and index its header
  names; with ``deep=True`` every row payload also decodes and matches the schema);
* single owner: no prompt is both a ledger entry and a committed group;
* group sizes: a group whose rows are stored has exactly rows ``0..n-1``, no more, no fewer;
  a ledger entry's stored siblings are exactly its recorded progress; no row belongs to nobody;
* index <-> data agreement in both directions (ready, pending, claimed, consumed indexes);
* counters in ``meta/state`` equal the real counts; sequence numbers are unique and below the
  allocator; the dispatch cursor is not behind the largest stamped ``target_step``;
* accounting: every allocated sequence number belongs to exactly one group record or ledger
  entry (no prompt that left the dataloader is lost), and the admitted, committed, evicted and
  aborted counters and the shortfall map equal what the records say;
* states: ready and claimed groups keep their rows, evicted and aborted ones do not; claims
  belong to the current step and consumption to earlier ones (more ready groups than the
  capacity is not a finding: a rollback legitimately returns them, and admission waits);
  every ledger entry is in a known phase and its recorded digests name exactly its siblings;
* token progress (format 4): every chunk's key has the ``{group}\\0{index}{start}`` shape and its
  header (checksum-verified; with ``deep`` the whole chunk) names that key; a sample's chunks are
  contiguous from token 0 and no longer than the schema's ``max_tokens``; every chunk belongs to a
  live ledger entry's sample that is not committed yet (anything else is ``orphan-progress``);
* every key of the file belongs to a table of its layout (:mod:`kvckpt.storage.layout`);
* every key that iteration finds is found by a lookup (a damaged branch page can misroute
  lookups while iteration still finds every key);
* every ``meta`` record passes its checksum and no unknown ``meta`` key exists; every row key
  has the ``{group}\\0{index}`` shape; with ``checksums`` or ``deep`` each group's digest (and
  each ledger sibling's) equals the digest of the stored row bytes (:mod:`kvckpt.tables.digest`).

A record that passes its checksum but lacks a field the checks need is reported as
``malformed`` instead of raising.

Cost: one pass over the keys of every table and a JSON decode per group and ledger entry (about
a second per 100,000 groups here; row payloads are not read); ``checksums`` adds one ``crc32``
and one ``blake2b`` pass over the stored row bytes (the group digests; ``blake2b`` is about 5x
slower than ``crc32`` here) and a small JSON parse per row;
``deep`` decompresses every row payload (about 3 s per GB of raw rows).

The module is long (about 560 lines) because the checks above share one pass over the snapshot
(each table is read once, and the index, sequence and accounting checks need what the record
checks collected).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lmdb

from kvckpt.durability import kinds
from kvckpt.errors import CorruptRecord, KvckptError
from kvckpt.storage import codec, keys
from kvckpt.storage.layout import ONE_TREE_TABLES
from kvckpt.storage.schema import RowSchema
from kvckpt.tables.digest import group_digest, row_digest
from kvckpt.tables.indexes import entry_index_key, group_index_keys
from kvckpt.tables.meta import (
    CONFIG_KEY,
    DATALOADER_KEY,
    KNOWN_META_KEYS,
    SHAPES_KEY,
    SHORTFALL_KEY,
    STAMP_KEY,
    STATE_KEY,
)
from kvckpt.tables.records import (
    ABORTED,
    CLAIMED,
    CONSUMED,
    EVICTED,
    GROUP_STATES,
    PHASE_ADMITTED,
    READY,
    lineage_weight,
)
from kvckpt.transitions.config import BufferConfig
from kvckpt.transitions.progress import decode_chunk
from kvckpt.values import records as values

#: Every key the ``meta`` table may hold; anything else is a damaged key (or a newer kvckpt).


@dataclass(frozen=True)
class Problem:
    """One finding: a stable ``code``, the ``key`` it concerns, and a sentence."""

    code: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.key}: {self.message}"


#: What each depth of :func:`check` leaves unchecked, in one line (``kvckpt verify`` prints it).
NOT_CHECKED = {
    "metadata": "row payloads: their checksums, their group digests and the group and index they name are "
                "checked when each row is read (read_batch, export), their fields too",
    "checksums": "row fields are not decoded (schema, dtypes, shapes, decompressed sizes): read_batch checks "
                 "them when it reads a row; --deep decodes every row now",
    "deep": "nothing a restore or a read checks; a file whose every checksum and digest was recomputed by "
            "someone else is indistinguishable from one kvckpt wrote",
}


@dataclass
class Report:
    """The verifier's findings, what it looked at and (``not_checked``) what it did not check."""

    problems: list[Problem] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    not_checked: str = ""

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def add(self, code: str, key: str, message: str) -> None:
        """Record a problem."""
        self.problems.append(Problem(code, key, message))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (``kvckpt verify --json``)."""
        return {"ok": self.ok, "counts": self.counts, "not_checked": self.not_checked,
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


def check(txn: Any, *, deep: bool = False, checksums: bool = False, lookups: bool = True,
          row_keys: list[bytes] | None = None, progress: Callable[[int], None] | None = None) -> Report:
    """Check every invariant on one snapshot (a :class:`kvckpt.storage.store.Txn`); see the module doc.

    Args:
        txn: an open transaction of the store.
        deep: also decode every row payload (checksums, schema, identity, digests). Defaults to False.
        checksums: also verify every row payload's checksum and the group and index it names
            in its header, and every group's digest, without decompressing anything (one ``crc32``
            and one ``blake2b`` pass over the stored row bytes; implied by ``deep``). Defaults to
            False: row payloads are then not read at all (their keys are); each row is verified
            when it is read.
        lookups: look every key up (see ``_check_lookups``). Defaults to True; False only where
            :func:`kvckpt.durability.structure.is_sound` proved the file's tree, which proves
            the same (every separator bounds its subtree).
        row_keys: the rows table's keys, in order, as a proof of this very snapshot read them
            (:func:`kvckpt.durability.structure.proven_keys`), taken instead of iterating the table
            where no row value is read (neither ``deep`` nor ``checksums``): on a cold page cache
            that iteration reads a page of every row. Defaults to None: iterate.
        progress: called with the number of rows checked so far (for progress bars).
    """
    report = Report(not_checked=NOT_CHECKED["deep" if deep else "checksums" if checksums else "metadata"])
    _check_layout(txn, report)
    if lookups:
        _check_lookups(txn, report)
    kinds.kind_of(txn).verify(txn, report, kinds.VerifyOptions(deep, checksums, row_keys, progress))
    return report


def _check_values(txn: Any, report: Report, options: kinds.VerifyOptions) -> None:
    """The value store kind's checks (:func:`kvckpt.values.records.problems`)."""
    found, counts = values.problems(txn, payloads=options.deep or options.checksums)
    report.not_checked = ("what each value means: the program that put it checks that when it reads it (the "
                          "TransferQueue backend's decode_value)" + ("" if options.deep or options.checksums else
                                                                      "; record payloads (their checksums)"))
    for problem in found:
        report.add(*problem)
    report.counts.update(counts)


def _check_buffer(txn: Any, report: Report, options: kinds.VerifyOptions) -> None:
    """The replay buffer kind's checks (the module docstring's list)."""
    meta = _decode_meta_table(txn, report)
    config, state = meta.get(CONFIG_KEY), meta.get(STATE_KEY)
    if config is None or state is None:
        if not report.problems:
            report.add("missing-meta", "meta", "meta/config or meta/state is missing: not a replay buffer store")
        return
    if not _check_config(config, report):
        return
    _check_ints(meta.get(STAMP_KEY), "meta/checkpoint", ("trainer_version", "dispatch_index"), report,
                required=True)
    if not _check_state(state, report):
        return
    _check_dataloader(txn, report)
    try:
        _check_snapshot(txn, report, config, state, meta.get(SHORTFALL_KEY) or {}, options.deep, options.checksums,
                        options.row_keys, options.progress)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError) as exc:
        report.add("malformed", "?", f"a record passes its checksum but lacks a field or has a wrong type "
                                     f"({type(exc).__name__}: {exc}); the store was not written by kvckpt")


#: The two built-in store kinds (kvckpt.durability.kinds); the tools attach their hooks to them.
kinds.register(kinds.StoreKind(
    "values", "a value store (a TransferQueue backend or verl ledger file): its values are encoded records of the "
    "program that put them, not rows of a schema", lambda txn: values.kind_of(txn) is not None, _check_values))
kinds.register(kinds.StoreKind("replay-buffer", "a replay buffer", lambda txn: txn.get("meta", CONFIG_KEY) is not None,
                               _check_buffer), fallback=True)


#: Integer fields of ``meta/state``, group records and ledger entries (``None`` allowed where optional).
_STATE_INTS = ("seq", "trainer_version", "dispatch_index", "inflight", "ready", "claimed", "weight_version",
               "admissions", "drop_floor")
#: Counters of ``meta/state`` that the verifier and recovery read.
_STATE_COUNTERS = ("admitted", "committed", "evicted", "aborted", "redispatched")
_RECORD_INTS = ("seq", "group_size", "prompt_idx", "start_weight", "attempt", "raw_bytes", "stored_bytes")
_OPTIONAL_INTS = ("end_weight", "target_step", "claimed_step", "consumed_step", "token_weight", "lineage_fork")
_INT64 = 1 << 63


def _check_ints(doc: dict[str, Any] | None, key: str, names: tuple[str, ...], report: Report, *,
                required: bool = False, optional: tuple[str, ...] = ()) -> bool:
    """Each named field is a 64-bit integer (``optional`` ones may also be ``None``); ``required``
    fields must be present. Reports ``malformed`` (a checksum-valid record kvckpt never writes)."""
    if doc is None:
        return True
    for name in (*names, *optional):
        if name not in doc:
            if required and name in names:
                report.add("malformed", key, f"the record has no {name!r}")
                return False
            continue
        value = doc[name]
        if value is None and name in optional:
            continue
        if type(value) is not int or not -_INT64 <= value < _INT64:
            report.add("malformed", key, f"{name} is {str(value)[:40]!r}, not a 64-bit integer")
            return False
    return True


def _check_state(state: dict[str, Any], report: Report) -> bool:
    """``meta/state`` has every field recovery reads, each of the type kvckpt writes (a list of
    versions in ``durable``, a map of integers in ``counters``): a checksum-valid record that lacks
    one is ``malformed`` here, not a ``TypeError`` in the middle of a restore."""
    if not _check_ints(state, "meta/state", _STATE_INTS, report, required=True):
        return False
    durable, counters = state.get("durable"), state.get("counters")
    if type(durable) is not list or not all(type(v) is int and -_INT64 <= v < _INT64 for v in durable):
        report.add("malformed", "meta/state.durable", f"is {str(durable)[:60]!r}, not a list of versions")
        return False
    if type(counters) is not dict or not _check_ints(counters, "meta/state.counters", _STATE_COUNTERS, report,
                                                     required=True):
        report.add("malformed", "meta/state.counters", f"is {str(counters)[:60]!r}, not a map of integers")
        return False
    if not isinstance(state.get("timeline", ""), str):
        report.add("malformed", "meta/state.timeline", "is not a string")
        return False
    return True


def _check_record_types(doc: dict[str, Any], gid: str, ledger: bool, report: Report) -> bool:
    """The non-integer fields recovery and leases read have the types kvckpt writes."""
    texts = ("task_name", "admission_id") + (() if ledger else ("digest",))
    for name in texts:
        if not isinstance(doc.get(name), str):
            report.add("malformed", gid, f"{name} is {str(doc.get(name))[:40]!r}, not a string")
            return False
    if not isinstance(doc.get("timeline", ""), str):
        report.add("malformed", gid, "timeline is not a string")
        return False
    if ledger and not isinstance(doc.get("holder", ""), str):
        report.add("malformed", gid, f"holder is {str(doc.get('holder'))[:40]!r}, not a string")
        return False
    if not ledger:
        if type(doc.get("rows_stored", True)) is not bool:
            report.add("malformed", gid, "rows_stored is not true or false")
            return False
        return True
    siblings, digests = doc.get("siblings", []), doc.get("digests", {})
    if type(siblings) is not list or not all(type(i) is int and 0 <= i < _INT64 for i in siblings):
        report.add("malformed", gid, f"siblings {str(siblings)[:60]!r} is not a list of row indexes")
        return False
    if type(digests) is not dict or not all(isinstance(v, str) for v in digests.values()):
        report.add("malformed", gid, f"digests {str(digests)[:60]!r} is not a map of row digests")
        return False
    return True


def _check_config(config: dict[str, Any], report: Report) -> bool:
    """``meta/config`` is one this kvckpt can build a buffer from."""

    try:
        BufferConfig.from_dict(config)
    except (KvckptError, TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
        report.add("malformed", "meta/config", f"not a buffer config kvckpt writes ({type(exc).__name__}: "
                                               f"{str(exc)[:200]})")
        return False
    return True


def _check_dataloader(txn: Any, report: Report) -> None:
    """The dataloader state decodes within the codec's limits (one small record: always checked, so
    a decompression bomb there is refused by ``restore()`` and ``verify``, not by the first read)."""
    value = txn.get("meta", DATALOADER_KEY)
    if value is not None:
        try:
            codec.decode(value, "meta/dataloader")
        except CorruptRecord as exc:
            report.add("corrupt-record", exc.key, exc.reason)


def _check_layout(txn: Any, report: Report) -> None:
    """Every key of the file belongs to one table (:mod:`kvckpt.storage.layout`)."""
    for stored in txn.stray_keys():
        report.add("stray-key", repr(stored[:64]), "a key of the file belongs to no kvckpt table: the file is "
                                                    "damaged or was written by another program")


def _check_lookups(txn: Any, report: Report) -> None:
    """Every key that iteration finds must be found by a lookup too. A damaged separator key in a
    branch page passes LMDB's own structure check and leaves iteration intact, but misroutes
    lookups (``get``, ``set_range``), so records would silently go missing."""
    for table in ONE_TREE_TABLES:
        for key in txn.iter_keys(table, b""):
            try:
                found = txn.has(table, key)
            except lmdb.BadValsizeError:  # a damaged node length: no valid key has this size
                report.add("bad-key", f"{table}/{key[:64]!r}", f"a key of {len(key)} bytes cannot exist in LMDB: "
                                                               "a page of the B-tree is damaged")
                continue
            if not found:
                report.add("unreachable", f"{table}/{key!r}", "iteration finds this key but a lookup does not: a "
                                                              "branch page of the B-tree is damaged")


def _decode_meta_table(txn: Any, report: Report) -> dict[bytes, dict[str, Any]]:
    """Every ``meta`` record, checksum-verified; unknown keys and corrupt records are reported."""
    docs = {}
    for key, value in txn.iter_prefix("meta", b""):
        name = f"meta/{key.decode(errors='replace')}"
        if key not in KNOWN_META_KEYS:
            report.add("unknown-meta", name, "unknown meta key (damaged, or written by a newer kvckpt)")
            continue
        try:
            docs[key] = codec.decode_meta(value, name)
        except CorruptRecord as exc:
            report.add("corrupt-record", exc.key, exc.reason)
    return docs


def _check_snapshot(txn: Any, report: Report, config: dict[str, Any], state: dict[str, Any],
                    shortfall: dict[str, int], deep: bool, checksums: bool, row_keys: list[bytes] | None,
                    progress: Callable[[int], None] | None) -> None:
    n = config["group_size"]
    schema = RowSchema.from_dict(config["schema"])
    pins = _shape_pins(txn, schema, report) if deep else {}
    groups = _decode_table(txn, "groups", report)
    ledger = _decode_table(txn, "ledger", report)
    report.counts.update(groups=len(groups), ledger=len(ledger))

    for gid in sorted(set(groups) & set(ledger)):
        report.add("double-owner", gid, "prompt is both a committed group and a ledger entry")

    rows: dict[str, set[int]] = {}
    digests: dict[tuple[str, int], str] = {}
    row_count = 0
    read_values = deep or checksums
    if read_values:
        row_items = txn.iter_prefix("rows", b"")
    else:
        row_items = ((k, b"") for k in (txn.iter_keys("rows", b"") if row_keys is None else row_keys))
    for key, value in row_items:
        gid, index = key[:-5].decode(errors="replace"), int.from_bytes(key[-4:], "big")
        row_count += 1
        if len(key) < 6 or key[-5] != 0:
            report.add("row-key", key.hex(), "row key is not {group id}\\0{4-byte index}")
            continue
        rows.setdefault(gid, set()).add(index)
        if deep:
            _check_row(value, gid, index, schema, pins, report)
        elif checksums:
            _check_row_identity(value, gid, index, report)
        if read_values:
            digests[gid, index] = row_digest(value)
        if read_values and progress is not None:
            progress(row_count)
    report.counts["rows"] = row_count

    expected_index: dict[bytes, str] = {}
    seqs: dict[int, str] = {}
    by_state = dict.fromkeys(GROUP_STATES, 0)
    max_target = -1
    for gid, doc in groups.items():
        if not (_check_ints(doc, gid, _RECORD_INTS, report, optional=_OPTIONAL_INTS)
                and _check_record_types(doc, gid, False, report)):
            continue
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
            if len(stored) != n or stored != set(range(n)):
                report.add("row-set", gid, f"stored rows {sorted(stored)[:20]} != 0..{n - 1}")
            elif read_values and doc["digest"] != group_digest(digests[gid, i] for i in range(n)):
                report.add("digest", gid, f"digest {doc['digest']!r} does not match the stored rows")
        elif stored:
            report.add("row-set", gid, f"{len(stored)} rows stored for a group marked rows_stored=false")
        _check_group_state(doc, gid, state["trainer_version"], report)
        for key in group_index_keys(state_name, doc["seq"], _lineage_weight(doc, gid, report), doc.get("target_step"),
                                    doc.get("claimed_step"), doc.get("consumed_step"), bool(doc.get("rows_stored"))):
            expected_index[key] = gid
        if state_name in (READY, CLAIMED) and doc.get("target_step") is not None:
            max_target = max(max_target, doc["target_step"])

    for gid, doc in ledger.items():
        if not (_check_ints(doc, gid, _RECORD_INTS, report, optional=_OPTIONAL_INTS)
                and _check_record_types(doc, gid, True, report)):
            continue
        _check_seq(doc, gid, seqs, state["seq"], report)
        if doc.get("group_size") != n:
            report.add("group-size", gid, f"ledger entry expects {doc.get('group_size')} rows, store's n is {n}")
        stored = rows.pop(gid, set())
        if stored != set(doc.get("siblings", ())):
            report.add("row-set", gid, f"stored siblings {sorted(stored)} != recorded {doc.get('siblings')}")
        if set(doc["digests"]) != {str(i) for i in doc["siblings"]}:
            report.add("digest", gid, f"digests of rows {sorted(doc['digests'])} recorded for siblings "
                                      f"{doc['siblings']}")
        elif read_values:
            for i in sorted(stored & set(doc["siblings"])):
                if doc["digests"][str(i)] != digests[gid, i]:
                    report.add("digest", keys.row_id(gid, i), "row bytes do not match the recorded digest")
        if doc.get("phase") != PHASE_ADMITTED:
            report.add("phase", gid, f"unknown ledger phase {doc.get('phase')!r}")
        expected_index[entry_index_key(_lineage_weight(doc, gid, report), doc["seq"])] = gid
        if doc.get("target_step") is not None:
            max_target = max(max_target, doc["target_step"])

    _check_progress(txn, report, schema, ledger, deep)

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
    _check_accounting(groups, ledger, state, shortfall, by_state, report)
    report.counts.update({f"groups_{k}": v for k, v in by_state.items()})


def _check_progress(txn: Any, report: Report, schema: RowSchema, ledger: dict[str, dict[str, Any]],
                    deep: bool) -> None:
    """Token-progress chunks: key shape, header identity, contiguity, bound and a live owner."""
    ends: dict[tuple[str, int], int] = {}
    count = 0
    for key, value in txn.iter_prefix("progress", b""):
        count += 1
        if len(key) < 14 or key[-13] != 0:
            report.add("progress-key", key.hex(), "progress key is not {group id}\\0{4-byte index}{8-byte start}")
            continue
        gid, index, start = key[:-13].decode(errors="replace"), int.from_bytes(key[-12:-8], "big"), \
            int.from_bytes(key[-8:], "big")
        name = f"progress/{keys.row_id(gid, index)}@{start}"
        try:
            meta = decode_chunk(schema, gid, index, start, value).meta if deep else codec.decode_meta(value, name)
        except CorruptRecord as exc:
            report.add("corrupt-record", name, exc.reason)
            continue
        length = meta.get("length")
        if (meta.get("group_id"), meta.get("index"), meta.get("start")) != (gid, index, start) \
                or type(length) is not int or length < 1 or type(meta.get("version")) is not int:
            report.add("key-mismatch", name, f"chunk header {meta!r:.200} does not describe its key")
            continue
        entry = ledger.get(gid)
        if entry is None or index >= entry["group_size"] or index in entry["siblings"]:
            why = "no ledger entry" if entry is None else f"row {index} is committed or outside the group"
            report.add("orphan-progress", name, f"token progress of a sample nobody generates ({why})")
        if ends.get((gid, index), 0) != start:
            report.add("progress", name, f"chunk starts at {start}, the prefix before it ends at "
                                         f"{ends.get((gid, index), 0)}")
        ends[gid, index] = start + length
        if start + length > schema.max_tokens:
            report.add("progress", name, f"prefix of {start + length} tokens is over max_tokens {schema.max_tokens}")
    report.counts["progress"] = count


def _lineage_weight(doc: dict[str, Any], gid: str, report: Report) -> int:
    """The record's lineage weight (its weight indexes' key); a ``lineage_fork`` at or above its
    ``start_weight`` is ``malformed`` (recovery sets one only below the stamp)."""
    fork = doc.get("lineage_fork")
    if fork is not None and fork >= doc["start_weight"]:
        report.add("malformed", gid, f"lineage_fork {fork} is not below start_weight {doc['start_weight']}")
    return lineage_weight(doc["start_weight"], fork)


def _check_group_state(doc: dict[str, Any], gid: str, version: int, report: Report) -> None:
    """Rows present exactly in the states that keep them; claims and consumption at the right steps."""
    state_name = doc["state"]
    if state_name in (READY, CLAIMED) and not doc["rows_stored"]:
        report.add("rows-state", gid, f"a {state_name} group must keep its rows (rows_stored=false)")
    if state_name in (EVICTED, ABORTED) and doc["rows_stored"]:
        report.add("rows-state", gid, f"an {state_name} group must not keep rows (rows_stored=true)")
    if state_name == CLAIMED and doc["claimed_step"] != version:
        report.add("step", gid, f"claimed by step {doc['claimed_step']}, the current step is {version}")
    if state_name == CONSUMED and not doc["consumed_step"] < version:
        report.add("step", gid, f"consumed by step {doc['consumed_step']}, not before the current step {version}")


def _check_accounting(groups: dict[str, dict[str, Any]], ledger: dict[str, dict[str, Any]], state: dict[str, Any],
                      shortfall: dict[str, int], by_state: dict[str, int], report: Report) -> None:
    """Every admitted prompt is exactly one record; counters and the shortfall map match the records."""
    allocated, counters = state["seq"], state["counters"]
    if len(groups) + len(ledger) != allocated:
        report.add("accounting", "meta/state.seq", f"{allocated} prompts were admitted but {len(groups)} groups + "
                                                   f"{len(ledger)} ledger entries account for them")
    committed = by_state[READY] + by_state[CLAIMED] + by_state[CONSUMED] + by_state[EVICTED]
    for name, real in (("admitted", allocated), ("committed", committed), ("evicted", by_state[EVICTED]),
                       ("aborted", by_state[ABORTED])):
        if counters[name] != real:
            report.add("counter", f"meta/state.counters.{name}", f"says {counters[name]}, the records hold {real}")
    short: dict[str, int] = {}
    for doc in groups.values():
        if doc.get("state") == ABORTED and doc["target_step"] is not None:
            short[str(doc["target_step"])] = short.get(str(doc["target_step"]), 0) + 1
    if short != shortfall:
        report.add("shortfall", "meta/shortfall", f"records {shortfall}, the aborted groups say {short}")


def _check_seq(doc: dict[str, Any], gid: str, seqs: dict[int, str], allocated: int, report: Report) -> None:
    seq = doc.get("seq")
    if not isinstance(seq, int) or not 0 <= seq < allocated:
        report.add("seq", gid, f"sequence number {seq!r} is outside 0..{allocated - 1}")
    elif seq in seqs:
        report.add("seq", gid, f"sequence number {seq} is also used by {seqs[seq]!r}")
    else:
        seqs[seq] = gid


def _check_row_identity(value: bytes, gid: str, index: int, report: Report) -> None:
    """Checksum and self-declared identity of one row, without decompressing its fields."""
    key = f"rows/{keys.row_id(gid, index)}"
    try:
        if codec.has_meta(value, {"group_id": gid, "index": index}, key):
            return
        meta = codec.decode_meta(value, key)
    except CorruptRecord as exc:
        report.add("corrupt-record", key, exc.reason)
        return
    _check_identity(meta, key, gid, index, report)


def _check_identity(meta: dict[str, Any], key: str, gid: str, index: int, report: Report) -> None:
    if meta.get("group_id") != gid or meta.get("index") != index:
        report.add("key-mismatch", key, f"payload says group {meta.get('group_id')!r} row {meta.get('index')!r}")


def _shape_pins(txn: Any, schema: RowSchema, report: Report) -> dict[str, Any]:
    """The store's pinned row shapes (``meta/shapes``); a pin map the schema refuses is reported."""
    try:
        pins = txn.get_json("meta", SHAPES_KEY) or {}
        schema.limits(pins)  # checks that it maps declared fields to shapes
        return pins
    except CorruptRecord:  # already reported with the meta table
        return {}
    except KvckptError as exc:
        report.add("schema", "meta/shapes", str(exc))
        return {}


def _check_row(value: bytes, gid: str, index: int, schema: RowSchema, pins: dict[str, Any], report: Report) -> None:
    key = f"rows/{keys.row_id(gid, index)}"
    try:
        record = codec.decode(value, key, limits=schema.limits(pins))
    except CorruptRecord as exc:
        report.add("corrupt-record", key, exc.reason)
        return
    _check_identity(record.meta, key, gid, index, report)
    try:
        schema.check_record(record, key)
        schema.pin(pins, [(key, {n: schema.shape_of(schema.fields[n], v) for n, v in record.arrays.items()})])
    except KvckptError as exc:
        report.add("schema", key, str(exc))
