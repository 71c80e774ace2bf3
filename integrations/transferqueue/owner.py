"""The single writer of a TransferQueue value store: one kvckpt store file, puts as transactions.

:class:`ValueStore` owns the file. It moves already-encoded records (:mod:`.values`) in and out,
so the bytes it writes are exactly the bytes the putting process checksummed, and the getting
process verifies them again. It runs either inside the one process that uses TransferQueue
(``owner: process``) or as a Ray actor (:data:`ValueStoreActor`, ``owner: actor``) that every
TransferQueue client reaches by name, since LMDB allows one writer per file.

Guarantees:

* **One put batch is one durable write transaction**: all of its values land, or none (a crash
  mid-put leaves the previous values), and a returned put survives a crash (fsync per commit).
* **A clear never destroys a newer write**: a key is deleted only if its stored write identity is
  the one the caller's metadata names.
* **A storage checkpoint is one consistent snapshot in one file**: a stamp transaction, a
  compacting copy of the read snapshot pinned right after it, fsync, rename, directory fsync
  (kvckpt's checkpoint recipe). In-process, writers are not blocked by the copy; the actor runs
  one call at a time, so its queued puts wait for the copy.
* **Loading a checkpoint never trusts the file**: it is structure-checked without mapping it,
  every record's checksum is verified, then it is copied to the live path (temporary name, fsync,
  rename) and opened through a fresh handle.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Any

import ray
from kvckpt.integrations.transferqueue.values import KEY_PREFIX, store_key, write_id_of

from kvckpt.durability.checkpoint import PARTIAL_SUFFIX
from kvckpt.durability.safe_open import check_header, copy_used, open_readonly
from kvckpt.errors import CheckpointError, FormatError, RecoveryError
from kvckpt.storage import codec
from kvckpt.storage.store import Store, Txn, fsync_dir, fsync_file
from kvckpt.tables.meta import STAMP_KEY

#: ``meta`` record that marks a store file as a TransferQueue value store.
FORMAT_KEY = b"transferqueue"
#: Version 2: JSON values in the record body, numpy text and object arrays (version 1 files are refused).
FORMAT = {"kind": "transferqueue-values", "version": 2}
#: Name of the store file inside a TransferQueue checkpoint directory.
CHECKPOINT_FILE = "kvckpt_values.kv"


class ValueStore:
    """The owner of one TransferQueue value store file (see the module docstring).

    Args:
        path: the live store file; created if missing.

    Raises:
        FormatError: the file is a kvckpt store of another kind (e.g. a replay buffer).
        StoreLocked: another process holds the file for writing.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self._store = self._open(self.path)

    @staticmethod
    def _open(path: str) -> Store:
        store = Store(path, create=True)
        try:
            def init(txn: Txn) -> None:
                doc = txn.get_json("meta", FORMAT_KEY)
                if doc is None:
                    if txn.get("meta", b"config") is not None:
                        raise FormatError(f"{path!r} is a kvckpt replay buffer, not a TransferQueue value store")
                    txn.put_json("meta", FORMAT_KEY, {**FORMAT, "created": time.time()})
                else:
                    _check_format(path, doc)
            store.write(init)
            store.upgrade_layout()  # a file of kvckpt format 1 or 2 moves into format 3's one tree
            return store
        except BaseException:
            store.close()
            raise

    # -- data path (called by KvckptStorageClient) ----------------------------------------------------
    def put(self, keys: list[str], values: list[bytes]) -> None:
        """Store encoded records under TransferQueue keys, all in one durable transaction."""
        self.write(keys, values, [])

    def write(self, keys: list[str], values: list[bytes], deletes: list[str]) -> None:
        """Store ``values`` under ``keys`` and delete ``deletes`` (absent ones skipped), in one durable
        transaction: a caller whose one change both writes and removes records never leaves half of it."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        pairs = [(store_key(k), v) for k, v in zip(keys, values, strict=True)]
        gone = [store_key(k) for k in deletes]

        def txn_fn(txn: Txn) -> None:
            for key in gone:
                txn.delete("rows", key)
            for key, value in pairs:
                txn.put("rows", key, value)
        self._store.write(txn_fn)

    def get(self, keys: list[str]) -> list[bytes | None]:
        """The stored records of ``keys`` (``None`` where absent), from one consistent snapshot."""
        skeys = [store_key(k) for k in keys]
        return self._store.read(lambda txn: [txn.get("rows", k) for k in skeys])

    def clear(self, keys: list[str], write_ids: list[str | None] | None = None) -> int:
        """Delete ``keys`` in one transaction; returns how many were deleted.

        With ``write_ids``, a key is deleted only if its stored write identity equals the given one
        (``None`` deletes unconditionally), so a clear issued from stale metadata leaves a newer
        write of a recycled index alone.
        """
        ids = write_ids if write_ids is not None else [None] * len(keys)
        if len(ids) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(ids)} write identities")

        def txn_fn(txn: Txn) -> int:
            deleted = 0
            for key, wid in zip(keys, ids, strict=True):
                skey = store_key(key)
                raw = txn.get("rows", skey)
                if raw is None or (wid is not None and write_id_of(raw, key) != wid):
                    continue
                deleted += txn.delete("rows", skey)
            return deleted
        return self._store.write(txn_fn)

    def keys(self, prefix: str = "") -> list[str]:
        """The TransferQueue keys stored under ``prefix``, in key order, from one snapshot."""
        start = store_key(prefix) if prefix else KEY_PREFIX
        return self._store.read(lambda txn: [k[len(KEY_PREFIX):].decode() for k in txn.iter_keys("rows", start)])

    def stamp_id(self) -> str | None:
        """The ``checkpoint_id`` of the last checkpoint copied from this store (``None`` if none was)."""
        stamp = self._store.read(lambda txn: txn.get_json("meta", STAMP_KEY))
        return None if stamp is None else stamp.get("checkpoint_id")

    def count(self) -> int:
        """How many values the store holds."""
        return self._store.read(_count)

    def info(self) -> dict[str, Any]:
        """The live file's path, size in bytes and number of values."""
        return {"path": self.path, "file_bytes": self._store.file_size(), "values": self.count()}

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint(self, dest: str) -> dict[str, Any]:
        """Write the current values to ``dest`` as one complete file (replacing it atomically).

        Returns the stamp (``checkpoint_id``, ``created``, ``values``, ``file_bytes``).

        Raises:
            CheckpointError: the directory is missing or the copy failed; ``dest`` is untouched.
        """
        dest = os.path.abspath(dest)
        directory = os.path.dirname(dest)
        if not os.path.isdir(directory):
            raise CheckpointError(f"checkpoint directory {directory!r} does not exist")
        stamp = {"checkpoint_id": uuid.uuid4().hex, "created": time.time(), "file": os.path.basename(dest)}

        _, snapshot = self._store.write_then_snapshot(lambda txn: txn.put_json("meta", STAMP_KEY, stamp))
        partial = f"{dest}.{stamp['checkpoint_id'][:8]}{PARTIAL_SUFFIX}"
        try:
            count = _count(snapshot.txn)
            self._store.copy_snapshot(partial, snapshot.txn)
            snapshot.close()
            fsync_file(partial)
            os.replace(partial, dest)
            fsync_dir(directory)
        except BaseException as exc:
            snapshot.close()
            with contextlib.suppress(OSError):
                os.unlink(partial)
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"TransferQueue storage checkpoint to {dest!r} failed: {exc}") from exc
        return {**stamp, "values": count, "file_bytes": os.path.getsize(dest)}

    def load(self, source: str) -> dict[str, Any]:
        """Replace the live values with a checkpoint file written by :meth:`checkpoint`.

        The file is validated before anything changes: structure (without mapping it), kind,
        stamp, and every record's checksum. Then the live store is closed, the file copied over it
        (temporary name, fsync, rename) and reopened. Returns the checkpoint's stamp.

        Raises:
            FileNotFoundError: no file at ``source``.
            FormatError / CorruptRecord / RecoveryError: the file is not a valid checkpoint of a
                TransferQueue value store; the live store is untouched.
        """
        source = os.path.abspath(source)
        if not os.path.isfile(source):
            raise FileNotFoundError(f"no TransferQueue storage checkpoint at {source!r}")
        stamp = _validate(source)  # through kvckpt's hardened read-only open
        used = check_header(source)
        self._store.close()
        tmp = f"{self.path}.{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}"
        try:
            copy_used(source, tmp, used)  # only the pages the file uses
            fsync_file(tmp)
            os.replace(tmp, self.path)
            fsync_dir(os.path.dirname(self.path))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._store = self._open(self.path)
            raise RecoveryError(f"copying {source!r} to {self.path!r} failed: {exc}") from None
        self._store = self._open(self.path)
        return stamp

    def close(self) -> None:
        """Close the store (idempotent)."""
        self._store.close()


def _check_format(path: str, doc: dict[str, Any]) -> None:
    """Refuse a value store of another kind or format version (its records would decode wrongly)."""
    if doc.get("kind") != FORMAT["kind"] or doc.get("version") != FORMAT["version"]:
        raise FormatError(f"{path!r} holds {str(doc.get('kind'))[:100]!r} version {str(doc.get('version'))[:20]}; "
                          f"this backend reads {FORMAT['kind']!r} version {FORMAT['version']}")


def _count(txn: Txn) -> int:
    """Number of TransferQueue values in a snapshot (keys only: no value is copied)."""
    return txn.count("rows", KEY_PREFIX)


def _validate(path: str) -> dict[str, Any]:
    """Check a checkpoint file read-only: its kind, its stamp, every record's checksum and key."""
    with open_readonly(path) as store:
        def txn_fn(txn: Txn) -> dict[str, Any]:
            doc = txn.get_json("meta", FORMAT_KEY)
            if doc is None:
                raise FormatError(f"{path!r} is not a TransferQueue value store checkpoint")
            _check_format(path, doc)
            stamp = txn.get_json("meta", STAMP_KEY)
            if stamp is None:
                raise RecoveryError(f"{path!r} is a TransferQueue value store but not a checkpoint (no stamp)")
            for skey, raw in txn.iter_prefix("rows", KEY_PREFIX):
                key = skey[len(KEY_PREFIX):].decode()
                if codec.decode_meta(raw, f"rows/{key}").get("k") != key:
                    raise RecoveryError(f"{path!r}: the record under {key!r} holds another key's value")
            return stamp
        return store.read(txn_fn)


#: :class:`ValueStore` as a Ray actor on the node that calls ``tq.init``; one call at a time, so a
#: checkpoint load never runs beside a data operation.
ValueStoreActor = ray.remote(num_cpus=0)(ValueStore)
