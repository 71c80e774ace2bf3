"""Replacing a file durably, written once: a private temporary name beside it, fsync, rename, directory fsync.

Every file kvckpt (and its tools, integrations and reference trainer) writes whole goes through
:func:`durable_replace`: the new content is written under a private ``.partial`` name next to the
destination; when the writer is done the file is fsynced, renamed over the destination and the
directory fsynced. The destination therefore holds the old content or the complete new one, never a
mix, after a crash or a power cut at any moment, and a returned call survives a power cut. A failed
write leaves the destination untouched and removes the temporary file.

With ``exclusive=True`` the new file is published only where nothing is yet (a hard link, which
refuses an existing name, then the private name removed): how a store is created, so an interrupted
creation leaves no file that every later open refuses. The checkpoint copy and restore keep their own
rename (their file is fsynced through a descriptor they hold) in :mod:`kvckpt.durability.checkpoint`.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator

from kvckpt.storage.store import fsync_dir, fsync_file

#: A file being written whole carries this suffix until it is complete (checkpoints and restores too).
PARTIAL_SUFFIX = ".partial"


def partial_name(dest: str) -> str:
    """A private temporary name next to ``dest`` (``dest.<8 hex>.partial``)."""
    return f"{dest}.{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}"


def publish(tmp: str, dest: str, *, synced: bool = False, exclusive: bool = False) -> None:
    """Give the complete file ``tmp`` the name ``dest`` durably: fsync it (unless ``synced``), rename it
    over ``dest`` (with ``exclusive``, link it to ``dest`` and drop ``tmp``), fsync ``dest``'s directory.

    Raises:
        FileExistsError: ``exclusive`` and ``dest`` exists; ``tmp`` is left as it is.
    """
    if not synced:
        fsync_file(tmp)
    if exclusive:
        os.link(tmp, dest)
        os.unlink(tmp)
    else:
        os.replace(tmp, dest)
    fsync_dir(os.path.dirname(os.path.abspath(dest)))


@contextlib.contextmanager
def durable_replace(dest: str, *, check: Callable[[], None] | None = None, exclusive: bool = False,
                    leftovers: tuple[str, ...] = ()) -> Iterator[str]:
    """The path to write ``dest``'s new content to; when the block returns, that file is published as
    ``dest`` (:func:`publish`; ``check`` runs just before, and may raise to publish nothing). Whether the
    block returns or raises, the temporary file (and ``tmp + s`` for each suffix in ``leftovers``, e.g. an
    LMDB lock file) is gone afterwards; on a raise ``dest`` is untouched.

    Examples:
        >>> import os, tempfile
        >>> dest = os.path.join(tempfile.mkdtemp(), "manifest.json")
        >>> with durable_replace(dest) as tmp, open(tmp, "w") as f:
        ...     _ = f.write("{}")
        >>> open(dest).read()
        '{}'
    """
    tmp = partial_name(dest)
    try:
        yield tmp
        fsync_file(tmp)
        if check is not None:
            check()
        publish(tmp, dest, synced=True, exclusive=exclusive)
    finally:
        for path in (tmp, *(tmp + suffix for suffix in leftovers)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def write_durably(dest: str, data: bytes) -> None:
    """Replace ``dest`` with ``data`` durably (:func:`durable_replace`)."""
    with durable_replace(dest) as tmp, open(tmp, "wb") as f:
        f.write(data)
