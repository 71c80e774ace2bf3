"""Put/get throughput through TransferQueue: the kvckpt backend next to TransferQueue's default.

Every backend stores the same realistic GRPO samples (:mod:`benchmarks.data`: 8-row groups, jagged
``input_ids`` / ``generation_logprobs`` / ``token_mask`` plus three per-row fields, about 28 KB a
sample) through TransferQueue's public ``kv_batch_put`` / ``kv_batch_get`` / ``kv_clear``, in the
same run, one after the other on one loopback Ray:

* ``SimpleStorage``: TransferQueue's default, in memory in its storage-unit actors (no durability);
* ``kvckpt actor``: the kvckpt backend with a Ray actor owning the store file (any process can use
  it), fsync on every put batch;
* ``kvckpt process``: the kvckpt backend opened inside this process (one process only), fsync on
  every put batch; ``kvckpt process zstd1``: the same with zstd level 1 values.

A round puts ``--batches`` batches of ``--samples`` samples under fresh keys, gets them back
batch by batch, then clears them; put and get rates are samples (and raw MB) over the wall time
of all the round's puts or gets. TransferQueue holds one backend per process at a time, so the
backends take turns: ``--passes`` passes, in alternating order, each starting every backend once
for a warm-up round and ``--rounds`` timed rounds. The median of each backend's timed rounds is
reported. The machines are shared and noisy: read ratios, not absolutes.

Run: ``python -m benchmarks.tq_bench [--samples 64] [--batches 8] [--rounds 3] [--passes 2] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import kvckpt.integrations.ray as kray  # before ray: keeps Ray on loopback
import kvckpt.integrations.transferqueue as ktq
import numpy as np
import torch

from benchmarks import data

BACKENDS: dict[str, dict[str, Any]] = {
    "SimpleStorage": {"storage_backend": "SimpleStorage"},
    "kvckpt actor": {"storage_backend": "kvckpt", "kvckpt": {"owner": "actor"}},
    "kvckpt process": {"storage_backend": "kvckpt", "kvckpt": {"owner": "process"}},
    "kvckpt process zstd1": {"storage_backend": "kvckpt", "kvckpt": {"owner": "process", "compression_level": 1}},
}


def make_batches(count: int, samples: int, seed: int) -> list[tuple[Any, int]]:
    """``count`` TensorDicts of ``samples`` realistic samples each, with their raw bytes."""
    from tensordict import TensorDict

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        rows: list[dict[str, torch.Tensor]] = []
        while len(rows) < samples:
            rows.extend({k: torch.as_tensor(v) for k, v in row.items()} for row in data.rows_of(data.make_group(rng)))
        rows = rows[:samples]
        fields = {}
        for name in data.TOKEN_FIELDS:
            fields[name] = torch.nested.as_nested_tensor([r[name] for r in rows], layout=torch.jagged)
        for name in data.ROW_FIELDS:
            fields[name] = torch.stack([r[name] for r in rows])
        raw = sum(t.nelement() * t.element_size() for r in rows for t in r.values())
        out.append((TensorDict(fields, batch_size=samples), raw))
    return out


def run_round(tq: Any, batches: list[tuple[Any, int]], prefix: str) -> dict[str, float]:
    """Put every batch, get every batch back, clear; returns the put and get rates."""
    keys = [[f"{prefix}-{b}-{i}" for i in range(td.batch_size[0])] for b, (td, _) in enumerate(batches)]
    samples = sum(td.batch_size[0] for td, _ in batches)
    raw = sum(r for _, r in batches)
    t0 = time.perf_counter()
    for ks, (td, _) in zip(keys, batches, strict=True):
        tq.kv_batch_put(keys=ks, partition_id="bench", fields=td)
    t1 = time.perf_counter()
    for ks in keys:
        tq.kv_batch_get(keys=ks, partition_id="bench")
    t2 = time.perf_counter()
    for ks in keys:
        tq.kv_clear(keys=ks, partition_id="bench")
    return {"put_samples_per_s": samples / (t1 - t0), "put_mb_per_s": raw / (t1 - t0) / 1e6,
            "get_samples_per_s": samples / (t2 - t1), "get_mb_per_s": raw / (t2 - t1) / 1e6}


def bench_backend(name: str, batches: list[tuple[Any, int]], rounds: int, workdir: str) -> list[dict[str, float]]:
    """Start TransferQueue on one backend, run a warm-up and ``rounds`` timed rounds, stop it."""
    import ray
    import transfer_queue as tq

    backend = json.loads(json.dumps(BACKENDS[name]))
    if "kvckpt" in backend:
        backend["kvckpt"]["path"] = os.path.join(workdir, name.replace(" ", "-") + ".kv")
        if os.path.exists(backend["kvckpt"]["path"]):
            os.unlink(backend["kvckpt"]["path"])
    tq.init({"backend": backend})
    try:
        run_round(tq, batches, "warmup")
        results = [run_round(tq, batches, f"r{i}") for i in range(rounds)]
    finally:
        tq.close()
        ktq.stop_value_store()
        while True:  # the controller's name is free again before the next backend starts
            try:
                ray.get_actor("TransferQueueController", namespace="transfer_queue")
            except ValueError:
                break
            time.sleep(0.1)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64, help="samples per put batch")
    parser.add_argument("--batches", type=int, default=8, help="put batches per round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per backend and pass")
    parser.add_argument("--passes", type=int, default=2, help="passes over the backends, in alternating order")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    batches = make_batches(args.batches, args.samples, seed=0)
    kray.init_local_ray(num_cpus=4, object_store_memory=1 << 30)
    results: dict[str, Any] = {"samples_per_batch": args.samples, "batches": args.batches, "rounds": args.rounds,
                               "passes": args.passes, "raw_mb_per_round": sum(r for _, r in batches) / 1e6,
                               "backends": {}}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in args.backends}
    with tempfile.TemporaryDirectory(prefix="tq-bench-") as workdir:
        for p in range(args.passes):
            for name in args.backends if p % 2 == 0 else reversed(args.backends):
                rounds[name] += bench_backend(name, batches, args.rounds, workdir)
    for name, runs in rounds.items():
        results["backends"][name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        results["backends"][name]["rounds"] = runs
    print(f"{args.batches} batches x {args.samples} samples per round, {results['raw_mb_per_round']:.1f} MB raw; "
          f"median of {args.passes} x {args.rounds} rounds")
    print(f"{'backend':<22} {'put samples/s':>14} {'put MB/s':>9} {'get samples/s':>14} {'get MB/s':>9}")
    for name, r in results["backends"].items():
        print(f"{name:<22} {r['put_samples_per_s']:>14.0f} {r['put_mb_per_s']:>9.1f} "
              f"{r['get_samples_per_s']:>14.0f} {r['get_mb_per_s']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
