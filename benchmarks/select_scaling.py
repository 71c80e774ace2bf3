"""Select cost against buffer size: 1k, 10k and 100k ready groups (issue 3's flatness check).

Builds each buffer through the real API on tmpfs (``/dev/shm``, so fsync costs nothing and only
the selection's own CPU shows), then claims 8 groups per ``select`` and reports the median CPU
time of the calling thread. An O(buffer) scan would grow 100x from the smallest to the largest.

Run: ``python -m benchmarks.select_scaling [--sizes 1000,10000,100000] [--samplers ...] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import numpy as np

from kvckpt import BufferConfig, ReplayBuffer

ROW = {"input_ids": np.arange(16, dtype=np.int64)}
SELECTS = 7
PER_SELECT = 8


def measure(directory: str, sampler: str, size: int) -> tuple[float, float]:
    """(median select CPU ms, build seconds) for one sampler at one buffer size."""
    window = size // 64 + 2 if sampler == "in_order" else 2
    key = "max_lookahead_versions" if sampler == "in_order" else "max_staleness_versions"
    path = os.path.join(directory, f"{sampler}-{size}.kv")
    buf = ReplayBuffer.create(path, BufferConfig(
        group_size=1, schema={"input_ids": ("int64", "token")}, sampler={"name": sampler, key: window},
        max_buffered_rollouts=max(size + 64, PER_SELECT * (window + 1)), groups_per_step=PER_SELECT))
    try:
        start = time.perf_counter()
        while buf.state()["ready"] < size:
            for lease in buf.admit([0] * 64, weight_version=0):
                buf.commit_group(lease, [ROW])
        build = time.perf_counter() - start
        cpu = []
        for _ in range(SELECTS):
            before = time.thread_time()
            chosen = buf.select(PER_SELECT, PER_SELECT)
            cpu.append(time.thread_time() - before)
            assert len(chosen) == PER_SELECT
        return float(np.median(cpu)) * 1e3, build
    finally:
        buf.close()
        os.unlink(path)


def main() -> None:
    """Print a Markdown table of select CPU per sampler and size, with the max/min ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--samplers", default="in_order,weight_fifo,windowed,ready_first")
    parser.add_argument("--dir", default="/dev/shm/kvckpt-sel")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    shutil.rmtree(args.dir, ignore_errors=True)  # leftovers of an interrupted run
    os.makedirs(args.dir)
    print("| sampler | " + " | ".join(f"{s:,} groups" for s in sizes) + " | max / min |")
    print("| --- |" + " ---: |" * (len(sizes) + 1))
    try:
        for sampler in args.samplers.split(","):
            cpu = [measure(args.dir, sampler, size)[0] for size in sizes]
            cells = " | ".join(f"{c:.2f} ms" for c in cpu)
            print(f"| {sampler} | {cells} | {max(cpu) / min(cpu):.2f}x |", flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
