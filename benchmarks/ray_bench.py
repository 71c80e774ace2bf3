"""Commit throughput through the buffer actor versus in-process, same rows, same run.

Four ways to commit the same realistic groups (:mod:`benchmarks.data`, 8 rows of about 32 KB,
about 256 KB per group), each into a fresh store with fsync on every commit:

* ``in-process, 1 thread``: ``ReplayBuffer.commit_group`` in a loop, in this process;
* ``in-process, P threads``: the same from P producer threads;
* ``actor, unbatched``: P producer actors, each ``ray.get(buffer.commit_group.remote(...))`` per
  group (one Ray round trip per commit);
* ``actor, batched+pipelined``: P producer actors, each through a
  :class:`~kvckpt.integrations.ray.BufferClient` (``--batch`` groups per call, ``--in-flight``
  calls outstanding).

``--rows tiny`` commits groups of 16-token rows instead, where the Ray round trip, not the
commit, is the cost that batching and pipelining hide.

Rows are generated once, put in Ray's object store once and shared by every producer, so the
actor modes measure transport and commit, not generation. Leases are admitted before the clock
starts. A rate is groups committed over the wall time from the start signal to the last
acknowledgement; every store is verified afterwards.

Every mode runs ``--repeats`` times, interleaved, and the table shows each mode's median (the
machines are shared: single runs vary by a factor of two).

Run: ``python -m benchmarks.ray_bench [--groups 400] [--repeats 3] [--producers 2] [--rows tiny]
[--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from typing import Any

import numpy as np
import ray
from kvckpt.integrations.ray import BufferClient, init_local_ray, start_buffer_actor, to_wire

from benchmarks import data
from kvckpt import BufferConfig, ReplayBuffer, verify_path

GROUP_SIZE = 8


def config(schema: Any) -> BufferConfig:
    """An ungated sampler with a window nothing leaves, and capacity for every group of the run."""
    return BufferConfig(group_size=GROUP_SIZE, schema=schema,
                        sampler={"name": "windowed", "max_staleness_versions": 1 << 20},
                        max_buffered_rollouts=1 << 24)


@ray.remote(num_cpus=0)
class Producer:
    """A rollout worker stand-in: commits pre-made rows under the leases it is handed."""

    def __init__(self, buffer: Any, pool: list[Any]) -> None:
        self.buffer = buffer
        self.pool = pool

    def ready(self) -> bool:
        return True

    def unbatched(self, leases: list[dict[str, Any]]) -> int:
        for i, lease in enumerate(leases):
            result = ray.get(self.buffer.commit_group.remote(lease, self.pool[i % len(self.pool)]))
            assert result["ready"] and not result["replayed"]
        return len(leases)

    def batched(self, leases: list[dict[str, Any]], batch: int, in_flight: int) -> int:
        with BufferClient(self.buffer, batch_groups=batch, max_in_flight=in_flight) as client:
            futures = [client.commit(lease, self.pool[i % len(self.pool)]) for i, lease in enumerate(leases)]
        assert all(f.result().ready and not f.result().replayed for f in futures)
        return len(leases)


def in_process(path: str, schema: Any, pool: list[Any], groups: int, threads: int) -> float:
    """Groups per second committed by ``threads`` threads into a buffer owned by this process."""
    buf = ReplayBuffer.create(path, config(schema))
    leases = buf.admit(list(range(groups)))
    shares = [leases[i::threads] for i in range(threads)]

    def work(share: list[Any]) -> None:
        for i, lease in enumerate(share):
            buf.commit_group(lease, pool[i % len(pool)])

    workers = [threading.Thread(target=work, args=(share,)) for share in shares]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    assert buf.stats()["committed"] == groups
    buf.close()
    return groups / elapsed


def through_actor(path: str, schema: Any, pool_ref: Any, groups: int, producers: int,
                  batch: int | None, in_flight: int) -> float:
    """Groups per second committed by ``producers`` producer actors through a buffer actor."""
    actor = start_buffer_actor(path, config(schema).to_dict(), name=f"bench-{os.path.basename(path)}")
    leases = ray.get(actor.admit.remote(list(range(groups))))
    workers = [Producer.remote(actor, pool_ref) for _ in range(producers)]
    ray.get([w.ready.remote() for w in workers])
    shares = [leases[i::producers] for i in range(producers)]
    t0 = time.perf_counter()
    if batch is None:
        done = ray.get([w.unbatched.remote(s) for w, s in zip(workers, shares, strict=True)])
    else:
        done = ray.get([w.batched.remote(s, batch, in_flight) for w, s in zip(workers, shares, strict=True)])
    elapsed = time.perf_counter() - t0
    assert sum(done) == groups and ray.get(actor.stats.remote())["committed"] == groups
    ray.get(actor.close.remote())
    for handle in [*workers, actor]:
        ray.kill(handle)
    return groups / elapsed


def row_pool(kind: str, seed: int) -> tuple[Any, list[Any], float]:
    """The schema, 32 distinct groups of rows, and their mean unpadded bytes per group."""
    if kind == "tiny":
        pool = [data.tiny_rows(GROUP_SIZE, seed + i) for i in range(32)]
        nbytes = [sum(t.nbytes for row in rows for t in row.values()) for rows in pool]
        return data.TINY_SCHEMA, pool, float(np.mean(nbytes))
    rng = np.random.default_rng(seed)
    padded = [data.make_group(rng, data.RolloutSpec(group_size=GROUP_SIZE)) for _ in range(32)]
    return data.SCHEMA, [data.rows_of(g) for g in padded], float(np.mean([data.unpadded_bytes(g) for g in padded]))


def run(groups: int, producers: int, batch: int, in_flight: int, rows: str = "realistic", repeats: int = 3,
        seed: int = 0) -> dict[str, Any]:
    """Measure every mode ``repeats`` times, interleaved (so all modes share the machine's noise),
    in one Ray session; returns every rate and each mode's median."""
    schema, pool, group_bytes = row_pool(rows, seed)
    init_local_ray(num_cpus=max(2, producers + 1), object_store_memory=1 << 30)
    pool_ref = ray.put(to_wire(pool))
    batched = f"actor, batched {batch} + {in_flight} in flight"
    modes = {
        "in-process, 1 thread": lambda p: in_process(p, schema, pool, groups, 1),
        f"in-process, {producers} threads": lambda p: in_process(p, schema, pool, groups, producers),
        "actor, unbatched": lambda p: through_actor(p, schema, pool_ref, groups, producers, None, 1),
        batched: lambda p: through_actor(p, schema, pool_ref, groups, producers, batch, in_flight),
    }
    rates: dict[str, list[float]] = {name: [] for name in modes}
    with tempfile.TemporaryDirectory(prefix="kvckpt-ray-bench-") as directory:
        for repeat in range(repeats):
            for i, (name, measure) in enumerate(modes.items()):
                path = os.path.join(directory, f"r{repeat}-m{i}.kv")
                rates[name].append(measure(path))
                problems = verify_path(path).problems
                assert not problems, problems
                os.unlink(path)
    ray.shutdown()
    medians = {name: float(np.median(values)) for name, values in rates.items()}
    best_in_process = max(v for k, v in medians.items() if k.startswith("in-process"))
    return {"rows": rows, "groups": groups, "repeats": repeats, "producers": producers,
            "group_bytes": group_bytes, "group_size": GROUP_SIZE, "rates": rates, "medians": medians,
            "batched_vs_best_in_process": medians[batched] / best_in_process}


def table(result: dict[str, Any]) -> str:
    """The figures as a markdown table."""
    mb = result["group_bytes"] / 1e6
    lines = ["| mode | groups/s (median) | MB/s | every run |", "| --- | ---: | ---: | --- |"]
    lines += [f"| {name} | {rate:,.0f} | {rate * mb:,.1f} | {', '.join(f'{r:.0f}' for r in result['rates'][name])} |"
              for name, rate in result["medians"].items()]
    lines.append(f"\n{result['rows']} rows: {result['groups']} groups per mode and run, {result['repeats']} runs, "
                 f"{result['group_size']} rows and {result['group_bytes'] / 1e3:.1f} KB per group; batched+pipelined "
                 f"through the actor reaches {result['batched_vs_best_in_process']:.0%} of the best in-process rate.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=400, help="groups committed per mode and run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every mode, interleaved")
    parser.add_argument("--producers", type=int, default=2, help="producer threads / actors")
    parser.add_argument("--batch", type=int, default=8, help="groups per actor call (batched mode)")
    parser.add_argument("--in-flight", type=int, default=4, help="calls outstanding per producer (batched mode)")
    parser.add_argument("--rows", choices=("realistic", "tiny"), default="realistic",
                        help="realistic GRPO groups (about 250 KB) or tiny ones (16 tokens: round-trip bound)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    result = run(args.groups, args.producers, args.batch, args.in_flight, args.rows, args.repeats)
    print(table(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
