"""The one benchmark command: every figure, kvckpt side by side with its baselines.

    python -m benchmarks.run                  # 0.25, 1 and 4 GB of raw rows (about 20 minutes)
    python -m benchmarks.run --quick          # seconds: proves the benchmarks run (CI)
    python -m benchmarks.run --sizes 0.25,1   # choose the buffer sizes (GB of raw padded rows)
    python -m benchmarks.run --figures 1,2,3  # only these figures' tables and plots (6 and 7 not measured)
    python -m benchmarks.run --from-json r.json --plots DIR   # report and plots of an earlier run

Prints the machine, the exact command, one Markdown table per figure and the targets; writes the
raw results as JSON (``--json``) and one PNG per figure (``--plots``; ``docs/img`` for a full run).
Stores are built under ``--work`` (a fresh directory under ``/var/tmp`` by default, deleted
afterwards): it must be on the disk you want to measure, not tmpfs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any

import lmdb
import numpy as np
import torch
import zstandard

import kvckpt
from benchmarks import figures, measure, measure_crashes, measure_select, plots

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine(work: str) -> dict[str, Any]:
    """What the numbers were measured on: CPUs, memory, the work directory's disk, versions, load."""
    with open("/proc/meminfo") as f:
        mem_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    df = subprocess.run(["df", "-hT", work], capture_output=True, text=True).stdout.splitlines()[-1].split()
    return {"nproc": os.cpu_count(), "cpu": cpu, "ram_gib": round(mem_kb / 2**20, 1),
            "disk": {"device": df[0], "fs": df[1], "size": df[2], "avail": df[4]},
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "lmdb": f"py-lmdb {lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))})",
            "numpy": np.__version__, "zstandard": zstandard.__version__, "kvckpt": kvckpt.__version__,
            "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  cwd=ROOT).stdout.strip(),
            "loadavg_start": os.getloadavg()}


def describe(info: dict[str, Any]) -> str:
    """The machine as a Markdown bullet list."""
    d = info["disk"]
    return "\n".join([
        f"- {info['nproc']} CPUs ({info['cpu']}), {info['ram_gib']} GiB RAM, Linux {info['kernel']}",
        f"- work directory on {d['device']} ({d['fs']}, {d['size']}, {d['avail']} free)",
        f"- Python {info['python']}, torch {info['torch']}, {info['lmdb']}, numpy {info['numpy']}, "
        f"zstandard {info['zstandard']}, kvckpt {info['kvckpt']} ({info['git']})",
        f"- load average at start {info['loadavg_start'][0]:.1f}, at end {info['loadavg_end'][0]:.1f} "
        f"(the machine is shared: compare ratios measured side by side, not absolute times)"])


def report(results: dict[str, Any], only: set[str] | None = None) -> str:
    """The whole report: machine, command, one table per figure (those numbered in ``only``), targets."""
    parts = [f"## Run of `{results['command']}`", "", describe(results["machine"]), ""]
    parts += [fig(results).markdown() for fig in figures.FIGURES if only is None or figures.number(fig) in only]
    parts.append(figures.targets(results, only).markdown())
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and short phases (CI)")
    parser.add_argument("--sizes", help="comma-separated buffer sizes in GB of raw rows (default 0.25,1,4)")
    parser.add_argument("--work", help="directory for the stores (default: a new one under /var/tmp)")
    parser.add_argument("--json", help="write the raw results here (default: <work>/results.json, kept)")
    parser.add_argument("--plots", help="write the PNGs here (default: docs/img, or <work>/img with --quick)")
    parser.add_argument("--cold", choices=("fadvise", "drop_caches"), default="fadvise",
                        help="how to drop the page cache before a restore (drop_caches needs root)")
    parser.add_argument("--rate", type=float, help="producer groups/s during the latency phases")
    parser.add_argument("--figures", help="comma-separated figure numbers to measure and report (default: all); "
                                          "1-5 share one pass per size, 6 and 7 are measured only when asked")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from-json", metavar="PATH", help="measure nothing: print the report and redraw the "
                                                             "plots of an earlier run's JSON")
    args = parser.parse_args(argv)
    only = {f.strip() for f in args.figures.split(",") if f.strip()} if args.figures else None
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        only = only or results.get("figures")
        only = set(only) if only else None
        paths = plots.plot_all(results, args.plots or os.path.join(ROOT, "docs", "img"), only)
        print(report(results, only))
        print(f"plots: {', '.join(paths)}", file=sys.stderr)
        return 0

    settings = measure.Settings.quick() if args.quick else measure.Settings()
    settings = replace(settings, cold=args.cold, seed=args.seed)
    if args.sizes:
        settings = replace(settings, sizes_gb=tuple(float(s) for s in args.sizes.split(",") if s.strip()))
    if args.rate:
        settings = replace(settings, rate=args.rate)
    parent = args.work or tempfile.mkdtemp(prefix="kvckpt-bench-", dir="/var/tmp")
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=parent)
    json_path = args.json or os.path.join(parent, "results.json")
    plot_dir = args.plots or (os.path.join(parent, "img") if args.quick else os.path.join(ROOT, "docs", "img"))
    command = "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))

    start = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {line}", file=sys.stderr, flush=True)

    results: dict[str, Any] = {"command": command.strip(), "machine": machine(work), "settings": asdict(settings),
                               "sizes": [], "figures": sorted(only) if only else None}
    try:
        for size in settings.sizes_gb:
            log(f"buffer of {size:g} GB raw")
            results["sizes"].append(measure.measure_size(size, work, settings, log))
        if only is None or "6" in only:
            log("select latency")
            results["select"] = measure_select.measure_select(work, settings, log)
        if only is None or "7" in only:
            log("crash recovery")
            results["crashes"] = measure_crashes.measure_crashes(work, settings, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - start
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    paths = plots.plot_all(results, plot_dir, only)
    print(report(results, only))
    log(f"results: {json_path}; plots: {', '.join(paths)}; {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
