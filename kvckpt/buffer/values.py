"""The value store: one kvckpt store file of encoded records under string keys, puts as transactions.

:class:`ValueStore` owns the file (:mod:`kvckpt.values.records` is its layout and its
transactions). It moves already-encoded codec records in and out, so the bytes it writes are
exactly the bytes the putting process checksummed, and the reading process verifies them again.
The TransferQueue backend (``kvckpt.integrations.transferqueue``) and the verl ledger
(``kvckpt.integrations.verl``) are built on it.

Guarantees:

* **One write is one durable write transaction**: all of its puts and deletes land, or none (a
  crash mid-write leaves the previous values), and a returned write survives a crash (fsync per
  commit). A ``fence`` is checked inside that same transaction.
* **A clear never destroys a newer write**: a key is deleted only if its stored write identity is
  the one the caller names.
* **A checkpoint is one consistent snapshot in one file**, written by the same primitive as a
  replay buffer's (:func:`kvckpt.durability.checkpoint.snapshot_to_file`: reservation, stamp
  transaction, background copy with the unused bytes cleared, fsync, rename, directory fsync).
  Writers on other threads (or other concurrency groups of an actor) keep committing while it copies.
* **Loading a checkpoint never trusts the file**: its used pages are copied under a private name
  (:func:`kvckpt.durability.checkpoint.install_checkpoint`), the copy is structure-checked before
  it is mapped (:func:`kvckpt.durability.safe_open.open_readonly`), its kind, stamp and every
  record's checksum are verified, then it is renamed over the live file and reopened.
  :meth:`merge_checkpoint` reads a checkpoint through the same private copy and checks, and puts
  the records its caller picks back into the live store in one write transaction.

Thread safety: data operations may run on several threads; :meth:`checkpoint`, :meth:`load`,
:meth:`merge_checkpoint` and :meth:`close` exclude each other, and :meth:`load` must not run beside a
data operation (the TransferQueue actor and the verl ledger's run data operations and loads one at a
time, checkpoints in their own group).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvckpt import args
from kvckpt.durability.checkpoint import install_checkpoint, private_copy, snapshot_to_file
from kvckpt.durability.safe_open import open_readonly
from kvckpt.errors import CheckpointError, FencedWrite, KvckptError
from kvckpt.storage.replace import durable_replace
from kvckpt.storage.replog import ReplicationLog
from kvckpt.storage.store import Store
from kvckpt.storage.txn import Txn
from kvckpt.transitions import progress_values
from kvckpt.values import records

#: The default key prefix of :meth:`ValueStore.record_progress`'s records.
PROGRESS = "progress/"


class ValueStore:
    """The owner of one value store file (see the module docstring).

    Args:
        path: the live store file; created if missing.

    Raises:
        FormatError: the file is a kvckpt store of another kind (e.g. a replay buffer).
        StoreLocked: another process holds the file for writing.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self._swap = threading.Lock()
        self._store = _open(self.path)

    @property
    def store(self) -> Store:
        """The open :class:`~kvckpt.storage.store.Store` of the live file (what replication works on:
        :func:`kvckpt.enable_replication` and the other functions of :mod:`kvckpt.buffer.standby` take a
        value store as they take a replay buffer). After :meth:`load` it is a new handle."""
        return self._store

    # -- data path --------------------------------------------------------------------------------
    def put(self, keys: list[str], values: list[bytes]) -> None:
        """Store encoded records under ``keys``, all in one durable transaction."""
        self.write(keys, values, [])

    def write(self, keys: list[str], values: list[bytes], deletes: list[str], *,
              fence: tuple[str, str] | None = None) -> None:
        """Store ``values`` under ``keys`` and delete ``deletes`` (absent ones skipped), in one durable
        transaction: a caller whose one change both writes and removes records never leaves half of it.

        Args:
            fence: ``(key, write_id)``: the write happens only if the record under ``key`` was
                written by ``write_id``, checked inside the transaction.

        Raises:
            FencedWrite: the fence does not hold; nothing was written.
        """
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        pairs = [(records.store_key(k), v) for k, v in zip(keys, values, strict=True)]
        gone = [records.store_key(k) for k in deletes]
        self._store.write(lambda txn: records.write(txn, self.path, pairs, gone, fence))

    def update(self, plan: Callable[[ValueView], tuple[list[str], list[bytes], list[str]]], *,
               fence: tuple[str, str] | None = None) -> None:
        """:meth:`write` of what ``plan`` decides from the store as this write transaction sees it: inside ONE
        durable write transaction the ``fence`` is checked, then ``plan(view)`` reads what it needs (a
        :class:`ValueView`: keys under a prefix, records) and returns ``(keys, values, deletes)``, which are
        written. So a change that reads what it then writes (a listing of the records it deletes) sees no other
        write between its read and its write, whatever its caller's locking.

        Raises:
            FencedWrite: the fence does not hold; ``plan`` is not run and nothing is written.
        """

        def run(txn: Txn) -> None:
            records.check_fence(txn, self.path, fence)
            keys, values, deletes = plan(ValueView(txn))
            if len(keys) != len(values):
                raise ValueError(f"{len(keys)} keys but {len(values)} values")
            records.write(txn, self.path, [(records.store_key(k), v) for k, v in zip(keys, values, strict=True)],
                          [records.store_key(k) for k in deletes], None)

        self._store.write(run)

    def record_progress(self, items: Sequence[Mapping[str, Any]], *, max_tokens: int, prefix: str = PROGRESS,
                        fence: tuple[str, str] | None = None, drop: Sequence[str] = (),
                        then: Callable[[list[int | KvckptError]], tuple[list[str], list[bytes]]] | None = None,
                        newest: Callable[[ValueView], tuple[int, str] | None] | None = None,
                        ) -> list[int | KvckptError]:
        """Record token progress under the replay buffer's rules, in ONE durable write transaction
        (:mod:`kvckpt.transitions.progress_values`: the buffer's per-sequence transition over this store's
        records). Each item is ``{"group", "index", "start", "tokens", "logprobs", "versions"}`` (a chunk of
        sample ``index`` of ``group``, one weight version per token); its records lie under
        ``{prefix}{group}/{index}/``. Returns per item where its durable prefix ends after it (a resend of a
        landed chunk gets the same answer), or the kvckpt error refusing it (nothing of it is written).

        Inside the transaction, in this order: the ``fence`` (as :meth:`write`'s; when it fails every item is
        refused with :class:`~kvckpt.errors.FencedWrite`, unless its identical bytes already landed, and
        nothing at all is written); every record under each of ``drop``'s prefixes is deleted; the items are
        judged and appended; then ``then(results)`` names more records to put, ``(keys, values)`` (a caller's
        marks of what landed). ``newest(view)``, read inside the transaction, gives the newest weight version a
        chunk may carry and what it is (``(version, "the trainer's step is 3")``; ``None``: not checked), as the
        buffer checks its trainer's version: a chunk of a later version is refused
        :class:`~kvckpt.errors.FutureVersion`.

        Refusals per item: BadArgument, SchemaMismatch (lengths, a prefix past ``max_tokens``), FutureVersion,
        :class:`~kvckpt.errors.ProgressGap`, DuplicateCommit (other content at a durable position), FencedWrite.
        """
        max_tokens = args.integer("max_tokens", max_tokens, minimum=1)
        sequences = [progress_values.sequence(prefix, item, max_tokens) for item in items]

        def run(txn: Txn) -> list[int | KvckptError]:
            fenced: FencedWrite | None = None
            try:
                records.check_fence(txn, self.path, fence)
            except FencedWrite as exc:
                fenced = exc

            def holds() -> None:
                if fenced is not None:
                    raise fenced

            if fenced is None:
                for gone in drop:
                    txn.delete_prefix("rows", records.store_key(gone))
            limit = None if newest is None else newest(ValueView(txn))
            out = progress_values.record(records.ValueChunks(txn), sequences, holds,
                                         *((None, "") if limit is None else limit))
            if fenced is None and then is not None:
                keys, values = then(out)
                records.write(txn, self.path, [(records.store_key(k), v) for k, v in zip(keys, values, strict=True)],
                              [], None)
            return out

        return self._store.write(run)

    def progress(self, group: str, index: int, *, max_tokens: int,
                 prefix: str = PROGRESS) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The durable progress of sample ``index`` of ``group`` (:meth:`record_progress`'s): its tokens, logprobs
        and per-token weight versions, from one snapshot, or ``None`` without any.

        Raises:
            CorruptRecord: a chunk is damaged, or the chunks leave a gap or overlap.
        """
        return self._store.read(lambda txn: progress_values.read(records.ValueChunks(txn), prefix, group, index,
                                                                  args.integer("max_tokens", max_tokens, minimum=1)))

    def get(self, keys: list[str]) -> list[bytes | None]:
        """The stored records of ``keys`` (``None`` where absent), from one consistent snapshot."""
        skeys = [records.store_key(k) for k in keys]
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
        return self._store.write(lambda txn: records.clear(txn, keys, ids))

    def keys(self, prefix: str = "") -> list[str]:
        """The keys stored under ``prefix``, in key order, from one snapshot."""
        return self._store.read(lambda txn: records.keys(txn, prefix))

    def stamp_id(self) -> str | None:
        """The ``checkpoint_id`` of the last checkpoint copied from this store (``None`` if none was)."""
        stamp = self._store.read(records.stamp_of)
        return None if stamp is None else stamp.get("checkpoint_id")

    def count(self) -> int:
        """How many values the store holds."""
        return self._store.read(records.count)

    def info(self) -> dict[str, Any]:
        """The live file's path, size in bytes and number of values."""
        return {"path": self.path, "file_bytes": self._store.file_size(), "values": self.count()}

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint(self, dest: str, *, fence: tuple[str, str] | None = None) -> dict[str, Any]:
        """Write the current values to ``dest`` as one complete file (replacing it atomically) and
        return its stamp (``checkpoint_id``, ``created``, ``file``, ``values``, ``file_bytes``) and
        ``how`` the snapshot was written (``"clone"``, ``"copy"`` or ``"compact"``).

        Blocks writers only for the stamp transaction; the copy runs on a background thread while
        this call waits for it.

        Args:
            fence: as :meth:`write`'s, checked inside the stamp transaction.

        Raises:
            CheckpointError: the directory is missing, another checkpoint to ``dest`` is being
                written, or the copy failed; ``dest`` is untouched.
            FencedWrite: the fence does not hold; nothing was stamped or written.
        """
        stamped: dict[str, Any] = {}

        def stamp(txn: Txn, base: dict[str, Any]) -> int:
            records.check_fence(txn, self.path, fence)
            records.put_stamp(txn, base)
            stamped.update(base)
            return 0

        with self._swap:
            handle = snapshot_to_file(self._store, dest, stamp, overwrite=True,
                                      describe=lambda txn: {"values": records.count(txn)})
            result = handle.wait()
        return {**stamped, "values": result.details["values"], "file_bytes": result.file_bytes, "how": result.how}

    def load(self, source: str, *, checkpoint_id: str | None = None) -> dict[str, Any]:
        """Replace the live values with a checkpoint file written by :meth:`checkpoint`; returns its stamp.

        The file's used pages are copied under a private name and the copy validated before
        anything changes (structure without mapping it, kind, stamp, every record's checksum and
        key); then it is renamed over the live file and reopened through a fresh handle. A
        checkpoint of a replicated store starts a new replication history on the copy, before the
        rename (as a replay buffer's restore does): the load rewinds the file, so a standby of the
        old history must refuse its log (``ForeignStore``) and take a snapshot.

        Args:
            checkpoint_id: the stamp the file must hold (checked before anything changes).

        Raises:
            FileNotFoundError: no file at ``source``.
            FormatError / CorruptRecord / RecoveryError: the file is not a valid value-store
                checkpoint; the live store is untouched.
            CheckpointError: its stamp is not ``checkpoint_id``; the live store is untouched.
        """
        source = os.path.abspath(source)
        if not os.path.isfile(source):
            raise FileNotFoundError(f"no TransferQueue storage checkpoint at {source!r}")

        def check(copy: str) -> dict[str, Any]:
            with open_readonly(copy, name=source) as store:
                stamp = store.read(lambda txn: records.validate_checkpoint(txn, source))
            _expect(stamp, checkpoint_id, source)
            with Store(copy) as store:  # proven above; a replicated copy starts a new history
                ReplicationLog.restart_history(store)
            return stamp

        with self._swap:
            self._store.close()
            try:
                return install_checkpoint(source, self.path, check)
            finally:
                self._store = _open(self.path)

    def merge_checkpoint(self, source: str, choose: Callable[[list[str], ValueView], list[str]], *,
                         checkpoint_id: str | None = None, fence: tuple[str, str] | None = None) -> dict[str, Any]:
        """Put back into the live store the records of the checkpoint file ``source`` that ``choose`` picks,
        in one durable write transaction; every other live record is left as it is. Returns the file's stamp
        with ``merged``, how many records were put back.

        ``source`` is untrusted: its used pages are copied under a private name, the copy is structure-checked
        before it is mapped, and its kind, stamp and every record's checksum and key are verified before the
        live store changes. ``choose(checkpoint_keys, live)`` runs inside the write transaction with the
        checkpoint's keys (in key order) and a read view of the live store; it returns the keys to put back.

        Args:
            checkpoint_id: the stamp the file must hold.
            fence: as :meth:`write`'s, checked inside the write transaction.

        Raises:
            FileNotFoundError: no file at ``source``.
            FormatError / CorruptRecord / RecoveryError: the file is not a valid value-store checkpoint.
            CheckpointError: its stamp is not ``checkpoint_id``.
            FencedWrite: the fence does not hold.
            In every case the live store is untouched.
        """
        source = os.path.abspath(source)
        if not os.path.isfile(source):
            raise FileNotFoundError(f"no value store checkpoint at {source!r}")
        with private_copy(source, self.path) as copy, open_readonly(copy, name=source) as checkpoint, \
                checkpoint.reader() as saved:
            stamp = records.validate_checkpoint(saved, source)
            _expect(stamp, checkpoint_id, source)
            saved_keys = records.keys(saved)

            def put_back(txn: Txn) -> int:
                records.check_fence(txn, self.path, fence)
                chosen = choose(saved_keys, ValueView(txn))
                for key in chosen:
                    raw = saved.get("rows", records.store_key(key))
                    if raw is None:
                        raise ValueError(f"{key!r} is not a key of the checkpoint {source!r}")
                    txn.put("rows", records.store_key(key), raw)
                return len(chosen)

            with self._swap:
                merged = self._store.write(put_back)
        return {**stamp, "merged": merged}

    def close(self) -> None:
        """Close the store (idempotent); waits for a checkpoint being copied."""
        with self._swap:
            self._store.close()


def _expect(stamp: dict[str, Any], checkpoint_id: str | None, source: str) -> None:
    """Refuse a checkpoint whose stamp is not the one its caller names."""
    if checkpoint_id is not None and stamp.get("checkpoint_id") != checkpoint_id:
        raise CheckpointError(f"the value store checkpoint {source!r} holds stamp {stamp.get('checkpoint_id')!r}, "
                              f"not {checkpoint_id!r}")


class ValueView:
    """A read view of the live store inside one write transaction (:meth:`ValueStore.merge_checkpoint`'s,
    :meth:`ValueStore.update`'s, :meth:`ValueStore.record_progress`'s ``newest``): what it reads is what that
    transaction commits over."""

    def __init__(self, txn: Txn) -> None:
        self._txn = txn

    def has(self, prefix: str) -> bool:
        """Whether any key is stored under ``prefix`` (reads one key at most)."""
        return next(self._txn.iter_keys("rows", records.store_key(prefix)), None) is not None

    def keys(self, prefix: str) -> list[str]:
        """The keys stored under ``prefix``, in key order (keys only)."""
        return records.keys(self._txn, prefix)

    def get(self, key: str) -> bytes | None:
        """The stored record of ``key``, or ``None``."""
        return self._txn.get("rows", records.store_key(key))


def _open(path: str) -> Store:
    """Open (or create) a value store file: mark or check its kind, move formats 1-2 into format 3's one tree.
    A new file is made whole under a private name, then linked: a cut leaves a complete value store or none."""
    created = time.time()
    if not os.path.exists(path):
        with contextlib.suppress(FileExistsError), \
                durable_replace(path, exclusive=True, leftovers=("-lock",)) as tmp, Store(tmp, create=True) as new:
            new.write(lambda txn: records.init(txn, path, created))  # a concurrent creator's file is then opened
    store = Store(path)
    try:
        store.write(lambda txn: records.init(txn, path, created))
        store.upgrade_layout()
        return store
    except BaseException:
        store.close()
        raise
