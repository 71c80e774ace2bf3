"""Compaction: a compacted single-file copy of a store, optionally with row payloads re-encoded.

:func:`compact` reads one snapshot of the source (opened read-only: no lock file, never
modified) and writes it with LMDB's compacting copy, which drops free pages, so a store that
churned through many evicted or consumed groups shrinks to the size of what it still holds. With
``level`` it also re-encodes every stored row payload at that zstd level (and records the level in
the config, so later commits use it too), then compacts once more.

The copy is written under a temporary ``.partial`` name, fsynced, renamed to ``dest`` and the
directory fsynced: ``dest`` is complete or absent, never half written. An existing ``dest`` is
replaced only with ``force`` (and never when it is the source).

Re-encoding is the encoding a commit at the new level would have written, byte for byte, so
each group's ``digest`` (and each ledger entry's sibling digests) is recomputed from the new
bytes: an idempotent retry of a commit still recognises its rows. ``stored_bytes`` (per group and
in the counters) follow the new encoding; everything else is copied unchanged. A value store's
records are re-encoded the same way (each keeps its key and write identity).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvckpt import Store, codec, durable_replace
from kvckpt.errors import BadArgument, StoreLocked
from kvckpt.tooling import (
    CONFIG_KEY,
    STATE_KEY,
    Txn,
    group_digest,
    keys,
    kinds,
    open_readonly,
    row_digest,
    writer_active,
)
from kvckpt.tooling import value_records as values

#: Suffixes of the first copy ``compact --level`` re-encodes (beside the final one) and of its lock file.
_FIRST = (".first", ".first-lock")
#: Bytes of stored row payloads re-encoded per write transaction.
BATCH_BYTES = 16 << 20

PhasedProgress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: phase ``"copy"`` counts bytes written, ``"re-encode"`` rows."""


@dataclass
class CompactResult:
    """What :func:`compact` did: sizes before and after (bytes), rows re-encoded, seconds."""

    src: str
    dest: str
    bytes_before: int
    bytes_after: int
    level: int | None = None
    rows_reencoded: int = 0
    stored_before: int = 0
    stored_after: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (``kvckpt compact --json``)."""
        return dict(self.__dict__)


def check_destination(src: str, dest: str, force: bool) -> None:
    """Refuse a destination that is the source, exists without ``force``, is held by a writer, or
    lies in a missing directory.

    Raises:
        BadArgument, StoreLocked: as above; nothing has been written.
    """
    directory = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(directory):
        raise BadArgument(f"directory {directory!r} of {dest!r} does not exist")
    if not os.path.exists(dest):
        return
    if os.path.exists(src) and os.path.samefile(src, dest):
        raise BadArgument(f"{dest!r} is the input itself; write to another file")
    if not force:
        raise BadArgument(f"{dest!r} already exists; pass --force to replace it")
    if not os.path.isfile(dest):
        raise BadArgument(f"{dest!r} exists and is not a regular file")
    if writer_active(dest):
        raise StoreLocked(f"{dest!r} is open for writing by another process; not replacing it")


def compact(src: str, dest: str, *, level: int | None = None, force: bool = False,
            progress: PhasedProgress | None = None) -> CompactResult:
    """Write a compacted copy of ``src`` (a live store or a checkpoint) to ``dest``.

    Args:
        src: the store to copy; opened read-only and never modified.
        dest: the file to write.
        level: re-encode row payloads with this zstd level (0 = uncompressed). Defaults to None
            (payloads are copied as they are).
        force: replace an existing ``dest``. Defaults to False.
        progress: called with ``(phase, done, total)``, see :data:`PhasedProgress`.

    Raises:
        BadArgument: bad ``level`` or destination (see :func:`check_destination`).
        StoreNotFound / FormatError: ``src`` is not a kvckpt store.
    """
    if level is not None and (isinstance(level, bool) or not isinstance(level, int)
                              or not 0 <= level <= codec.MAX_LEVEL):
        raise BadArgument(f"--level must be an integer from 0 to {codec.MAX_LEVEL}, got {level!r}")
    src, dest = os.fspath(src), os.fspath(dest)
    t0 = time.perf_counter()
    check_destination(src, dest, force)
    result = CompactResult(src, dest, os.path.getsize(src) if os.path.exists(src) else 0, 0, level)
    # nothing appears or gets locked at dest between the check above and the rename
    with durable_replace(dest, check=lambda: check_destination(src, dest, force), leftovers=_FIRST) as final:
        first = final + _FIRST[0] if level is not None else final
        with open_readonly(src) as store:
            _copy(store, first, progress)
        if level is not None:
            _reencode_file(first, level, result, progress)
            with Store(first, readonly=True) as store:
                _copy(store, final, progress)
            os.unlink(first)
    result.bytes_after = os.path.getsize(dest)
    result.seconds = time.perf_counter() - t0
    return result


def _copy(store: Store, dest: str, progress: PhasedProgress | None) -> None:
    """LMDB's compacting copy of one snapshot; progress follows the growing file."""
    info = store.env.info()
    estimate = (info["last_pgno"] + 1) * store.env.stat()["psize"]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            with contextlib.suppress(OSError):
                progress("copy", os.path.getsize(dest), estimate)

    watcher = threading.Thread(target=watch, daemon=True) if progress is not None else None
    with store.reader() as txn:
        if watcher is not None:
            watcher.start()
        try:
            store.copy_snapshot(dest, txn)
        finally:
            done.set()
            if watcher is not None:
                watcher.join()
    if progress is not None:
        size = os.path.getsize(dest)
        progress("copy", size, size)


def reencode(value: bytes, key: str, level: int) -> bytes:
    """A stored record re-encoded at ``level``: the bytes a fresh encode of its content would give."""
    record = codec.decode(value, key)
    # bfloat16 arrays are raw uint16 bits; only the torch view carries the logical dtype.
    fields = record.tensors() if "bfloat16" in record.dtypes.values() else record.arrays
    return codec.encode(fields, record.meta, level)


def _reencode_rows(txn: Txn, gid: str, level: int) -> tuple[dict[str, str], int, int]:
    """Re-encode the stored rows of one group: (row digests by index, bytes before, bytes after)."""
    digests, before, after = {}, 0, 0
    for key, value in list(txn.iter_prefix("rows", keys.row_prefix(gid))):
        index = int.from_bytes(key[-4:], "big")
        new = reencode(value, f"rows/{keys.row_id(gid, index)}", level)
        txn.put("rows", key, new)
        digests[str(index)] = row_digest(new)
        before += len(value)
        after += len(new)
    return digests, before, after


def _reencode_file(path: str, level: int, result: CompactResult, progress: PhasedProgress | None) -> None:
    """Re-encode every stored row of the private copy at ``path`` in bounded transactions."""
    with Store(path) as store:
        store.read(kinds.kind_of).hook("compact", result.src)(store, level, result, progress)


def _reencode_buffer(store: Store, level: int, result: CompactResult, progress: PhasedProgress | None) -> None:
    """Re-encode every stored row of a replay buffer, its groups' and ledger entries' digests recomputed."""
    if store.read(lambda t: t.get_json("meta", CONFIG_KEY)) is None:
        raise BadArgument(f"{result.src!r} holds no replay buffer or value store; --level needs one")
    total = store.read(lambda t: t.count("rows"))
    for table in ("groups", "ledger"):
        start: bytes | None = b""
        while start is not None:
            start, rows, before, after = store.write(
                lambda txn, s=start, t=table: _reencode_batch(txn, t, s, level))
            result.rows_reencoded += rows
            result.stored_before += before
            result.stored_after += after
            if progress is not None:
                progress("re-encode", result.rows_reencoded, total)

    def finish(txn: Txn) -> None:
        config = txn.get_json("meta", CONFIG_KEY)
        txn.put_json("meta", CONFIG_KEY, {**config, "compression_level": level})
        state = txn.get_json("meta", STATE_KEY)
        state["counters"]["stored_bytes"] += result.stored_after - result.stored_before
        txn.put_json("meta", STATE_KEY, state)

    store.write(finish)


def _reencode_values(store: Store, level: int, result: CompactResult, progress: PhasedProgress | None) -> None:
    """Re-encode every record of a value store (its key and write identity kept in its ``meta``),
    about :data:`BATCH_BYTES` of stored records per write transaction."""
    total = store.read(values.count)

    def batch(txn: Txn, start: bytes) -> bytes | None:
        todo, size = [], 0
        for key, value in txn.iter_prefix("rows", values.KEY_PREFIX, start):
            if size >= BATCH_BYTES:
                break
            todo.append((key, bytes(value)))
            size += len(value)
        else:
            key = None
        for stored, value in todo:  # written only after the scan: no put under a live cursor
            new = reencode(value, f"rows/{stored.decode(errors='replace')}", level)
            txn.put("rows", stored, new)
            result.rows_reencoded += 1
            result.stored_before += len(value)
            result.stored_after += len(new)
        return key

    start: bytes | None = values.KEY_PREFIX
    while start is not None:
        start = store.write(lambda txn, s=start: batch(txn, s))
        if progress is not None:
            progress("re-encode", result.rows_reencoded, total)


def _reencode_batch(txn: Txn, table: str, start: bytes, level: int) -> tuple[bytes | None, int, int, int]:
    """Re-encode groups (or ledger entries) from key ``start`` until about :data:`BATCH_BYTES`;
    returns the key to continue from (``None`` when done), rows, bytes before and after."""
    batch, size, resume = [], 0, None
    for key, value in txn.iter_prefix(table, b"", start):
        if size >= BATCH_BYTES:
            resume = key
            break
        doc = codec.decode_meta(value, f"{table}/{key.decode(errors='replace')}")
        if doc.get("rows_stored") if table == "groups" else doc.get("siblings"):
            batch.append((key, doc))
            size += doc.get("stored_bytes", 0)
    rows = before_all = after_all = 0
    for key, doc in batch:  # written only after the scan: no put under a live cursor of the table
        digests, before, after = _reencode_rows(txn, doc["group_id"], level)
        rows += len(digests)
        before_all += before
        after_all += after
        doc["stored_bytes"] = doc.get("stored_bytes", 0) + after - before
        if table == "groups":
            doc["digest"] = group_digest(digests[str(i)] for i in range(doc["group_size"]))
        else:
            doc["digests"] = {**doc.get("digests", {}), **digests}
        txn.put_json(table, key, doc)
    return resume, rows, before_all, after_all


kinds.attach("values", compact=_reencode_values)
kinds.attach("replay-buffer", compact=_reencode_buffer)
