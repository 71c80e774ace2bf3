"""Measure the command line on realistic sizes: export throughput and peak memory, compact on churn.

    python -m benchmarks.cli_bench [--gb 1.0] [--dir DIR] [--json FILE]

1. Builds a store of at least ``--gb`` GB of raw rows (groups of 16 rows x 4096 tokens: int64 ids,
   float32 logprobs, two bool masks, a float32 reward; the layout of docs' LMDB baselines) and
   checkpoints it.
2. Exports the checkpoint to Parquet with ``kvckpt export`` in a fresh process and reports MB/s of
   raw rows and that process's peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``), next to
   the peak RSS of a process that only imports the same modules (the fixed cost).
3. Builds a churned store (many steps whose groups were consumed and dropped, or evicted) and
   runs ``kvckpt compact`` on it, with and without ``--level 3``: seconds and bytes before/after.

Every measured command runs in its own process (``--measure``), so peak memory is per command. Linux
carries ``ru_maxrss`` across ``exec`` (a child starts with its parent's high-water mark), so the stores
are built in child processes too and this parent stays small; ``VmHWM`` (the peak of the command's
own address space) is reported next to it as a cross-check.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

TOKENS, ROWS = 4096, 16
SCHEMA = {"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"),
          "token_mask": ("bool", "token"), "sample_mask": ("bool", "token"), "total_reward": ("float32", "row")}


def _rows(rng: np.random.Generator, prompt_idx: int) -> list[dict[str, np.ndarray]]:
    """One group: a shared prompt, then responses of varied length padded to TOKENS (like a padded batch)."""
    prompt = rng.integers(0, 32_000, 512)
    rows = []
    for _ in range(ROWS):
        length = int(rng.integers(600, TOKENS - 512))
        ids = np.zeros(TOKENS, np.int64)
        ids[:512] = prompt
        ids[512:512 + length] = rng.integers(0, 32_000, length)
        mask = np.zeros(TOKENS, bool)
        mask[512:512 + length] = True
        logprobs = np.where(mask, -rng.exponential(0.7, TOKENS), 0).astype(np.float32)
        rows.append({"input_ids": ids, "generation_logprobs": logprobs, "token_mask": mask,
                     "sample_mask": mask.copy(), "total_reward": np.float32(rng.random())})
    return rows


def build_full(path: str, gb: float) -> dict[str, Any]:
    """A store of at least ``gb`` GB of raw rows, all ready, and its checkpoint file."""
    import torch

    from kvckpt import BufferConfig, ReplayBuffer

    rng = np.random.default_rng(0)
    group_bytes = sum(a.nbytes for a in _rows(np.random.default_rng(1), 0)[0].values()) * ROWS
    groups = int(np.ceil(gb * 1e9 / group_bytes))
    buf = ReplayBuffer.create(path, BufferConfig(group_size=ROWS, schema=SCHEMA, sampler="windowed",
                                                 max_buffered_rollouts=groups + 1))
    t0 = time.perf_counter()
    for start in range(0, groups, 64):
        leases = buf.admit(list(range(start, min(start + 64, groups))))
        for lease in leases:
            buf.commit_group(lease, [{k: torch.from_numpy(np.asarray(v)) for k, v in row.items()}
                                     for row in _rows(rng, lease.prompt_idx)])
    build = time.perf_counter() - t0
    ckpt = path + ".kvckpt"
    buf.checkpoint(ckpt, background=False)
    raw = buf.stats()["raw_bytes"]
    buf.close()
    return {"groups": groups, "raw_bytes": raw, "file_bytes": os.path.getsize(ckpt), "build_seconds": build,
            "checkpoint": ckpt}


def build_churned(path: str, steps: int) -> dict[str, Any]:
    """A store that trained ``steps`` steps of 32 groups (8 KiB-token rows): consumed groups' rows are
    dropped once a checkpoint covers them, unselected ones evicted; the file keeps its peak size."""
    import torch

    from kvckpt import BufferConfig, ReplayBuffer

    rng = np.random.default_rng(2)
    buf = ReplayBuffer.create(path, BufferConfig(
        group_size=ROWS, schema=SCHEMA, sampler={"name": "windowed", "max_staleness_versions": 0},
        max_buffered_rollouts=64, groups_per_step=16, durable_checkpoints=1))
    ckpt = path + ".kvckpt"
    for step in range(steps):
        for lease in buf.admit(list(range(step * 32, step * 32 + 32))):
            buf.commit_group(lease, [{k: torch.from_numpy(np.asarray(v)) for k, v in row.items()}
                                     for row in _rows(rng, lease.prompt_idx)])
        buf.select(16, 16)
        buf.finish_step()
        buf.evict()
        buf.checkpoint(ckpt, overwrite=True, background=False)
    for lease in buf.admit(list(range(10**6, 10**6 + 8))):  # what is left: 8 fresh groups
        buf.commit_group(lease, [{k: torch.from_numpy(np.asarray(v)) for k, v in row.items()}
                                 for row in _rows(rng, lease.prompt_idx)])
    stats = buf.stats()
    buf.close()
    os.unlink(path + "-lock")
    os.unlink(ckpt)
    return {"steps": steps, "groups_committed": stats["committed"], "raw_bytes_committed": stats["raw_bytes"],
            "groups_held": stats["ready"] + stats["claimed"], "file_bytes": os.path.getsize(path)}


def _child(flag: str, args: list[str]) -> dict[str, Any]:
    """Run this module with ``flag ARGS`` in a fresh process and return the JSON line it prints."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cli_bench", flag, *args],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"{flag} {' '.join(args)} failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout.splitlines()[-1])


def measure(args: list[str]) -> dict[str, Any]:
    """Run ``kvckpt ARGS --json`` in a fresh process: its JSON report, peak RSS and VmHWM (bytes)."""
    return _child("--measure", args)


def _status(*names: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` in bytes (VmHWM: peak RSS of this address space; RssAnon: heap
    and other private memory; RssFile: mapped file pages: shared libraries and LMDB's map of the store)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in names:
                out[key] = int(line.split()[1]) * 1024
    return out


class _PeakSampler:
    """Samples RssAnon and RssFile every 20 ms: their peaks separate working memory from mapped pages."""

    def __init__(self) -> None:
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for key, value in _status("RssAnon", "RssFile").items():
                self.peak[key] = max(self.peak[key], value)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def _measure_here(args: list[str]) -> None:
    """The ``--measure`` child: run the CLI in this process, then print one JSON line."""
    import contextlib
    import io

    if args == ["imports"]:
        for module in ("pyarrow.parquet", "kvckpt.tools.export", "kvckpt.tools.cli"):
            importlib.import_module(module)
        report, code, seconds, cpu, peaks = None, 0, 0.0, 0.0, {}
    else:
        from kvckpt.tools.cli import main

        out = io.StringIO()
        sampler = _PeakSampler()
        before = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(out):
            code = main([*args, "--json"])
        seconds = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        peaks = sampler.stop()
        report = json.loads(out.getvalue())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"exit": code, "seconds": seconds, "cpu_seconds": cpu, "max_rss": rss,
                      "vm_hwm": _status("VmHWM")["VmHWM"],
                      "peak_anon": peaks["RssAnon"] if args != ["imports"] else 0,
                      "peak_file": peaks["RssFile"] if args != ["imports"] else 0, "report": report}))


def run(gb: float, directory: str, churn_steps: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    full = _child("--build-full", [os.path.join(directory, "full.kv"), str(gb)])
    results["store"] = full
    print(f"store: {full['groups']} groups, {full['raw_bytes'] / 1e9:.2f} GB raw, checkpoint "
          f"{full['file_bytes'] / 1e9:.2f} GB, built in {full['build_seconds']:.1f} s", flush=True)

    base = measure(["imports"])
    out = os.path.join(directory, "rows.parquet")
    export = measure(["export", full["checkpoint"], out, "--format", "parquet"])
    rep = export["report"]
    results["export"] = {"rows": rep["rows"], "raw_bytes": rep["raw_bytes"], "file_bytes": rep["file_bytes"],
                         "seconds": rep["seconds"], "raw_mb_per_s": rep["raw_bytes"] / rep["seconds"] / 1e6,
                         "cpu_seconds": export["cpu_seconds"],
                         "raw_mb_per_cpu_s": rep["raw_bytes"] / export["cpu_seconds"] / 1e6,
                         "load_average": os.getloadavg()[0],
                         "max_rss": export["max_rss"], "vm_hwm": export["vm_hwm"], "peak_anon": export["peak_anon"],
                         "peak_file": export["peak_file"],
                         "imports_max_rss": base["max_rss"]}
    e = results["export"]
    print(f"export parquet: {e['rows']} rows, {e['raw_bytes'] / 1e9:.2f} GB raw in {e['seconds']:.1f} s = "
          f"{e['raw_mb_per_s']:.0f} MB/s raw ({e['cpu_seconds']:.1f} CPU s: {e['raw_mb_per_cpu_s']:.0f} MB per CPU "
          f"second; load average {e['load_average']:.1f}); peak RSS {e['max_rss'] / 2**20:.0f} MiB (VmHWM "
          f"{e['vm_hwm'] / 2**20:.0f} MiB; peaks: private {e['peak_anon'] / 2**20:.0f} MiB, file-backed "
          f"{e['peak_file'] / 2**20:.0f} MiB) "
          f"(imports alone {e['imports_max_rss'] / 2**20:.0f} MiB); file {e['file_bytes'] / 1e9:.2f} GB", flush=True)
    os.unlink(out)
    os.unlink(full["checkpoint"])
    os.unlink(os.path.join(directory, "full.kv"))

    churn = _child("--build-churned", [os.path.join(directory, "churn.kv"), str(churn_steps)])
    results["churned"] = churn
    print(f"churned store: {churn['groups_committed']} groups ({churn['raw_bytes_committed'] / 1e9:.2f} GB raw) "
          f"committed over {churn['steps']} steps, file {churn['file_bytes'] / 1e6:.1f} MB", flush=True)
    for level in (None, 3):
        dest = os.path.join(directory, f"compact-{level}.kv")
        args = ["compact", os.path.join(directory, "churn.kv"), dest] + (["--level", str(level)] if level else [])
        m = measure(args)
        rep = m["report"]
        results[f"compact_level_{level}"] = {**rep, "max_rss": m["max_rss"], "cpu_seconds": m["cpu_seconds"]}
        print(f"compact{'' if level is None else f' --level {level}'}: {rep['bytes_before'] / 1e6:.1f} MB -> "
              f"{rep['bytes_after'] / 1e6:.1f} MB ({rep['bytes_after'] / rep['bytes_before']:.1%}) in "
              f"{rep['seconds']:.2f} s ({m['cpu_seconds']:.2f} CPU s); peak RSS {m['max_rss'] / 2**20:.0f} MiB",
              flush=True)
        os.unlink(dest)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="raw GB of rows in the export store (default 1.0)")
    parser.add_argument("--churn-steps", type=int, default=40, help="steps of the churned store (default 40)")
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--measure", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--build-full", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--build-churned", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        _measure_here(args.measure)
        return
    if args.build_full:
        print(json.dumps(build_full(args.build_full[0], float(args.build_full[1]))))
        return
    if args.build_churned:
        print(json.dumps(build_churned(args.build_churned[0], int(args.build_churned[1]))))
        return
    directory = args.dir or tempfile.mkdtemp(prefix="kvckpt-cli-bench-")
    os.makedirs(directory, exist_ok=True)
    try:
        results = run(args.gb, directory, args.churn_steps)
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
