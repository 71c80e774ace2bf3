"""A transaction of a :class:`~kvckpt.storage.store.Store`: tables by name, keys as each table knows
them, wherever the store's :class:`~kvckpt.storage.layout.Layout` puts them.

Every read and write of kvckpt goes through :class:`Txn`; nothing above :mod:`kvckpt.storage` opens
an LMDB database or cursor itself, which is what lets the layout change (format 3) stay one
mapping.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lmdb

from kvckpt.errors import KvckptError
from kvckpt.storage import codec
from kvckpt.storage.layout import Layout

#: LMDB's key size limit (as stored: a layout's prefix and suffix count).
MAX_KEY_BYTES = 511


class Txn:
    """A transaction wrapper that names tables and verifies record checksums on read.

    Keys are a table's own keys; where they are stored is the store's :class:`~kvckpt.storage.layout.Layout`.
    """

    #: The replication capture (docs/replication.md): ``None`` unless the store is replicated; then
    #: a list that :meth:`put` and :meth:`delete` append ``(stored key, value or None)`` to, in order,
    #: which the store's log turns into this transaction's one log record.
    capture: list[tuple[bytes, bytes | None]] | None = None

    def __init__(self, txn: lmdb.Transaction, layout: Layout, write: bool) -> None:
        self.raw = txn
        self.layout = layout
        self.write = write
        self._lookups: dict[Any, lmdb.Cursor] = {}
        #: Puts and deletes made through this object so far: ``Store.write_each`` tells a refusal
        #: that wrote nothing (no rollback needed) from one that wrote.
        self.writes = 0

    def get(self, table: str, key: bytes) -> bytes | None:
        """The raw stored value, or ``None``."""
        if not self.layout.holds(table):
            return None
        db, stored = self.layout.place(table, key)
        return self.raw.get(stored, db=db)

    def put(self, table: str, key: bytes, value: bytes) -> None:
        """Store ``value`` under ``key`` (overwriting)."""
        db, stored = self.layout.place(table, key)
        if len(stored) > MAX_KEY_BYTES:
            raise KvckptError(f"key of {len(key)} bytes exceeds LMDB's {MAX_KEY_BYTES}-byte limit")
        self.writes += 1
        self.raw.put(stored, value, db=db)
        if self.capture is not None:
            self.capture.append((stored, bytes(value)))

    def delete(self, table: str, key: bytes) -> bool:
        """Delete ``key``; returns whether it existed."""
        db, stored = self.layout.place(table, key)
        self.writes += 1
        found = self.raw.delete(stored, db=db)
        if self.capture is not None and found:
            self.capture.append((stored, None))
        return found

    def has(self, table: str, key: bytes) -> bool:
        """Whether a lookup of ``key`` finds it (a cursor seek: the value is not copied)."""
        db, stored = self.layout.place(table, key)
        return self._lookup(db).set_key(stored)

    def _lookup(self, db: Any) -> lmdb.Cursor:
        """This transaction's cursor on ``db`` for one-shot seeks (:meth:`has`, :meth:`last`): each
        positions it afresh and is done with it before returning."""
        cur = self._lookups.get(db)
        if cur is None:
            cur = self._lookups[db] = self.raw.cursor(db=db)
        return cur

    def get_json(self, table: str, key: bytes) -> dict[str, Any] | None:
        """Decode a JSON record, verifying its checksum; ``None`` if absent."""
        value = self.get(table, key)
        if value is None:
            return None
        return codec.decode_meta(value, f"{table}/{key.decode(errors='replace')}")

    def put_json(self, table: str, key: bytes, doc: dict[str, Any]) -> None:
        """Store ``doc`` as a JSON record."""
        self.put(table, key, codec.encode_json(doc))

    def _scan(self, table: str, prefix: bytes, start: bytes | None) -> Iterator[tuple[bytes, lmdb.Cursor]]:
        """``(key, cursor on it)`` for ``table``'s keys starting with ``prefix`` in order, from ``start``."""
        if not self.layout.holds(table):
            return
        db, stored_prefix = self.layout.region(table, prefix)
        cur = self.raw.cursor(db=db)
        if not cur.set_range(self.layout.place(table, start)[1] if start is not None else stored_prefix):
            return
        for stored in cur.iternext(keys=True, values=False):
            if not stored.startswith(stored_prefix):
                return
            key = self.layout.logical(table, stored)
            if key is not None and key.startswith(prefix):
                yield key, cur

    def iter_prefix(self, table: str, prefix: bytes,
                    start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Yield ``(key, value)`` for keys starting with ``prefix`` in key order, from ``start``."""
        for key, cur in self._scan(table, prefix, start):
            yield key, cur.value()

    def iter_keys(self, table: str, prefix: bytes) -> Iterator[bytes]:
        """Yield the keys starting with ``prefix`` in order, without touching their values (a large
        value's overflow pages are never read)."""
        for key, _ in self._scan(table, prefix, None):
            yield key

    def count(self, table: str, prefix: bytes = b"") -> int:
        """Number of keys of ``table`` starting with ``prefix`` (LMDB's own count where the layout
        keeps the table alone in a database; otherwise a scan of keys, no values)."""
        db = self.layout.counted(table) if not prefix and self.layout.holds(table) else None
        if db is not None:
            return int(self.raw.stat(db)["entries"])
        return sum(1 for _ in self._scan(table, prefix, None))

    def delete_prefix(self, table: str, prefix: bytes) -> int:
        """Delete every key of ``table`` starting with ``prefix``; returns how many there were."""
        doomed = list(self.iter_keys(table, prefix))
        for key in doomed:
            self.delete(table, key)
        return len(doomed)

    def last(self, table: str, prefix: bytes) -> tuple[bytes, bytes] | None:
        """``(key, value)`` of the largest key of ``table`` starting with ``prefix``, or ``None``."""
        if not self.layout.holds(table):
            return None
        db, stored_prefix = self.layout.region(table, prefix)
        cur = self._lookup(db)
        bound = _successor(stored_prefix)
        found = cur.prev() if bound and cur.set_range(bound) else cur.last()
        while found and cur.key().startswith(stored_prefix):
            key = self.layout.logical(table, cur.key())
            if key is not None and key.startswith(prefix):
                return key, cur.value()
            found = cur.prev()
        return None

    def stray_keys(self) -> Iterator[bytes]:
        """Keys of the file's main database that belong to no table (damage, or another program's).
        A range every key of which belongs to a table (format 3's rows, say) is skipped, not read."""
        cur = self.raw.cursor()
        found = cur.first()
        while found:
            stored = cur.key()
            owned = self.layout.owning_prefix(stored)
            if owned is not None:
                bound = _successor(owned)
                found = bool(bound) and cur.set_range(bound)
                continue
            if self.layout.stray(stored):
                yield stored
            found = cur.next()


def _successor(prefix: bytes) -> bytes:
    """The smallest byte string greater than every string starting with ``prefix`` (``b""`` if none)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b""
