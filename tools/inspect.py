"""Inspection of a store or checkpoint file: what it is, what it holds, where its cursors are.

:func:`inspect_path` opens the file read-only through :func:`kvckpt.durability.safe_open.open_readonly` (no
lock file unless a writer holds it, in which case the writer's lock file is shared), reads
**one snapshot** and returns a JSON-able dict:
identity, config, group counts by state, the ledger (count and the first few entries), the token
progress of samples still generating (samples, chunks, durable tokens), cursors, the last
checkpoint stamp, bytes (raw, stored, file), the oldest and newest weight versions, and
histograms by weight version and by training step. It never writes. A value store (``kind``
``"values"``; a replay buffer is ``"replay-buffer"``) is described by its kind marker, its number
of values, its stored bytes and its last checkpoint stamp.

Records that fail their checksum, and checksum-valid records kvckpt never writes (a config it
cannot build a buffer from, a group record with a missing or mistyped field), are counted under
``problems`` instead of aborting the scan (``kvckpt verify`` lists them all).
Cost: one JSON decode per group and ledger entry and one header decode per sample with
progress; row and chunk payloads are never read.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from kvckpt import CLAIMED, CONSUMED, READY, BufferConfig, codec
from kvckpt.errors import CorruptRecord, KvckptError
from kvckpt.tooling import (
    CONFIG_KEY,
    DATALOADER_KEY,
    GROUP_STATES,
    SHORTFALL_KEY,
    STAMP_KEY,
    STATE_KEY,
    Txn,
    kinds,
    lineage_weight,
    open_readonly,
    replog,
    writer_active,
)
from kvckpt.tooling import value_records as values

INFLIGHT = "inflight"
#: Column order of the by-weight histogram: in flight first, then the group states.
HISTOGRAM_STATES = (INFLIGHT, *GROUP_STATES)

Progress = Callable[[int, int], None]
"""A progress callback: ``progress(done, total)``."""


def _scan(txn: Txn, table: str, problems: list[dict[str, str]], progress: Progress | None,
          done: list[int], total: int) -> Any:
    """Yield the decoded JSON documents of ``table``; damaged records go to ``problems``."""
    for key, value in txn.iter_prefix(table, b""):
        name = f"{table}/{key.decode(errors='replace')}"
        done[0] += 1
        if progress is not None and done[0] % 4096 == 0:
            progress(done[0], total)
        try:
            yield codec.decode_meta(value, name)
        except CorruptRecord as exc:
            problems.append({"key": name, "problem": exc.reason})


#: The fields of group records and ledger entries the scan reads, and the types kvckpt writes.
_FIELDS = {"group_id": (str,), "state": (str,), "start_weight": (int,), "target_step": (int, type(None)),
           "claimed_step": (int, type(None)), "consumed_step": (int, type(None)), "rows_stored": (bool,),
           "raw_bytes": (int,), "stored_bytes": (int,), "seq": (int,), "siblings": (list,),
           "lineage_fork": (int, type(None)), "lineage_newest": (int, type(None))}
_REQUIRED = {"groups": ("group_id", "state", "start_weight"), "ledger": ("group_id", "start_weight")}


def _well_formed(doc: dict[str, Any], table: str, problems: list[dict[str, str]]) -> bool:
    """Whether a record has the fields the scan needs, of the types kvckpt writes; else a problem."""
    missing = [k for k in _REQUIRED[table] if k not in doc]
    wrong = [k for k, types in _FIELDS.items() if k in doc and not isinstance(doc[k], types)]
    if missing or wrong:
        name = str(doc.get("group_id"))[:100]
        problems.append({"key": f"{table}/{name}", "problem": f"checksum-valid but not a record kvckpt writes "
                                                             f"(missing {missing}, mistyped {wrong})"})
        return False
    return True


def _token_progress(txn: Txn, problems: list[dict[str, str]]) -> dict[str, int]:
    """Samples with token progress, their chunks, and their durable tokens (each sample's last
    chunk's start plus its length, from that chunk's header: the one record decoded per sample)."""
    samples = chunks = tokens = 0
    # a progress key is the row's key (group id, 0x00, index u32) then the chunk's start (u64)
    for row, sample in itertools.groupby(txn.iter_prefix("progress", b""), key=lambda kv: kv[0][:-8]):
        found = list(sample)
        samples, chunks = samples + 1, chunks + len(found)
        key, value = found[-1]
        name = f"progress/{row[:-5].decode(errors='replace')}#{int.from_bytes(row[-4:], 'big')}"
        try:
            length = codec.decode_meta(value, name).get("length")
        except CorruptRecord as exc:
            problems.append({"key": name, "problem": exc.reason})
            continue
        if type(length) is int and length > 0:
            tokens += int.from_bytes(key[-8:], "big") + length
    return {"samples": samples, "chunks": chunks, "tokens": tokens}


def _span(values: list[int]) -> dict[str, int | None]:
    return {"oldest": min(values) if values else None, "newest": max(values) if values else None}


def inspect_path(path: str, *, ledger_limit: int = 5, progress: Progress | None = None) -> dict[str, Any]:
    """Describe the store or checkpoint at ``path`` from one read snapshot (see the module doc).

    Args:
        path: a live store or a checkpoint file.
        ledger_limit: how many ledger entries to list (in dispatch order). Defaults to 5.
        progress: called with ``(records scanned, records in all)`` during the scan.

    Raises:
        StoreNotFound / FormatError: no file, or not a kvckpt store.
    """
    path = os.fspath(path)
    live = writer_active(path)
    with open_readonly(path) as store:
        info = store.env.info()
        page = store.env.stat()["psize"]
        with store.reader() as txn:
            kind = kinds.kind_of(txn)
            out = kind.hook("inspect", path)(txn, ledger_limit, progress)
            out["replication"] = replog.describe(txn)  # None: not replicated (docs/replication.md)
        out.update(path=path, live=live, kind=kind.name)
        out["identity"] = {k: store.info.get(k) for k in ("store_id", "format", "version", "created")}
        out["bytes"].update(file=os.path.getsize(path), lmdb_pages_used=(info["last_pgno"] + 1) * page,
                            page_size=page)
    return out


def _describe_values(txn: Txn, ledger_limit: int, progress: Progress | None) -> dict[str, Any]:
    """A value store's kind marker, value count, last checkpoint stamp and stored bytes; damaged
    records (checksum) under ``problems``."""
    problems: list[dict[str, str]] = []
    marker = stamp = None
    try:
        marker = values.kind_of(txn)
        stamp = values.stamp_of(txn)
    except CorruptRecord as exc:
        problems.append({"key": exc.key, "problem": exc.reason})
    count = stored = 0
    for key, raw in txn.iter_prefix("rows", values.KEY_PREFIX):
        count += 1
        stored += len(raw)
        try:
            codec.decode_meta(raw, f"rows/{key.decode(errors='replace')}")
        except CorruptRecord as exc:
            problems.append({"key": exc.key, "problem": exc.reason})
    return {"problems": problems, "value_store": marker, "values": count, "checkpoint": stamp,
            "bytes": {"stored": stored}}


def _describe(txn: Txn, ledger_limit: int, progress: Progress | None) -> dict[str, Any]:
    problems: list[dict[str, str]] = []
    out: dict[str, Any] = {"problems": problems}
    try:
        config = txn.get_json("meta", CONFIG_KEY)
        state = txn.get_json("meta", STATE_KEY)
        stamp = txn.get_json("meta", STAMP_KEY)
        shortfall = txn.get_json("meta", SHORTFALL_KEY)
    except CorruptRecord as exc:
        problems.append({"key": exc.key, "problem": exc.reason})
        config = state = stamp = shortfall = None
    if config is not None:
        try:
            BufferConfig.from_dict(config)
        except (KvckptError, TypeError, ValueError, KeyError, AttributeError) as exc:
            problems.append({"key": "meta/config", "problem": f"not a buffer config kvckpt writes "
                                                              f"({type(exc).__name__}: {str(exc)[:200]})"})
            config = None
    out["config"] = config
    dataloader = None
    try:
        value = txn.get("meta", DATALOADER_KEY)
        dataloader = None if value is None else codec.decode(value, "meta/dataloader").arrays["state"].nbytes
    except CorruptRecord as exc:
        problems.append({"key": exc.key, "problem": exc.reason})
    total = txn.count("groups") + txn.count("ledger")
    rows = txn.count("rows")
    done = [0]

    counts: Counter[str] = Counter()
    by_weight: dict[int, Counter[str]] = defaultdict(Counter)
    by_step: dict[int, Counter[str]] = defaultdict(Counter)
    held_weights: list[int] = []
    all_weights: list[int] = []
    lineage: list[tuple[bool, int, bool]] = []  # per held record: forked, lineage weight, spans a sync
    raw = stored = 0
    for doc in _scan(txn, "groups", problems, progress, done, total):
        if not _well_formed(doc, "groups", problems):
            continue
        name = doc.get("state")
        counts[name] += 1
        if name in (READY, CLAIMED):
            lineage.append(_lineage(doc))
        weight = doc.get("start_weight")
        if isinstance(weight, int):
            by_weight[weight][name] += 1
            all_weights.append(weight)
        if name == CLAIMED:
            by_step[doc["claimed_step"]][CLAIMED] += 1
        elif name == CONSUMED:
            by_step[doc["consumed_step"]][CONSUMED] += 1
        if doc.get("target_step") is not None and name == READY:
            by_step[doc["target_step"]]["target_ready"] += 1
        if doc.get("rows_stored"):
            raw += doc.get("raw_bytes", 0)
            stored += doc.get("stored_bytes", 0)
            if isinstance(weight, int):
                held_weights.append(weight)

    entries = []
    for doc in _scan(txn, "ledger", problems, progress, done, total):
        if not _well_formed(doc, "ledger", problems):
            continue
        entries.append(doc)
        lineage.append(_lineage(doc))
        counts[INFLIGHT] += 1
        by_weight[doc["start_weight"]][INFLIGHT] += 1
        all_weights.append(doc["start_weight"])
        held_weights.append(doc["start_weight"])
        if doc.get("target_step") is not None:
            by_step[doc["target_step"]]["target_inflight"] += 1
        raw += doc.get("raw_bytes", 0)
        stored += doc.get("stored_bytes", 0)
    if progress is not None:
        progress(done[0], total)
    out["progress"] = _token_progress(txn, problems)
    entries.sort(key=lambda e: e.get("seq", 0))

    out["counts"] = {name: counts.get(name, 0) for name in HISTOGRAM_STATES}
    out["counts"].update(groups=sum(counts[s] for s in GROUP_STATES), rows=rows)
    out["ledger"] = {
        "count": len(entries), "partial": sum(1 for e in entries if e.get("siblings")),
        "first": [{k: e.get(k) for k in ("group_id", "prompt_idx", "task_name", "target_step", "start_weight",
                                          "attempt", "siblings")} for e in entries[:ledger_limit]]}
    cursor_keys = ("dispatch_index", "trainer_version", "weight_version", "admissions", "seq", "drop_floor",
                   "durable")
    out["cursors"] = {k: state.get(k) for k in cursor_keys} if state else None
    counters = state.get("counters") if state else None
    out["counters"] = dict(counters) if isinstance(counters, dict) else None
    out["batch_shortfall"] = shortfall or {}
    out["dataloader_state_bytes"] = dataloader
    out["checkpoint"] = None if stamp is None else {
        k: stamp.get(k) for k in ("checkpoint_id", "trainer_version", "dispatch_index", "created", "file",
                                  "trainer_state")}
    out["bytes"] = {"raw": raw, "stored": stored}
    out["weights"] = {"held": _span(held_weights), "all": _span(all_weights)}
    forked = [weight for fork, weight, _ in lineage if fork]
    out["lineage"] = {"forked": len(forked), "spanning": sum(span for _, _, span in lineage),
                      "lowest": min(forked, default=None)}
    step_columns = ("target_inflight", "target_ready", CLAIMED, CONSUMED)
    out["histogram"] = {
        "by_weight": [{"weight": w, **{s: by_weight[w].get(s, 0) for s in HISTOGRAM_STATES}}
                      for w in sorted(by_weight)],
        "by_step": [{"step": s, **{c: by_step[s].get(c, 0) for c in step_columns}} for s in sorted(by_step)]}
    return out


def _lineage(doc: dict[str, Any]) -> tuple[bool, int, bool]:
    """A ready, claimed or in-flight record's lineage: forked by a rollback, its lineage weight (the one
    rule every sampler reads), and whether its tokens span a weight sync (``lineage_newest``)."""
    fork, newest = doc.get("lineage_fork"), doc.get("lineage_newest")
    return fork is not None, lineage_weight(doc["start_weight"], fork, newest), newest is not None


kinds.attach("values", inspect=_describe_values)
kinds.attach("replay-buffer", inspect=_describe)
