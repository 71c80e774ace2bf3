"""Trainer blocked per checkpoint with producers committing at full rate (issue 28):

    python -m benchmarks.blocked_bench --size 1 --producers 2 --seconds 30 --json blocked.json

A buffer of ``--size`` GB of raw rows is built (one durable transaction per group), then for
``--seconds``: ``--producers`` threads admit and commit groups as fast as they can (no pacing: the
writer lock is always wanted), and the trainer thread selects a step, finishes it, and starts a
checkpoint whenever the previous one has finished copying. Blocked is what ``checkpoint()`` takes
to return (the stamp transaction, including the wait for the writer lock); the copy runs in the
background. Figure 2 measures the same under a paced load (:mod:`benchmarks.measure`).

The same run measures the floor a stamp cannot beat, under the same load: right before each
``checkpoint()`` call, the trainer thread times a bare durable LMDB write transaction of a stamp's
size (:data:`STAMP_BYTES`) in the bare LMDB baseline (:class:`benchmarks.baselines.BareLmdb`:
py-lmdb's durable defaults, as the store's) in the work directory (``bare``);
``blocked_vs_bare`` is blocked over bare at p99 and at the maximum
(0 when no checkpoint ran). Before, not after: right after ``checkpoint()`` the new copy shares the
disk, which the stamp never does (it waits for the previous copy to finish).

The machine's other users change the figure (the maximum grew 40x under another engineer's test
suite), so a loaded run brings its own load, started ``--load-head-start`` seconds before the
loaded phase and stopped after it: ``--cpu-load N`` runs N busy processes at nice 0 (a pure
Python loop each), ``--io-load N`` runs N processes each writing 1 MB blocks into its own 256 MB
file in the work directory and fsyncing every 16 MB. The load averages at the start and end of
the loaded phase are recorded with the figures. Each checkpoint's blocked time is broken down
from :attr:`kvckpt.durability.checkpoint.CheckpointResult.timings` (``breakdown``: per phase
over all checkpoints; ``worst``: the phases of the slowest ones). ``--switch-interval`` sets this
process's ``sys.setswitchinterval`` (a trainer's own choice: every system call and every LMDB put
hands the GIL to a busy producer thread, which keeps it up to one interval).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from benchmarks import baselines, data, measure
from kvckpt import ReplayBuffer

#: The phases of one checkpoint's blocked time, as CheckpointResult.timings names them.
PHASES = ("blocked", "reserve", "lock_wait", "txn", "commit", "snapshot", "start")
#: The size of the bare transaction's value: about what a checkpoint's stamp record holds.
STAMP_BYTES = 300
_CPU_LOAD = "while True: pass"
_IO_LOAD = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
block, n = os.urandom(1 << 20), 0
while True:
    os.pwrite(fd, block, (n % 256) << 20)
    n += 1
    if n % 16 == 0:
        os.fsync(fd)
"""


def start_load(cpu: int, io: int, work: str) -> list[subprocess.Popen[bytes]]:
    """Start ``cpu`` busy processes and ``io`` writing-and-fsyncing processes (see the module doc)."""
    procs = [subprocess.Popen([sys.executable, "-c", _CPU_LOAD]) for _ in range(cpu)]
    procs += [subprocess.Popen([sys.executable, "-c", _IO_LOAD, os.path.join(work, f"io-load-{i}")])
              for i in range(io)]
    return procs


def stop_load(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill the load processes this run started and reap them."""
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def bare_stamp(bare: baselines.BareLmdb) -> float:
    """Seconds one durable write transaction of :data:`STAMP_BYTES` takes in the bare LMDB baseline
    (py-lmdb's defaults, the store's durability settings): the floor of a stamp."""
    return bare.put_group([(b"stamp", bytes(STAMP_BYTES))])


def run(size_gb: float, producers: int, seconds: float, work: str, cpu_load: int = 0, io_load: int = 0,
        head_start: float = 10.0) -> dict[str, Any]:
    """Build, load and checkpoint; returns the blocked times, their breakdown and what the producers
    achieved."""
    settings = measure.Settings()
    buf = ReplayBuffer.create(os.path.join(work, "live.kv"), measure.buffer_config(settings))
    prompt = 0
    for chunk in measure.chunks(data.iter_groups(int(size_gb * measure.GB), settings.seed, settings.spec), 32):
        for lease, group in zip(buf.admit(list(range(prompt, prompt + len(chunk)))), chunk, strict=True):
            buf.commit_group(lease, data.rows_of(group))
        prompt += len(chunk)
    rng = np.random.default_rng(settings.seed + 1)
    pool = [data.rows_of(data.make_group(rng, settings.spec)) for _ in range(8)]
    lock, stop = threading.Lock(), threading.Event()
    commits: list[float] = []

    def produce() -> None:
        nonlocal prompt
        while not stop.is_set():
            with lock:
                first, prompt = prompt, prompt + 8
            for i, lease in enumerate(buf.admit(list(range(first, first + 8)))):
                t0 = time.perf_counter()
                buf.commit_group(lease, pool[i % len(pool)])
                commits.append(time.perf_counter() - t0)

    bare_env = baselines.BareLmdb(os.path.join(work, "bare.lmdb"))
    bare: list[float] = []
    load_procs = start_load(cpu_load, io_load, work)
    if load_procs:
        time.sleep(head_start)
    threads = [threading.Thread(target=produce, daemon=True) for _ in range(producers)]
    for t in threads:
        t.start()
    blocked, copies, steps = [], [], 0
    phases: list[dict[str, float]] = []
    load = [os.getloadavg()[0]]
    t_end = time.perf_counter() + seconds
    handle, n = None, 0
    while time.perf_counter() < t_end:
        buf.select(1, settings.groups_per_step)
        buf.finish_step()
        steps += 1
        if handle is None or handle.done():
            if handle is not None:
                done = handle.wait()
                copies.append({"seconds": done.timings["total"], "bytes": done.file_bytes, "how": done.how})
                phases.append({k: done.timings[k] for k in PHASES})
                os.unlink(done.path)
            bare.append(bare_stamp(bare_env))
            t0 = time.perf_counter()
            handle = buf.checkpoint(os.path.join(work, f"ckpt-{n}.kvckpt"), {"step": steps})
            blocked.append(time.perf_counter() - t0)
            n += 1
    load.append(os.getloadavg()[0])
    stop.set()
    for t in threads:
        t.join()
    stop_load(load_procs)
    if handle is not None:
        phases.append({k: handle.wait().timings[k] for k in PHASES})
    buf.close()
    bare_env.close()
    blocked_summary, bare_summary = measure.summary(blocked), measure.summary(bare)
    worst = sorted(phases, key=lambda p: p["blocked"], reverse=True)[:5]
    return {"size_gb": size_gb, "producers": producers, "seconds": seconds, "cpu_load": cpu_load,
            "io_load": io_load, "switch_interval": sys.getswitchinterval(), "blocked": blocked_summary,
            "blocked_all": blocked, "bare": bare_summary, "bare_all": bare,
            "blocked_vs_bare": {k: blocked_summary[k] / bare_summary[k] if bare else 0.0 for k in ("p99", "max")},
            "breakdown": {k: measure.summary([p[k] for p in phases]) for k in PHASES}, "worst": worst,
            "commits": measure.summary(commits), "commits_per_s": len(commits) / seconds,
            "trainer_steps": steps, "copies": copies, "loadavg": load}


def main() -> None:
    """Run one size and print (and optionally save) the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=1.0, help="GB of raw rows (default 1)")
    parser.add_argument("--producers", type=int, default=2, help="producer threads (default 2)")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the loaded phase (default 30)")
    parser.add_argument("--cpu-load", type=int, default=0, help="busy processes at nice 0 (default 0)")
    parser.add_argument("--io-load", type=int, default=0, help="processes writing and fsyncing a file (default 0)")
    parser.add_argument("--load-head-start", type=float, default=10.0,
                        help="seconds the load runs before the loaded phase (default 10)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for this process, in seconds (default: Python's, 0.005)")
    parser.add_argument("--work", default=None, help="directory on the disk to measure (default /var/tmp)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    work = tempfile.mkdtemp(prefix="kvckpt-blocked-", dir=args.work or "/var/tmp")
    try:
        result = run(args.size, args.producers, args.seconds, work, args.cpu_load, args.io_load,
                     args.load_head_start)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    b, c = result["blocked"], result["commits"]
    copy = measure.summary([x["seconds"] for x in result["copies"]])
    print(f"{args.size:g} GB, cpu load {args.cpu_load}, io load {args.io_load}, {args.producers} producers at "
          f"full rate ({result['commits_per_s']:.0f} commits/s, commit p50 {c['p50'] * 1e3:.1f} ms p99 "
          f"{c['p99'] * 1e3:.1f} ms), load {result['loadavg']}: {b['n']} checkpoints, blocked p50 "
          f"{b['p50'] * 1e3:.2f} ms p99 {b['p99'] * 1e3:.2f} ms max {b['max'] * 1e3:.2f} ms; copy median "
          f"{copy['p50']:.2f} s")
    bare, ratio = result["bare"], result["blocked_vs_bare"]
    print(f"bare {STAMP_BYTES}-byte durable transaction before each checkpoint: p99 {bare['p99'] * 1e3:.2f} ms max "
          f"{bare['max'] * 1e3:.2f} ms; blocked / bare: p99 {ratio['p99']:.2f}x max {ratio['max']:.2f}x")
    print("phase       p50 ms   p99 ms   max ms")
    for k, v in result["breakdown"].items():
        print(f"{k:<10} {v['p50'] * 1e3:7.2f}  {v['p99'] * 1e3:7.2f}  {v['max'] * 1e3:7.2f}")
    print("worst:", [{k: round(v * 1e3, 1) for k, v in w.items()} for w in result["worst"]])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
