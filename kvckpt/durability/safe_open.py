"""How kvckpt opens a file it did not write itself: check the bytes before liblmdb maps them.

A checkpoint is untrusted input. liblmdb trusts the pages it maps: a damaged or crafted file can
make it read out of bounds (SIGSEGV/SIGBUS, which no ``try`` catches) or loop. So before the C
engine sees an untrusted file, :func:`check_structure` runs two pure-Python passes that read the
file with ``seek``/``read`` only (never ``mmap``), so no input can crash or hang them:

1. kvckpt's header check: LMDB magic, data format 1, a sane page size, both meta pages, and a
   file long enough for the committed last page (a truncated file would SIGBUS the engine);
2. the structure check: every reachable page is parsed and bounds-checked, reachable exactly
   once, keys are in order, the counters match, and the free and live pages exactly cover the
   file. :func:`kvckpt.durability.structure.is_sound` proves this with numpy for the shape kvckpt
   writes (about 2 us a row); whatever it does not prove goes to py-lmdb's offline verifier
   (``lmdb.verify``, 16-20 us a row), which gives the verdict and names the problem.

A file that passes is safe to open through liblmdb; :func:`kvckpt.durability.verify.check` (``deep=True``)
then checks every record's checksum and every kvckpt invariant. :func:`kvckpt.restore`
does both unless told ``trusted=True``. :func:`verify_untrusted` runs the whole sequence, in a
child process with a timeout when asked, for tools that must survive anything.

:func:`open_readonly` is the one door every reader of a file kvckpt did not just write goes through
(``ReplayBuffer.open(readonly=True)``, every ``kvckpt`` verb, export, diff, compact, the
TransferQueue backend's load): the header and allocation checks, the structure check, then a
read-only handle whose map is exactly the bytes the file uses. Before anything is copied or mapped,
:func:`check_header` also refuses sparse files whose used pages are mostly holes (``truncate -s``,
a meta page claiming a million pages): kvckpt never writes holes, and copying them costs gigabytes.
A file held by a live writer (this process or another) is a store kvckpt is writing right now: it
cannot be structure-checked while it changes, so only its header is (``docs/reliability.md``).

Limit: a check is a statement about the bytes at that moment. Verify files nobody else writes
(a checkpoint is immutable once renamed; :func:`kvckpt.restore` copies it first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

from lmdb import verify as lmdb_verify

from kvckpt.durability.structure import proven_keys
from kvckpt.durability.verify import Report, check
from kvckpt.errors import FormatError, KvckptError, ResourceLimit, StoreNotFound
from kvckpt.storage.filecopy import copy_range
from kvckpt.storage.store import FILE_MODE, Store, check_lmdb_header, fd_limit, writer_active

#: At most this many structural findings are quoted in an error message.
SHOWN_PROBLEMS = 5


def check_structure(path: str | os.PathLike[str], *, name: str | None = None) -> bool:
    """Raise unless ``path`` is a structurally sound, complete LMDB format-1 data file. Returns
    whether the fast proof (:func:`kvckpt.durability.structure.is_sound`) accepted it, which also
    proves that a lookup finds every key iteration finds; False when ``lmdb.verify`` did.
    (:func:`prove_structure` does the same and returns the keys the proof read.)

    Nothing in ``path`` can crash or hang the calling process (``pread``, never ``mmap``). Cost: one
    read of every branch and leaf page and of the first page of every large value (about 0.03 s
    per 13,500 rows of a file kvckpt wrote; 0.1-0.3 s where ``lmdb.verify`` has to decide, see
    ``docs/reliability.md``). ``name`` is what error messages call the file (default: ``path``).

    Raises:
        StoreNotFound: nothing at ``path``.
        FormatError: not a regular file, not an LMDB file, another data format, truncated, or
            damaged (the message quotes the verifier's first findings).
    """
    return prove_structure(path, None, name=name) is not None


def prove_structure(path: str | os.PathLike[str], prefix: bytes | None, *,
                    name: str | None = None) -> list[bytes] | None:
    """:func:`check_structure`, returning the main tree's keys under ``prefix`` in order where the
    fast proof accepted the file (:func:`kvckpt.durability.structure.proven_keys`), None where
    ``lmdb.verify`` did. Raises as :func:`check_structure`."""
    path = os.fspath(path)
    shown_as = repr(name if name is not None else path)
    with fd_limit(path):
        check_header(path, name=name)
        keys = proven_keys(path, prefix)  # the fast proof, for the shape kvckpt writes; else the full verifier
        if keys is not None:
            return keys
    try:
        with fd_limit(path):
            problems = lmdb_verify.verify(path, subdir=False)
    except lmdb_verify.VerifyError as exc:
        raise FormatError(f"{shown_as} is not a sound LMDB file: {exc}") from None
    except (OSError, ValueError, IndexError, KeyError, OverflowError, MemoryError, RecursionError) as exc:
        if isinstance(exc, ResourceLimit):
            raise
        raise FormatError(f"{shown_as} could not be parsed as an LMDB file ({type(exc).__name__}: {exc}); "
                          "it is damaged") from None
    if problems:
        shown = "; ".join(problems[:SHOWN_PROBLEMS])
        more = f" (and {len(problems) - SHOWN_PROBLEMS} more)" if len(problems) > SHOWN_PROBLEMS else ""
        raise FormatError(f"{shown_as} failed LMDB structural verification: {shown}{more}. The file is damaged; "
                          "use another checkpoint")
    return None


def check_header(path: str | os.PathLike[str], *, name: str | None = None) -> int:
    """The cheap first half of :func:`check_structure`: a regular file with LMDB format-1 meta
    pages, long enough for its last committed page, whose used pages are not mostly holes (a few
    page reads and one ``SEEK_HOLE`` walk, whatever the size). Returns the bytes in use (what a
    copy or a read-only map needs; bytes past them are never read)."""
    path = os.fspath(path)
    shown_as = repr(name if name is not None else path)
    if not os.path.exists(path):
        raise StoreNotFound(f"no checkpoint file at {shown_as}")
    if not os.path.isfile(path):
        raise FormatError(f"{shown_as} is not a regular file; a kvckpt checkpoint is one file")
    used = check_lmdb_header(path, name)
    holes = hole_bytes(path, used)
    if holes > max(MAX_HOLE_BYTES, used // 4):
        raise FormatError(f"{shown_as} claims {used:,} bytes of pages but {holes:,} of them are holes (a sparse "
                          "file: extended with truncate, or a meta page claiming pages that were never "
                          "written); kvckpt never writes holes, so it is damaged or crafted. Nothing was copied")
    return used


#: Holes (never-written ranges) tolerated inside a file's used pages; filesystems that store
#: all-zero blocks as holes (ZFS with compression) can make a few. Above this, and above a
#: quarter of the used bytes, :func:`check_header` refuses the file.
MAX_HOLE_BYTES = 1 << 20


def hole_bytes(path: str, limit: int) -> int:
    """Bytes of holes in ``path``'s first ``limit`` bytes (``SEEK_DATA``/``SEEK_HOLE``; 0 where the
    filesystem does not report holes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        holes, pos = 0, 0
        while pos < limit:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole remains
                return holes + limit - pos
            holes += min(data, limit) - pos
            if data >= limit:
                return holes
            pos = os.lseek(fd, data, os.SEEK_HOLE)
        return holes
    except OSError:  # EINVAL: no hole reporting here
        return 0
    finally:
        os.close(fd)


def copy_used(src: str, dest: str, used: int) -> str:
    """Copy the first ``used`` bytes of ``src`` (what its meta page says is in use: bytes past it
    are never read; free pages past the end of a file that ends early are written as zeros, see
    :func:`kvckpt.storage.store.check_lmdb_header`) to ``dest``, a new file of mode 0600, and
    return how: ``"clone"`` where the filesystem shares extents (XFS with reflink, btrfs: nothing
    is copied), else ``"copy"`` (in the kernel, :func:`kvckpt.storage.filecopy.copy_range`).
    Nothing is fsynced.

    Raises:
        FormatError: ``src`` shrank below ``used`` meanwhile. FileExistsError / OSError: as ``open``.
    """
    with open(src, "rb") as fin:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            return copy_range(fin.fileno(), fd, 0, used, zeros_past_eof=True)
        except EOFError as exc:
            raise FormatError(f"{src!r} shrank while being copied: {exc}") from None
        finally:
            os.close(fd)


def open_readonly(path: str | os.PathLike[str], *, map_size: int | None = None,
                  name: str | None = None) -> Store:
    """Open a store or checkpoint file kvckpt did not just write, read-only, after checking it.

    The file gets :func:`check_header` and, unless a live writer holds it, :func:`check_structure`;
    then a read-only :class:`~kvckpt.storage.store.Store` with no lock file whose map is the file's used
    bytes (or ``map_size``). Nothing in the file can then crash the process through liblmdb;
    records are still checksum-verified as they are read.

    Raises:
        StoreNotFound: nothing at ``path``.
        FormatError: not a sound LMDB file, sparse, or not a kvckpt store of a readable version.
        ResourceLimit: the map cannot be reserved (``ulimit -v``) or no file descriptor is left.
    """
    path = os.fspath(path)
    if writer_active(path):
        return Store(path, readonly=True, map_size=map_size)
    check_structure(path, name=name)
    return Store(path, readonly=True, map_size=map_size)


def verify_untrusted(path: str | os.PathLike[str], *, deep: bool = True, timeout: float | None = None) -> Report:
    """Structural check, then the kvckpt verifier; never raises for a bad file, returns a Report.

    Args:
        path: the file to check (opened read-only, no lock file).
        deep: also decode every row payload. Defaults to True.
        timeout: run everything in a child process (``python -m kvckpt.durability.safe_open``) killed after
            this many seconds; a crash or timeout of the child is reported as a problem. Defaults
            to None: run in this process.
    """
    path = os.fspath(path)
    if timeout is not None:
        return _verify_in_child(path, deep, timeout)
    try:
        check_structure(path)
    except KvckptError as exc:
        report = Report()
        report.add("structure", path, str(exc))
        return report
    return verify_path(path, deep=deep)


def _verify_in_child(path: str, deep: bool, timeout: float) -> Report:
    cmd = [sys.executable, "-m", "kvckpt.durability.safe_open", path] + ([] if deep else ["--shallow"])
    report = Report()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        report.add("timeout", path, f"verification did not finish within {timeout}s; treat the file as damaged")
        return report
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        report.add("crash", path, f"the verifier process died (exit status {proc.returncode}): "
                                  f"{proc.stderr.strip()[-500:]}")
        return report
    report.counts.update(doc["counts"])
    for problem in doc["problems"]:
        report.add(problem["code"], problem["key"], problem["message"])
    return report


def verify_path(path: str, *, deep: bool = False, checksums: bool = False,
                progress: Callable[[int], None] | None = None) -> Report:
    """Open ``path`` read-only through :func:`open_readonly` (structure-checked
    unless a live writer holds it) and :func:`~kvckpt.durability.verify.check` it.

    A file that cannot be opened at all (foreign, damaged pages, sparse) yields a report with one
    ``open`` problem instead of an exception, and one whose records LMDB finds damaged while
    reading a ``read`` problem.
    """
    report = Report()
    try:
        store = open_readonly(path)
    except KvckptError as exc:
        report.add("open", path, str(exc))
        return report
    try:
        return store.read(lambda txn: check(txn, deep=deep, checksums=checksums, progress=progress))
    except KvckptError as exc:
        report.add("read", path, str(exc))
        return report
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvckpt.durability.safe_open PATH [--shallow]``: print the report as JSON; exit 1 if not ok."""
    args = sys.argv[1:] if argv is None else argv
    paths = [a for a in args if not a.startswith("--")]
    if len(paths) != 1:
        print("usage: python -m kvckpt.durability.safe_open PATH [--shallow]", file=sys.stderr)
        return 2
    report = verify_untrusted(paths[0], deep="--shallow" not in args)
    print(json.dumps(report.to_dict()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
