"""Ingest at scale (issue 19): today's commit path against encode-at-the-edge + group commit.

One command, every mode side by side in the same run, ratios reported::

    python -m benchmarks.ingest_bench            # about 5 minutes on 2 shared cores
    python -m benchmarks.ingest_bench --quick    # under a minute: proves it runs
    python -m benchmarks.ingest_bench --json benchmarks/results/ingest-DATE.json

Two group kinds (:func:`benchmarks.ray_bench.row_pool`: 8 realistic GRPO rows, about 254 KB, and
8 rows of 16 tokens, about 1 KB), committed into fresh stores (fsync on every durable commit) by
1, 4, 16 and 64 producer threads in this process:

* **old** (today's path): ``commit_group`` with ``GroupCommitter(store, max_batch=1)``: every
  commit is its own durable transaction, and the store's side validates, encodes, compresses
  and checksums the rows;
* **new**: each producer encodes its rows itself (``RowEncoder.encode``, timed as the
  producer's CPU) and calls ``commit_encoded`` (the store only checks the records) through the
  group committer (concurrent commits share one transaction and one fsync).

"Buffer-side CPU" is the CPU time (``time.thread_time``: user + system, no waits) spent inside the
commit call, summed over producer threads: with group commit the leader's thread does every
follower's transaction, so the sum is all the store's work, and it excludes the producers'
encoding on the new path. "Commits per fsync" is the committer's transitions per durable
transaction. Bytes written per commit are the process's ``/proc/self/io`` ``wchar`` (bytes handed
to write syscalls: LMDB's page and meta writes) over the phase.

Baselines in the same run (:class:`benchmarks.baselines.BareLmdb`, one durable transaction per
group, py-lmdb's defaults, one thread): the bare put loop of pre-encoded values, and the same loop
with the same ``RowEncoder.encode`` call before each put. The disk's fsync'd sequential write
bandwidth is measured last (:func:`benchmarks.baselines.sequential_write`).

The module is long because its measurements share one setup (stores, workload, repetitions and
report) that only makes sense whole; the boundary rule covers it as it covers the tools (issue 48).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shlex
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import ray
from kvckpt.integrations.ray import BufferClient, init_local_ray, start_buffer_actor

from benchmarks import baselines
from benchmarks.ray_bench import config, row_pool
from kvckpt import ReplayBuffer, RowEncoder
from kvckpt.tooling import GroupCommitter, check_encoded, keys

PRODUCERS = (1, 4, 16, 64)
KINDS = ("realistic", "tiny")


def proc_io() -> dict[str, int]:
    """This process's I/O counters (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def run_threads(count: int, work: Callable[[int], dict[str, float]]) -> tuple[float, list[dict[str, float]]]:
    """Run ``work(i)`` on ``count`` threads released together; wall seconds and their results."""
    results: list[dict[str, float]] = [{} for _ in range(count)]
    start = threading.Barrier(count + 1)

    def run(i: int) -> None:
        start.wait()
        results[i] = work(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, results


def kvckpt_run(path: str, schema: Any, pool: list[Any], groups: int, producers: int, new: bool) -> dict[str, Any]:
    """``groups`` commits by ``producers`` threads into a fresh store, old or new path."""
    buf = ReplayBuffer.create(path, config(schema))
    if not new:
        buf.committer = GroupCommitter(buf.store, max_batch=1)  # one durable transaction per commit
    leases = buf.admit(list(range(groups)))
    encoder = RowEncoder.from_config(buf.config.to_dict())
    shares = [leases[i::producers] for i in range(producers)]
    before = dict(buf.committer.stats)
    size0, io0, cpu0 = os.path.getsize(path), proc_io(), time.process_time()

    def work(i: int) -> dict[str, float]:
        store_cpu = encode_cpu = 0.0
        for j, lease in enumerate(shares[i]):
            rows = pool[(i + j * producers) % len(pool)]
            c0 = time.thread_time()
            if new:
                wire = [r.to_dict() for r in encoder.encode(lease, rows)]
                c1 = time.thread_time()
                buf.commit_encoded(lease, wire)
            else:
                c1 = c0
                buf.commit_group(lease, rows)
            c2 = time.thread_time()
            encode_cpu += c1 - c0
            store_cpu += c2 - c1
        return {"store_cpu": store_cpu, "encode_cpu": encode_cpu}

    wall, parts = run_threads(producers, work)
    cpu, io1 = time.process_time() - cpu0, proc_io()
    stats = {k: buf.committer.stats[k] - before[k] for k in before}
    committed = buf.stats()["committed"]
    buf.close()
    assert committed == groups, (committed, groups)
    out = {"groups": groups, "producers": producers, "wall_s": wall, "groups_per_s": groups / wall,
           "store_cpu_ms": 1e3 * sum(p["store_cpu"] for p in parts) / groups,
           "encode_cpu_ms": 1e3 * sum(p["encode_cpu"] for p in parts) / groups,
           "process_cpu_ms": 1e3 * cpu / groups,
           "transactions": stats["transactions"], "transitions": stats["transitions"],
           "commits_per_fsync": stats["transitions"] / stats["transactions"],
           "wchar_per_group": (io1["wchar"] - io0["wchar"]) / groups,
           "write_bytes_per_group": (io1["write_bytes"] - io0["write_bytes"]) / groups,
           "file_growth_per_group": (os.path.getsize(path) - size0) / groups}
    remove_store(path)
    return out


def bare_run(path: str, schema: Any, pool: list[Any], groups: int, encode: bool) -> dict[str, Any]:
    """The bare LMDB loop, one thread, one durable transaction per group; with ``encode`` the same
    ``RowEncoder.encode`` call precedes each put (timed in), else the values are encoded before the clock."""
    encoder = RowEncoder.from_config(config(schema).to_dict())

    def items(i: int) -> list[tuple[bytes, bytes]]:
        gid = f"bare-{i}"
        lease = types.SimpleNamespace(group_id=gid, missing=())  # all the encoder reads of a lease
        return [(keys.row_key(gid, r.index), r.value) for r in encoder.encode(lease, pool[i % len(pool)])]

    ready = None if encode else [items(i) for i in range(groups)]
    bare = baselines.BareLmdb(path)
    size0, io0, cpu0 = os.path.getsize(path), proc_io(), time.thread_time()
    t0 = time.perf_counter()
    for i in range(groups):
        bare.put_group(items(i) if ready is None else ready[i])
    wall, cpu, io1 = time.perf_counter() - t0, time.thread_time() - cpu0, proc_io()
    growth = os.path.getsize(path) - size0
    bare.close()
    remove_store(path)
    return {"groups": groups, "wall_s": wall, "groups_per_s": groups / wall, "cpu_ms": 1e3 * cpu / groups,
            "wchar_per_group": (io1["wchar"] - io0["wchar"]) / groups,
            "write_bytes_per_group": (io1["write_bytes"] - io0["write_bytes"]) / groups,
            "file_growth_per_group": growth / groups}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ACTOR_MODES = {  # name: (encode at the edge, groups per call, calls in flight)
    "owner encodes, 1 group per call": (False, 1, 1),
    "owner encodes, batched 8 + 4 in flight": (False, 8, 4),
    "edge-encoded, batched 8 + 4 in flight": (True, 8, 4),
    "edge-encoded, batched 32 + 4 in flight": (True, 32, 4),
}


def actor_runs(groups: dict[str, int], producers: int, directory: str, seed: int,
               log: Callable[[str], None]) -> dict[str, Any]:
    """Groups/s, the buffer actor's process CPU per group and its commits per call and per fsync
    with ``producers`` producer actors, every :data:`ACTOR_MODES` mode, both kinds; Ray on loopback
    only, one session. Each producer builds its client before the clock starts (a rollout worker
    does once: it asks the actor for its config to encode at the edge)."""
    @ray.remote(num_cpus=0)
    class Producer:
        """A rollout worker stand-in: commits pre-made rows through a BufferClient."""

        def __init__(self, actor: Any, pool: list[Any]) -> None:
            self.actor, self.pool = actor, pool

        def ready(self, edge: bool, batch: int, in_flight: int) -> bool:
            self.client = BufferClient(self.actor, batch_groups=batch, max_in_flight=in_flight, encode_at_edge=edge)
            return True

        def run(self, leases: list[dict[str, Any]]) -> int:
            with self.client as c:
                futures = [c.commit(lease, self.pool[i % len(self.pool)]) for i, lease in enumerate(leases)]
            assert all(f.result().ready for f in futures)
            return len(leases)

    init_local_ray(num_cpus=producers + 1, object_store_memory=1 << 30)
    out: dict[str, Any] = {"producers": producers}
    try:
        for kind in KINDS:
            schema, pool, group_bytes = row_pool(kind, seed)
            pool_ref = ray.put(pool)
            res: dict[str, Any] = {"group_bytes": group_bytes, "groups": groups[kind], "modes": {}}
            for i, (name, (edge, batch, in_flight)) in enumerate(ACTOR_MODES.items()):
                path = os.path.join(directory, f"actor-{kind}-{i}.kv")
                actor = start_buffer_actor(path, config(schema).to_dict(), name=f"ingest-{kind}-{i}")
                pid = ray.get(actor.info.remote())["pid"]
                leases = ray.get(actor.admit.remote(list(range(groups[kind]))))
                workers = [Producer.remote(actor, pool_ref) for _ in range(producers)]
                ray.get([w.ready.remote(edge, batch, in_flight) for w in workers])
                before = ray.get(actor.stats.remote())
                cpu0, t0 = cpu_seconds(pid), time.perf_counter()
                done = ray.get([w.run.remote(leases[j::producers]) for j, w in enumerate(workers)])
                wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
                after = ray.get(actor.stats.remote())
                assert sum(done) == groups[kind] == after["committed"]
                d = {k: after[k] - before[k] for k in ("commit_transactions", "commit_transitions",
                                                       "actor_commit_calls", "actor_commit_call_commits")}
                ray.get(actor.close.remote())
                for handle in [*workers, actor]:
                    ray.kill(handle)
                remove_store(path)
                res["modes"][name] = {
                    "groups_per_s": groups[kind] / wall, "actor_cpu_ms": 1e3 * cpu / groups[kind],
                    "commits_per_fsync": d["commit_transitions"] / d["commit_transactions"],
                    "commits_per_call": d["actor_commit_call_commits"] / d["actor_commit_calls"],
                    "calls_most_running": after["actor_commit_calls_most_running"], "loadavg": os.getloadavg()[0]}
                log(f"actor {kind} {name}: {groups[kind] / wall:.0f} groups/s, actor CPU "
                    f"{1e3 * cpu / groups[kind]:.2f} ms/group, {res['modes'][name]['commits_per_fsync']:.1f} commits "
                    f"per fsync, {res['modes'][name]['commits_per_call']:.1f} per call, load {os.getloadavg()[0]:.1f}")
            out[kind] = res
    finally:
        ray.shutdown()
    return out


def actor_table(result: dict[str, Any], disk_MBps: float) -> str:
    """The actor figures as a Markdown table."""
    first = next(iter(ACTOR_MODES))
    lines = [f"### Through the buffer actor, {result['producers']} producer actors (Ray, loopback)", "",
             "| mode | realistic groups/s (× first) | MB/s raw (of the disk's fsync'd) | actor CPU ms/group | "
             "commits per call / per fsync | 1 KB groups/s (× first) | actor CPU ms/group | "
             "commits per call / per fsync |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    real, tiny = result["realistic"], result["tiny"]
    for name in ACTOR_MODES:
        r, t = real["modes"][name], tiny["modes"][name]
        mbps = r["groups_per_s"] * real["group_bytes"] / 1e6
        gain = r["groups_per_s"] / real["modes"][first]["groups_per_s"]
        lines.append(f"| {name} | {r['groups_per_s']:,.0f} ({gain:.2f}×)"
                     f" | {mbps:,.1f} ({mbps / disk_MBps:.0%}) | {r['actor_cpu_ms']:.2f} | "
                     f"{r['commits_per_call']:.1f} / {r['commits_per_fsync']:.1f} | {t['groups_per_s']:,.0f} "
                     f"({t['groups_per_s'] / tiny['modes'][first]['groups_per_s']:.2f}×) | {t['actor_cpu_ms']:.2f} | "
                     f"{t['commits_per_call']:.1f} / {t['commits_per_fsync']:.1f} |")
    return "\n".join(lines)


def check_cost(schema: Any, pool: list[Any], groups: int) -> float:
    """CPU ms per group of ``check_encoded`` alone (what the owner does to a producer's records
    before the transaction), one thread, on rows encoded beforehand."""
    encoder = RowEncoder.from_config(config(schema).to_dict())
    wires = []
    for i in range(groups):
        lease = types.SimpleNamespace(group_id=f"check-{i}", missing=())
        wires.append((lease.group_id, [r.to_dict() for r in encoder.encode(lease, pool[i % len(pool)])]))
    c0 = time.thread_time()
    for gid, wire in wires:
        check_encoded(schema, encoder.group_size, gid, wire)
    return 1e3 * (time.thread_time() - c0) / groups


def remove_store(path: str) -> None:
    for p in (path, path + "-lock"):
        if os.path.exists(p):
            os.unlink(p)


def profile_new(directory: str, schema: Any, pool: list[Any], groups: int) -> str:
    """cProfile of the new path's store side (1 producer, pre-encoded rows): the top functions."""
    buf = ReplayBuffer.create(os.path.join(directory, "profile.kv"), config(schema))
    leases = buf.admit(list(range(groups)))
    encoder = RowEncoder.from_config(buf.config.to_dict())
    wires = [[r.to_dict() for r in encoder.encode(lease, pool[i % len(pool)])] for i, lease in enumerate(leases)]
    prof = cProfile.Profile(time.thread_time)  # CPU, not the fsync waits
    prof.enable()
    for lease, wire in zip(leases, wires, strict=True):
        buf.commit_encoded(lease, wire)
    prof.disable()
    buf.close()
    remove_store(os.path.join(directory, "profile.kv"))
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(8)
    return text.getvalue()


def run(groups: dict[str, int], producers: tuple[int, ...], directory: str, seed: int = 0,
        seq_bytes: int = 256 << 20, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every mode of every kind, old and new interleaved at each producer count."""
    out: dict[str, Any] = {"kinds": {}}
    for kind in KINDS:
        schema, pool, group_bytes = row_pool(kind, seed)
        n = groups[kind]
        res: dict[str, Any] = {"group_bytes": group_bytes, "groups": n, "old": {}, "new": {}}
        res["bare_put"] = bare_run(os.path.join(directory, "bare.lmdb"), schema, pool, n, encode=False)
        res["bare_encode_put"] = bare_run(os.path.join(directory, "bare.lmdb"), schema, pool, n, encode=True)
        res["check_cpu_ms"] = check_cost(schema, pool, min(n, 256))
        log(f"{kind}: bare put {res['bare_put']['groups_per_s']:.0f} groups/s, "
            f"encode + put {res['bare_encode_put']['groups_per_s']:.0f}")
        for p in producers:
            m = max(n, 4 * p)
            for path_name in ("old", "new"):
                r = kvckpt_run(os.path.join(directory, f"{kind}-{path_name}-{p}.kv"), schema, pool, m, p,
                               new=path_name == "new")
                res[path_name][str(p)] = r
                log(f"{kind} {path_name} {p:>2} producers: {r['groups_per_s']:.0f} groups/s, store CPU "
                    f"{r['store_cpu_ms']:.3f} ms/group, {r['commits_per_fsync']:.1f} commits/fsync")
        out["kinds"][kind] = res
    out["disk_seq_fsync_MBps"] = baselines.sequential_write(os.path.join(directory, "seq.bin"), seq_bytes)
    return out


def ratios(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets as measured values (the ratios the report and docs quote)."""
    out: dict[str, Any] = {}
    for kind, res in result["kinds"].items():
        one_new, one_old = res["new"]["1"], res["old"]["1"]
        four = res["new"].get("4")
        bare, bare_enc = res["bare_put"], res["bare_encode_put"]
        out[kind] = {
            "store_cpu_ms_new_1": one_new["store_cpu_ms"],
            "store_cpu_old_over_new": {p: res["old"][p]["store_cpu_ms"] / res["new"][p]["store_cpu_ms"]
                                       for p in res["new"]},
            "commits_per_fsync_new": {p: r["commits_per_fsync"] for p, r in res["new"].items()},
            "rate_new_over_old": {p: res["new"][p]["groups_per_s"] / res["old"][p]["groups_per_s"]
                                  for p in res["new"]},
            "one_producer_new_over_bare_encode_put": one_new["groups_per_s"] / bare_enc["groups_per_s"],
            "one_producer_old_over_bare_encode_put": one_old["groups_per_s"] / bare_enc["groups_per_s"],
            "four_producers_new_over_bare_put": four["groups_per_s"] / bare["groups_per_s"] if four else None,
            "four_producers_new_over_bare_encode_put":
                four["groups_per_s"] / bare_enc["groups_per_s"] if four else None,
            "wchar_per_commit_new_1_over_bare": one_new["wchar_per_group"] / bare["wchar_per_group"],
            "wchar_per_commit_old_1_over_bare": one_old["wchar_per_group"] / bare["wchar_per_group"],
            "growth_per_commit_new_1_over_bare": one_new["file_growth_per_group"] / bare["file_growth_per_group"],
        }
    return out


def tables(result: dict[str, Any]) -> str:
    """The figures as Markdown tables."""
    lines = []
    for kind, res in result["kinds"].items():
        kb = res["group_bytes"] / 1e3
        lines += [f"### {kind} groups (8 rows, {kb:.1f} KB), {res['groups']} commits per mode (≥ 4 per producer)",
                  "", "| producers | groups/s old / new (×) | buffer-side CPU ms/group old / new (×) | "
                  "producer encode ms/group (new) | commits per fsync old / new | bytes written per commit old / new |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for p in res["new"]:
            o, n = res["old"][p], res["new"][p]
            lines.append(f"| {p} | {o['groups_per_s']:,.0f} / {n['groups_per_s']:,.0f} "
                         f"({n['groups_per_s'] / o['groups_per_s']:.2f}×) | {o['store_cpu_ms']:.3f} / "
                         f"{n['store_cpu_ms']:.3f} ({o['store_cpu_ms'] / n['store_cpu_ms']:.1f}×) | "
                         f"{n['encode_cpu_ms']:.3f} | {o['commits_per_fsync']:.1f} / {n['commits_per_fsync']:.1f} | "
                         f"{o['wchar_per_group'] / 1e3:,.0f} KB / {n['wchar_per_group'] / 1e3:,.0f} KB |")
        b, be = res["bare_put"], res["bare_encode_put"]
        lines += ["", f"Of the new path's buffer-side CPU, checking the records (`check_encoded` alone, 1 thread) "
                      f"costs {res['check_cpu_ms']:.3f} ms per group.", "",
                  f"Bare LMDB loop (1 thread, one durable transaction per group): put only "
                      f"{b['groups_per_s']:,.0f} groups/s ({b['cpu_ms']:.3f} ms CPU, {b['wchar_per_group'] / 1e3:,.0f} "
                      f"KB written per group); encode + put {be['groups_per_s']:,.0f} groups/s ({be['cpu_ms']:.3f} ms "
                      f"CPU).", ""]
    r = ratios(result)
    lines += ["### Targets (issue 19)", "", "| target | realistic | 1 KB |", "| --- | ---: | ---: |"]
    rows = [
        ("buffer-side CPU per group, new path, 1 producer (≤ 0.25 ms)",
         lambda k: f"{r[k]['store_cpu_ms_new_1']:.3f} ms"),
        ("commits per fsync at 16 producers (≥ 8)",
         lambda k: f"{r[k]['commits_per_fsync_new'].get('16', float('nan')):.1f}"),
        ("1 producer / (bare loop + same encode) (≥ 90 %)",
         lambda k: f"{r[k]['one_producer_new_over_bare_encode_put']:.0%} "
                   f"(old {r[k]['one_producer_old_over_bare_encode_put']:.0%})"),
        ("4 producer threads / bare put loop (≥ 1.0×)",
         lambda k: "n/a" if r[k]["four_producers_new_over_bare_put"] is None
         else f"{r[k]['four_producers_new_over_bare_put']:.2f}× (vs encode + put "
              f"{r[k]['four_producers_new_over_bare_encode_put']:.2f}×)"),
        ("bytes written per commit / bare loop (≤ 1.2×)",
         lambda k: f"{r[k]['wchar_per_commit_new_1_over_bare']:.2f}× "
                   f"(old {r[k]['wchar_per_commit_old_1_over_bare']:.2f}×; "
                   f"file growth {r[k]['growth_per_commit_new_1_over_bare']:.2f}×)"),
    ]
    for name, cell in rows:
        lines.append(f"| {name} | {cell('realistic')} | {cell('tiny')} |")
    lines += ["", f"Disk, fsync'd sequential write in the same run: {result['disk_seq_fsync_MBps']:,.0f} MB/s."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ingest_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few commits per mode (under a minute)")
    parser.add_argument("--groups", type=int, help="realistic commits per mode (tiny: 4 times as many)")
    parser.add_argument("--work", help="directory for the stores (default: a new one under /var/tmp)")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the new path's store side")
    parser.add_argument("--ray", type=int, metavar="P", help="also commit through the buffer actor from P producer "
                                                                  "actors (Ray on loopback; 16 in the issue)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    n = args.groups or (48 if args.quick else 384)
    groups = {"realistic": n, "tiny": 4 * n}
    command = "python -m benchmarks.ingest_bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None
                                                                                          else argv))
    start = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {line}", file=sys.stderr, flush=True)

    parent = args.work or "/var/tmp"
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvckpt-ingest-", dir=parent) as directory:
        load0 = os.getloadavg()
        result = run(groups, PRODUCERS, directory, args.seed, (64 if args.quick else 256) << 20, log)
        result.update({"command": command.strip(), "nproc": os.cpu_count(), "python": platform.python_version(),
                       "loadavg_start": load0, "loadavg_end": os.getloadavg(), "ratios": ratios(result)})
        if args.ray:
            result["actor"] = actor_runs({"realistic": n, "tiny": 2 * n}, args.ray, directory, args.seed, log)
        profile = profile_new(directory, *row_pool("realistic", args.seed)[:2], n) if args.profile else None
    print(f"## Run of `{result['command']}`\n\n{result['nproc']} CPUs, load average {load0[0]:.1f} at start, "
          f"{result['loadavg_end'][0]:.1f} at end.\n")
    print(tables(result))
    if "actor" in result:
        print("\n" + actor_table(result["actor"], result["disk_seq_fsync_MBps"]))
    if profile:
        print("\n```\n" + profile + "```")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
