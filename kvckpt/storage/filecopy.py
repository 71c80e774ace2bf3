"""Copy a byte range of one file into another at the disk's rate: a clone where the filesystem
shares extents, else a copy inside the kernel.

:func:`copy_range` first asks for a clone (``FICLONERANGE``: XFS with ``reflink=1``, btrfs, bcachefs):
the destination then shares the source's blocks, nothing is read or written but metadata, and a
later write to either file copies only the block it touches. Where the filesystem cannot clone
(ext4, tmpfs, two filesystems, a range not aligned to its blocks) it copies with
``copy_file_range`` (no user-space buffer; ``sendfile`` where that is refused too). With ``pace`` the
write-back of each chunk is started as soon as it is written and waited for one chunk later
(``sync_file_range``), so the copy never holds more than two chunks of dirty pages: a producer's
``fsync`` that has to push the filesystem journal then never waits behind gigabytes of the copy's
dirty data, and the final ``fsync`` finds almost nothing left to write.

Nothing here makes the destination durable: the caller ``fsync``\\ s it (and its directory).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from collections.abc import Callable

#: Bytes per ``copy_file_range`` call and per paced write-back window. A producer's fsync on ext4
#: waits for the copy's write-back in flight (ordered data), up to two chunks: 8 MB chunks made the
#: producers' commit p99 5.5x its value without a copy at 4 GB on a quiet disk, 2 MB 3.5x, for a
#: copy about 6% slower (BENCHMARKS.md, figure 1 at 4 GB).
CHUNK = 2 << 20

# linux/fs.h: FICLONERANGE = _IOW(0x94, 13, struct file_clone_range {s64 src_fd; u64 src_offset,
# src_length, dest_offset}).
_FICLONERANGE = 0x4020940D
_CLONE_RANGE = struct.Struct("=qQQQ")
#: Errors that only mean "this filesystem (or this pair of files) cannot clone": fall back to a copy.
_CANNOT_CLONE = frozenset({errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS})
_CANNOT_COPY_IN_KERNEL = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP})

_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4


def _sync_file_range_fn() -> object | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _sync_file_range_fn()


def clone_range(src_fd: int, dst_fd: int, start: int, end: int) -> bool:
    """Clone ``src_fd``'s bytes ``[start, end)`` to the same offsets of ``dst_fd``; False (and nothing
    changed) where the filesystem cannot. Other errors (EIO, ENOSPC) raise ``OSError``."""
    if end <= start:
        return True
    try:
        fcntl.ioctl(dst_fd, _FICLONERANGE, _CLONE_RANGE.pack(src_fd, start, end - start, start))
    except OSError as exc:
        if exc.errno in _CANNOT_CLONE:
            return False
        raise
    return True


def copy_range(src_fd: int, dst_fd: int, start: int, end: int, *, clone: bool = True, pace: bool = False,
               zeros_past_eof: bool = False, before_writeback: Callable[[int, int], object] | None = None) -> str:
    """Make ``dst_fd``'s bytes ``[start, end)`` equal to ``src_fd``'s (same offsets) and return how:
    ``"clone"`` or ``"copy"``.

    Args:
        clone: try a clone first (default True).
        pace: bound the copy's dirty pages to two :data:`CHUNK`\\ s (see the module doc); for copies
            that run beside durable writers. Defaults to False.
        zeros_past_eof: where ``src_fd`` ends before ``end`` (checked once, at the start), write
            zeros for the rest instead of raising: an LMDB file may end before its last page,
            since LMDB never writes a page it allocated and freed in one transaction. Defaults
            to False.
        before_writeback: called as ``before_writeback(chunk_start, chunk_end)`` once each chunk is
            copied, before its write-back starts: a change made there to the chunk's bytes is
            written once, with the copy (a change after a paced copy writes those pages again).
            Not called for a clone, nor for the zeros written past the source's end.

    Raises:
        EOFError: ``src_fd`` ended before ``end`` (it shrank meanwhile); the caller names the file.
        OSError: reading or writing failed.
    """
    if zeros_past_eof and os.fstat(src_fd).st_size < end:
        available = max(start, os.fstat(src_fd).st_size)
        how = copy_range(src_fd, dst_fd, start, available, clone=clone, pace=pace, before_writeback=before_writeback)
        for pos in range(available, end, CHUNK):
            os.pwrite(dst_fd, bytes(min(CHUNK, end - pos)), pos)
        return how
    if clone and clone_range(src_fd, dst_fd, start, end):
        return "clone"
    in_kernel = hasattr(os, "copy_file_range")  # Linux
    previous: tuple[int, int] | None = None
    for chunk in range(start, end, CHUNK):
        pos, stop = chunk, min(end, chunk + CHUNK)
        while pos < stop:
            if in_kernel:
                try:
                    sent = os.copy_file_range(src_fd, dst_fd, stop - pos, pos, pos)
                except OSError as exc:
                    if exc.errno not in _CANNOT_COPY_IN_KERNEL:
                        raise
                    in_kernel = False
                    continue
            else:
                os.lseek(dst_fd, pos, os.SEEK_SET)
                sent = os.sendfile(dst_fd, src_fd, pos, stop - pos)
            if sent == 0:
                raise EOFError(f"the source ended at byte {pos:,}; {end:,} were to be copied")
            pos += sent
        if before_writeback is not None:
            before_writeback(chunk, stop)
        if pace and _sync_file_range is not None:
            _sync(dst_fd, chunk, stop, _SYNC_WRITE)  # start this chunk's write-back now
            if previous is not None:
                _sync(dst_fd, *previous, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER)
            previous = (chunk, stop)
    return "copy"


def _sync(fd: int, start: int, stop: int, flags: int) -> None:
    if _sync_file_range(fd, start, stop - start, flags) != 0:  # type: ignore[operator]
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")
