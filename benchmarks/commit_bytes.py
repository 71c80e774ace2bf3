"""Bytes one durable commit writes, against a bare py-lmdb loop of the same rows (issue 19, item 3).

    python -m benchmarks.commit_bytes [--groups 200] [--rows realistic|tiny]

One producer, one group per durable transaction, in the same run:

* **bare**: the bare py-lmdb loop (:class:`benchmarks.baselines.BareLmdb`) putting the same
  encoded row values under the same keys;
* **kvckpt**: ``commit_encoded`` of the same rows (prompts admitted beforehand, outside the
  measured phase, so only commits are counted);

What other layouts would write is :mod:`benchmarks.layout_bytes`'s (a replay of these commits).

Bytes are the process's ``/proc/self/io`` ``wchar`` over the phase (what LMDB hands to ``write``:
dirty pages and the meta page), per commit. Prints one Markdown table with the ratios to bare.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

from benchmarks import baselines
from benchmarks.ingest_bench import proc_io
from benchmarks.ray_bench import GROUP_SIZE, row_pool
from kvckpt import BufferConfig, Prompt, ReplayBuffer, RowEncoder
from kvckpt.tooling import keys


def commit_setup(path: str, groups: int, rows: str = "realistic") -> tuple[ReplayBuffer, list[Any], list[Any]]:
    """A fresh store at ``path`` with ``groups + 1`` prompts in flight, and each one's edge-encoded
    rows (``RowEncoder.encode``): the starting point of every measured commit loop here."""
    schema, pool, _ = row_pool(rows, 0)
    config = BufferConfig(group_size=GROUP_SIZE, schema=schema, max_buffered_rollouts=groups + 1,
                          sampler={"name": "windowed", "max_staleness_versions": groups})
    encoder = RowEncoder.from_config(config.to_dict())
    buf = ReplayBuffer.create(path, config)
    leases = buf.admit([Prompt(prompt_idx=i) for i in range(groups + 1)], timeout=0)
    return buf, leases, [encoder.encode(lease, pool[i % len(pool)]) for i, lease in enumerate(leases)]


def measure(groups: int, rows: str = "realistic", directory: str | None = None) -> dict[str, Any]:
    """``wchar`` per commit of each mode, and the group's encoded size."""
    work = tempfile.mkdtemp(dir=directory)
    out: dict[str, Any] = {"groups": groups, "rows": rows}
    buf, leases, encoded = commit_setup(os.path.join(work, "kvckpt.kv"), groups, rows)
    buf.commit_encoded(leases[0], encoded[0])  # the first commit creates the tree: not measured
    before = proc_io()
    for lease, rows_ in zip(leases[1:], encoded[1:], strict=True):
        buf.commit_encoded(lease, rows_)
    out["kvckpt"] = (proc_io()["wchar"] - before["wchar"]) / groups
    buf.close()
    out["encoded_bytes_per_group"] = sum(len(r.value) for r in encoded[0])
    out["bare"] = bare_bytes(os.path.join(work, "bare.mdb"), leases, encoded)
    shutil.rmtree(work, ignore_errors=True)
    return out


def bare_bytes(path: str, leases: list[Any], encoded: list[Any]) -> float:
    """``wchar`` per group of the bare py-lmdb loop (:class:`benchmarks.baselines.BareLmdb`)
    putting the same encoded rows under the same keys, one durable transaction per group; the
    first group (which creates the tree) is not measured."""
    bare = baselines.BareLmdb(path)
    items = [[(keys.row_key(lease.group_id, r.index), r.value) for r in rows_]
             for lease, rows_ in zip(leases, encoded, strict=True)]
    bare.put_group(items[0])
    before = proc_io()
    for group in items[1:]:
        bare.put_group(group)
    per_group = (proc_io()["wchar"] - before["wchar"]) / (len(items) - 1)
    bare.close()
    return per_group


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--rows", choices=("realistic", "tiny"), default="realistic")
    parser.add_argument("--dir", default=None, help="where the stores go (default: the temp dir)")
    opts = parser.parse_args(argv)
    r = measure(opts.groups, opts.rows, opts.dir)
    size = r["encoded_bytes_per_group"] / 1e3
    print(f"{r['groups']} commits of one {r['rows']} group ({size:.1f} KB encoded) each\n")
    print("| mode | bytes written per commit (wchar) | / bare |\n| --- | ---: | ---: |")
    for mode in ("bare", "kvckpt"):
        print(f"| {mode} | {r[mode] / 1e3:.1f} KB | {r[mode] / r['bare']:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
