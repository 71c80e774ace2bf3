"""The value store's file: its kind marker, key layout and every transaction over it.

A value store is a kvckpt store file (format 3's one tree) whose ``rows`` table holds codec
records (:mod:`kvckpt.storage.codec`) under ``tq/<key>``; each record's ``meta`` names its key
(``k``) and the write identity of the put that wrote it (``w``). ``meta/transferqueue`` marks the
kind (:data:`FORMAT`); ``meta/checkpoint`` is the last checkpoint's stamp (``checkpoint_id``,
``created``, ``file``). Nothing else is stored (docs/format.md, "The value store").

Each function below runs inside one transaction its caller opened (:class:`~kvckpt.storage.txn.Txn`),
so a value-store operation is one transaction: a write's fence check, its deletes and its puts
commit together or not at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvckpt.errors import BadArgument, CorruptRecord, FencedWrite, FormatError, RecoveryError
from kvckpt.storage import codec
from kvckpt.storage.txn import Txn
from kvckpt.tables.meta import FORMAT_KEY as STORE_FORMAT_KEY
from kvckpt.tables.meta import STAMP_KEY

#: ``meta`` record that marks a store file as a value store (its name predates the core kind).
FORMAT_KEY = b"transferqueue"
#: Version 2: JSON values in the record body, numpy text and object arrays (version 1 files are refused).
FORMAT = {"kind": "transferqueue-values", "version": 2}
#: Prefix of every key in the store's ``rows`` table.
KEY_PREFIX = b"tq/"
#: The ``meta`` keys a value store holds.
META_KEYS = frozenset({STORE_FORMAT_KEY, FORMAT_KEY, STAMP_KEY})


def store_key(key: str) -> bytes:
    """The LMDB key of a value key (TransferQueue's ``"{global_index}@{field}"``, the verl ledger's names)."""
    if not isinstance(key, str) or not key:
        raise BadArgument(f"value keys are non-empty strings, got {key!r}")
    return KEY_PREFIX + key.encode()


def write_id_of(raw: bytes, key: str) -> str | None:
    """The write identity stamped in a stored record (its checksum verified)."""
    return codec.decode_meta(raw, f"rows/{key}").get("w")


def kind_of(txn: Txn) -> dict[str, Any] | None:
    """The value store's kind marker, or ``None`` where the file is not a value store."""
    return txn.get_json("meta", FORMAT_KEY)


def check_format(path: str, doc: dict[str, Any]) -> None:
    """Refuse a value store of another kind or format version (its records would decode wrongly)."""
    if doc.get("kind") != FORMAT["kind"] or doc.get("version") != FORMAT["version"]:
        raise FormatError(f"{path!r} holds {str(doc.get('kind'))[:100]!r} version {str(doc.get('version'))[:20]}; "
                          f"this backend reads {FORMAT['kind']!r} version {FORMAT['version']}")


def init(txn: Txn, path: str, created: float) -> None:
    """Mark a new file as a value store, or check an existing one's marker.

    Raises:
        FormatError: the file is a replay buffer, or a value store of another version.
    """
    doc = kind_of(txn)
    if doc is None:
        if txn.get("meta", b"config") is not None:
            raise FormatError(f"{path!r} is a kvckpt replay buffer, not a TransferQueue value store")
        txn.put_json("meta", FORMAT_KEY, {**FORMAT, "created": created})
    else:
        check_format(path, doc)


def check_fence(txn: Txn, path: str, fence: tuple[str, str] | None) -> None:
    """Refuse the transaction unless the record under ``fence[0]`` was written by ``fence[1]``.

    Raises:
        FencedWrite: it was written by another identity (or is absent); nothing is written.
    """
    if fence is None:
        return
    key, expected = fence
    raw = txn.get("rows", store_key(key))
    found = None if raw is None else write_id_of(raw, key)
    if found != expected:
        raise FencedWrite(path, key, expected, found)


def write(txn: Txn, path: str, pairs: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes],
          fence: tuple[str, str] | None) -> None:
    """Check the fence, delete ``deletes`` (absent ones skipped), then put ``pairs``."""
    check_fence(txn, path, fence)
    for key in deletes:
        txn.delete("rows", key)
    for key, value in pairs:
        txn.put("rows", key, value)


def clear(txn: Txn, keys: Sequence[str], write_ids: Sequence[str | None]) -> int:
    """Delete each key whose stored write identity is the given one (``None``: unconditionally)."""
    deleted = 0
    for key, wid in zip(keys, write_ids, strict=True):
        skey = store_key(key)
        raw = txn.get("rows", skey)
        if raw is None or (wid is not None and write_id_of(raw, key) != wid):
            continue
        deleted += txn.delete("rows", skey)
    return deleted


def keys(txn: Txn, prefix: str = "") -> list[str]:
    """The value keys under ``prefix``, in key order (keys only: no value is read)."""
    start = store_key(prefix) if prefix else KEY_PREFIX
    return [k[len(KEY_PREFIX):].decode() for k in txn.iter_keys("rows", start)]


def count(txn: Txn) -> int:
    """How many values the snapshot holds (keys only)."""
    return txn.count("rows", KEY_PREFIX)


def put_stamp(txn: Txn, stamp: dict[str, Any]) -> None:
    """Record a checkpoint's stamp (``checkpoint_id``, ``created``, ``file``)."""
    txn.put_json("meta", STAMP_KEY, stamp)


def stamp_of(txn: Txn) -> dict[str, Any] | None:
    """The last checkpoint's stamp, or ``None``."""
    return txn.get_json("meta", STAMP_KEY)


def validate_checkpoint(txn: Txn, path: str) -> dict[str, Any]:
    """Check a value-store checkpoint's snapshot: its kind, its stamp, every record's checksum and
    key. Returns the stamp.

    Raises:
        FormatError: not a value store, or another version. RecoveryError: no stamp, or a record
        holding another key's value. CorruptRecord: a record fails its checksum.
    """
    doc = kind_of(txn)
    if doc is None:
        raise FormatError(f"{path!r} is not a TransferQueue value store checkpoint")
    check_format(path, doc)
    stamp = stamp_of(txn)
    if stamp is None:
        raise RecoveryError(f"{path!r} is a TransferQueue value store but not a checkpoint (no stamp)")
    for skey, raw in txn.iter_prefix("rows", KEY_PREFIX):
        key = skey[len(KEY_PREFIX):].decode()
        if codec.decode_meta(raw, f"rows/{key}").get("k") != key:
            raise RecoveryError(f"{path!r}: the record under {key!r} holds another key's value")
    return stamp


def problems(txn: Txn, *, payloads: bool = False) -> tuple[list[tuple[str, str, str]], dict[str, int]]:
    """Every finding on a value store's snapshot, as ``(code, key, message)``, and its counts
    (``kvckpt verify``): the kind marker, the meta keys, every key under the value prefix, every
    record's header checksum (the whole record, decompressed, with ``payloads``) and the key it names."""
    found: list[tuple[str, str, str]] = []
    for key, value in txn.iter_prefix("meta", b""):
        name = f"meta/{key.decode(errors='replace')}"
        if key not in META_KEYS:
            found.append(("unknown-meta", name, "unknown meta key of a value store (damaged, or a newer kvckpt)"))
            continue
        try:
            codec.decode_meta(value, name)
        except CorruptRecord as exc:
            found.append(("corrupt-record", exc.key, exc.reason))
    try:
        doc = kind_of(txn)
        if doc is not None and (doc.get("kind"), doc.get("version")) != (FORMAT["kind"], FORMAT["version"]):
            found.append(("format", "meta/transferqueue", f"value store of kind {str(doc.get('kind'))[:100]!r} "
                                                          f"version {str(doc.get('version'))[:20]}"))
    except CorruptRecord:
        pass  # reported above
    values = 0
    for skey, raw in txn.iter_prefix("rows", b""):
        name = f"rows/{skey.decode(errors='replace')}"
        if not skey.startswith(KEY_PREFIX) or len(skey) == len(KEY_PREFIX):
            found.append(("stray-key", name, "a key outside the value store's key layout"))
            continue
        values += 1
        key = skey[len(KEY_PREFIX):].decode(errors="replace")
        try:
            meta = codec.decode(raw, name).meta if payloads else codec.decode_meta(raw, name)
        except CorruptRecord as exc:
            found.append(("corrupt-record", exc.key, exc.reason))
            continue
        if meta.get("k") != key:
            found.append(("key-mismatch", name, f"the record names key {str(meta.get('k'))[:100]!r}"))
    return found, {"values": values}


# -- token progress (progress_step's rules over this store kind) ----------------------------------------
def progress_row(prefix: str, group_id: str, index: int) -> str:
    """The key prefix of the progress chunks of sample ``index`` of ``group_id`` under a caller's ``prefix``
    (``{prefix}{group_id}/{index}/``); each chunk is one record under it, :func:`chunk_key`.

    Raises:
        BadArgument: a group id that is not a non-empty string without '/', or an index that is not an int >= 0.
    """
    if not isinstance(group_id, str) or not group_id or "/" in group_id:
        raise BadArgument(f"a progress group id is a non-empty string without '/', got {group_id!r}")
    if type(index) is not int or index < 0:
        raise BadArgument(f"a progress sample index is an integer >= 0, got {index!r}")
    return f"{prefix}{group_id}/{index}/"


def chunk_key(row: str, start: int) -> str:
    """The value key of the chunk of sample ``row`` (:func:`progress_row`) that begins at token ``start``."""
    return f"{row}{start:010d}"


class ValueChunks:
    """A value store's progress chunks inside one open write transaction: the ``ChunkRows`` that
    ``kvckpt.transitions.progress_step.append`` runs its rules over (the buffer's is ``Tables``). A
    sample's ``row`` is its :func:`progress_row` as bytes; nothing but its chunks may lie under it."""

    def __init__(self, txn: Txn) -> None:
        self.txn = txn

    def last_progress_chunk_of(self, row: bytes) -> tuple[int, bytes] | None:
        """``(start, stored chunk)`` of the sample's last chunk, or ``None``.

        Raises:
            CorruptRecord: the last key under the sample's prefix is not a chunk's.
        """
        found = self.txn.last("rows", KEY_PREFIX + row)
        return None if found is None else (_start_of(found[0], row), found[1])

    def progress_chunk_of(self, row: bytes, start: int) -> bytes | None:
        """The sample's chunk that begins at token ``start``, or ``None``."""
        return self.txn.get("rows", b"%s%s%010d" % (KEY_PREFIX, row, start))

    def put_progress_chunk_of(self, row: bytes, start: int, value: bytes) -> None:
        """Store one chunk."""
        self.txn.put("rows", b"%s%s%010d" % (KEY_PREFIX, row, start), value)

    def chunks(self, row: bytes) -> list[tuple[int, bytes]]:
        """``(start, stored chunk)`` of every chunk of the sample, in token order."""
        return [(_start_of(k, row), v) for k, v in self.txn.iter_prefix("rows", KEY_PREFIX + row)]


def _start_of(key: bytes, row: bytes) -> int:
    """The start of the chunk stored under ``key`` (of sample ``row``).

    Raises:
        CorruptRecord: ``key`` is not a chunk's (only a chunk's key lies under a sample's prefix).
    """
    tail = key[len(KEY_PREFIX) + len(row):]
    if len(tail) != 10 or not tail.isdigit():
        raise CorruptRecord(f"rows/{key.decode(errors='replace')}", "a key under a sample's progress prefix that is "
                                                                   "not a chunk's")
    return int(tail)
