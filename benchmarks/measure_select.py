"""Figure 6: ``select`` latency against the number of buffered groups, per sampler, on disk and
on tmpfs (:func:`measure_select`)."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks import data
from benchmarks.measure import Settings, summary
from kvckpt import BufferConfig, ReplayBuffer

SAMPLERS = ("in_order", "weight_fifo", "windowed", "ready_first")
SELECT_BATCH = 8
WEIGHTS = 8


def _select_store(path: str, count: int) -> dict[str, Any]:
    """``count`` ready groups of 2 tiny rows over 8 weight versions, trainer at version 7.

    Built under ``in_order`` (about 100 admissions, one target step each, at least 8 prompts
    each) with every window wide enough to hold them all; the other samplers reuse the file via
    ``recover(sampler=...)``.
    """
    batch = max(SELECT_BATCH, count // 100)
    admits = -(-count // batch)
    config = BufferConfig(group_size=2, schema=data.TINY_SCHEMA,
                          sampler={"name": "in_order", "max_lookahead_versions": admits + 1},
                          max_buffered_rollouts=(admits + 2) * batch, groups_per_step=batch)
    t0 = time.perf_counter()
    with ReplayBuffer.create(path, config) as buf:
        done = 0
        for b in range(admits):
            n = min(batch, count - done)
            leases = buf.admit(list(range(done, done + n)), weight_version=b * WEIGHTS // admits)
            for lease in leases:
                buf.commit_group(lease, data.tiny_rows(2, lease.prompt_idx))
            done += n
        for _ in range(WEIGHTS - 1):
            buf.finish_step()
    return {"groups": count, "build_seconds": time.perf_counter() - t0, "admits": admits, "admit_batch": batch,
            "file_bytes": os.path.getsize(path)}


def _sampler_config(name: str, window: int) -> dict[str, Any]:
    key = "max_lookahead_versions" if name == "in_order" else "max_staleness_versions"
    return {"name": name, key: window}


def _scratch_dir(work: str) -> tuple[str, str]:
    """A directory on tmpfs (``/dev/shm``, where fsync costs nothing) if there is one, else under
    ``work``; and the kind of filesystem it is on."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return tempfile.mkdtemp(prefix="kvckpt-bench-", dir="/dev/shm"), "tmpfs"
    return tempfile.mkdtemp(prefix="select-", dir=work), "disk"


def measure_select(work: str, settings: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    """Figure 6: ``select`` latency (claim up to 8 groups, one durable transaction) per sampler at
    each buffered-group count; ``finish_step`` between selects (untimed) moves the step on.

    Stores are built once per count (on tmpfs when available: one fsync per commit would make
    100,000 commits take minutes on a busy disk), then copied, switched to each sampler with
    ``recover(sampler=...)`` and measured in two places: the work directory's disk (what a trainer
    sees, fsync included) and tmpfs (the CPU cost alone, where an index scan would show; this
    thread's CPU time is kept next to wall time). For one
    sampler every count and place is open at once and the selects go round-robin across them,
    so the machine's noise falls on all of them alike.
    """
    scratch, scratch_kind = _scratch_dir(work)
    places = {"disk": tempfile.mkdtemp(prefix="select-", dir=work)}
    if scratch_kind == "tmpfs":
        places["tmpfs"] = scratch
    out: dict[str, Any] = {"stores": {}, "build_on": scratch_kind,
                           "latency": {place: {name: {} for name in SAMPLERS} for place in places}}
    try:
        bases = {}
        for count in settings.select_counts:
            bases[count] = os.path.join(scratch, f"base-{count}.kv")
            out["stores"][str(count)] = _select_store(bases[count], count)
            log(f"  select store of {count} groups built in {out['stores'][str(count)]['build_seconds']:.1f} s "
                f"on {scratch_kind}")
        for name in SAMPLERS:
            cells = list(itertools.product(places.items(), settings.select_counts))
            buffers = []
            for (_, directory), count in cells:
                path = os.path.join(directory, f"{name}-{count}.kv")
                shutil.copyfile(bases[count], path)
                buffers.append(ReplayBuffer.open(path))
                buffers[-1].recover(sampler=_sampler_config(name, out["stores"][str(count)]["admits"] + 1))
            lat: list[list[float]] = [[] for _ in cells]
            cpu: list[list[float]] = [[] for _ in cells]
            sizes: list[list[int]] = [[] for _ in cells]
            for _ in range(settings.select_repeats):
                for i, buf in enumerate(buffers):
                    t0, c0 = time.perf_counter(), time.thread_time()
                    sel = buf.select(1, SELECT_BATCH)
                    lat[i].append(time.perf_counter() - t0)
                    cpu[i].append(time.thread_time() - c0)
                    sizes[i].append(len(sel))
                    buf.finish_step()
            for i, ((place, _), count) in enumerate(cells):
                out["latency"][place][name][str(count)] = {**summary(lat[i]), "cpu": summary(cpu[i]),
                                                           "selected": sizes[i]}
                path = buffers[i].path
                buffers[i].close()
                for p in (path, path + "-lock"):
                    os.unlink(p)
    finally:
        for directory in {scratch, *places.values()}:
            shutil.rmtree(directory, ignore_errors=True)
    return out
