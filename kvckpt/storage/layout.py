"""Where each table's records live in the LMDB file: the one mapping from ``(table, key)`` to a
database and a stored key.

Two layouts exist, and a :class:`~kvckpt.storage.store.Txn` reads and writes both the same way:

* :class:`OneTree` (format 3, what kvckpt writes): every table in LMDB's main database, each
  under a one-byte prefix. A durable commit then rewrites one B-tree's pages, not five trees'
  plus the main database's page of their roots (``python -m benchmarks.layout_bytes`` measures
  it). Ledger entries, group records and (format 4) token-progress chunks share one prefix, told
  apart by a last byte, so a commit that deletes a prompt's entry and its samples' progress and
  writes its group record changes one leaf, not two.
* :class:`NamedTables` (formats 1 and 2): each table its own LMDB named database, keys as given.
  Still read and written, so old stores and checkpoints open; a writable replay buffer moves them
  into :class:`OneTree` (:meth:`~kvckpt.storage.store.Store.upgrade_layout`: copied in bounded
  transactions, switched in one).

Format 4 is format 3 plus the ``progress`` table (a sample's durable token prefix, in chunks); the
named-table layout has no ``progress`` table (:meth:`Layout.holds`): formats 1 and 2 predate it,
and reading it there finds nothing.

Both map every ``(table, key)`` to exactly one stored key and back (:meth:`Layout.logical`), and
keep each table's keys in their own order, so prefix scans mean what they meant.
"""

from __future__ import annotations

from typing import Any

#: Named sub-databases of formats 1 and 2, and the tables of every format.
TABLES = ("meta", "groups", "rows", "ledger", "index")
#: The tables of the one-tree layout: :data:`TABLES`, (format 4) ``progress`` and ``replog`` (the
#: replication log and its state, present only in a replicated store: docs/replication.md).
ONE_TREE_TABLES = (*TABLES, "progress", "replog")
#: Format 3's prefix of each table in the main database.
PREFIXES = {"meta": b"m", "index": b"i", "rows": b"r", "groups": b"g", "ledger": b"g", "progress": b"g",
            "replog": b"l"}
#: The last byte of the tables that share the ``g`` prefix (a prompt's records, every kind).
SUFFIXES = {"groups": b"\x00", "ledger": b"\x01", "progress": b"\x02"}
#: The format versions each layout is written under (4 adds ``progress`` to 3).
ONE_TREE_VERSIONS = (3, 4)
NAMED_TABLES_VERSIONS = (1, 2)


class Layout:
    """The placement of every table of one open store (see the module docstring)."""

    #: Format versions whose files use this layout.
    versions: tuple[int, ...] = ()

    def place(self, table: str, key: bytes) -> tuple[Any, bytes]:
        """``(database handle, stored key)`` of ``table``'s ``key``."""
        raise NotImplementedError

    def holds(self, table: str) -> bool:
        """Whether this layout has ``table`` (a table it lacks reads as empty and refuses writes)."""
        raise NotImplementedError

    def region(self, table: str, prefix: bytes) -> tuple[Any, bytes]:
        """``(database handle, stored prefix)``: every stored key of ``table`` whose key starts with
        ``prefix`` starts with the stored prefix (other tables' keys may too; see :meth:`logical`)."""
        raise NotImplementedError

    def logical(self, table: str, stored: bytes) -> bytes | None:
        """The key of ``table`` stored as ``stored``, or ``None`` when ``stored`` is another table's."""
        raise NotImplementedError

    def counted(self, table: str) -> Any | None:
        """The database handle whose LMDB entry count is exactly ``table``'s, or ``None`` (count by scan)."""
        raise NotImplementedError

    def stray(self, stored: bytes) -> bool:
        """Whether a key of the main database belongs to no table (damage, or another program's)."""
        raise NotImplementedError

    def owning_prefix(self, stored: bytes) -> bytes | None:
        """A prefix of ``stored`` such that every key of the main database starting with it belongs
        to a table (a scan for stray keys skips them all), or ``None``."""
        return None


class OneTree(Layout):
    """Format 3: every table in the main database under its prefix (:data:`PREFIXES`)."""

    versions = ONE_TREE_VERSIONS

    def __init__(self, main: Any) -> None:
        self.main = main

    def place(self, table: str, key: bytes) -> tuple[Any, bytes]:
        return self.main, stored_key(table, key)

    def holds(self, table: str) -> bool:
        return table in PREFIXES

    def region(self, table: str, prefix: bytes) -> tuple[Any, bytes]:
        return self.main, PREFIXES[table] + prefix

    def logical(self, table: str, stored: bytes) -> bytes | None:
        where = split(stored)
        return where[1] if where is not None and where[0] == table else None

    def counted(self, table: str) -> Any | None:
        return None

    def stray(self, stored: bytes) -> bool:
        return split(stored) is None

    def owning_prefix(self, stored: bytes) -> bytes | None:
        return stored[:1] if stored[:1] in _TABLE_OF_PREFIX else None


class NamedTables(Layout):
    """Formats 1 and 2: each table its own named database (``dbs``), keys as given."""

    versions = NAMED_TABLES_VERSIONS

    def __init__(self, dbs: dict[str, Any]) -> None:
        self.dbs = dbs

    def place(self, table: str, key: bytes) -> tuple[Any, bytes]:
        return self.dbs[table], key

    def holds(self, table: str) -> bool:
        return table in self.dbs

    def region(self, table: str, prefix: bytes) -> tuple[Any, bytes]:
        return self.dbs[table], prefix

    def logical(self, table: str, stored: bytes) -> bytes | None:
        return stored

    def counted(self, table: str) -> Any | None:
        return self.dbs[table]

    def stray(self, stored: bytes) -> bool:
        return stored not in _NAMED and not partial_copy_key(stored)


_TABLE_OF_PREFIX = {b"m": "meta", b"i": "index", b"r": "rows", b"l": "replog"}
_TABLE_OF_SUFFIX = {suffix: table for table, suffix in SUFFIXES.items()}


def split(stored: bytes) -> tuple[str, bytes] | None:
    """``(table, key)`` of a key of format 3's main database, or ``None`` if no table owns it."""
    table = _TABLE_OF_PREFIX.get(stored[:1])
    if table is not None:
        return table, stored[1:]
    table = _TABLE_OF_SUFFIX.get(stored[-1:]) if stored[:1] == b"g" and len(stored) >= 2 else None
    return None if table is None else (table, stored[1:-1])


_NAMED = frozenset(table.encode() for table in TABLES)


def partial_copy_key(stored: bytes) -> bool:
    """Whether a key of a format-1/2 file's main database is one an upgrade interrupted by a crash
    had copied there (format-3 shaped, and not a named database's own record): ignored by
    readers, cleared by the next upgrade (:meth:`~kvckpt.storage.store.Store.upgrade_layout`)."""
    return stored not in _NAMED and split(stored) is not None


def stored_key(table: str, key: bytes) -> bytes:
    """The key format 3 stores ``table``'s ``key`` under in the main database (for tools and tests
    that edit files below kvckpt's API)."""
    return PREFIXES[table] + key + SUFFIXES.get(table, b"")
