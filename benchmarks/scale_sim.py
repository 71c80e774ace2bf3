"""Capacity model of one buffer node: a seeded discrete-event simulation of a generation fleet.

    python -m benchmarks.scale_sim                          # the docs/scale.md table (seconds)
    python -m benchmarks.scale_sim --from-json benchmarks/results/ingest-2026-12-01.json
    python -m benchmarks.scale_sim --gpus 64,256,1024 --store-cpu-ms 0.25   # the issue's target cost

The model (every parameter is a flag; ``--from-json`` takes the measured ones from an
:mod:`benchmarks.ingest_bench` result):

* ``gpus`` generation GPUs, each finishing groups (16 rows of about 1k tokens) as a Poisson process
  of ``rate`` groups/s. A GPU's :class:`~kvckpt.integrations.ray.BufferClient` sends each group as
  one actor call and keeps at most ``window`` groups unacknowledged; a GPU with a full window
  stalls (its generation waits: this is how an overloaded buffer slows the fleet, so *achieved*
  falls below *offered*).
* The buffer actor's CPU (one core's worth: the Python work holds the GIL) serves, in arrival
  order, each call's receive cost ``call_ms`` plus the buffer-side cost of checking and writing
  the group, ``store_cpu_ms``, and the per-transaction cost ``txn_ms``.
* Group commit: when the writer is idle it takes every checked group queued (up to ``max_batch``)
  into one transaction; once its CPU work is done the fsync takes ``fsync_ms`` plus the batch's
  bytes over the disk's fsync'd bandwidth; then every group of the batch is acknowledged. Groups
  checked meanwhile form the next batch (the leader/follower queue of kvckpt.storage.group_commit).

Reported per fleet size: offered and achieved groups/s, mean groups per fsync, the latency from a
group's completion on its GPU to its acknowledgement (p50/p99), the CPU's and the disk's busy
fractions, and the node's analytic ceiling (the smaller of the CPU and disk limits).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Params:
    """One buffer node and its fleet (times in ms, bytes per 16-row group)."""

    rate: float = 2.5          # groups/s per GPU (one H100, vLLM, 7B model, 16 x 1k tokens)
    window: int = 32           # unacknowledged groups per GPU before it stalls
    call_groups: int = 1       # groups per actor call (BufferClient batch_groups)
    workers: int = 4           # the actor's commit threads (BufferActor max_workers, default 4)
    call_ms: float = 0.3       # actor-side receive cost of one call (Ray deserialisation, dispatch)
    check_ms: float = 2.5      # buffer-side CPU per group before the transaction (check_encoded)
    apply_ms: float = 1.5      # buffer-side CPU per group inside the transaction (its transition)
    txn_ms: float = 0.2        # CPU per durable transaction (parent txn commit)
    fsync_ms: float = 1.0      # a durable commit's fixed latency (LMDB's two syncs)
    bytes_per_group: float = 240e3  # bytes written per group (compressed rows, ledger, indexes)
    disk_MBps: float = 280.0   # the disk's fsync'd sequential write bandwidth
    max_batch: int = 256       # transitions per transaction (GroupCommitter's default)

    def ceiling(self) -> dict[str, float]:
        """Groups/s the node cannot exceed: its CPU (every group's receive, check and apply work
        on one core) and its disk (bytes at the fsync'd bandwidth)."""
        cpu = 1e3 / (self.call_ms / self.call_groups + self.check_ms + self.apply_ms)
        disk = self.disk_MBps * 1e6 / self.bytes_per_group
        return {"cpu": cpu, "disk": disk, "node": min(cpu, disk)}


def simulate(gpus: int, p: Params, seconds: float = 20.0, warmup: float = 5.0, seed: int = 0) -> dict[str, Any]:
    """Run the fleet for ``seconds`` (simulated) and measure after ``warmup``.

    Calls wait in Ray's queue for one of the actor's ``workers`` threads; a thread checks its call
    (CPU), queues its groups for the group committer, and stays blocked until they are durable
    (as ``AsyncReplayBuffer.commit_many`` does). The writer takes every queued group (up to
    ``max_batch``), applies them (CPU), fsyncs, and acknowledges them.
    """
    rng = random.Random(seed)
    events: list[tuple[float, int, str, Any]] = []
    tie = 0

    def push(t: float, kind: str, arg: Any) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(events, (t, tie, kind, arg))

    outstanding = [0] * gpus
    stalled = [False] * gpus
    forming: list[list[tuple[int, float]]] = [[] for _ in range(gpus)]  # a GPU's call being filled
    for g in range(gpus):
        push(rng.expovariate(p.rate), "gen", g)
    cpu_free = 0.0  # when the actor's CPU (one GIL) is next idle
    busy = {"cpu": 0.0, "disk": 0.0}
    calls: deque[list[tuple[int, float]]] = deque()  # Ray's queue of calls waiting for a thread
    idle_workers = p.workers
    checked: list[list[tuple[int, float]]] = []  # calls checked, waiting for the next transaction
    writing = False
    acks: list[float] = []
    batches: list[int] = []
    offered = acked = 0
    end = warmup + seconds

    def cpu(t: float, ms: float) -> float:
        """Queue ``ms`` of CPU work arriving at ``t``; when it finishes."""
        nonlocal cpu_free
        start = max(t, cpu_free)
        cpu_free = start + ms / 1e3
        if warmup <= start < end:
            busy["cpu"] += ms / 1e3
        return cpu_free

    def dispatch(t: float) -> None:
        nonlocal idle_workers
        while idle_workers and calls:
            idle_workers -= 1
            call = calls.popleft()
            push(cpu(t, p.call_ms + p.check_ms * len(call)), "checked", call)

    def start_batch(t: float) -> None:
        nonlocal writing, checked
        batch: list[list[tuple[int, float]]] = []
        while checked and sum(map(len, batch)) + len(checked[0]) <= max(p.max_batch, len(checked[0])):
            batch.append(checked.pop(0))
        groups = sum(map(len, batch))
        writing = True
        done_cpu = cpu(t, p.txn_ms + p.apply_ms * groups)
        sync = p.fsync_ms / 1e3 + groups * p.bytes_per_group / (p.disk_MBps * 1e6)
        if warmup <= done_cpu < end:
            busy["disk"] += sync
        push(done_cpu + sync, "durable", batch)

    while events:
        t, _, kind, arg = heapq.heappop(events)
        if t > end:
            break
        if kind == "gen":  # a GPU finished a group: send it once its call is full
            g = arg
            if t >= warmup:
                offered += 1
            outstanding[g] += 1
            forming[g].append((g, t))
            if len(forming[g]) >= p.call_groups:
                calls.append(forming[g])
                forming[g] = []
                dispatch(t)
            if outstanding[g] < p.window:
                push(t + rng.expovariate(p.rate), "gen", g)
            else:
                stalled[g] = True
        elif kind == "checked":
            checked.append(arg)
            if not writing:
                start_batch(t)
        elif kind == "durable":
            writing = False
            if t >= warmup:
                batches.append(sum(map(len, arg)))
            for call in arg:
                idle_workers += 1
                for g, born in call:
                    outstanding[g] -= 1
                    if t >= warmup:
                        acked += 1
                        acks.append(t - born)
                    if stalled[g]:
                        stalled[g] = False
                        push(t + rng.expovariate(p.rate), "gen", g)
            if checked:
                start_batch(t)
            dispatch(t)
    acks.sort()

    def pct(q: float) -> float:
        return 1e3 * acks[min(len(acks) - 1, int(q * len(acks)))] if acks else float("nan")

    return {"gpus": gpus, "offered": gpus * p.rate, "generated": offered / seconds, "achieved": acked / seconds,
            "batch_mean": sum(batches) / len(batches) if batches else 0.0,
            "latency_p50_ms": pct(0.50), "latency_p99_ms": pct(0.99),
            "cpu_busy": busy["cpu"] / seconds, "disk_busy": busy["disk"] / seconds}


def from_ingest(path: str, base: Params = Params()) -> Params:
    """The measured parameters of an :mod:`benchmarks.ingest_bench` result, its 8-row realistic
    groups scaled to 16 rows: the new path's buffer-side CPU per group at 1 producer split into the
    records' check (``check_cpu_ms``) and the rest (the transition), bytes written per group at 16
    producers (group commit shares the metadata pages), the
    durable commit's fixed latency (the 1 KB bare loop's wall per group minus its CPU), the disk's
    fsync'd bandwidth."""
    with open(path) as f:
        result = json.load(f)
    real = result["kinds"]["realistic"]
    one = real["new"]["1"]
    tiny_bare = result["kinds"]["tiny"]["bare_put"]
    return replace(base, check_ms=2 * real["check_cpu_ms"], apply_ms=2 * (one["store_cpu_ms"] - real["check_cpu_ms"]),
                   bytes_per_group=2 * real["new"]["16"]["wchar_per_group"],
                   fsync_ms=1e3 / tiny_bare["groups_per_s"] - tiny_bare["cpu_ms"],
                   disk_MBps=result["disk_seq_fsync_MBps"])


def table(p: Params, rows: list[dict[str, Any]]) -> str:
    """The simulation's table in Markdown, with its parameters and the node's ceiling."""
    c = p.ceiling()
    lines = [f"Parameters: {json.dumps(asdict(p))}",
             f"Ceiling: CPU {c['cpu']:,.0f} groups/s, disk {c['disk']:,.0f} groups/s "
             f"-> node {c['node']:,.0f} groups/s",
             "", "| GPUs | offered groups/s | achieved groups/s | groups per fsync | ack latency p50 / p99 (ms) | "
             "actor CPU busy | disk busy |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['gpus']:,} | {r['offered']:,.0f} | {r['achieved']:,.0f} | {r['batch_mean']:.1f} | "
                     f"{r['latency_p50_ms']:,.1f} / {r['latency_p99_ms']:,.1f} | {r['cpu_busy']:.0%} | "
                     f"{r['disk_busy']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_sim", description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="64,256,1024", help="fleet sizes, comma-separated")
    parser.add_argument("--from-json", help="take the measured parameters from an ingest_bench result")
    parser.add_argument("--seconds", type=float, default=20.0, help="simulated seconds measured (after 5 s warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    for name, default in asdict(Params()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), help=f"(default {default})")
    args = parser.parse_args(argv)
    p = from_ingest(args.from_json) if args.from_json else Params()
    p = replace(p, **{k: getattr(args, k) for k in asdict(p) if getattr(args, k) is not None})
    rows = [simulate(int(n), p, args.seconds, seed=args.seed) for n in args.gpus.split(",")]
    print(table(p, rows))


if __name__ == "__main__":
    main()
