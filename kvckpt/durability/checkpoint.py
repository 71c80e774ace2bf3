"""Checkpoints: one stamp transaction, one background copy to one file; restore via a fresh handle.

:func:`checkpoint_store` blocks the caller only for the stamp transaction (step, trainer state,
checkpoint id). It pins a read snapshot of exactly that state (and captures the file's two meta
pages) before releasing the writer lock, then a background thread writes the snapshot to the
reserved file: page for page (:meth:`~kvckpt.storage.store.Store.copy_pinned`: a clone where the
filesystem has reflinks, else an in-kernel copy paced by ``sync_file_range``; IO-bound, at the
disk's rate, never blocking writers; it runs at normal CPU priority because it needs little,
about 0.7 CPU-seconds per GB of file in bursts of one 2 MB chunk, and at nice 19 a saturated
machine starved it 10-20x), or, when more than :data:`COMPACT_WHEN_FREE` of the
snapshot's pages are free, with LMDB's compacting copy at nice 19 (CPU-bound; keeps the file
small). It fsyncs the copy, renames it to its final name and fsyncs the directory. A file under
the final name is therefore always complete; a failed or interrupted
copy leaves only a ``.partial`` file, never a half-written checkpoint. The destination is reserved
when :func:`checkpoint_store` is called: ``dest + ".partial"`` is created (mode 0600) and ``flock``-ed
for the whole copy, so a second checkpoint to the same name while the first copies is refused at
call time, before anything is stamped (a reservation left by a crashed process holds no lock and
is reused).

:func:`restore_file` copies a checkpoint file to the live path (the checkpoint stays immutable)
and runs :func:`kvckpt.durability.recovery.recover_store` on the copy at the stamped trainer
version; :func:`kvckpt.restore` then opens a fresh buffer handle on it.

The module is long (about 590 lines) because checkpoint and restore are one protocol: the
reservation, the pinned snapshot, the low-priority copy and the fsync/rename order are shared by
both directions and tested together (tests/campaigns/test_powercut.py checks the order).
"""

from __future__ import annotations

import _thread
import contextlib
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvckpt.durability.format import buffer_config
from kvckpt.durability.recovery import RecoveryPlan, recover_store
from kvckpt.durability.safe_open import check_header, copy_used, open_readonly, prove_structure
from kvckpt.durability.structure import unused_ranges
from kvckpt.errors import (
    BadArgument,
    CheckpointError,
    FormatError,
    KvckptError,
    RecoveryError,
    StoreLocked,
    VerificationFailed,
)
from kvckpt.storage.layout import stored_key
from kvckpt.storage.replace import PARTIAL_SUFFIX, partial_name, publish
from kvckpt.storage.replog import ReplicationLog
from kvckpt.storage.store import (
    FILE_MODE,
    Store,
    Txn,
    fsync_dir,
    fsync_file,
    lock_file_users,
    lock_or_close,
    writer_active,
)
from kvckpt.tables.access import Tables

log = logging.getLogger("kvckpt.checkpoint")
T = TypeVar("T")
#: Reads what a caller wants to know from a checkpoint's pinned snapshot (:func:`snapshot_to_file`).
Describe = Callable[[Txn], dict[str, Any]]

#: A checkpoint copies its snapshot page for page (IO-bound, at the disk's rate) unless more than
#: this share of the snapshot's pages are free; then it compacts them away with LMDB's compacting
#: copy (a CPU-bound tree walk, at nice 19) so that the file stays small.
COMPACT_WHEN_FREE = 0.25
#: Bytes of zeros written per call when a page copy's unused bytes are cleared.
ZERO_CHUNK = 8 << 20


@dataclass
class CheckpointResult:
    """A finished checkpoint: its file, id, stamped version, size and phase timings (seconds).

    ``timings``: what the caller of :func:`checkpoint_store` was blocked for, ``blocked``, made of
    ``reserve`` (the destination's checks and reservation), ``stamp`` (the stamp transaction and
    the snapshot pin; within it ``lock_wait``, ``txn``, ``commit`` and ``snapshot`` as
    :meth:`~kvckpt.storage.store.Store.write_then_snapshot` reports them) and ``start`` (handing
    the copy to its thread); then the copy's ``copy``, ``fsync_rename`` and ``total`` (from the
    stamp to the file under its name).
    """

    path: str
    checkpoint_id: str
    trainer_version: int
    file_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    #: How the snapshot was written: "clone", "copy" or "compact" (see Store.copy_pinned).
    how: str = ""
    #: Bytes a page copy overwrote with zeros because they held nothing of the snapshot (:class:`_UnusedBytes`).
    zeroed_bytes: int = 0
    #: What the caller's ``describe`` read from the checkpoint's snapshot (:func:`snapshot_to_file`).
    details: dict[str, Any] = field(default_factory=dict)


class CheckpointHandle:
    """A checkpoint being copied in the background. Wait on it or poll it.

    The stamp is already durable when the handle is returned; the file appears under its final
    name only once :meth:`wait` returns without raising.
    """

    def __init__(self, result: CheckpointResult) -> None:
        self._result = result
        self._error: BaseException | None = None
        self._done = threading.Event()

    @property
    def checkpoint_id(self) -> str:
        """The id stamped into the store (and into the file)."""
        return self._result.checkpoint_id

    def done(self) -> bool:
        """Whether the copy has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> CheckpointResult:
        """Block until the file is complete and return its description.

        Raises:
            CheckpointError: the copy failed (the message says why); no file carries the name.
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint {self._result.path!r} still copying after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result


def checkpoint_store(store: Store, dest: str | os.PathLike[str], trainer_state: Mapping[str, Any] | None = None,
                     *, durable_checkpoints: int, overwrite: bool = False, background: bool = True) -> CheckpointHandle:
    """Stamp a live buffer's store and copy it to ``dest`` as one file without stopping producers
    (:func:`kvckpt.checkpoint` and :meth:`kvckpt.ReplayBuffer.checkpoint` call this; the copy is
    :func:`snapshot_to_file`'s).

    Args:
        store: the live buffer's store.
        dest: the checkpoint file to create (its directory must exist).
        trainer_state: a small JSON-able dict saved with the stamp (step, RNG seeds, paths...);
            :class:`~kvckpt.durability.recovery.RecoveryPlan` hands it back on restore.
        overwrite: replace an existing ``dest`` (atomically, once the new copy is complete).
            Defaults to False.
        background: copy on a background thread. Defaults to True; False copies before returning.
        durable_checkpoints: the buffer's ``durable_checkpoints`` (how many completed checkpoints
            the state record keeps track of, at least 16).

    Raises:
        CheckpointError: ``dest`` exists (without ``overwrite``), another checkpoint to ``dest``
            is still being written, or its directory is missing or not writable; checked before
            anything is stamped.
    """
    entered = time.perf_counter()
    try:
        doc = dict(trainer_state or {})
        json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BadArgument(f"trainer_state must be JSON-serialisable: {exc}") from None

    def stamp(txn: Txn, base: dict[str, Any]) -> int:
        t = Tables(txn)
        st = t.state()
        t.put_stamp({"checkpoint_id": base["checkpoint_id"], "trainer_version": st["trainer_version"],
                     "dispatch_index": st["dispatch_index"], "trainer_state": doc, "created": base["created"],
                     "file": base["file"]})
        return st["trainer_version"]

    return snapshot_to_file(store, dest, stamp, overwrite=overwrite, background=background, entered=entered,
                            after=lambda version: _mark_durable(store, version, durable_checkpoints))


def snapshot_to_file(store: Store, dest: str | os.PathLike[str], stamp: Callable[[Txn, dict[str, Any]], int], *,
                     overwrite: bool = False, background: bool = True, entered: float | None = None,
                     after: Callable[[int], None] | None = None,
                     describe: Describe | None = None) -> CheckpointHandle:
    """The one checkpoint recipe of every store kind (a replay buffer, a value store): reserve
    ``dest``, run ``stamp`` as one durable write transaction and pin the snapshot right after it,
    then copy that snapshot to ``dest`` (page copy with its unused bytes cleared, or compacting
    copy; see the module docstring), fsync, rename, fsync the directory; on a background thread
    unless ``background`` is False.

    Args:
        store: the live store (any kind).
        dest: the file to create (its directory must exist).
        stamp: writes the kind's stamp record, given ``{"checkpoint_id", "created", "file"}``, and
            returns the version it covers (:attr:`CheckpointResult.trainer_version`). It may raise
            to refuse the checkpoint: then nothing is written and ``dest`` is released.
        overwrite: replace an existing ``dest`` once the new copy is complete. Defaults to False.
        background: copy on a background thread. Defaults to True.
        entered: when the caller started (``perf_counter``), for the ``reserve`` timing.
        after: called with the stamped version once the file is under its name (before the
            handle completes).
        describe: read from the pinned snapshot on the copy's thread, before the copy; what it
            returns is :attr:`CheckpointResult.details` (a count, say, without holding writers).

    Raises:
        CheckpointError: ``dest`` exists (without ``overwrite``), another checkpoint to ``dest``
            is still being written, or its directory is missing or not writable; checked before
            anything is stamped.
    """
    entered = time.perf_counter() if entered is None else entered
    dest = os.path.abspath(os.fspath(dest))
    directory = os.path.dirname(dest)
    if os.path.exists(dest) and not overwrite:
        raise CheckpointError(f"checkpoint destination {dest!r} already exists; pass overwrite=True or "
                              "choose a new name")
    partial = dest + PARTIAL_SUFFIX
    try:
        reservation = _reserve(partial, dest)
    except CheckpointError:
        # Diagnosed only when the reservation failed: each system call the caller waits for can
        # cost it a GIL hand-off (milliseconds when producers keep the interpreter busy).
        if not os.path.isdir(directory):
            raise CheckpointError(f"checkpoint directory {directory!r} does not exist") from None
        if not os.access(directory, os.W_OK):
            raise CheckpointError(f"checkpoint directory {directory!r} is not writable") from None
        raise
    try:
        return _stamp_and_copy(store, dest, stamp, partial, reservation, background, (after, describe), entered)
    except BaseException:
        _release(partial, reservation)
        raise


def _reserve(partial: str, dest: str) -> int:
    """Create (or reuse a crashed run's) ``partial`` and lock it; the descriptor holds the lock."""
    try:
        fd = os.open(partial, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except OSError as exc:
        raise CheckpointError(f"cannot reserve checkpoint destination {dest!r} ({partial!r}): {exc.strerror}; "
                              "nothing was stamped") from None
    if not lock_or_close(fd):
        raise CheckpointError(f"another checkpoint to {dest!r} is still being written (it holds {partial!r}); "
                              "wait for it or choose another name. Nothing was stamped") from None
    os.ftruncate(fd, 0)
    return fd


def _release(partial: str, fd: int) -> None:
    """Delete the reservation (while still holding its lock) and close it."""
    with contextlib.suppress(OSError):
        if os.path.exists(partial) and os.path.samestat(os.fstat(fd), os.stat(partial)):
            os.unlink(partial)
    os.close(fd)


def _stamp_and_copy(store: Store, dest: str, stamp: Callable[[Txn, dict[str, Any]], int], partial: str, fd: int,
                    background: bool, hooks: tuple[Callable[[int], None] | None, Describe | None],
                    entered: float) -> CheckpointHandle:
    """The stamp transaction, then the copy into the reserved ``fd`` (on a thread if ``background``);
    ``hooks`` are :func:`snapshot_to_file`'s ``after`` and ``describe``; ``entered`` is when the
    caller entered :func:`snapshot_to_file` (``perf_counter``)."""
    after, describe = hooks
    directory = os.path.dirname(dest)
    base = {"checkpoint_id": uuid.uuid4().hex, "created": time.time(), "file": os.path.basename(dest)}
    t0 = time.perf_counter()
    timings = {"reserve": t0 - entered}
    version, snapshot = store.write_then_snapshot(lambda txn: stamp(txn, base), timings)
    timings["stamp"] = time.perf_counter() - t0
    result = CheckpointResult(dest, base["checkpoint_id"], version, timings=timings)
    handle = CheckpointHandle(result)

    def copy() -> None:
        renamed = False
        try:
            t1 = time.perf_counter()
            if describe is not None:
                result.details = describe(snapshot.txn)
            if store.free_share(snapshot) > COMPACT_WHEN_FREE:
                result.how = "compact"
                if background:
                    _at_lowest_cpu_priority(lambda: store.copy_snapshot(fd, snapshot.txn))
                else:
                    store.copy_snapshot(fd, snapshot.txn)
            else:
                # The unused bytes are found in the live file as the snapshot sees it and cleared in
                # each chunk before its write-back: cleared after a paced copy, every page holding
                # a row's tail was written to disk twice (half of a 134 MB file at 1 GB of rows).
                found = unused_ranges(store.data_fd(), snapshot.metas, headers=False)  # the live file is ours
                clear = _UnusedBytes(fd, *found) if found is not None else None
                result.timings["find_unused"] = time.perf_counter() - t1
                result.how = store.copy_pinned(fd, snapshot, before_writeback=None if clear is None else clear.upto)
                snapshot.close()  # what follows reads only the copy
                t_zero = time.perf_counter()
                result.zeroed_bytes = clear.rest() if clear is not None else _zero_unused(fd)
                result.timings["zero_unused"] = time.perf_counter() - t_zero
            snapshot.close()
            t2 = time.perf_counter()
            os.fsync(fd)
            os.replace(partial, dest)
            renamed = True
            fsync_dir(directory)
            os.close(fd)
            t3 = time.perf_counter()
            result.timings.update(copy=t2 - t1, fsync_rename=t3 - t2)
            result.file_bytes = os.path.getsize(dest)
            if after is not None:
                after(version)
        except BaseException as exc:
            snapshot.close()
            if renamed:
                with contextlib.suppress(OSError):
                    os.close(fd)
            else:
                _release(partial, fd)
            # Whatever failed (disk full, a bad name, a closed store), the caller sees the
            # documented CheckpointError; the original error stays attached as its cause.
            error = exc
            if not isinstance(exc, CheckpointError):
                error = CheckpointError(f"checkpoint to {dest!r} failed: {exc}; the previous checkpoint files "
                                        "are untouched")
                error.__cause__ = exc
            handle._error = error
        finally:
            result.timings["total"] = time.perf_counter() - t0
            handle._done.set()

    t1 = time.perf_counter()
    if background:
        # Not threading.Thread: its start() waits until the new thread has run, and on a saturated
        # machine that wait (a CPU for the new thread, then the GIL back) blocked the trainer for
        # up to 27 ms, longer than the rest of the checkpoint. The thread is a daemon, as before.
        try:
            _thread.start_new_thread(copy, ())
        except BaseException:  # no thread (RuntimeError): the copy never runs, so unpin its snapshot here
            snapshot.close()
            raise
    else:
        copy()
    t2 = time.perf_counter()
    timings.update(start=t2 - t1, blocked=t2 - entered)
    return handle


def _zero_unused(fd: int) -> int:
    """Overwrite with zeros every byte of the page copy open as ``fd`` that holds nothing of its
    snapshot (:func:`kvckpt.durability.structure.unused_ranges`: free pages, the unused middle of
    tree pages, the rest of overflow runs' last pages) and return how many were written.

    A page copy takes the live file's pages as they are, and LMDB fills those bytes from reused
    buffers: older versions of records, rows dropped since, an earlier stamp's trainer_state. A
    checkpoint is a file users hand on, so it must carry its snapshot and nothing else (LMDB's
    compacting copy carries none either). A copy the structure proof cannot read (an older format's
    shape) keeps them, and a warning says so.
    """
    found = unused_ranges(fd)
    if found is None:
        log.warning("checkpoint copy: its unused bytes were not cleared (the copy's shape is not one the "
                    "structure proof reads); run `kvckpt compact` on it before handing it on")
        return 0
    return _UnusedBytes(fd, *found).rest()


class _UnusedBytes:
    """Byte ranges of a page copy to overwrite with zeros (sorted, disjoint), cleared as the copy
    writes its chunks in file order (:meth:`upto`, a ``before_writeback`` hook), the rest at the end
    (:meth:`rest`)."""

    def __init__(self, fd: int, offsets: Any, lengths: Any) -> None:
        self.fd, self.offsets, self.lengths = fd, offsets.tolist(), lengths.tolist()
        self.next = self.zeroed = 0
        self.zeros = memoryview(bytes(ZERO_CHUNK))

    def upto(self, _start: int, stop: int) -> None:
        """Clear every range, or its part, before byte ``stop`` (the copy wrote everything before it)."""
        while self.next < len(self.offsets) and self.offsets[self.next] < stop:
            offset, length = self.offsets[self.next], self.lengths[self.next]
            part = min(length, stop - offset)
            self._clear(offset, part)
            if part < length:  # the rest lies in a chunk not copied yet
                self.offsets[self.next], self.lengths[self.next] = offset + part, length - part
                return
            self.next += 1

    def rest(self) -> int:
        """Clear every range not cleared yet; return the bytes cleared in all."""
        self.upto(0, 1 << 62)
        return self.zeroed

    def _clear(self, offset: int, length: int) -> None:
        for pos in range(offset, offset + length, ZERO_CHUNK):
            self.zeroed += os.pwrite(self.fd, self.zeros[:min(ZERO_CHUNK, offset + length - pos)], pos)


def _at_lowest_cpu_priority(fn: Callable[[], None]) -> None:
    """Run ``fn`` on a fresh thread at nice 19 and wait for it; re-raise what it raised.

    The compacting copy is CPU-bound C code that releases the GIL: at normal priority it takes a
    whole core from the producers and the trainer for seconds per GB (on 2 cores, producer commit
    p99 grew 2-5x during a copy). At nice 19 it gets the CPU nobody else wants (on a saturated
    machine, little: it then takes many times longer). Only the copy runs there: the writes that
    follow (marking the checkpoint durable) take the writer lock, and a low-priority thread
    holding it would stall everyone. Linux only (a thread has its own nice value there);
    elsewhere ``fn`` runs at normal priority.
    """
    errors: list[BaseException] = []

    def run() -> None:
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="kvckpt-checkpoint-copy", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _mark_durable(store: Store, version: int, durable_checkpoints: int) -> None:
    """Record that a complete checkpoint covers ``version`` (lets old consumed rows be dropped)."""
    def txn_fn(txn: Txn) -> None:
        t = Tables(txn)
        st = t.state()
        if not st["durable"] or st["durable"][-1] < version:
            st["durable"] = (st["durable"] + [version])[-max(16, durable_checkpoints):]
            t.put_state(st)

    with contextlib.suppress(KvckptError):  # closed meanwhile: the file is complete, the marker is skipped
        store.write(txn_fn)


def read_stamp(path: str) -> dict[str, Any]:
    """The stamp of a checkpoint file (opened read-only, no lock file).

    Raises:
        FormatError: not a kvckpt store. RecoveryError: the file has no checkpoint stamp.
    """
    with open_readonly(path) as store:
        stamp = store.read(lambda txn: Tables(txn).stamp())
    if stamp is None:
        raise RecoveryError(f"{path!r} is a kvckpt store but not a checkpoint (no stamp)")
    return stamp


def restore_file(checkpoint_file: str, live_path: str, *, sampler: Any = None,
                 max_buffered_rollouts: int | None = None, overwrite: bool = False,
                 trusted: bool = False, deep: bool = False) -> RecoveryPlan:
    """Restore a checkpoint file into ``live_path`` (closed when this returns) and return its plan;
    :func:`kvckpt.restore` calls this, then opens the buffer.

    The checkpoint file is only read: its header is checked (a file whose used pages are mostly
    holes, such as ``truncate -s`` or a meta page claiming pages never written, is refused before
    anything is copied), then exactly the pages its meta page says are used are copied under a
    temporary name (mode 0600) next to ``live_path``. The copy is what gets validated (so nothing can change between
    the check and the use): a pure-Python structure check before liblmdb maps it (see
    :mod:`kvckpt.durability.safe_open`), then, in the recovery transaction at the stamped version, every
    kvckpt invariant of the metadata: the checksum and fields of every group record, ledger entry,
    cursor and ``meta`` record, the indexes, the row keys of every group (claims made after the
    stamp are undone, in-flight prompts are fenced and planned for redispatch). The copy is fsynced meanwhile in a
    background thread; only when it is durable and recovered does it take the name
    ``live_path`` (then the directory is fsynced); the caller opens it through a fresh handle.

    Row payloads are not read here, so the cost follows the metadata, not the rows: each row is
    checked when it is read (``read_batch``: its checksum, its group's digest, the group and index
    it names, its schema, dtypes, shapes and decoded size), which fails with
    :class:`~kvckpt.errors.CorruptRecord` or :class:`~kvckpt.errors.InvariantViolation` naming the
    row rather than return wrong data; the other groups stay readable. ``kvckpt verify --deep``
    checks every row of a file up front, and ``deep=True`` does it here (about 3 s per GB of raw
    rows).

    Args:
        checkpoint_file: a file written by :func:`kvckpt.checkpoint`.
        live_path: where the live store goes.
        sampler, max_buffered_rollouts: restore under another sampler or capacity (reported in
            ``plan.changes``).
        overwrite: replace an existing live store (it must not be open for writing).
        trusted: the file is exactly what this process's own :func:`kvckpt.checkpoint` wrote and
            nothing else touched it: check it as the crash path checks the live store
            (:func:`kvckpt.durability.recovery.recover_store` with ``lookups=None``), not as
            untrusted input. No structure check before liblmdb maps it (a damaged file can then
            crash the process); inside recovery the proof of its tree pages only
            (``is_sound(headers=False)``, no page per row), which stands in for the key lookups
            and hands the verifier the rows' keys, and the lookups where it fails. Every kvckpt
            invariant of the metadata is still checked, and every row where it is read. The
            fastest safe mode for such a file. Defaults to False.
        deep: also decode every row payload before returning. Defaults to False.

    Raises:
        StoreNotFound: no file at ``checkpoint_file``.
        FormatError: not a complete LMDB file of the right format, or structurally damaged.
        VerificationFailed: a kvckpt invariant or a checksum does not hold (``problems`` lists each).
        RecoveryError: not a checkpoint, copying failed, or recovery refused the requested sampler
            or capacity (``CapacityError`` when it would deadlock).
        StoreLocked: the live store is open for writing elsewhere, or a reader in another process shares its
            lock file (:func:`install_checkpoint`).
        The live store is left untouched whenever ``restore`` raises.
    """
    t0 = time.perf_counter()
    checkpoint_file = os.fspath(checkpoint_file)
    used = check_header(checkpoint_file)  # also refuses sparse files, before anything is copied
    live_path = os.path.abspath(live_path)
    if os.path.exists(live_path):
        if os.path.samefile(live_path, checkpoint_file):
            raise BadArgument(f"live path {live_path!r} is the checkpoint file itself; restore into another path "
                              "(a checkpoint stays immutable)")
        if not overwrite:
            raise RecoveryError(f"live store {live_path!r} exists; pass overwrite=True to replace it with "
                                f"the checkpoint (or recover it in place with ReplayBuffer.recover)")
        if writer_active(live_path):
            raise StoreLocked(f"live store {live_path!r} is open for writing; close it before restoring over it")
    timings: dict[str, float] = {}

    def check(tmp: str) -> RecoveryPlan:
        # The fast proof covers the lookups, and the rows' keys it read are the copy's (which
        # nothing writes before recovery). A trusted file is proven as a live store is, inside
        # recovery (lookups=None), and only its tree pages: no page per row.
        t1 = time.perf_counter()
        rows = None
        if not trusted:
            rows = prove_structure(tmp, stored_key("rows", b""), name=checkpoint_file)
            timings["structure"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        plan = _recover_copy(tmp, checkpoint_file, sampler, max_buffered_rollouts, deep,
                             lookups=None if trusted else rows is None, proven_rows=rows)
        timings["recovery"] = time.perf_counter() - t1  # opening the copy, its config and stamp, recover
        return plan

    plan = install_checkpoint(checkpoint_file, live_path, check, used=used, timings=timings, started=t0)
    plan.timings.update(timings)
    return plan


def install_checkpoint(checkpoint_file: str, live_path: str, check: Callable[[str], T], *, used: int | None = None,
                       timings: dict[str, float] | None = None, started: float | None = None) -> T:
    """The one restore recipe of every store kind: copy the pages ``checkpoint_file`` uses to a
    temporary name next to ``live_path`` (mode 0600), run ``check`` on that private copy (so
    nothing can change between the check and the use; ``check`` opens it only through the
    hardened open, :mod:`kvckpt.durability.safe_open`) while the copy is fsynced in the
    background, then rename it to ``live_path`` and fsync the directory. Returns what ``check``
    returned. ``live_path`` must not be open (the caller checks).

    Args:
        used: the bytes :func:`~kvckpt.durability.safe_open.check_header` found used (checked here if None).
        timings: filled with ``copy``, ``fsync_wait`` and ``rename`` (seconds).
        started: when the caller started (``perf_counter``), for the ``copy`` timing.

    Raises:
        StoreLocked: another process has ``live_path``'s lock file open (a reader that shares a writer's lock
            file): LMDB would pair the new file with the old lock file's transaction state, and its handles would
            read the wrong meta page, so nothing is copied.
        RecoveryError: copying failed. Whatever ``check`` raised, naming ``checkpoint_file``
            where it named the private copy. ``live_path`` is untouched whenever this raises.
    """
    t0 = time.perf_counter() if started is None else started
    users = lock_file_users(live_path)
    if users:  # LMDB would pair the new file with the old lock file's state: readers of the wrong meta page
        raise StoreLocked(f"live store {live_path!r} is still open in process(es) {users} (a reader sharing its lock "
                          "file); close every handle on it before replacing it with a checkpoint")
    timings = {} if timings is None else timings
    flush: _BackgroundFsync | None = None
    tmp = None
    try:
        with private_copy(checkpoint_file, live_path, used) as tmp:
            timings["copy"] = time.perf_counter() - t0
            flush = _BackgroundFsync(tmp)  # the copy's write-back overlaps the checks
            try:
                checked = check(tmp)
            except BaseException:
                flush.join(raise_error=False)
                raise
            t1 = time.perf_counter()
            flush.join()
            timings["fsync_wait"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            publish(tmp, live_path, synced=True)
            timings["rename"] = time.perf_counter() - t2
    except BaseException as exc:
        if isinstance(exc, OSError) and not isinstance(exc, KvckptError):
            raise RecoveryError(f"copying {checkpoint_file!r} to {live_path!r} failed: {exc}") from None
        if isinstance(exc, KvckptError) and tmp is not None:
            _name_user_file(exc, tmp, checkpoint_file)
        raise
    return checked


@contextlib.contextmanager
def private_copy(checkpoint_file: str, beside: str, used: int | None = None) -> Iterator[str]:
    """The pages ``checkpoint_file`` uses (:func:`~kvckpt.durability.safe_open.check_header`'s ``used``, checked
    here if None) copied to a private file next to ``beside`` (mode 0600), removed with its lock file on exit
    unless it was renamed meanwhile: what every load of an untrusted file checks and reads."""
    used = check_header(checkpoint_file) if used is None else used
    tmp = partial_name(beside)
    try:
        copy_used(checkpoint_file, tmp, used)
        yield tmp
    finally:
        for path in (tmp, tmp + "-lock"):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _name_user_file(exc: KvckptError, tmp: str, checkpoint_file: str) -> None:
    """Make ``exc`` name the file the user passed where it names restore's private copy of it (the
    copy is what gets checked and opened, and it is deleted by the time the caller sees the error)."""
    exc.args = tuple(a.replace(tmp, checkpoint_file) if isinstance(a, str) else a for a in exc.args)
    if isinstance(exc, OSError):
        if isinstance(exc.strerror, str):
            exc.strerror = exc.strerror.replace(tmp, checkpoint_file)
        if exc.filename == tmp:
            exc.filename = checkpoint_file


def _recover_copy(tmp: str, checkpoint_file: str, sampler: Any, max_buffered_rollouts: int | None,
                  deep: bool, *, lookups: bool | None, proven_rows: list[bytes] | None) -> RecoveryPlan:
    """Open the private copy, start a new replication history on it if it is replicated (the
    restore rewinds it: a standby of its old history must not take its log as a continuation), read
    its stamp and recover it at the stamped version."""
    store = Store(tmp)
    try:
        ReplicationLog.restart_history(store)
        try:
            config = buffer_config(store)
        except BadArgument:
            raise FormatError(f"{checkpoint_file!r} is a kvckpt store without a replay buffer config (meta/config): "
                              "damaged, or not a replay buffer checkpoint") from None
        stamp = store.read(lambda txn: Tables(txn).stamp())
        if stamp is None:
            raise RecoveryError(f"{checkpoint_file!r} is a kvckpt store but not a checkpoint (no stamp)")
        version = stamp.get("trainer_version")
        if type(version) is not int or not 0 <= version < 1 << 63:
            raise FormatError(f"{checkpoint_file!r}: meta/checkpoint passes its checksum but its trainer_version "
                              f"is {str(version)[:40]!r}, not a step number: the file is damaged or crafted")
        plan, _ = recover_store(store, config, version, sampler=sampler, max_buffered_rollouts=max_buffered_rollouts,
                                deep=deep, lookups=lookups, proven_rows=proven_rows)
        return plan
    except VerificationFailed as exc:
        raise VerificationFailed(f"checkpoint {checkpoint_file!r}", exc.problems) from None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError, RecursionError) as exc:
        if isinstance(exc, KvckptError):
            raise
        raise FormatError(f"{checkpoint_file!r}: a record passes its checksum but is not one kvckpt writes "
                          f"({type(exc).__name__}: {str(exc)[:200]}); the file is damaged or crafted") from None
    finally:
        store.close()


class _BackgroundFsync(threading.Thread):
    """fsync one file on a daemon thread (``os.fsync`` releases the GIL)."""

    def __init__(self, path: str) -> None:
        super().__init__(name="kvckpt-restore-fsync", daemon=True)
        self.path, self.error = path, None
        self.start()

    def run(self) -> None:
        try:
            fsync_file(self.path)
        except OSError as exc:
            self.error = exc

    def join(self, timeout: float | None = None, *, raise_error: bool = True) -> None:
        super().join(timeout)
        if raise_error and self.error is not None:
            raise self.error


def keep_latest(directory: str, pattern: str = "*.kvckpt", keep: int = 3) -> list[str]:
    """Delete all but the ``keep`` newest checkpoint files matching ``pattern`` in ``directory``.

    Returns the deleted paths. ``.partial`` files (copies in progress, or left by a crash) are
    never matched by the default pattern and are left alone.
    """
    import glob

    if keep < 1:
        raise BadArgument("keep must be >= 1")
    files = sorted(glob.glob(os.path.join(directory, pattern)), key=os.path.getmtime)
    doomed = files[:-keep]
    for path in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if doomed:
        fsync_dir(directory)
    return doomed
