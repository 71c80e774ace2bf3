"""Diff: what differs between two stores or checkpoint files.

:func:`diff_paths` opens both files read-only (never modified, no lock files), takes one snapshot
of each and walks their ``groups`` and ``ledger`` tables side by side in key order (a streaming
merge: memory grows with the number of differences, not with the stores). It reports

* identity (store id, format version), config keys, cursors and counters, the dataloader state
  and the checkpoint stamp that differ;
* groups added (only in B), removed (only in A) and changed, with each changed field
  (state, stamps, attempt, ``digest``...);
* ledger entries added, removed and changed.

A group's ``digest`` covers its rows' *encoded* bytes, so it is only comparable when both stores
encode at the same zstd level. When the levels differ (e.g. after ``kvckpt compact --level``), or
when ``rows=True``, the rows of every group stored on both sides are decoded and compared
instead (a ``rows`` change), and ``stored_bytes`` counts are left out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvckpt.tools.inspect import Progress

from kvckpt import GroupInfo, LedgerEntry, Store, codec
from kvckpt.tooling import CONFIG_KEY, DATALOADER_KEY, SHORTFALL_KEY, STAMP_KEY, STATE_KEY, Txn, keys, open_readonly

#: Fields whose values depend on the encoding, compared only when digests are comparable.
ENCODING_FIELDS = ("digest", "digests", "stored_bytes")
GROUP_FIELDS = tuple(f for f in GroupInfo.__dataclass_fields__ if f not in ENCODING_FIELDS)
LEDGER_FIELDS = tuple(f for f in LedgerEntry.__dataclass_fields__ if f not in ENCODING_FIELDS)
#: Differences kept per category in detail (all are counted).
DETAIL_LIMIT = 10_000


@dataclass
class TableDiff:
    """Keys only in A (``removed``), only in B (``added``), and changed fields per common key."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"added": 0, "removed": 0, "changed": 0, "same": 0})

    @property
    def same(self) -> bool:
        """No key added, removed or changed."""
        return not (self.counts["added"] or self.counts["removed"] or self.counts["changed"])

    def note(self, kind: str, key: str, fields: dict[str, list[Any]] | None = None) -> None:
        """Count a difference and keep its detail while under :data:`DETAIL_LIMIT`."""
        self.counts[kind] += 1
        if self.counts[kind] > DETAIL_LIMIT:
            return
        if kind == "changed":
            self.changed[key] = fields or {}
        else:
            getattr(self, kind).append(key)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"counts": self.counts, "added": self.added, "removed": self.removed, "changed": self.changed}


@dataclass
class DiffResult:
    """Everything that differs between A and B; each value difference is ``[a, b]``."""

    a: str
    b: str
    identity: dict[str, list[Any]] = field(default_factory=dict)
    config: dict[str, list[Any]] = field(default_factory=dict)
    cursors: dict[str, list[Any]] = field(default_factory=dict)
    groups: TableDiff = field(default_factory=TableDiff)
    ledger: TableDiff = field(default_factory=TableDiff)
    compared_rows: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def same(self) -> bool:
        """True when nothing differs."""
        return not (self.identity or self.config or self.cursors) and self.groups.same and self.ledger.same

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (``kvckpt diff --json``)."""
        return {"a": self.a, "b": self.b, "same": self.same, "identity": self.identity, "config": self.config,
                "cursors": self.cursors, "groups": self.groups.to_dict(), "ledger": self.ledger.to_dict(),
                "compared_rows": self.compared_rows, "notes": self.notes}


def diff_paths(a: str, b: str, *, rows: bool = False, progress: Progress | None = None) -> DiffResult:
    """Compare the stores at ``a`` and ``b`` (see the module docstring).

    Args:
        a, b: live stores or checkpoint files.
        rows: compare decoded rows instead of digests even when the encodings match. Defaults to False.
        progress: called with ``(records compared, records in A and B)``.

    Raises:
        StoreNotFound / FormatError: a path is not a kvckpt store.
        CorruptRecord: a record failed its checksum (run ``kvckpt verify``).
    """
    a, b = os.fspath(a), os.fspath(b)
    result = DiffResult(a, b)
    with open_readonly(a) as sa:
        if os.path.samefile(a, b):  # LMDB opens a file once per process: compare the snapshot to itself
            result.notes.append("A and B are the same file")
            with sa.reader() as txn:
                _compare(result, sa, sa, txn, txn, rows, progress)
            return result
        with open_readonly(b) as sb, sa.reader() as ta, sb.reader() as tb:
            _compare(result, sa, sb, ta, tb, rows, progress)
    return result


def _flat(doc: dict[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``a.b`` keys (lists and scalars are leaves)."""
    out: dict[str, Any] = {}
    for key, value in (doc or {}).items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _differences(da: dict[str, Any], db: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, list[Any]]:
    return {k: [da.get(k), db.get(k)] for k in sorted(set(da) | set(db))
            if da.get(k) != db.get(k) and not any(k == s or k.endswith("." + s) for s in skip)}


def _show(blob: bytes) -> str:
    """Opaque bytes as text when printable ASCII, else as ``0x`` hex."""
    return blob.decode() if blob.isascii() and blob.decode().isprintable() else "0x" + blob.hex()


def _meta(txn: Txn) -> dict[str, Any]:
    value = txn.get("meta", DATALOADER_KEY)
    dataloader = None if value is None else _show(codec.decode(value, "meta/dataloader").arrays["state"].tobytes())
    stamp = txn.get_json("meta", STAMP_KEY) or {}
    return {"config": txn.get_json("meta", CONFIG_KEY) or {},
            "cursors": {**_flat(txn.get_json("meta", STATE_KEY)), "dataloader_state": dataloader,
                        **{f"batch_shortfall.{k}": v for k, v in (txn.get_json("meta", SHORTFALL_KEY) or {}).items()},
                        **{f"checkpoint.{k}": stamp.get(k) for k in ("checkpoint_id", "trainer_version")}}}


def _compare(result: DiffResult, sa: Store, sb: Store, ta: Txn, tb: Txn, rows: bool,
             progress: Progress | None) -> None:
    result.identity = _differences({k: sa.info.get(k) for k in ("store_id", "version")},
                                   {k: sb.info.get(k) for k in ("store_id", "version")})
    ma, mb = _meta(ta), _meta(tb)
    level_a, level_b = ma["config"].get("compression_level"), mb["config"].get("compression_level")
    result.compared_rows = rows or level_a != level_b
    if level_a != level_b:
        result.notes.append(f"compression levels differ ({level_a} vs {level_b}): digests are not comparable, "
                            "rows were decoded and compared instead")
    skip = ENCODING_FIELDS if result.compared_rows else ()
    result.config = _differences(ma["config"], mb["config"])
    result.cursors = _differences(ma["cursors"], mb["cursors"], skip)
    total = sum(t.count(name) for t in (ta, tb) for name in ("groups", "ledger"))
    done = [0]
    for table, fields, out in (("groups", GROUP_FIELDS, result.groups), ("ledger", LEDGER_FIELDS, result.ledger)):
        compared = fields + (() if result.compared_rows else tuple(f for f in ENCODING_FIELDS if f != "stored_bytes"))
        for raw_key, da, db in _merge(_docs(ta, table), _docs(tb, table)):
            key = raw_key.decode(errors="replace")
            done[0] += (da is not None) + (db is not None)
            if progress is not None and done[0] % 4096 < 2:
                progress(done[0], total)
            if db is None:
                out.note("removed", key)
            elif da is None:
                out.note("added", key)
            else:
                changes = {f: [da.get(f), db.get(f)] for f in compared if da.get(f) != db.get(f)}
                if result.compared_rows and not _same_rows(ta, tb, key, da, db, table):
                    changes["rows"] = ["differ", "differ"]
                if changes:
                    out.note("changed", key, changes)
                else:
                    out.counts["same"] += 1
    if progress is not None:
        progress(total, total)


def _docs(txn: Txn, table: str) -> Iterator[tuple[bytes, dict[str, Any]]]:
    for key, value in txn.iter_prefix(table, b""):
        yield key, codec.decode_meta(value, f"{table}/{key.decode(errors='replace')}")


def _merge(left: Iterator[tuple[bytes, Any]], right: Iterator[tuple[bytes, Any]]
           ) -> Iterator[tuple[bytes, Any, Any]]:
    """Join two streams in LMDB key order (bytewise): ``(key, left doc or None, right doc or None)``."""
    a, b = next(left, None), next(right, None)
    while a is not None or b is not None:
        if b is None or (a is not None and a[0] < b[0]):
            yield a[0], a[1], None
            a = next(left, None)
        elif a is None or b[0] < a[0]:
            yield b[0], None, b[1]
            b = next(right, None)
        else:
            yield a[0], a[1], b[1]
            a, b = next(left, None), next(right, None)


def _rows(txn: Txn, gid: str) -> dict[int, codec.Record]:
    return {int.from_bytes(k[-4:], "big"): codec.decode(v, f"rows/{keys.row_id(gid, int.from_bytes(k[-4:], 'big'))}")
            for k, v in txn.iter_prefix("rows", keys.row_prefix(gid))}


def _same_rows(ta: Txn, tb: Txn, gid: str, da: dict[str, Any], db: dict[str, Any], table: str) -> bool:
    """Whether the decoded rows of a group (or a ledger entry's siblings) are identical on both sides."""
    stored = (lambda d: d.get("rows_stored")) if table == "groups" else (lambda d: bool(d.get("siblings")))
    if not (stored(da) and stored(db)):
        return True  # no rows on one side: the state or sibling fields already say so
    ra, rb = _rows(ta, gid), _rows(tb, gid)
    if ra.keys() != rb.keys():
        return False
    for index, rec in ra.items():
        other = rb[index]
        if rec.dtypes != other.dtypes or rec.meta != other.meta:
            return False
        if not all(codec.same_value(value, other.arrays[name]) for name, value in rec.arrays.items()):
            return False
    return True
