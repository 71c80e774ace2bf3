"""A FUSE filesystem that loses, at a power cut, everything that was not made durable.

A passthrough over a backing directory (in the spirit of LazyFS) that also keeps, in memory, the
*durable image* of every file and directory under strict POSIX rules:

* written bytes become durable only on ``fsync``/``fdatasync`` of the file, or at once when the
  descriptor was opened with ``O_SYNC``/``O_DSYNC`` (LMDB writes its meta pages that way);
* directory entries (create, mkdir, link, rename, unlink, rmdir) become durable only when *that*
  directory is fsynced (a rename touches two directories; each side becomes durable on its own);
* file sizes follow the data (durable on the file's fsync).

:meth:`PowerFS.cut` freezes the filesystem (every later call fails with ``EIO``, so nothing can be
acknowledged after the cut) and writes the image that survives to a directory. ``strict`` keeps
only what was made durable; ``random`` also keeps a random subset of the unsynced 4 KiB page writes
and a random prefix of the unsynced directory operations, the way a disk that wrote some of its
cache back would. Not modelled: torn writes inside a page, a disk that lies about its cache,
metadata other than names and sizes (modes, times).

Reads go to the backing files, and FUSE runs without ``direct_io``, so the page cache and
read-only ``mmap`` (LMDB with ``writemap=False``) work. :func:`mount` runs the filesystem in its
own process and returns a :class:`Mount` to cut and unmount it. Needs Linux, ``/dev/fuse``,
``fusermount3`` and the ``mfusepy`` package; :func:`unavailable` says why when they are missing.

Why this module is long (about 480 lines): :class:`PowerFS` is one state machine (the FUSE
operations and the durable image they update share every field); split, each half would reach the
other's privates.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

PAGE = 4096  #: the unit in which unsynced writes survive (or not) a ``random`` cut
_SYNC_FLAGS = os.O_SYNC | os.O_DSYNC
_NOT_PASSED = os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_APPEND | getattr(os, "O_DIRECT", 0)


def unavailable() -> str | None:
    """Why a power-cut filesystem cannot be mounted here (``None`` when it can)."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine (the kernel's FUSE device is needed to mount powerfs)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing (install fuse3: `bash scripts/setup_fuse.sh` as root)"
    if os.geteuid() != 0:
        return "not root: mounting powerfs needs root here (fusermount3 without allow_other setup)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: mfusepy found no libfuse
        return f"the mfusepy package does not import ({exc}); `pip install -e '.[test]'` installs it"
    return None


@dataclass(eq=False)
class _File:
    """One file: its durable bytes, and the pages written since they were last made durable
    (``None``: read the page from the backing file; bytes: captured when the last descriptor closed)."""

    durable: bytearray
    size: int
    dirty: dict[int, bytes | None] = field(default_factory=dict)
    fds: set[int] = field(default_factory=set)


@dataclass(eq=False)
class _Dir:
    """One directory: its entries now, and the entries that survive a cut."""

    entries: dict[str, Any] = field(default_factory=dict)
    durable: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class _Op:
    """An unsynced directory operation; ``dirs`` are the directories it is not yet durable in."""

    kind: str  # "link" (create, mkdir, link, rename's target) or "unlink" (unlink, rmdir, rename's source)
    changes: list[tuple[_Dir, str, Any]]
    dirs: set[int]


@dataclass
class CutReport:
    """What a cut kept: files and directories written, unsynced pages and directory ops kept of the total."""

    files: int = 0
    dirs: int = 0
    pages_kept: int = 0
    pages_unsynced: int = 0
    ops_kept: int = 0
    ops_unsynced: int = 0


class PowerFS:
    """The FUSE operations; one instance serves one mount. Every operation holds one lock, so a
    :meth:`cut` sees no operation half done.

    The callbacks (``getattr`` ... ``utimens``) have mfusepy's names and signatures and do what
    their system call does on the backing file, recording durability as the module docstring
    says; after a cut each raises ``EIO`` (``release`` still closes). The class does not derive
    from ``mfusepy.Operations``, so importing this module does not import mfusepy (a third of a
    second per process).
    """

    use_ns = True

    def __init__(self, backing: str, on_ready: Any = None) -> None:
        self.backing = os.path.abspath(backing)
        self.on_ready = on_ready
        self._mutex = threading.Lock()
        self.frozen = False
        self.pending: list[_Op] = []
        self.handles: dict[int, tuple[_File, bool]] = {}
        self.root = self._scan(self.backing)

    def _scan(self, path: str) -> _Dir:
        """What the backing directory holds at mount time is durable (the previous power cycle's image)."""
        d = _Dir()
        for name in os.listdir(path):
            full = os.path.join(path, name)
            if os.path.isdir(full):
                d.entries[name] = self._scan(full)
            else:
                with open(full, "rb") as f:
                    data = bytearray(f.read())
                d.entries[name] = _File(data, len(data))
        d.durable = dict(d.entries)
        return d

    # -- helpers ---------------------------------------------------------------------------------
    def _real(self, path: str) -> str:
        return self.backing + path

    def _lookup(self, path: str) -> Any:
        node: Any = self.root
        for part in [p for p in path.split("/") if p]:
            if not isinstance(node, _Dir) or part not in node.entries:
                raise OSError(errno.ENOENT, path)
            node = node.entries[part]
        return node

    def _parent(self, path: str) -> tuple[_Dir, str]:
        head, name = path.rsplit("/", 1)
        parent = self._lookup(head or "/")
        if not isinstance(parent, _Dir):
            raise OSError(errno.ENOTDIR, path)
        return parent, name

    def _record(self, kind: str, changes: list[tuple[_Dir, str, Any]]) -> None:
        self.pending.append(_Op(kind, changes, {id(d) for d, _, _ in changes}))

    def _persist(self, node: _File, fd: int | None, pages: list[int] | None = None) -> None:
        """Make ``pages`` (default: all dirty pages) and the size of ``node`` durable."""
        for page in list(node.dirty) if pages is None else pages:
            if page not in node.dirty:
                continue
            data = node.dirty.pop(page)
            if data is None:
                data = os.pread(fd, PAGE, page * PAGE) if fd is not None else b""
            _put(node.durable, page * PAGE, data)
        del node.durable[node.size:]
        node.durable.extend(bytes(node.size - len(node.durable)))

    def _guard(self) -> None:
        if self.frozen:
            raise OSError(errno.EIO, "powerfs: the power was cut")

    # -- FUSE operations -------------------------------------------------------------------------
    def init(self, path: str) -> None:
        if self.on_ready is not None:
            self.on_ready()

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        with self._mutex:
            self._guard()
            st = os.lstat(self._real(path))
            return {"st_mode": st.st_mode, "st_nlink": st.st_nlink, "st_uid": st.st_uid, "st_gid": st.st_gid,
                    "st_size": st.st_size, "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns,
                    "st_ctime": st.st_ctime_ns}

    def readdir(self, path: str, fh: int) -> list[str]:
        with self._mutex:
            self._guard()
            return [".", "..", *os.listdir(self._real(path))]

    def statfs(self, path: str) -> dict[str, int]:
        with self._mutex:
            self._guard()
            st = os.statvfs(self._real(path))
            return {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                                                 "f_files", "f_ffree", "f_favail", "f_flag", "f_namemax")}

    def open(self, path: str, flags: int) -> int:
        with self._mutex:
            self._guard()
            node = self._lookup(path)
            fd = os.open(self._real(path), (flags & ~(_NOT_PASSED | os.O_ACCMODE | _SYNC_FLAGS)) | os.O_RDWR)
            if flags & os.O_TRUNC:  # libfuse passes O_TRUNC here (atomic_o_trunc): a truncate, not yet durable
                os.ftruncate(fd, 0)
                node.size = 0
                node.dirty.clear()
            node.fds.add(fd)
            self.handles[fd] = (node, bool(flags & os.O_DSYNC))
            return fd

    def create(self, path: str, mode: int, flags: int) -> int:
        with self._mutex:
            self._guard()
            parent, name = self._parent(path)
            fd = os.open(self._real(path), os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
            node = _File(bytearray(), 0, fds={fd})
            parent.entries[name] = node
            self._record("link", [(parent, name, node)])
            self.handles[fd] = (node, bool(flags & os.O_DSYNC))
            return fd

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        with self._mutex:
            self._guard()
            return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        with self._mutex:
            self._guard()
            node, sync = self.handles[fh]
            written = os.pwrite(fh, data, offset)
            pages = list(range(offset // PAGE, (offset + written - 1) // PAGE + 1)) if written else []
            for page in pages:
                node.dirty[page] = None
            node.size = max(node.size, offset + written)
            if sync:
                self._persist(node, fh, pages)
            return written

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        with self._mutex:
            self._guard()
            node = self.handles[fh][0] if fh is not None else self._lookup(path)
            os.truncate(fh if fh is not None else self._real(path), length)
            node.size = length
            for page in [p for p in node.dirty if p * PAGE >= length]:
                del node.dirty[page]
            return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        with self._mutex:
            self._guard()
            self._persist(self.handles[fh][0], fh)
            return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        with self._mutex:
            self._guard()
            d = self._lookup(path)
            d.durable = dict(d.entries)
            for op in self.pending:
                op.dirs.discard(id(d))
            self.pending = [op for op in self.pending if op.dirs]
            return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        with self._mutex:  # runs after a cut too: descriptors must close
            node, _ = self.handles.pop(fh)
            node.fds.discard(fh)
            if not node.fds:  # keep the unsynced pages' bytes: the file may be unlinked next
                for page, data in node.dirty.items():
                    if data is None:
                        node.dirty[page] = os.pread(fh, PAGE, page * PAGE)
            os.close(fh)
            return 0

    def mkdir(self, path: str, mode: int) -> int:
        with self._mutex:
            self._guard()
            parent, name = self._parent(path)
            os.mkdir(self._real(path), mode)
            parent.entries[name] = node = _Dir()
            self._record("link", [(parent, name, node)])
            return 0

    def link(self, target: str, source: str) -> int:
        with self._mutex:
            self._guard()
            node = self._lookup(source)
            parent, name = self._parent(target)
            os.link(self._real(source), self._real(target))
            parent.entries[name] = node
            self._record("link", [(parent, name, node)])
            return 0

    def unlink(self, path: str) -> int:
        return self._remove(path, os.unlink)

    def rmdir(self, path: str) -> int:
        return self._remove(path, os.rmdir)

    def _remove(self, path: str, remove: Any) -> int:
        with self._mutex:
            self._guard()
            parent, name = self._parent(path)
            node = self._lookup(path)
            remove(self._real(path))
            del parent.entries[name]
            self._record("unlink", [(parent, name, node)])
            return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        with self._mutex:
            self._guard()
            if flags & ~1:  # only RENAME_NOREPLACE
                raise OSError(errno.EINVAL, "powerfs: rename flags other than RENAME_NOREPLACE")
            src, sname = self._parent(old)
            dst, dname = self._parent(new)
            node = self._lookup(old)
            if flags and dname in dst.entries:
                raise OSError(errno.EEXIST, new)
            os.rename(self._real(old), self._real(new))
            del src.entries[sname]
            dst.entries[dname] = node
            self._record("unlink", [(src, sname, node)])
            self._record("link", [(dst, dname, node)])
            return 0

    def chmod(self, path: str, mode: int) -> int:
        with self._mutex:
            self._guard()
            os.chmod(self._real(path), mode)
            return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        with self._mutex:
            self._guard()
            os.chown(self._real(path), uid, gid)
            return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        with self._mutex:
            self._guard()
            os.utime(self._real(path), ns=times)
            return 0

    # -- the power cut ---------------------------------------------------------------------------
    def cut(self, out: str, mode: str = "strict", seed: int = 0) -> CutReport:
        """Freeze the filesystem and write the image that survives to the new directory ``out``.

        ``mode`` is ``strict`` (only what was made durable) or ``random`` (also a random subset of
        unsynced page writes and a random prefix of unsynced directory operations, by ``seed``).
        """
        if mode not in ("strict", "random"):
            raise ValueError(f"unknown cut mode {mode!r} (strict or random)")
        rng = random.Random(seed)
        with self._mutex:
            self.frozen = True
            report = CutReport(ops_unsynced=len(self.pending))
            views: dict[int, dict[str, Any]] = {}

            def view(d: _Dir) -> dict[str, Any]:
                return views.setdefault(id(d), dict(d.durable))

            keep = rng.randint(0, len(self.pending)) if mode == "random" else 0
            for op in self.pending[:keep]:
                for d, name, node in op.changes:
                    if id(d) not in op.dirs:
                        continue
                    if op.kind == "link":
                        view(d)[name] = node
                    elif view(d).get(name) is node:
                        del view(d)[name]
            report.ops_kept = keep
            written: dict[int, bytes] = {}
            self._dump(self.root, out, view, rng if mode == "random" else None, written, report)
            return report

    def _dump(self, d: _Dir, out: str, view: Any, rng: random.Random | None, written: dict[int, bytes],
              report: CutReport) -> None:
        os.mkdir(out)
        report.dirs += 1
        for name, node in view(d).items():
            path = os.path.join(out, name)
            if isinstance(node, _Dir):
                self._dump(node, path, view, rng, written, report)
                continue
            if id(node) not in written:
                data = bytearray(node.durable)
                report.pages_unsynced += len(node.dirty)
                for page, page_data in sorted(node.dirty.items()):
                    if rng is None or rng.random() < 0.5:
                        continue
                    if page_data is None:
                        fd = next(iter(node.fds))
                        page_data = os.pread(fd, PAGE, page * PAGE)
                    _put(data, page * PAGE, page_data)
                    report.pages_kept += 1
                written[id(node)] = bytes(data)
            with open(path, "wb") as f:
                f.write(written[id(node)])
            report.files += 1


def _put(buf: bytearray, offset: int, data: bytes) -> None:
    """Write ``data`` into ``buf`` at ``offset``, growing it with zeros as needed."""
    if len(buf) < offset + len(data):
        buf.extend(bytes(offset + len(data) - len(buf)))
    buf[offset:offset + len(data)] = data


# -- running it in its own process -----------------------------------------------------------------


def _serve(backing: str, mountpoint: str, conn: Any) -> None:
    """The filesystem process: mount, report readiness, obey ``("cut", out, mode, seed)`` on ``conn``."""
    import mfusepy

    fs = PowerFS(backing, on_ready=lambda: conn.send(("ready",)))

    def control() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            try:
                conn.send(("cut", fs.cut(msg[1], msg[2], msg[3])))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))

    threading.Thread(target=control, daemon=True).start()
    mfusepy.FUSE(fs, mountpoint, foreground=True, nothreads=True, fsname="powerfs")


class Mount:
    """A mounted :class:`PowerFS` running in its own process."""

    def __init__(self, process: Any, conn: Any, mountpoint: str) -> None:
        self.process, self.conn, self.mountpoint = process, conn, mountpoint

    def cut(self, out: str, mode: str = "strict", seed: int = 0, timeout: float = 120.0) -> CutReport:
        """Cut the power: freeze the filesystem and write its surviving image to ``out``."""
        self.conn.send(("cut", out, mode, seed))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"powerfs did not finish the cut within {timeout}s")
        kind, payload = self.conn.recv()
        if kind != "cut":
            raise RuntimeError(f"powerfs cut failed: {payload}")
        return payload

    def unmount(self) -> None:
        """Detach the mount (lazily, so a process still inside cannot block it) and stop the server."""
        subprocess.run(["fusermount3", "-u", "-z", self.mountpoint], capture_output=True, check=False)
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def mount(backing: str, mountpoint: str, context: Any = None, timeout: float = 30.0) -> Mount:
    """Mount a :class:`PowerFS` over ``backing`` at ``mountpoint`` (created if missing) in a new
    process of the multiprocessing ``context`` (default: fork server), and wait until it serves."""
    import multiprocessing

    ctx = context or multiprocessing.get_context("forkserver")
    os.makedirs(mountpoint, exist_ok=True)
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve, args=(backing, mountpoint, child), daemon=True)
    process.start()
    child.close()
    m = Mount(process, parent, mountpoint)
    deadline = time.monotonic() + timeout
    while not parent.poll(0.05):
        if not process.is_alive() or time.monotonic() > deadline:
            m.unmount()
            raise RuntimeError(f"powerfs did not mount {mountpoint!r} (exit status {process.exitcode})")
    parent.recv()
    return m
