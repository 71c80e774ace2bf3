"""Store files as kvckpt formats 1 and 2 laid them out, made from a current store file.

Formats 1 and 2 keep each table in its own LMDB named database (:class:`kvckpt.storage.layout.NamedTables`);
format 3 keeps them all in the main database. Tests rewrite a closed format-3 file with raw LMDB
calls (no kvckpt code on the write path) to check that old files still open and upgrade.
"""

from __future__ import annotations

import lmdb

from kvckpt.storage import codec
from kvckpt.storage.layout import TABLES, split
from kvckpt.storage.store import MAX_DBS


def rewrite_as_named_tables(path: str, version: int) -> None:
    """Rewrite the closed format-3 store at ``path`` in place into the named-tables layout, its
    format record saying ``version`` (1 or 2)."""
    env = lmdb.open(path, subdir=False, max_dbs=MAX_DBS, lock=False, map_size=1 << 32)
    try:
        with env.begin(write=True) as txn:
            items = list(txn.cursor())
            dbs = {table: env.open_db(table.encode(), txn=txn) for table in TABLES}
            for stored, value in items:
                where = split(stored)
                assert where is not None, f"{stored!r} belongs to no table"
                table, key = where
                txn.delete(stored)
                if (table, key) == ("meta", b"format"):
                    value = codec.encode_json({**codec.decode_meta(value), "version": version})
                txn.put(key, value, db=dbs[table])
    finally:
        env.close()
