"""The measurements behind every benchmark figure, kvckpt and its baselines side by side.

Each function returns plain JSON-able dicts (seconds and bytes, no formatting);
:mod:`benchmarks.figures` turns them into tables and :mod:`benchmarks.plots` into PNGs.

* :func:`measure_size` builds one buffer size (kvckpt store, bare LMDB file and the in-memory
  baseline from the same groups, interleaved so they share the machine's noise) and measures
  ingest (figure 4), bytes on disk (5), checkpoints under a steady producer/trainer load (1, 2)
  and restore to the first batch in a fresh process (3).

The module is long (about 540 lines) because figures 1 to 5 share one built store per size: the
ingest, the paced loads of both sides and the restore children all work on it, and splitting
them would pass that store and its baselines between modules.
Figure 6 (select latency) is :mod:`benchmarks.measure_select`, figure 7 (groups lost per crash)
:mod:`benchmarks.measure_crashes`; both take this module's :class:`Settings`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from benchmarks import baselines, data
from kvckpt import BufferConfig, ReplayBuffer, codec, restore
from kvckpt.tooling import keys

GB = 1e9
CHUNK = 32  # groups per admission while ingesting


@dataclass
class Settings:
    """Knobs of one benchmark run (the defaults are the full run; :meth:`quick` is CI's)."""

    sizes_gb: tuple[float, ...] = (0.25, 1.0, 4.0)
    spec: data.RolloutSpec = field(default_factory=data.RolloutSpec)
    level: int = codec.DEFAULT_LEVEL
    seed: int = 0
    threads: int = 2  # producer threads of the multi-producer ingest
    rate: float = 20.0  # groups/s the producer offers during the latency phases (at most)
    groups_per_step: int = 8
    phase_seconds: float = 15.0
    warmup_seconds: float = 5.0
    min_checkpoints: int = 2
    restore_repeats: int = 3
    restore_fresh_process: bool = True
    cold: str = "fadvise"  # or "drop_caches"
    select_counts: tuple[int, ...] = (1_000, 10_000, 100_000)
    select_repeats: int = 30
    crash_steps_per_checkpoint: int = 4
    crash_groups_per_step: int = 4
    crash_points: tuple[str, ...] = ("after-checkpoint", "mid-interval", "before-checkpoint", "during-copy")
    fsync_samples: int = 2000
    small_txns: int = 200  # one 300-byte put per durable transaction: the floor under kvckpt's stamp

    @classmethod
    def quick(cls) -> Settings:
        """A few seconds per figure: proves the benchmarks run, measures nothing meaningful."""
        return cls(sizes_gb=(0.02,), spec=data.RolloutSpec(group_size=8, response_median=300),
                   rate=40.0, phase_seconds=0.5, warmup_seconds=0.2, min_checkpoints=1, restore_repeats=1,
                   restore_fresh_process=False,
                   select_counts=(300, 1_000), select_repeats=5, crash_steps_per_checkpoint=2,
                   crash_groups_per_step=2, crash_points=("mid-interval", "during-copy"), fsync_samples=100,
                   small_txns=20)


def summary(values: list[float]) -> dict[str, float]:
    """Count, p50, p99, max and mean of a list of seconds (zeros when empty)."""
    if not values:
        return {"n": 0, "p50": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0}
    arr = np.asarray(values)
    return {"n": len(values), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99)),
            "max": float(arr.max()), "mean": float(arr.mean())}


def child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code args...`` from the repository root (a fresh interpreter)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=root)


def buffer_config(settings: Settings) -> BufferConfig:
    """The realistic buffer: ungated ``windowed`` sampler with a window wide enough that nothing
    is evicted or held back, and capacity for every group a run commits."""
    return BufferConfig(group_size=settings.spec.group_size, schema=data.SCHEMA,
                        sampler={"name": "windowed", "max_staleness_versions": 1 << 20},
                        max_buffered_rollouts=1 << 24, groups_per_step=settings.groups_per_step,
                        compression_level=settings.level)


def chunks(groups: Iterator[data.Group], size: int) -> Iterator[list[data.Group]]:
    chunk: list[data.Group] = []
    for group in groups:
        chunk.append(group)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encoded(gid: str, group: data.Group, level: int) -> list[tuple[bytes, bytes]]:
    """The row keys and values kvckpt stores for ``group`` (same codec call, same meta)."""
    return [(keys.row_key(gid, i), codec.encode(data.SCHEMA.validate(row, gid), {"group_id": gid, "index": i},
                                                level=level))
            for i, row in enumerate(data.rows_of(group))]


# -- figure 4 (ingest) and the shared setup ------------------------------------------------------
@dataclass
class Built:
    """One buffer size, built: the live kvckpt buffer and the in-memory baseline, same groups."""

    directory: str
    buffer: ReplayBuffer
    baseline: baselines.LockedTensorBuffer
    pool: list[data.Group]  # fresh groups producers commit during the latency phases
    next_prompt: int


def ingest(size_gb: float, directory: str, settings: Settings) -> tuple[Built, dict[str, Any]]:
    """Fill a kvckpt buffer, a bare LMDB file and the in-memory baseline with the same groups.

    Per chunk of :data:`CHUNK` groups: kvckpt admits them (one transaction) and commits each
    (``commit_group``: validation, encoding, one durable transaction); the same rows are encoded
    with the same codec call (timed apart) and put in the bare LMDB file one transaction per
    group; the padded tensors go into the baseline dict. Wall time and this thread's CPU time
    are kept for each part (CPU time is what a busy shared machine distorts least). Then a second kvckpt store is filled
    from ``settings.threads`` producer threads, and the disk's own limits are measured.
    """
    os.makedirs(directory, exist_ok=True)
    config = buffer_config(settings)
    buf = ReplayBuffer.create(os.path.join(directory, "live.kv"), config)
    bare = baselines.BareLmdb(os.path.join(directory, "bare.lmdb"))
    base = baselines.LockedTensorBuffer()
    out: dict[str, Any] = {"groups": 0, "raw_bytes": 0, "unpadded_bytes": 0, "response_tokens": 0,
                           "kvckpt_seconds": 0.0, "encode_seconds": 0.0, "bare_seconds": 0.0,
                           "kvckpt_cpu": 0.0, "encode_cpu": 0.0, "bare_cpu": 0.0}
    commit_lat, bare_lat = [], []
    prompt = 0
    groups = data.iter_groups(int(size_gb * GB), settings.seed, settings.spec)
    for chunk in chunks(groups, CHUNK):
        t0, c0 = time.perf_counter(), time.thread_time()
        leases = buf.admit(list(range(prompt, prompt + len(chunk))))
        for lease, group in zip(leases, chunk, strict=True):
            t1 = time.perf_counter()
            buf.commit_group(lease, data.rows_of(group))
            commit_lat.append(time.perf_counter() - t1)
        out["kvckpt_seconds"] += time.perf_counter() - t0
        out["kvckpt_cpu"] += time.thread_time() - c0
        for lease, group in zip(leases, chunk, strict=True):
            t1, c1 = time.perf_counter(), time.thread_time()
            items = _encoded(lease.group_id, group, settings.level)
            out["encode_seconds"] += time.perf_counter() - t1
            c2 = time.thread_time()
            out["encode_cpu"] += c2 - c1
            bare_lat.append(bare.put_group(items))
            out["bare_cpu"] += time.thread_time() - c2
            base.commit(lease.group_id, data.as_tensors(group))
            out["raw_bytes"] += data.raw_bytes(group)
            out["unpadded_bytes"] += data.unpadded_bytes(group)
            out["response_tokens"] += data.response_tokens(group)
        prompt += len(chunk)
    out["groups"] = prompt
    out["bare_seconds"] = sum(bare_lat)
    out["kvckpt_commit"] = summary(commit_lat)
    out["bare_commit"] = summary(bare_lat)
    out["kvckpt_file_bytes"] = buf.store.file_size()
    out["kvckpt_stored_bytes"] = buf.stats()["stored_bytes"]
    out["bare_small_txn"] = summary([bare.put_group([(b"stamp", bytes(300))]) for _ in range(settings.small_txns)])
    bare.close()
    out["bare_file_bytes"] = os.path.getsize(bare.path)
    os.unlink(bare.path)
    os.unlink(bare.path + "-lock")
    held = [{k: v.numpy() for k, v in g.items()} for g in base.groups.values()]
    out.update(_ingest_threads(directory, config, held, settings.threads))
    out["disk_seq_write_MBps"] = baselines.sequential_write(os.path.join(directory, "seq.bin"),
                                                            min(out["raw_bytes"], 1 << 30))
    out["disk_fsync_4k"] = summary(baselines.fsync_latency(os.path.join(directory, "fsync.bin"),
                                                           settings.fsync_samples))
    settle()
    pool_rng = np.random.default_rng(settings.seed + 1)
    pool = [data.make_group(pool_rng, settings.spec) for _ in range(16)]
    return Built(directory, buf, base, pool, prompt), out


def _ingest_threads(directory: str, config: BufferConfig, groups: list[data.Group], threads: int) -> dict[str, Any]:
    """The same groups committed to a fresh store by ``threads`` producers (8-prompt admissions)."""
    path = os.path.join(directory, "threads.kv")
    buf = ReplayBuffer.create(path, config)
    lock = threading.Lock()
    cursor = iter(enumerate(groups))

    def producer() -> None:
        while True:
            with lock:
                batch = [item for _, item in zip(range(8), cursor, strict=False)]
            if not batch:
                return
            leases = buf.admit([i for i, _ in batch])
            for lease, (_, group) in zip(leases, batch, strict=True):
                buf.commit_group(lease, data.rows_of(group))

    workers = [threading.Thread(target=producer) for _ in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    committed = buf.stats()["committed"]
    buf.close()
    size = os.path.getsize(path)
    os.unlink(path)
    os.unlink(path + "-lock")
    return {"threads": threads, "threads_seconds": elapsed, "threads_groups": committed, "threads_file_bytes": size}


# -- cache control -------------------------------------------------------------------------------
def evict_cache(paths: list[str], how: str) -> None:
    """Drop the page cache of ``paths`` (``fadvise``) or of the whole machine (``drop_caches``)."""
    if how == "drop_caches":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- figures 1 and 2 (checkpoints under load) ----------------------------------------------------
class _Paced(threading.Thread):
    """Calls ``fn(i)`` at ``rate`` per second until stopped; records (scheduled, end) of each call.

    Latency is measured from the *scheduled* time, so a call delayed by a stalled predecessor
    counts its wait (no coordinated omission). ``between(i)`` runs after call ``i`` (untimed
    housekeeping such as admitting the next prompts).
    """

    def __init__(self, fn: Callable[[int], Any], rate: float, between: Callable[[int], Any] | None = None) -> None:
        super().__init__(daemon=True)
        self.fn, self.period, self.between = fn, 1.0 / rate, between
        self.stop = threading.Event()
        self.records: list[tuple[float, float]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            due = time.perf_counter()
            i = 0
            while not self.stop.is_set():
                delay = due - time.perf_counter()
                if delay > 0 and self.stop.wait(delay):
                    return
                self.fn(i)
                self.records.append((due, time.perf_counter()))
                if self.between is not None:
                    self.between(i)
                i += 1
                due += self.period
        except BaseException as exc:
            self.error = exc

    def finish(self) -> list[tuple[float, float]]:
        self.stop.set()
        self.join()
        if self.error is not None:
            raise self.error
        return self.records


def _latencies(records: list[tuple[float, float]], windows: list[tuple[float, float]] | None) -> list[float]:
    """Latencies of calls overlapping any window (all calls when ``windows`` is None)."""
    return [end - due for due, end in records
            if windows is None or any(due < w_end and end > w_start for w_start, w_end in windows)]


class _KvckptLoad:
    """Producers committing and a trainer consuming at the same group rate, on the live buffer."""

    def __init__(self, built: Built, settings: Settings) -> None:
        self.built, self.settings = built, settings
        self.leases: list[Any] = []
        self.lock = threading.Lock()

    def _lease(self) -> Any:
        with self.lock:
            if not self.leases:
                n = self.built.next_prompt
                self.leases = self.built.buffer.admit(list(range(n, n + self.settings.groups_per_step)))
                self.built.next_prompt = n + self.settings.groups_per_step
            return self.leases.pop(0)

    def start(self) -> list[_Paced]:
        buf, pool, gps = self.built.buffer, self.built.pool, self.settings.groups_per_step
        pending = [self._lease()]

        def commit(i: int) -> None:
            buf.commit_group(pending.pop(), data.rows_of(pool[i % len(pool)]))

        def step(_: int) -> None:
            buf.select(1, gps)
            buf.finish_step()

        threads = [_Paced(commit, self.settings.rate, lambda _: pending.append(self._lease())),
                   _Paced(step, self.settings.rate / gps)]
        for t in threads:
            t.start()
        return threads


class _BaselineLoad:
    """The same load on the in-memory baseline: dict inserts and pops under its lock."""

    def __init__(self, built: Built, settings: Settings) -> None:
        self.built, self.settings = built, settings

    def start(self) -> list[_Paced]:
        base, pool, gps = self.built.baseline, self.built.pool, self.settings.groups_per_step
        fresh = [data.as_tensors(pool[0], copy=True)]

        def commit(i: int) -> None:
            base.commit(f"load-{i}", fresh.pop())

        def refill(i: int) -> None:
            fresh.append(data.as_tensors(pool[(i + 1) % len(pool)], copy=True))

        threads = [_Paced(commit, self.settings.rate, refill),
                   _Paced(lambda _: base.take(gps), self.settings.rate / gps)]
        for t in threads:
            t.start()
        return threads


#: settle() waits until this many 4 KiB write+fsync probes in a row each take under QUIET_FSYNC.
QUIET_PROBES, QUIET_FSYNC, QUIET_MAX_SECONDS = 20, 0.010, 90.0


def settle(paths: list[str] = (), directory: str = "/var/tmp") -> float:
    """Delete ``paths``, flush the page cache to disk, then wait until the disk is quiet, so that
    one phase's writes and deletions (a 4 GB unlink is seconds of TRIMs on a ``discard`` mount,
    during which every fsync waits) do not land in the next phase's fsyncs. Quiet: QUIET_PROBES
    write+fsync probes in a row under QUIET_FSYNC each (at most QUIET_MAX_SECONDS). Returns the
    seconds waited."""
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)
    os.sync()
    t0 = time.perf_counter()
    # one probe per process: two benchmark runs on one machine must not delete each other's probe
    probe = os.path.join(os.path.dirname(paths[0]) if paths else directory, f".settle-probe-{os.getpid()}")
    quiet = 0
    while quiet < QUIET_PROBES and time.perf_counter() - t0 < QUIET_MAX_SECONDS:
        quiet = quiet + 1 if baselines.fsync_latency(probe, 1)[0] < QUIET_FSYNC else 0
        time.sleep(0.05)
    return time.perf_counter() - t0


def _phase(load: Any, checkpoint: Callable[[int], dict[str, Any]] | None, settings: Settings) -> dict[str, Any]:
    """Run ``load`` for ``phase_seconds`` with back-to-back checkpoints (or none); checkpoint files
    are deleted only after the phase, then the disk is let settle."""
    settle()
    threads = load.start()
    t0 = time.perf_counter()
    windows, ckpts = [], []
    if checkpoint is None:
        time.sleep(settings.phase_seconds)
    else:
        while True:
            start = time.perf_counter()
            ckpts.append(checkpoint(len(ckpts)))
            windows.append((start, time.perf_counter()))
            if time.perf_counter() - t0 >= settings.phase_seconds and len(ckpts) >= settings.min_checkpoints:
                break
    commits, steps = (t.finish() for t in threads)
    elapsed = time.perf_counter() - t0
    settle([c.pop("path") for c in ckpts])
    return _phase_result(_latencies(commits, windows or None), _latencies(commits, None),
                         _latencies(steps, windows or None), ckpts, elapsed)


def _phase_result(commit: list[float], commit_all: list[float], step: list[float], ckpts: list[dict[str, Any]],
                  seconds: float) -> dict[str, Any]:
    return {"commit": summary(commit), "commit_all": summary(commit_all), "trainer_step": summary(step),
            "checkpoints": ckpts, "seconds": seconds, "raw": {"commit": commit, "commit_all": commit_all, "step": step}}


def _pooled(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Phases without checkpoints pooled into one (their latencies together)."""
    raw = [p.pop("raw") for p in phases]
    return _phase_result([v for r in raw for v in r["commit"]], [v for r in raw for v in r["commit_all"]],
                         [v for r in raw for v in r["step"]], [], sum(p["seconds"] for p in phases))


def checkpoints_under_load(built: Built, settings: Settings) -> dict[str, Any]:
    """Figures 1 and 2: producer commit latency and trainer-blocked time while checkpoints run.

    For each system: a warm-up (the first seconds of load after ingest show one-off commit
    outliers, kept in the results but not compared), a phase without checkpoints, a phase with
    checkpoints back to back, and a second phase without (pooled with the first, so that noise
    drifting over the run lands on both sides of the comparison), under the same paced load
    (``rate`` groups/s committed by a producer, the same consumed by a trainer in steps of
    ``groups_per_step``). kvckpt's blocked
    time is ``checkpoint()``'s return (the stamp); the baseline's is the time ``torch.save`` holds
    the lock.
    """
    d = built.directory

    def kv_checkpoint(i: int) -> dict[str, Any]:
        path = os.path.join(d, f"load-{i}.kvckpt")
        t0 = time.perf_counter()
        handle = built.buffer.checkpoint(path, {"step": i})
        blocked = time.perf_counter() - t0
        result = handle.wait()
        return {"blocked": blocked, "total": time.perf_counter() - t0, "file_bytes": result.file_bytes, "path": path}

    def base_checkpoint(i: int) -> dict[str, Any]:
        path = os.path.join(d, f"load-{i}.pt")
        blocked, total = built.baseline.checkpoint(path)
        return {"blocked": blocked, "total": total, "file_bytes": os.path.getsize(path), "path": path}

    warm = replace(settings, phase_seconds=settings.warmup_seconds)
    out = {}
    for name, load, checkpoint in (("kvckpt", _KvckptLoad(built, settings), kv_checkpoint),
                                   ("baseline", _BaselineLoad(built, settings), base_checkpoint)):
        warmup, before = _phase(load, None, warm), _phase(load, None, settings)
        ckpt = _phase(load, checkpoint, settings)
        idle = _pooled([before, _phase(load, None, settings)])
        for phase in (warmup, ckpt, idle):
            phase.pop("raw")
        out[name] = {"warmup": warmup, "idle": idle, "ckpt": ckpt}
    return out


# -- figure 3 (restore to the first batch) -------------------------------------------------------
RESTORE_MODES = ("kvckpt", "kvckpt_trusted", "kvckpt_live", "torch", "torch_mmap")


def restore_child(jobs: str) -> None:
    """Runs in a fresh process (imports done). For each job ``[mode, source, live, count, cold]``
    of the JSON list ``jobs``: drop the source's page cache, restore, build the first batch of
    ``count`` groups, print one JSON line of timings. ``kvckpt_live`` is the crash path instead:
    open the live store ``source`` in place and ``recover()`` it (no file is copied)."""
    for mode, source, live, count, cold in json.loads(jobs):
        for path in (live, live + "-lock"):
            if os.path.exists(path):
                os.unlink(path)
        evict_cache([source], cold)
        t0 = time.perf_counter()
        if mode == "kvckpt_live":
            buf = ReplayBuffer.open(source)
            plan = buf.recover()
            t1 = time.perf_counter()
            batch = buf.read_batch(buf.select(1, count))
            rows = int(batch.lengths.numel())
            extra = {"restore": t1 - t0, **plan.timings}
            buf.close()
        elif mode in ("kvckpt", "kvckpt_trusted"):
            buf, plan = restore(source, live, overwrite=True, trusted=mode == "kvckpt_trusted")
            t1 = time.perf_counter()
            batch = buf.read_batch(buf.select(1, count))
            rows = int(batch.lengths.numel())
            extra = {"restore": t1 - t0, **plan.timings}
            buf.close()
        else:
            batch = baselines.load_first_batch(source, count, mmap=mode == "torch_mmap")
            rows = int(batch["input_ids"].shape[0])
            extra = {}
        print(json.dumps({"seconds": time.perf_counter() - t0, "mode": mode, "rows": rows, **extra}), flush=True)


def _run_restores(jobs: list[list[Any]]) -> list[dict[str, Any]]:
    proc = child("import sys; from benchmarks.measure import restore_child; restore_child(sys.argv[1])",
                  json.dumps(jobs))
    if proc.returncode != 0:
        raise RuntimeError(f"restore child failed: {proc.stderr[-2000:]}")
    return [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(jobs):]]


def restore_first_batch(ckpt: str, pt: str, directory: str, settings: Settings) -> dict[str, Any]:
    """Figure 3: restore start -> first training batch, page cache of the file dropped first;
    kvckpt (``restore`` + ``select`` + ``read_batch``; default, and ``trusted=True`` for a file of
    known provenance; and the crash path, live-store ``recover()`` of the same state in place) vs
    ``torch.load`` of the same rows (plain and ``mmap=True``) + building the same batch. Each run
    is a fresh process (imports excluded from the time) unless ``settings.restore_fresh_process``
    is off (quick mode: one process for all); repeats alternate modes."""
    live = os.path.join(directory, "restored.kv")
    crashed = os.path.join(directory, "crashed-live.kv")  # the live store a crashed trainer left
    restore(ckpt, crashed, trusted=True)[0].close()
    sources = {"kvckpt": ckpt, "kvckpt_trusted": ckpt, "kvckpt_live": crashed, "torch": pt, "torch_mmap": pt}
    jobs = [[mode, sources[mode], live, settings.groups_per_step, settings.cold]
            for _ in range(settings.restore_repeats) for mode in RESTORE_MODES]
    if settings.restore_fresh_process:
        done = [run for job in jobs for run in _run_restores([job])]
    else:
        done = _run_restores(jobs)
    runs = {mode: [r for r in done if r["mode"] == mode] for mode in RESTORE_MODES}
    return {mode: {"seconds": summary([r["seconds"] for r in rs]), "rows": rs[0]["rows"],
                   "breakdown": {k: float(np.median([r[k] for r in rs])) for k in rs[0]
                                 if k not in ("seconds", "rows", "mode")}}
            for mode, rs in runs.items()}


def measure_size(size_gb: float, work: str, settings: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    """Figures 1-5 at one buffer size (``size_gb`` GB of raw padded rows)."""
    directory = os.path.join(work, f"size-{size_gb:g}")
    t0 = time.perf_counter()
    built, ingested = ingest(size_gb, directory, settings)
    log(f"  ingest {ingested['groups']} groups, {ingested['raw_bytes'] / GB:.2f} GB raw "
        f"({time.perf_counter() - t0:.0f} s)")
    try:
        ckpt, pt = os.path.join(directory, "first.kvckpt"), os.path.join(directory, "first.pt")
        t1 = time.perf_counter()
        result = built.buffer.checkpoint(ckpt, {"step": 0}).wait()
        kv_idle = {"blocked": result.timings["stamp"], "total": time.perf_counter() - t1,
                   "file_bytes": result.file_bytes, "timings": result.timings}
        blocked, total = built.baseline.checkpoint(pt)
        base_idle = {"blocked": blocked, "total": total, "file_bytes": os.path.getsize(pt)}
        restored = restore_first_batch(ckpt, pt, directory, settings)
        log(f"  restore kvckpt {restored['kvckpt']['seconds']['p50']:.3f} s, "
            f"torch.load {restored['torch']['seconds']['p50']:.3f} s")
        settle([pt, ckpt])
        rate = min(settings.rate, 0.25 * ingested["groups"] / ingested["kvckpt_seconds"])
        loaded = checkpoints_under_load(built, replace(settings, rate=rate))
        loaded["rate"] = rate
        log(f"  load phases done ({time.perf_counter() - t0:.0f} s)")
        return {"size_gb": size_gb, "ingest": ingested, "restore": restored, "load": loaded,
                "checkpoint_no_load": {"kvckpt": kv_idle, "baseline": base_idle}}
    finally:
        built.buffer.close()
        shutil.rmtree(directory, ignore_errors=True)
        settle()
