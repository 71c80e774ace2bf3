"""Commit cost with the replication log's code present but off, against another tree's code, paired
in the same run (issue 44, stage 1: within 3%).

    python -m benchmarks.replog_overhead [--base main] [--rounds 40] [--commits 50] [--rows tiny|realistic|txn]
                                         [--dir D]

Two long-lived worker processes, one importing kvckpt from this tree, one from ``git archive BASE``
(``main`` by default) unpacked in a temporary directory; neither store has a standby. The parent
alternates them round by round (which one goes first alternates too); each round is ``--commits``
``commit_encoded`` calls of one group (one durable transaction each, fsync included) on the
worker's own store, timed inside the worker. ``base2`` is a second worker of the base's code (what
the same code differs from itself in this run: the noise floor), and ``on`` this tree with the log
enabled (no standby attached: the cost of writing the record). Prints, per mode, the median commit
time and its ratio to the base, and the median of the per-round paired ratios (this tree's round
over the base's adjacent round): the overhead figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORKER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from benchmarks.commit_bytes import commit_setup
import kvckpt
from kvckpt.storage.store import Store
path, rounds, commits, rows, replicate = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
if rows == "txn":  # the Txn layer alone: one transaction of `commits` x 100 small puts and deletes a round
    store = Store(path, create=True)
    def one(txn):
        for k in range(commits * 100):
            txn.put("rows", b"key%06d" % k, b"v" * 64)
            txn.delete("rows", b"key%06d" % (k - 50))
    commit = lambda: store.write(one)
else:
    buf, leases, encoded = commit_setup(path, rounds * commits + 1, rows)
    store = buf.store
    def commit():
        global i
        buf.commit_encoded(leases[i], encoded[i])
        i += 1
if replicate == "on":
    from kvckpt.storage.replog import ReplicationLog
    ReplicationLog.enable(store)
i = 0
commit()
print(json.dumps({"kvckpt": kvckpt.__file__}), flush=True)
for line in sys.stdin:
    t0 = time.perf_counter()
    c0 = time.process_time()
    for _ in range(1 if rows == "txn" else commits):
        commit()
    print(json.dumps({"wall": (time.perf_counter() - t0) / commits, "cpu": (time.process_time() - c0) / commits}),
          flush=True)
store.close()
"""


def _start(tree: str, path: str, opts: argparse.Namespace, replicate: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, tree, path, str(opts.rounds), str(opts.commits),
                             opts.rows, replicate], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    loaded = json.loads(proc.stdout.readline())["kvckpt"]
    if not loaded.startswith(tree):
        raise SystemExit(f"worker for {tree} imported kvckpt from {loaded}")
    return proc


def _round(proc: subprocess.Popen[str]) -> dict[str, float]:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def measure(opts: argparse.Namespace) -> dict[str, Any]:
    """Per mode (``base``, ``base2``, ``off``, ``on``) the per-round seconds per commit, wall and CPU."""
    work = tempfile.mkdtemp(dir=opts.dir)
    base_tree = os.path.join(work, "base")
    os.makedirs(base_tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", opts.base, "kvckpt"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", base_tree], input=archive.stdout, check=True)
    workers = {"base": _start(base_tree, os.path.join(work, "base.kv"), opts, "off"),
               "base2": _start(base_tree, os.path.join(work, "base2.kv"), opts, "off"),
               "off": _start(ROOT, os.path.join(work, "off.kv"), opts, "off"),
               "on": _start(ROOT, os.path.join(work, "on.kv"), opts, "on")}
    out: dict[str, Any] = {mode: [] for mode in workers}
    try:
        for r in range(opts.rounds):
            order = list(workers) if r % 2 == 0 else list(reversed(workers))
            for mode in order:
                out[mode].append(_round(workers[mode]))
    finally:
        for proc in workers.values():
            proc.stdin.close()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="the git ref whose kvckpt is the baseline")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--commits", type=int, default=50)
    parser.add_argument("--rows", choices=("realistic", "tiny", "txn"), default="tiny",
                        help="the group committed (txn: no group, one transaction of COMMITS x 100 puts and "
                        "deletes per round, what the Txn layer alone costs)")
    parser.add_argument("--dir", default=None, help="where the stores go (default: the temp dir)")
    opts = parser.parse_args(argv)
    out = measure(opts)
    print(f"{opts.rounds} rounds x {opts.commits} commits of one {opts.rows} group, load {os.getloadavg()[0]:.2f}\n")
    print("| mode | median ms/commit (wall) | / base | median of paired round ratios | "
          "median CPU ms/commit | / base |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    base_wall = statistics.median(r["wall"] for r in out["base"])
    base_cpu = statistics.median(r["cpu"] for r in out["base"])
    for mode in ("base", "base2", "off", "on"):
        wall = statistics.median(r["wall"] for r in out[mode])
        cpu = statistics.median(r["cpu"] for r in out[mode])
        paired = statistics.median(a["wall"] / b["wall"] for a, b in zip(out[mode], out["base"], strict=True))
        print(f"| {mode} | {wall * 1e3:.3f} | {wall / base_wall:.3f} | {paired:.3f} | {cpu * 1e3:.3f} | "
              f"{cpu / base_cpu:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
