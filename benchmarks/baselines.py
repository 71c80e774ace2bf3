"""The baselines kvckpt is measured against, implemented the way their users run them.

* :class:`LockedTensorBuffer`: the in-memory replay buffer of NeMo-RL's async GRPO and most peers,
  a dict of padded tensors per group behind one lock. Its checkpoint is ``torch.save`` of that
  dict (``replay_buffer.pt``) while producers wait on the lock: the stop-the-world, exclusive-cut
  pattern. The lock is held only while ``torch.save`` serialises and writes; the fsync, rename
  and directory fsync that make the file durable happen after producers are released (generous
  to the baseline: peers that fsync at all do it under the cut).
* :func:`load_first_batch`: restore from that file (``torch.load``, optionally ``mmap=True``) and
  build the first training batch the way :meth:`kvckpt.ReplayBuffer.read_batch` lays it out.
* :class:`BareLmdb`: a bare LMDB put loop of the same encoded values kvckpt stores, one write
  transaction per group, py-lmdb's default durable flags (``sync=True, metasync=True``).
* :func:`sequential_write` and :func:`fsync_latency`: the disk's own limits.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable

import lmdb
import torch

from benchmarks.data import ROW_FIELDS, TOKEN_FIELDS
from kvckpt import durable_replace

MAP_SIZE = 64 << 30


class LockedTensorBuffer:
    """Padded tensors per group in a dict behind one lock; checkpoints stop the world.

    Producers call :meth:`commit` (a dict insert under the lock), the trainer :meth:`take`
    (pops the oldest groups). :meth:`checkpoint` holds the lock while ``torch.save`` writes the
    whole dict, so every producer and the trainer wait for it.
    """

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, torch.Tensor]] = {}
        self.lock = threading.Lock()

    def commit(self, group_id: str, group: dict[str, torch.Tensor]) -> None:
        """Insert one group (its tensors must not be shared with another entry)."""
        with self.lock:
            self.groups[group_id] = group

    def take(self, count: int) -> list[str]:
        """Remove and return the ``count`` oldest group ids (a training step's batch)."""
        with self.lock:
            gids = list(self.groups)[:count]
            for gid in gids:
                del self.groups[gid]
            return gids

    def raw_bytes(self) -> int:
        """Bytes of every tensor held."""
        with self.lock:
            return sum(t.numel() * t.element_size() for g in self.groups.values() for t in g.values())

    def checkpoint(self, path: str) -> tuple[float, float]:
        """``torch.save`` the buffer to ``path`` durably and atomically.

        Returns:
            ``(blocked, total)`` seconds: how long producers and the trainer were stopped (the
            lock was held), and the whole checkpoint including fsync and rename.
        """
        t0 = time.perf_counter()
        with durable_replace(path) as tmp:
            with self.lock:
                torch.save(self.groups, tmp)
            blocked = time.perf_counter() - t0
        return blocked, time.perf_counter() - t0


def load_first_batch(path: str, count: int, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """Restore a :class:`LockedTensorBuffer` file and build the first batch of ``count`` groups.

    The batch has the shapes of :meth:`kvckpt.ReplayBuffer.read_batch`'s padded layout: token
    fields ``[rows, longest row]`` (each group's own padding kept, the rest padded with 0), row
    fields stacked. ``weights_only=True`` keeps
    the load from running pickled code (the file is one this benchmark wrote).
    """
    groups = torch.load(path, weights_only=True, mmap=mmap)
    chosen = [groups[gid] for gid in list(groups)[:count]]
    width = max(int(g["input_lengths"].max()) for g in chosen)
    batch = {}
    for name in TOKEN_FIELDS:
        batch[name] = torch.cat([torch.nn.functional.pad(g[name], (0, width - g[name].shape[1])) for g in chosen])
    for name in ROW_FIELDS:
        batch[name] = torch.cat([g[name] for g in chosen])
    return batch


class BareLmdb:
    """One LMDB file with py-lmdb's defaults (durable), written one transaction per group."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.env = lmdb.open(path, subdir=False, map_size=MAP_SIZE)

    def put_group(self, items: Iterable[tuple[bytes, bytes]]) -> float:
        """Put one group's ``(key, value)`` pairs in one write transaction; returns its seconds."""
        t0 = time.perf_counter()
        with self.env.begin(write=True) as txn:
            for key, value in items:
                txn.put(key, value)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Close the environment."""
        self.env.close()


def sequential_write(path: str, total_bytes: int, chunk_bytes: int = 8 << 20) -> float:
    """Write ``total_bytes`` sequentially then fsync; returns MB/s (the file is removed)."""
    block = os.urandom(chunk_bytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < total_bytes:
            written += os.write(fd, block)
        os.fsync(fd)
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return written / 1e6 / elapsed


def fsync_latency(path: str, count: int) -> list[float]:
    """Seconds of each of ``count`` appends of 4 KiB followed by fsync (the file is removed)."""
    block = os.urandom(4096)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    out = []
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            os.write(fd, block)
            os.fsync(fd)
            out.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    return out
