"""Trainer blocked per checkpoint with producers committing at full rate (issue 28):

    python -m benchmarks.blocked_bench --size 1 --producers 2 --seconds 30 --json blocked.json

A buffer of ``--size`` GB of raw rows is built (one durable transaction per group), then for
``--seconds``: ``--producers`` threads admit and commit groups as fast as they can (no pacing: the
writer lock is always wanted), and the trainer thread selects a step, finishes it, and starts a
checkpoint whenever the previous one has finished copying. Blocked is what ``checkpoint()`` takes
to return (the stamp transaction, including the wait for the writer lock); the copy runs in the
background. Figure 2 measures the same under a paced load (:mod:`benchmarks.measure`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Any

import numpy as np

from benchmarks import data, measure
from kvckpt import ReplayBuffer


def run(size_gb: float, producers: int, seconds: float, work: str) -> dict[str, Any]:
    """Build, load and checkpoint; returns the blocked times and what the producers achieved."""
    settings = measure.Settings()
    buf = ReplayBuffer.create(os.path.join(work, "live.kv"), measure.buffer_config(settings))
    prompt = 0
    for chunk in measure._chunks(data.iter_groups(int(size_gb * measure.GB), settings.seed, settings.spec), 32):
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

    threads = [threading.Thread(target=produce, daemon=True) for _ in range(producers)]
    for t in threads:
        t.start()
    blocked, copies, steps = [], [], 0
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
                os.unlink(done.path)
            t0 = time.perf_counter()
            handle = buf.checkpoint(os.path.join(work, f"ckpt-{n}.kvckpt"), {"step": steps})
            blocked.append(time.perf_counter() - t0)
            n += 1
    stop.set()
    for t in threads:
        t.join()
    if handle is not None:
        handle.wait()
    load.append(os.getloadavg()[0])
    buf.close()
    return {"size_gb": size_gb, "producers": producers, "seconds": seconds, "blocked": measure.summary(blocked),
            "blocked_all": blocked, "commits": measure.summary(commits), "commits_per_s": len(commits) / seconds,
            "trainer_steps": steps, "copies": copies, "loadavg": load}


def main() -> None:
    """Run one size and print (and optionally save) the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=1.0, help="GB of raw rows (default 1)")
    parser.add_argument("--producers", type=int, default=2, help="producer threads (default 2)")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the loaded phase (default 30)")
    parser.add_argument("--work", default=None, help="directory on the disk to measure (default /var/tmp)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="kvckpt-blocked-", dir=args.work or "/var/tmp")
    try:
        result = run(args.size, args.producers, args.seconds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    b, c = result["blocked"], result["commits"]
    print(f"{args.size:g} GB, {args.producers} producers at full rate ({result['commits_per_s']:.0f} commits/s, "
          f"commit p50 {c['p50'] * 1e3:.1f} ms p99 {c['p99'] * 1e3:.1f} ms), load {result['loadavg']}: "
          f"{b['n']} checkpoints, blocked p50 {b['p50'] * 1e3:.2f} ms p99 {b['p99'] * 1e3:.2f} ms "
          f"max {b['max'] * 1e3:.2f} ms; copies {[round(x['seconds'], 2) for x in result['copies']]} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
