"""The single-file LMDB environment every kvckpt object lives in.

A :class:`Store` is one LMDB environment in one file (``subdir=False``) holding a fixed set of tables
(:data:`~kvckpt.storage.layout.TABLES`), laid out as :mod:`kvckpt.storage.layout` says. It guarantees:

* **Durability.** ``sync=True, metasync=True, writemap=False``: a returned :meth:`Store.write`
  survives process crashes, OS crashes and power loss (LMDB's full ACID mode).
* **One transaction, all or nothing.** :meth:`Store.write` runs a function inside one write
  transaction. If the function raises, nothing is written. If the map is full the transaction is
  aborted, the map doubled and the *whole function replayed*, so functions passed to it must
  have no side effects outside the transaction.
* **One writer.** A writable handle takes an exclusive ``flock`` on the data file; a second
  writable handle, in this process or another, gets :class:`~kvckpt.errors.StoreLocked`.
  Writes from several threads of the owning process are serialised, in the order they asked
  (:class:`~kvckpt.storage.fairlock.FairLock`), except that a checkpoint's stamp
  (:meth:`Store.write_then_snapshot`) goes ahead of the queued writes: it waits only for the
  write in progress.
* **Identity.** A new store records a format version and a random store id; every open checks
  them and refuses foreign LMDB files, other formats and other versions with
  :class:`~kvckpt.errors.FormatError`.
* **Read-only opens write nothing.** ``readonly=True`` on a file no writer holds opens it without
  a lock file (the way to open a finished checkpoint); on a file a writer in another process
  holds it shares that writer's lock file so the snapshot stays consistent; in the writer's own
  process it is a view through the writer's environment (LMDB allows one per file per process).

Limits: local disks only (not NFS/CIFS/FUSE); keys are at most 511 bytes; never carry an open
``Store`` across ``fork`` (open it in the child). Values are always kvckpt records
(:mod:`kvckpt.storage.codec`); the ``get_json``/``put_json`` helpers verify their checksums.

The module is long (about 900 lines) because it is the whole contract of the environment: the
writer lock, the map-full replay, nested transactions for group commit, the layout's detection and
upgrade, reader-slot checks, the LMDB header check and the fsync helpers each map liblmdb's and the
OS's errors to kvckpt's. Transactions are :mod:`kvckpt.storage.txn`'s.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import lmdb
from lmdb import verify as lmdb_verify

from kvckpt.errors import (
    CheckpointError,
    DiskFull,
    FormatError,
    KvckptError,
    ReadOnlyStore,
    ResourceLimit,
    StoreLocked,
    StoreNotFound,
)
from kvckpt.storage.fairlock import FairLock
from kvckpt.storage.filecopy import copy_range
from kvckpt.storage.layout import TABLES, Layout, NamedTables, OneTree, partial_copy_key
from kvckpt.storage.replog import ReplicationLog
from kvckpt.storage.txn import Txn

FORMAT_NAME = "kvckpt"
FORMAT_VERSION = 4
#: Versions this code opens. Version 1 (kvckpt before lease fencing by timeline) and version 2 have
#: the same tables and records in named sub-databases (:mod:`kvckpt.storage.layout`); a writable
#: :class:`~kvckpt.buffer.ReplayBuffer` upgrades them in place (:meth:`Store.upgrade_layout`).
#: Version 3 is version 4's layout without token-progress records; a writable open rewrites its
#: format record (:meth:`Store.upgrade_record`), so a kvckpt that knows no progress records
#: refuses the file from then on instead of leaving them behind.
READABLE_VERSIONS = (1, 2, 3, 4)
#: ``max_dbs`` is not stored in the file, so every opener of a format-1/2 file uses this.
MAX_DBS = 8
DEFAULT_MAP_SIZE = 64 << 30
#: Every this many commits a writer clears the reader slots of dead processes and measures how far
#: the oldest live reader's snapshot lags (a pinned snapshot stops LMDB reusing freed pages).
READER_CHECK_COMMITS = 256
#: A reader this many commits behind is logged as pinning old pages (``Store.readers`` reports it).
PIN_WARN_COMMITS = 1000
log = logging.getLogger("kvckpt.store")
#: Mode of the store, lock and checkpoint files kvckpt creates (before the umask): owner only.
FILE_MODE = 0o600

T = TypeVar("T")


class _Replay(Exception):
    """Aborts :meth:`Store.write_each`'s flat pass (a function refused after it wrote): the batch is run
    again, each function in a nested transaction; never seen outside this module."""


class _Refused(Exception):
    """Carries a function's refusal out of :meth:`Store.write` (which aborts on any exception) to
    :meth:`Store.write_each`; never seen outside this module."""

    def __init__(self, error: KvckptError) -> None:
        super().__init__(str(error))
        self.error = error


class _ReadersGate:
    """Readers share; a map resize waits until no read transaction of this handle is open."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._resizing = False

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def resizing(self) -> Iterator[None]:
        with self._cond:
            self._resizing = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


class Store:
    """One kvckpt store file. See the module docstring for its guarantees.

    Args:
        path: the data file. The lock file, when one is used, is ``path + "-lock"``.
        create: create the store if the file does not exist. Defaults to False.
        readonly: open without write access. Defaults to False.
        map_size: initial LMDB map size in bytes; it doubles on demand. Defaults to 64 GiB of
            address space for a writer (the file grows with its data) and, for a read-only open
            of a file no writer holds, to exactly the bytes the file uses (so ``ulimit -v`` far
            below 64 GiB still opens checkpoints). New files are created mode 0600 (rollouts can
            be sensitive); ``chmod`` them to share.

    Raises:
        StoreNotFound: no file at ``path`` and ``create`` is False.
        StoreLocked: another writable handle holds the store.
        FormatError: not a kvckpt store, or another format version.
    """

    #: The replication log of a replicated store's writable handle (docs/replication.md), read from
    #: the file at open: every write transaction of a primary appends its log record through it,
    #: and a standby's refuses writes that are not applies. ``None`` for a store not replicated.
    replication: ReplicationLog | None = None

    def __init__(self, path: str | os.PathLike[str], *, create: bool = False, readonly: bool = False,
                 map_size: int | None = None) -> None:
        self.path = os.fspath(path)
        self.readonly = readonly
        self._flock_fd: int | None = None
        self._write_lock = FairLock()
        self._gate = _ReadersGate()
        self._owner: Store | None = None
        self._commits = 0
        #: The figures of the last :meth:`check_readers` (writers only).
        self.reader_stats = {"stale_readers_cleared": 0, "readers": 0, "oldest_reader_lag": 0}
        exists = os.path.exists(self.path)
        if exists and readonly:
            owner = _writer_in_this_process(self.path)
            if owner is not None:
                self._share(owner)
                return
        if not exists and (readonly or not create):
            raise StoreNotFound(f"no kvckpt store at {self.path!r} (pass create=True to make one)")
        if exists and not os.path.isfile(self.path):
            raise FormatError(f"{self.path!r} is not a regular file; a kvckpt store is one file")
        with fd_limit(self.path):
            used = check_lmdb_header(self.path) if exists else 0
        if map_size is None:  # a reader of a file no writer holds maps only what the file uses
            map_size = used if readonly and not writer_active(self.path) else DEFAULT_MAP_SIZE
        if not readonly:
            self._take_writer_lock(create and not exists)
        try:
            self.env = self._open_env(map_size)
            self.layout = self._open_layout(create and not exists)
            self.info = self._check_format()
            if not readonly:
                self.env.reader_check()
                self.replication = ReplicationLog.load(self)
            if create and not exists:  # the new file's directory entry must survive a power cut too
                fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        except BaseException:
            self._release()
            raise
        if not readonly:
            self._key = _identity(self.path)
            with _WRITERS_LOCK:
                _WRITERS[self._key] = self

    def _share(self, owner: Store) -> None:
        """Become a read-only view of ``owner``, this process's writable handle of the same file.

        LMDB allows one environment per file per process, so the view reads through the owner's
        environment (its snapshots are as consistent as any reader's); closing the view leaves the
        owner open, and closing the owner closes the view.
        """
        self._owner = owner
        self.env, self.layout, self.info, self._gate = owner.env, owner.layout, owner.info, owner._gate

    # -- opening ---------------------------------------------------------------------------
    def _take_writer_lock(self, creating: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT if creating else 0)
        try:
            fd = os.open(self.path, flags, FILE_MODE)
        except OSError as exc:  # EROFS (a read-only mount) is not a PermissionError
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise ResourceLimit(exc.errno, f"cannot open {self.path!r}: too many open files; close "
                                               "stores or raise `ulimit -n`") from None
            if not isinstance(exc, PermissionError) and exc.errno != errno.EROFS:
                raise
            raise ReadOnlyStore(f"cannot open {self.path!r} for writing: {exc.strerror}; "
                                "open it with readonly=True") from None
        if not lock_or_close(fd):
            raise StoreLocked(f"{self.path!r} is open for writing by another handle (this or another "
                              "process); kvckpt allows one writer. Close it, or open readonly=True") from None
        self._flock_fd = fd

    def _open_env(self, map_size: int) -> lmdb.Environment:
        shared_lock = self.readonly and writer_active(self.path) and os.path.exists(self.path + "-lock")
        try:
            return lmdb.open(self.path, subdir=False, readonly=self.readonly,
                             lock=(not self.readonly) or shared_lock, max_dbs=MAX_DBS,
                             map_size=map_size, sync=True, metasync=True, writemap=False,
                             meminit=False, max_spare_txns=4, mode=FILE_MODE)
        except lmdb.Error as exc:
            raise _translate(exc, f"cannot open {self.path!r}") from None

    def _open_layout(self, creating: bool) -> Layout:
        """The layout of the file: format 3's one tree for a new file, otherwise what the file holds."""
        try:
            main = self.env.open_db(None)
            one_tree = OneTree(main)
            if creating:
                with self.env.begin(write=True) as txn:
                    Txn(txn, one_tree, True).put_json("meta", b"format", {
                        "format": FORMAT_NAME, "version": FORMAT_VERSION,
                        "store_id": uuid.uuid4().hex, "created": time.time()})
                return one_tree
            with self.env.begin() as txn:
                if Txn(txn, one_tree, False).get("meta", b"format") is not None:
                    return one_tree
            # Without ``txn=``: a handle opened inside a read transaction dies with it.
            return NamedTables({name: self.env.open_db(name.encode(), create=False) for name in TABLES})
        except (lmdb.NotFoundError, lmdb.IncompatibleError):
            raise FormatError(f"{self.path!r} is an LMDB file but not a kvckpt store (it has neither a format "
                              f"record nor the tables {', '.join(TABLES)})") from None
        except lmdb.Error as exc:
            raise _translate(exc, f"cannot open the tables of {self.path!r}") from None

    def _check_format(self) -> dict[str, Any]:
        info = self.read(lambda txn: txn.get_json("meta", b"format"))
        if not info or info.get("format") != FORMAT_NAME:
            raise FormatError(f"{self.path!r} is not a kvckpt store (no format record)")
        if info.get("version") not in READABLE_VERSIONS:
            raise FormatError(f"{self.path!r} has kvckpt format version {info.get('version')!r}; this "
                              f"kvckpt reads versions {', '.join(map(str, READABLE_VERSIONS))}. Use a matching "
                              "kvckpt release")
        if info.get("version") not in self.layout.versions:
            raise FormatError(f"{self.path!r} says it is kvckpt format version {info.get('version')!r} but is laid "
                              f"out as versions {', '.join(map(str, self.layout.versions))} are: damaged or crafted")
        return info

    def upgrade_layout(self, prepare: Callable[[Txn], None] | None = None) -> bool:
        """Move a format-1 or format-2 store into format 3's layout and return whether there was
        anything to move.

        The records are copied into the main database in transactions of at most
        :data:`UPGRADE_BATCH_BYTES` of values each (memory stays bounded whatever the store's
        size), while the named databases stay the store: every reader, and a crash, still see
        format 1 or 2, and the copy's keys are ignored until the switch. The switch is one
        transaction: ``prepare`` runs on the copy (the replay buffer fences format 1's leases
        there), the format record says version :data:`FORMAT_VERSION` with ``upgraded_from``, and
        the named databases are dropped. So a crash leaves the old store (a later upgrade clears
        the partial copy and starts again) or the new one, never a mix. The file grows by about
        the store's size while the copy is written; the old pages are reused afterwards
        (``kvckpt compact`` returns them to the disk).

        Raises:
            ReadOnlyStore: the handle is read-only.
            KvckptError: a record cannot be copied (a crafted key colliding with a named
                database's own record); the store is left in its old format.
        """
        old = self.layout
        if not isinstance(old, NamedTables):
            return False
        if self.readonly:
            raise ReadOnlyStore(f"{self.path!r} is open read-only; upgrading it needs a writable open")
        new = OneTree(self.env.open_db(None))
        info = {**self.info, "version": FORMAT_VERSION, "upgraded_from": self.info.get("version")}
        # Room for a second copy of every record: a full map during the switch would replay a
        # transaction whose dropped databases no longer exist.
        needed = 2 * (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"] + (64 << 20)
        if self.env.info()["map_size"] < needed:
            with self._gate.resizing():
                self.env.set_mapsize(needed)
        started = time.monotonic()
        log.info("%s: upgrading kvckpt format %s to %s", self.path, info["upgraded_from"], FORMAT_VERSION)
        while not self.write(lambda txn: _clear_partial_copy(txn, new)):
            pass
        for table in TABLES:
            start: bytes | None = b""
            while start is not None:
                start = self.write(lambda txn, start=start, table=table: _copy_batch(txn, new, table, start))

        def switch(txn: Txn) -> None:
            moved = Txn(txn.raw, new, True)
            if prepare is not None:
                prepare(moved)
            moved.put_json("meta", b"format", info)
            for db in old.dbs.values():
                txn.raw.drop(db, delete=True)

        self.write(switch)
        self.layout, self.info = new, info
        log.info("%s: upgraded to format %s in %.1f s", self.path, FORMAT_VERSION, time.monotonic() - started)
        return True

    def upgrade_record(self) -> bool:
        """Mark a format-3 store as format :data:`FORMAT_VERSION` (its layout is already the current
        one; only the format record changes, in one transaction) and return whether it did.

        Raises:
            ReadOnlyStore: the handle is read-only.
        """
        if self.info.get("version") not in (3,):
            return False
        if self.readonly:
            raise ReadOnlyStore(f"{self.path!r} is open read-only; upgrading it needs a writable open")
        info = {**self.info, "version": FORMAT_VERSION, "upgraded_from": self.info.get("version")}
        self.write(lambda txn: txn.put_json("meta", b"format", info))
        self.info = info
        return True

    @property
    def store_id(self) -> str:
        """The random identity written when the store was created (copies keep it)."""
        return self.info["store_id"]

    # -- transactions ----------------------------------------------------------------------
    def write(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in one durable write transaction and return its result.

        ``fn`` may be called more than once (the map grows and the transaction is replayed), so
        it must not have side effects outside the transaction. If it raises, nothing is written.

        Raises:
            ReadOnlyStore: the handle is read-only.
            DiskFull: the filesystem is full; nothing was written.
        """
        if self.readonly:
            raise ReadOnlyStore(f"{self.path!r} is open read-only")
        with self._write_lock:
            if self.env is None:
                raise KvckptError(f"{self.path!r} is closed")
            while True:
                txn = self.env.begin(write=True)
                try:
                    if self.replication is None:
                        result = fn(Txn(txn, self.layout, True))
                        txn.commit()
                    else:  # captures, appends the log record and commits (docs/replication.md)
                        result = self.replication.run(fn, Txn(txn, self.layout, True))
                    self._commits += 1
                    if self._commits % READER_CHECK_COMMITS == 0:
                        self.check_readers()
                    return result
                except lmdb.MapFullError:
                    txn.abort()
                    self._grow()
                except lmdb.Error as exc:
                    txn.abort()
                    raise _translate(exc, f"write to {self.path!r} failed", self.path) from None
                except BaseException:
                    txn.abort()
                    raise

    def write_each(self, fns: Sequence[Callable[[Txn], T]]) -> list[T | KvckptError]:
        """Run every function of ``fns`` in one durable write transaction (one fsync) and return
        their results in order.

        A function that raises a :class:`~kvckpt.errors.KvckptError` (a deliberate refusal) writes
        nothing, and the error takes its place in the result list; the others still commit. Any
        other exception aborts the whole transaction and propagates. As with :meth:`write`, a full
        map replays the whole batch.

        The functions run one after another in the durable transaction itself (issue 45: a nested
        transaction per function cost a child begin and commit, page copies and a fresh cursor each,
        and py-lmdb releases the GIL for every one). A refusal that wrote nothing (``Txn.writes``
        unchanged: every check before any write, as the transitions do) needs no rollback. One that
        refuses after it wrote aborts that pass, and the batch runs again with each function in its own
        nested transaction, so its writes are rolled back alone (the functions may run twice, as
        :meth:`write` already allows).

        A batch of one function needs no nested transaction: it runs in the durable one, and its
        refusal aborts that (nothing written, no fsync).
        """
        if len(fns) == 1:
            [fn] = fns

            def alone(txn: Txn) -> T:
                try:
                    return fn(txn)
                except KvckptError as exc:  # the function's refusal, told apart from a failed commit
                    raise _Refused(exc) from None

            try:
                return [self.write(alone)]
            except _Refused as refused:
                return [refused.error]

        def flat(txn: Txn) -> list[T | KvckptError]:
            results: list[T | KvckptError] = []
            for fn in fns:
                before = txn.writes
                try:
                    results.append(fn(txn))
                except KvckptError as exc:
                    if txn.writes != before:  # it wrote, then refused: only a nested transaction undoes that
                        raise _Replay from None
                    results.append(exc)
            return results

        try:
            return self.write(flat)
        except _Replay:
            pass

        def nested(txn: Txn) -> list[T | KvckptError]:
            results: list[T | KvckptError] = []
            for fn in fns:
                child = self.env.begin(write=True, parent=txn.raw)
                view = Txn(child, self.layout, True)
                if txn.capture is not None:  # replicated: the child's writes join the parent's record
                    view.capture, mark = txn.capture, len(txn.capture)
                try:
                    results.append(fn(view))
                    child.commit()
                except KvckptError as exc:
                    child.abort()
                    if txn.capture is not None:  # what the refused child wrote is rolled back, so unlogged
                        del txn.capture[mark:]
                    results.append(exc)
                except BaseException:
                    child.abort()
                    raise
            return results

        return self.write(nested)

    def check_readers(self) -> dict[str, int]:
        """Clear reader slots left by dead processes and measure the oldest live snapshot.

        A writer runs this every :data:`READER_CHECK_COMMITS` commits; it logs a warning on
        ``kvckpt.storage.store`` when a reader is :data:`PIN_WARN_COMMITS` or more commits behind (the
        file then grows, since pages freed after that snapshot cannot be reused). Returns (and
        keeps in :attr:`reader_stats`): ``stale_readers_cleared`` (total so far), ``readers``
        (live read transactions) and ``oldest_reader_lag`` (commits behind, 0 if none).
        """
        cleared = self.env.reader_check()
        last = self.env.info()["last_txnid"]
        txnids = [int(parts[2]) for parts in (line.split() for line in self.env.readers().splitlines()[1:])
                  if len(parts) == 3 and parts[2].isdigit()]
        lag = last - min(txnids) if txnids else 0
        stats = self.reader_stats
        stats.update(stale_readers_cleared=stats["stale_readers_cleared"] + cleared, readers=len(txnids),
                     oldest_reader_lag=lag)
        if lag >= PIN_WARN_COMMITS:
            log.warning("%s: a reader has held a snapshot for %d commits; pages freed since cannot be reused, "
                        "so the file grows until it ends its read transaction", self.path, lag)
        return dict(stats)

    def _grow(self) -> None:
        new_size = self.env.info()["map_size"] * 2
        with self._gate.resizing():
            self.env.set_mapsize(new_size)

    def read(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in a read transaction (a consistent snapshot) and return its result.

        Values returned by ``fn`` must not alias LMDB memory; this wrapper never uses
        ``buffers=True``, so plain ``bytes`` are safe.
        """
        with self.reader() as txn:
            return fn(txn)

    @contextmanager
    def reader(self) -> Iterator[Txn]:
        """A read transaction as a context manager; it ends (and frees its snapshot) on exit."""
        with self._gate.reading():
            if self.env is None or (self._owner is not None and self._owner.env is None):
                raise KvckptError(f"{self.path!r} is closed")
            txn = self.env.begin()
            try:
                yield Txn(txn, self._owner.layout if self._owner is not None else self.layout, False)
            except lmdb.Error as exc:  # a damaged page met while reading
                raise _translate(exc, f"reading {self.path!r} failed") from None
            finally:
                txn.abort()

    def write_then_snapshot(self, fn: Callable[[Txn], T],
                            timings: dict[str, float] | None = None) -> tuple[T, Snapshot]:
        """Run ``fn`` in a write transaction, then pin a read snapshot of exactly its result.

        The snapshot begins before the writer lock is released, so no other write lands between
        the two. The caller must :meth:`Snapshot.close` it (a held snapshot stops LMDB from reusing
        pages freed by later commits, so the file grows while it is open).

        The writer lock is taken ahead of the writes queued for it
        (:meth:`~kvckpt.storage.fairlock.FairLock.first`): a checkpoint's stamp waits only for the
        write in progress (and an earlier stamp), not for the writes that asked before it.

        ``timings``, when given, receives the phases in seconds: ``lock_wait`` (for the writer
        lock), ``txn`` (beginning the transaction and running ``fn``, replays included),
        ``commit`` (the durable commit: LMDB's two fsync barriers, and the reader check every
        :data:`READER_CHECK_COMMITS` commits) and ``snapshot`` (pinning the read snapshot and
        reading the meta pages).
        """
        t0 = time.perf_counter()
        with self._write_lock.first():
            t1 = time.perf_counter()
            ran = [t1]

            def timed(txn: Txn) -> T:
                out = fn(txn)
                ran[0] = time.perf_counter()
                return out

            result = self.write(timed)
            t2 = time.perf_counter()
            snapshot = Snapshot(self)
            try:
                # Both meta pages exactly as this commit left them (no write can land while the
                # lock is held): what a plain copy of the snapshot starts with (copy_pinned).
                snapshot.metas = os.pread(self.data_fd(), 2 * self.env.stat()["psize"], 0)
            except BaseException:
                snapshot.close()
                raise
        if timings is not None:
            timings.update(lock_wait=t1 - t0, txn=ran[0] - t1, commit=t2 - ran[0],
                           snapshot=time.perf_counter() - t2)
        return result, snapshot

    def copy_pinned(self, fd: int, snapshot: Snapshot, *, pace: bool = True,
                    before_writeback: Callable[[int, int], object] | None = None) -> str:
        """Write the snapshot pinned by :meth:`write_then_snapshot` into the empty file ``fd`` page
        for page and return how: ``"clone"`` or ``"copy"``.

        The copy is the file as the snapshot's commit left it, as LMDB's own non-compacting copy
        makes one: the meta page captured under the writer lock, twice (:func:`_twin_metas`), then
        every page up to the snapshot's last, cloned or copied in the kernel
        (:func:`kvckpt.storage.filecopy.copy_range`, paced when ``pace``; pages past the end of a
        file that ends early are free and written as zeros). Every page the snapshot can reach
        stays untouched while it is pinned (LMDB reuses a page only once no reader can see it); a
        page that is free in the snapshot may be rewritten by a later commit meanwhile, and the
        copy's free list says it is free. So
        the copy is IO-bound: no tree walk, no user-space buffer, but the snapshot's free pages
        are copied too (:meth:`free_share`; :meth:`copy_snapshot` compacts). Nothing is fsynced.
        ``before_writeback`` is passed to :func:`~kvckpt.storage.filecopy.copy_range` (a change to
        each copied chunk before it is written back).

        Raises:
            KvckptError: ``snapshot`` was not pinned by :meth:`write_then_snapshot`, or the file
                is shorter than the snapshot's pages.
            DiskFull: the destination's filesystem is full. OSError: reading or writing failed.
        """
        psize, pages = self._pinned_pages(snapshot)
        try:
            os.pwrite(fd, _twin_metas(snapshot.metas, psize), 0)
            return copy_range(self.data_fd(), fd, 2 * psize, pages * psize, pace=pace, zeros_past_eof=True,
                              before_writeback=before_writeback)
        except EOFError as exc:
            raise KvckptError(f"{self.path!r} is shorter than its committed pages: {exc}") from None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(errno.ENOSPC, f"copying {self.path!r}: the disk is full") from None
            raise

    def free_share(self, snapshot: Snapshot) -> float:
        """The share of the pinned snapshot's pages that are free (what :meth:`copy_pinned` copies
        and a compacting copy leaves out)."""
        _, pages = self._pinned_pages(snapshot)
        return max(0, pages - 2 - self._tree_pages(snapshot.txn)) / pages

    def data_fd(self) -> int:
        """The writer's descriptor of its data file (its lock descriptor): the file this handle
        writes even after its path was renamed or deleted. Read it with ``os.pread``, never write it
        (every write goes through a transaction) and never close it.

        Raises:
            KvckptError: the handle is read-only or closed.
        """
        fd = (self._owner or self)._flock_fd
        if fd is None:
            raise KvckptError(f"{self.path!r} is not open for writing by this handle")
        return fd

    def _pinned_pages(self, snapshot: Snapshot) -> tuple[int, int]:
        """Page size and page count of the snapshot, from the meta pages captured with it."""
        metas = snapshot.metas
        if metas is None:
            raise KvckptError("a page copy needs a snapshot pinned by write_then_snapshot (its meta pages)")
        psize = len(metas) // 2
        last_pg, txnid = max((_META.unpack_from(metas, i * psize + _META_OFFSET)[3:] for i in (0, 1)),
                             key=lambda meta: meta[1])
        if txnid != snapshot.txn.raw.id():
            raise KvckptError(f"{self.path!r}: the captured meta page is transaction {txnid}, the snapshot "
                              f"{snapshot.txn.raw.id()}; refusing a copy that would mix two states")
        return psize, last_pg + 1

    def _tree_pages(self, txn: Txn) -> int:
        """Branch, leaf and overflow pages of the trees ``txn`` sees (everything but free pages)."""
        layout = txn.layout
        handles = [layout.main] if isinstance(layout, OneTree) else list(layout.dbs.values())
        total = 0
        for db in handles:
            st = txn.raw.stat(db)
            total += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return total

    def copy_snapshot(self, dest: str | int, txn: Txn) -> None:
        """Write a compacted copy of ``txn``'s snapshot to ``dest``: a path that must not exist
        (created mode :data:`FILE_MODE`), or an open file descriptor written from its offset.

        LMDB does not fsync the copy: the caller fsyncs and renames it (see :mod:`kvckpt.durability.checkpoint`).
        """
        try:
            if isinstance(dest, int):
                self.env.copyfd(dest, compact=True, txn=txn.raw)
                return
            try:
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    raise ResourceLimit(exc.errno, f"cannot create {dest!r}: too many open files") from None
                raise CheckpointError(f"cannot create the copy {dest!r}: {exc.strerror}") from None
            try:
                self.env.copyfd(fd, compact=True, txn=txn.raw)
            finally:
                os.close(fd)
        except lmdb.Error as exc:
            raise _translate(exc, f"copying {self.path!r} to {dest!r} failed") from None

    def file_size(self) -> int:
        """Bytes the data file occupies now."""
        return os.path.getsize(self.path)

    def close(self) -> None:
        """Close the environment and release the writer lock. Idempotent.

        Waits for open read transactions of this handle (e.g. a background checkpoint copy) to
        end first: closing an environment under a running copy is undefined behaviour in LMDB.
        """
        if getattr(self, "_owner", None) is not None:
            self.env = None  # a view: the owner's environment stays open
            return
        env = getattr(self, "env", None)
        if env is not None:
            with _WRITERS_LOCK:
                if _WRITERS.get(getattr(self, "_key", None)) is self:
                    del _WRITERS[self._key]
            with self._write_lock, self._gate.resizing():
                env.close()
                self.env = None
        self._release()

    def _release(self) -> None:
        if self._flock_fd is not None:
            os.close(self._flock_fd)
            self._flock_fd = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "readonly" if self.readonly else "writable"
        return f"Store({self.path!r}, {mode})"


#: Bytes of values one transaction of :meth:`Store.upgrade_layout`'s copy carries at most (LMDB
#: holds a write transaction's dirty pages in memory).
UPGRADE_BATCH_BYTES = 64 << 20
_PARTIAL_BATCH_KEYS = 10_000


def _clear_partial_copy(txn: Txn, new: OneTree) -> bool:
    """Delete up to :data:`_PARTIAL_BATCH_KEYS` keys an interrupted upgrade copied into the main
    database of a format-1/2 file; True when none are left."""
    doomed = []
    for stored in txn.raw.cursor(db=new.main).iternext(keys=True, values=False):
        if partial_copy_key(stored):
            doomed.append(stored)
            if len(doomed) == _PARTIAL_BATCH_KEYS:
                break
    for stored in doomed:
        txn.raw.delete(stored, db=new.main)
    return len(doomed) < _PARTIAL_BATCH_KEYS


def _copy_batch(txn: Txn, new: OneTree, table: str, start: bytes) -> bytes | None:
    """Copy ``table``'s records from ``start`` into ``new``'s places until
    :data:`UPGRADE_BATCH_BYTES` of values are copied; the key to go on from, or None when done.

    The format record is not copied: its presence in the main database is what makes a file
    format 3 (:meth:`Store._open_layout`), so only the switch writes it."""
    moved = Txn(txn.raw, new, True)
    size = 0
    for key, value in txn.iter_prefix(table, b"", start):
        if size >= UPGRADE_BATCH_BYTES:
            return key
        if (table, key) == ("meta", b"format"):
            continue
        moved.put(table, key, value)
        size += len(value) + len(key)
    return None


def fsync_file(path: str) -> None:
    """Make ``path``'s data durable (``fsync``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, with each directory it creates made durable in its parent."""
    path = os.path.abspath(path)
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        os.makedirs(directory, exist_ok=True)
        fsync_dir(os.path.dirname(directory))


_WRITERS: dict[tuple[int, int], Store] = {}
_WRITERS_LOCK = threading.Lock()


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _writer_in_this_process(path: str) -> Store | None:
    """This process's open writable handle of ``path`` (the same file by device and inode), if any."""
    try:
        key = _identity(path)
    except OSError:
        return None
    with _WRITERS_LOCK:
        owner = _WRITERS.get(key)
    return owner if owner is not None and owner.env is not None else None


@contextmanager
def fd_limit(path: str) -> Iterator[None]:
    """Turn running out of file descriptors (EMFILE/ENFILE) while opening ``path`` into
    :class:`~kvckpt.errors.ResourceLimit`."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        raise ResourceLimit(exc.errno, f"cannot open {path!r}: too many open files; close stores or raise "
                                       "`ulimit -n`") from None


def writer_active(path: str) -> bool:
    """Whether a writable :class:`Store` handle (any process) holds ``path`` now."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def lock_file_users(path: str) -> list[int]:
    """The other processes that have ``path``'s LMDB lock file open (a writer, or a reader sharing a writer's lock
    file): LMDB holds a POSIX lock on it while an environment uses it, and Linux lists those in ``/proc/locks``.
    Empty when there is no lock file or no ``/proc/locks`` to read (another system: nothing can be told)."""
    try:
        st = os.stat(path + "-lock")
        with open("/proc/locks") as listing:
            lines = listing.read().splitlines()
    except OSError:
        return []
    want, users = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino), set()
    for line in lines:
        fields = [f for f in line.split() if f != "->"]  # "->" marks a waiting lock
        if len(fields) < 6 or fields[1] != "POSIX":
            continue
        major, minor, inode = fields[5].split(":")
        if (int(major, 16), int(minor, 16), int(inode)) == want and int(fields[4]) != os.getpid():
            users.add(int(fields[4]))
    return sorted(users)


class Snapshot:
    """A read transaction that outlives a ``with`` block (for background checkpoint copies)."""

    def __init__(self, store: Store) -> None:
        self._ctx = store.reader()
        self.txn = self._ctx.__enter__()
        #: The file's two meta pages as the snapshot's commit left them (set by write_then_snapshot).
        self.metas: bytes | None = None

    def close(self) -> None:
        """End the read transaction. Idempotent."""
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None


_LMDB_MAGIC = 0xBEEFC0DE
# MDB_meta inside a meta page (64-bit build): 16-byte page header, then mm_magic u32, mm_version
# u32, mm_address, mm_mapsize, mm_dbs[2] (48 bytes each; mm_dbs[0].md_pad holds the page size),
# mm_last_pg, mm_txnid.
_META = struct.Struct("<II8x8xI44x48xQQ")
_META_OFFSET = 16
_TXNID_OFFSET = _META_OFFSET + _META.size - 8


def _twin_metas(metas: bytes, psize: int) -> bytes:
    """Both meta pages of a page copy: the committed one as it is, and in the other slot the same
    page under its own page number with the transaction id one lower (LMDB's slot parity).

    The other slot of the live file describes the commit before the snapshot's, whose pages later
    commits may have reused while the copy ran; and before a checkpoint's stamp, that commit holds
    the previous checkpoint's stamp. Copied as it is, a damaged transaction id in the committed
    page would make LMDB open that older state, a consistent but other checkpoint. With twins
    any damage to either id opens the same tree, or is refused."""
    newer = max((0, 1), key=lambda i: _META.unpack_from(metas, i * psize + _META_OFFSET)[4])
    txnid = _META.unpack_from(metas, newer * psize + _META_OFFSET)[4]
    page = bytearray(metas[newer * psize:(newer + 1) * psize])
    struct.pack_into("<Q", page, 0, 1 - newer)  # mp_pgno
    struct.pack_into("<Q", page, _TXNID_OFFSET, txnid - 1)
    twin = bytes(page)
    committed = metas[newer * psize:(newer + 1) * psize]
    return committed + twin if newer == 0 else twin + committed


def lock_or_close(fd: int) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without waiting; if another descriptor holds one, close
    ``fd`` and return False (the caller says who holds it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    return True


def check_lmdb_header(path: str, name: str | None = None) -> int:
    """Refuse files that are not complete LMDB v1 data files before the C engine maps them.

    Pages 0 and 1 are meta pages; LMDB uses the one with the larger transaction id, and that meta
    names the last page in use. A file shorter than that is truncated, unless every missing page
    is free: LMDB never writes a page it allocated and freed in one transaction, so a committed file
    can end early, and then py-lmdb's offline verifier (which reads with ``read``, never a map)
    proves that no reachable page lies past the end. A truncated file would crash the process with
    SIGBUS on the first read past the end, so it is reported here instead. Returns the bytes in use,
    ``(last page + 1) * page size`` (what a read-only map needs).
    """
    shown = repr(name if name is not None else path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(_META_OFFSET + _META.size)
        if len(head) < _META_OFFSET + _META.size:
            raise FormatError(f"{shown} is {size} bytes: truncated, or not a kvckpt store")
        magic, version, psize, _, _ = _META.unpack_from(head, _META_OFFSET)
        if magic != _LMDB_MAGIC:
            raise FormatError(f"{shown} is not an LMDB file, so not a kvckpt store")
        if version != 1:
            raise FormatError(f"{shown} is LMDB data format {version}; kvckpt stores use format 1")
        if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
            raise FormatError(f"{shown} has an invalid LMDB page size {psize}: damaged")
        if size < 2 * psize:
            raise FormatError(f"{shown} is {size} bytes, less than its two {psize}-byte meta pages: "
                              "truncated")
        f.seek(psize)
        second = f.read(_META_OFFSET + _META.size)
    metas = [_META.unpack_from(head, _META_OFFSET), _META.unpack_from(second, _META_OFFSET)]
    if metas[1][0] != _LMDB_MAGIC or metas[1][1] != 1:
        raise FormatError(f"{shown} has a damaged second LMDB meta page")
    last_pg = max(metas, key=lambda m: m[4])[3]  # ties go to page 0, as in LMDB
    if size < (last_pg + 1) * psize and lmdb_verify.verify(path, subdir=False):
        raise FormatError(f"{shown} is {size} bytes but its last committed page ends at byte "
                          f"{(last_pg + 1) * psize}: the file is truncated (copied while being "
                          "written, or cut short); restore from a checkpoint")
    return (last_pg + 1) * psize


#: A commit that fails with EIO while less than this is free on the store's filesystem hit a full disk.
_FULL_MARGIN = 1 << 20


def _translate(exc: lmdb.Error, what: str, path: str | None = None) -> KvckptError:
    """Map an ``lmdb.Error`` to the kvckpt error that says what to do.

    LMDB reports the short write of a commit that fills the disk as ``EIO``; when ``path`` (the
    file being written) is given, an ``EIO`` on a filesystem with (almost) no space left is
    reported as :class:`DiskFull` too.
    """
    code = getattr(exc, "code", None) or getattr(exc, "errno", None)
    text = str(exc)
    if code == errno.ENOSPC or "No space left" in text or (
            path is not None and (code == errno.EIO or "Input/output error" in text) and _disk_full(path)):
        return DiskFull(errno.ENOSPC, f"{what}: the disk is full; nothing was written. Free space and retry")
    if code in (errno.EACCES, errno.EROFS) or "Permission denied" in text or "Read-only" in text:
        return ReadOnlyStore(f"{what}: {text}")
    if code == errno.ENOMEM or "Cannot allocate memory" in text:
        return ResourceLimit(errno.ENOMEM, f"{what}: the memory map could not be reserved ({text}); the "
                             "address-space limit (`ulimit -v`) is probably below the map size: raise it, or "
                             "pass a smaller map_size= to open (a reader needs only the file's size)")
    if code in (errno.EMFILE, errno.ENFILE) or "Too many open files" in text:
        return ResourceLimit(errno.EMFILE, f"{what}: too many open files ({text}); close stores or raise "
                             "`ulimit -n`")
    if isinstance(exc, lmdb.BadDbiError):  # kvckpt drops databases only when it upgrades a format-1/2 file
        return FormatError(f"{what}: the file's tables moved under this handle (its writer upgraded it to format "
                           f"{FORMAT_VERSION}); open it again")
    if isinstance(exc, (lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.CorruptedError,
                        lmdb.PageNotFoundError, lmdb.CursorFullError)):
        # CursorFullError: a tree deeper than LMDB's 32-level cursor stack, which no LMDB write
        # makes; a branch page naming itself (or an ancestor) as a child reads as one.
        return FormatError(f"{what}: {text}. The file is damaged or not a kvckpt store")
    return KvckptError(f"{what}: {text}")


def _disk_full(path: str) -> bool:
    """Whether the filesystem holding ``path`` has less than :data:`_FULL_MARGIN` bytes available."""
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < _FULL_MARGIN
