"""The standby replica's cost and its failover time (issue 44), each level beside no standby in the same run.

    python -m benchmarks.replication_bench                       # about 10 minutes on 2 shared cores
    python -m benchmarks.replication_bench --quick               # about 3 minutes: proves it runs
    python -m benchmarks.replication_bench --json benchmarks/results/replication-DATE.json
    python -m benchmarks.replication_bench --parts cost --profile owner.txt --profile-mode async  # py-spy

Four parts (``--parts``, all by default):

``cost``: **throughput and producer latency through the actor, per level.** One loopback Ray; per
mode (``none``, ``async``, ``remote_apply``, ``remote_durable``; the order rotates every repeat,
``--repeats`` of each) a fresh primary actor and, but for ``none``, a fresh standby actor on its own
file, caught up before the clock starts. ``--engines`` engine processes each run ``--producers``
producer threads; each producer streams its share of progress (one step message of ``--per-step``
2 KB chunks per engine step, :func:`benchmarks.progress_bench._step_message`) and commits a group
of 8 rows every ``--commit-every`` steps, through its own ``BufferClient`` keeping ``--in-flight``
calls in flight (4, the client's default: an engine does not wait for a step's durability before
the next step). A call's latency is from its submission to its answer. Reported per mode: progress
appends/s, groups/s, p50/p99 of the step calls and of the commits, and each rate's ratio to
``none``'s (median over repeats).

``lag``: **the async standby's lag at the fleet's rate.** The same producers paced to ``--rate``
progress appends/s in all (6,400 by default: the issue's fleet) plus a commit every
``--commit-every`` steps, at ``async``. Reported: the rate reached, and the p50/p99/max of the
acknowledgement lag (seconds from each write's answer to the standby's acknowledgement of its
record: ``BufferActor.replica_lags``, every write), plus the p99 of ``replica_status()["lag_s"]``
sampled every 50 ms and the writes held by the bound.

``failover``: **from the primary node's death to the first acknowledged write on the promoted
standby.** A loopback multi-node cluster (``tests/_fleet.py``: a dead node is declared after 3
missed health checks 1 s apart): the primary on node A at ``--failover-ack``, the standby on B with
automatic promotion, a producer on C streaming progress and committing through a
``BufferClient(failover=[standby])``, redispatching the recovery plan's leases when fenced. Node A
is SIGKILLed mid-stream. Reported: kill -> Ray declares the node dead (detection, Ray's part) ->
promoted (the standby's watch and the promotion's transaction and recovery) -> the first write the
promoted standby acknowledged (the client's failover and resend).

``embedded``: **the embedded store's commit cost with replication off against ``main``'s.** Runs
``python -m benchmarks.replog_overhead --rounds R --commits 30`` (see that module: this tree's
workers beside ``git archive main``'s, alternating round by round).

The machine is shared: read the ratios of each run, and the load printed beside them.

The module is long (about 470 lines) because its four parts share one command, one report and the
producers' workload; split, the command the issue asks for would be four.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import ray
from kvckpt.integrations.ray import BufferClient, init_local_ray, start_buffer_actor, start_standby_actor

from benchmarks.ingest_bench import cpu_seconds
from benchmarks.progress_bench import CHUNK_TOKENS, GROUP, _chunk, _config, _plan, _py_spy, _step_message

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("none", "async", "remote_apply", "remote_durable")
ROW_TOKENS = 64


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank), NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rows() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(0, 150_000, ROW_TOKENS, dtype=np.int64),
             "generation_logprobs": -rng.random(ROW_TOKENS, dtype=np.float32),
             "token_mask": np.ones(ROW_TOKENS, dtype=np.int64)} for _ in range(GROUP)]


@ray.remote(num_cpus=0)
class Engines:
    """``producers`` rollout engine stand-ins in one process, one thread each: per engine step one
    blocking progress step message, and every ``commit_every`` steps one blocking group commit."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.encoder = BufferClient(actor).progress_encoder()

    def ready(self) -> bool:
        return True

    def run(self, leases: list[Any], commit_leases: list[list[Any]], plans: list[list[list[tuple[int, int]]]],
            commit_every: int, step_period: float | None, in_flight: int) -> dict[str, list[float]]:
        tokens, logprobs = (x.numpy() for x in _chunk(0))
        rows = _rows()
        out: dict[str, list[float]] = {"step": [], "commit": []}
        lock = threading.Lock()

        def timed(future: Any, into: list[float]) -> Any:
            t0 = time.perf_counter()
            future.add_done_callback(lambda _f: into.append(time.perf_counter() - t0))
            return future

        def produce(p: int) -> None:
            client = BufferClient(self.actor, batch_groups=1, max_in_flight=in_flight, batch_steps=1)
            mine = iter(commit_leases[p])
            steps: list[float] = []
            commits: list[float] = []
            futures, committed = [], []
            start = time.perf_counter()
            for s, step in enumerate(plans[p]):
                if step_period is not None:  # paced: engine step s starts at start + s * period
                    delay = start + s * step_period - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                message = _step_message(self.encoder, leases, step, tokens, logprobs)
                futures.append(timed(client.record_progress_step(message), steps))
                if (s + 1) % commit_every == 0:
                    committed.append(timed(client.commit(next(mine), rows), commits))
            client.flush()
            for f in futures:
                assert all(isinstance(r, int) for r in f.result()), f.result()
            assert all(f.result().ready for f in committed)
            with lock:
                out["step"] += steps
                out["commit"] += commits

        threads = [threading.Thread(target=produce, args=(p,)) for p in range(len(plans))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


def _caught_up(primary: Any, timeout: float = 300) -> None:
    """Wait until the standby acknowledged everything the primary wrote (its snapshot, the admissions)."""
    deadline = time.monotonic() + timeout
    while True:
        status = ray.get(primary.replica_status.remote())
        if status.get("acked") is not None and status["lag_records"] == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the standby never caught up: {status}")
        time.sleep(0.05)


def stream(directory: str, mode: str, run: int, *, engines: int, producers: int, per_step: int, steps: int,
           commit_every: int, in_flight: int, rate: float | None = None, profile: str | None = None,
           ) -> dict[str, Any]:
    """One run of ``mode``: fresh actors, the producers' stream, the figures."""
    name = f"repl-bench-{mode}-{run}"
    primary_path, standby_path = os.path.join(directory, f"{name}.kv"), os.path.join(directory, f"{name}-standby.kv")
    standby = None
    replication = None
    if mode != "none":
        standby = start_standby_actor(standby_path, name=f"{name}-standby")
        replication = {"standby": f"{name}-standby", "ack": mode}
    primary = start_buffer_actor(primary_path, _config().to_dict(), name=name, replication=replication)
    total = engines * producers
    plan = _plan(total, per_step, steps)
    leases = ray.get(primary.admit.remote(list(range(total * per_step * 4 // GROUP))))
    per_producer = steps // commit_every
    more = ray.get(primary.admit.remote(list(range(10**6, 10**6 + total * per_producer))))
    commit_leases = [more[p * per_producer:(p + 1) * per_producer] for p in range(total)]
    if standby is not None:
        _caught_up(primary)
        ray.get(primary.replica_lags.remote())  # drop the setup's
    workers = [Engines.remote(primary) for _ in range(engines)]
    ray.get([w.ready.remote() for w in workers])
    step_period = None if rate is None else total * per_step / rate  # each producer's seconds per step
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(ray.get(primary.replica_status.remote())["lag_s"])
            time.sleep(0.05)

    sampler = threading.Thread(target=sample) if standby is not None and rate is not None else None
    pid = ray.get(primary.info.remote())["pid"]
    standby_pid = None if standby is None else ray.get(standby.info.remote())["pid"]
    spy = _py_spy(pid, profile) if profile else None
    if sampler is not None:
        sampler.start()
    cpu0 = cpu_seconds(pid), 0.0 if standby_pid is None else cpu_seconds(standby_pid)
    t0 = time.perf_counter()
    parts = ray.get([w.run.remote(leases, commit_leases[e * producers:(e + 1) * producers],
                                  plan[e * producers:(e + 1) * producers], commit_every, step_period, in_flight)
                     for e, w in enumerate(workers)])
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(pid) - cpu0[0], 0.0 if standby_pid is None else cpu_seconds(standby_pid) - cpu0[1]
    stop.set()
    if sampler is not None:
        sampler.join()
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=120)
    appends = total * per_step * steps
    doc: dict[str, Any] = {"mode": mode, "wall_s": wall, "appends_per_s": appends / wall,
                           "groups_per_s": total * per_producer / wall,
                           "primary_cpu_us_per_append": 1e6 * cpu[0] / appends,
                           "standby_cpu_us_per_append": 1e6 * cpu[1] / appends}
    step_lat = [x for p in parts for x in p["step"]]
    commit_lat = [x for p in parts for x in p["commit"]]
    for label, values in (("step", step_lat), ("commit", commit_lat)):
        doc[f"{label}_p50_ms"] = 1e3 * pct(values, 0.5)
        doc[f"{label}_p99_ms"] = 1e3 * pct(values, 0.99)
    if standby is not None:
        lags = ray.get(primary.replica_lags.remote())
        status = ray.get(primary.replica_status.remote())
        doc.update(ack_lag_p50_s=pct(lags, 0.5), ack_lag_p99_s=pct(lags, 0.99), ack_lag_max_s=max(lags, default=0.0),
                   ack_lag_writes=len(lags), held_writes=status["held_writes"], held_s=status["held_s"],
                   batches=status["batches"])
        if samples:
            doc.update(lag_s_sampled_p99=pct(samples, 0.99), lag_s_sampled_max=max(samples))
    stats = ray.get(primary.stats.remote())
    doc["primary_transactions"] = stats["commit_transactions"]
    for actor in [primary] + ([standby] if standby is not None else []):
        ray.get(actor.close.remote())
    for actor in [*workers, primary] + ([standby] if standby is not None else []):
        ray.kill(actor)
    for path in (primary_path, standby_path):
        for p in (path, path + "-lock"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
    return doc


def cost(directory: str, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Part ``cost``: every mode, ``repeats`` times, the order rotating; medians and ratios to ``none``."""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            doc = stream(directory, mode, r, engines=args.engines, producers=args.producers, per_step=args.per_step,
                         steps=args.steps, commit_every=args.commit_every, in_flight=args.in_flight,
                         profile=args.profile if (args.profile and mode == args.profile_mode and r == 0) else None)
            log(f"  run {r} {mode:15s} {doc['appends_per_s']:8.0f} appends/s {doc['groups_per_s']:6.1f} groups/s  "
                f"step p99 {doc['step_p99_ms']:6.1f} ms  commit p99 {doc['commit_p99_ms']:6.1f} ms  "
                f"load {os.getloadavg()[0]:.1f}")
            runs[mode].append(doc)
    table = {}
    for mode in MODES:
        med = {k: statistics.median(d[k] for d in runs[mode]) for k in
               ("appends_per_s", "groups_per_s", "step_p50_ms", "step_p99_ms", "commit_p50_ms", "commit_p99_ms",
                "primary_cpu_us_per_append", "standby_cpu_us_per_append")}
        table[mode] = med
    for mode in MODES:
        table[mode]["appends_ratio"] = table[mode]["appends_per_s"] / table["none"]["appends_per_s"]
        table[mode]["groups_ratio"] = table[mode]["groups_per_s"] / table["none"]["groups_per_s"]
    return {"runs": runs, "medians": table}


def lag(directory: str, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Part ``lag``: async, paced to ``--rate`` appends/s."""
    steps = max(args.commit_every, int(args.lag_seconds * args.rate / (args.engines * args.producers * args.per_step)))
    doc = stream(directory, "async", 99, engines=args.engines, producers=args.producers, per_step=args.per_step,
                 steps=steps, commit_every=args.commit_every, in_flight=args.in_flight, rate=args.rate)
    log(f"  async at {args.rate:.0f} appends/s asked: {doc['appends_per_s']:.0f} appends/s and "
        f"{doc['groups_per_s']:.1f} groups/s reached; acknowledgement lag p50 {doc['ack_lag_p50_s'] * 1e3:.1f} ms, "
        f"p99 {doc['ack_lag_p99_s'] * 1e3:.1f} ms, max {doc['ack_lag_max_s'] * 1e3:.1f} ms over "
        f"{doc['ack_lag_writes']} writes; sampled lag_s p99 {doc.get('lag_s_sampled_p99', float('nan')) * 1e3:.1f} ms; "
        f"held writes {doc['held_writes']}; load {os.getloadavg()[0]:.1f}")
    return doc


@ray.remote(num_cpus=0, max_concurrency=4)
class FailoverProducer:
    """On node C: streams progress and commits groups, one lease after another, through a client
    that fails over to the standby; when fenced, takes the recovery plan's leases. Records the time
    and the epoch of every acknowledged write."""

    def __init__(self, primary: Any, standby_name: str) -> None:
        self.client = BufferClient(primary, batch_groups=1, max_in_flight=1, failover=[standby_name],
                                   restart_timeout=120)
        self.acks: list[tuple[float, int | None]] = []
        self.stop = False

    def run(self, leases: list[dict[str, Any]], fleet: Any) -> int:
        """Stream and commit ``leases``; ``fleet`` is tests/_fleet.py (pickled by value)."""
        from kvckpt import AbandonedTimeline

        group_size, expected_tokens, logprobs_of = fleet

        queue, done = list(leases), set()
        while queue and not self.stop:
            lease = queue.pop(0)
            if lease["group_id"] in done:
                continue
            try:
                for start in (0, 4, 8):
                    items = [{"lease": lease, "index": i, "start": start,
                              "tokens": expected_tokens(lease["group_id"], i, start, 4),
                              "logprobs": logprobs_of(expected_tokens(lease["group_id"], i, start, 4)),
                              "weight_version": 0} for i in range(group_size)]
                    results = self.client.record_progress_step(items).result()
                    if any(isinstance(r, BaseException) for r in results):
                        raise next(r for r in results if isinstance(r, BaseException))
                    self.acks.append((time.time(), self.client.epoch))
                rows = [{"input_ids": expected_tokens(lease["group_id"], i, 0, 12),
                         "generation_logprobs": logprobs_of(expected_tokens(lease["group_id"], i, 0, 12)),
                         "total_reward": 1.0} for i in range(group_size)]
                self.client.commit(lease, rows).result()
                self.acks.append((time.time(), self.client.epoch))
                done.add(lease["group_id"])
            except AbandonedTimeline:  # the promoted standby fenced it: redispatch the plan's leases
                plan = ray.get(self.client.actor.recovery_plan.remote())
                queue = [x for x in plan["leases"] if x["group_id"] not in done] + \
                    [x for x in queue if x["group_id"] not in {y["group_id"] for y in plan["leases"]}]
        return len(done)

    def acknowledged(self) -> list[tuple[float, int | None]]:
        return list(self.acks)

    def halt(self) -> None:
        self.stop = True


def failover(directory: str, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Part ``failover``: a loopback cluster, the primary's node SIGKILLed mid-stream."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import _fleet

    ray.shutdown()
    out: dict[str, Any] = {"ack": args.failover_ack, "runs": []}
    with _fleet.loopback_cluster("kvckpt-repl-bench", {"standby_b": 4, "rollout_c": 4}, sys.modules[__name__]) \
            as cluster:
        for run in range(args.failover_runs):
            owner = cluster.add_node(**_fleet.COMMON, num_cpus=1, resources={"owner_a": 1})
            cluster.wait_for_nodes()
            node_b = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "standby_b" in n["Resources"])
            name = f"failover-standby-{run}"
            standby = start_standby_actor(os.path.join(directory, f"{name}.kv"), name=name, node_id=node_b,
                                          auto_promote=True)
            primary = start_buffer_actor(os.path.join(directory, f"failover-primary-{run}.kv"),
                                         _fleet.fleet_config(256), name=f"failover-primary-{run}",
                                         node_id=owner.node_id, max_restarts=0,
                                         replication={"standby": name, "ack": args.failover_ack})
            leases = ray.get(primary.admit.remote(list(range(200))))
            _caught_up(primary)
            producer = FailoverProducer.options(resources={"rollout_c": 1}).remote(primary, name)
            running = producer.run.remote(leases, (_fleet.GROUP_SIZE, _fleet.expected_tokens, _fleet.logprobs_of))
            deadline = time.monotonic() + 120
            while len(ray.get(producer.acknowledged.remote())) < 20:  # mid-stream
                if ray.wait([running], timeout=0)[0]:
                    ray.get(running)
                if time.monotonic() > deadline:
                    raise RuntimeError("the producer acknowledged nothing")
                time.sleep(0.05)
            time.sleep(random.uniform(0, 0.2))
            killed_at = time.time()
            _fleet.kill_node(cluster, owner)
            while any(n["NodeID"] == owner.node_id and n["Alive"] for n in ray.nodes()):
                time.sleep(0.02)
            declared_at = time.time()
            while ray.get(standby.info.remote())["promoted_at"] is None:
                time.sleep(0.02)
            promoted_at = ray.get(standby.info.remote())["promoted_at"]
            deadline = time.monotonic() + 120
            while not any(t > killed_at and e == 2 for t, e in ray.get(producer.acknowledged.remote())):
                if ray.wait([running], timeout=0)[0]:
                    ray.get(running)  # the producer stopped: its error, if any
                if time.monotonic() > deadline:
                    raise RuntimeError("the promoted standby acknowledged nothing")
                time.sleep(0.05)
            first = min(t for t, e in ray.get(producer.acknowledged.remote()) if t > killed_at and e == 2)
            ray.get(producer.halt.remote())
            ray.get(running)
            doc = {"detect_s": declared_at - killed_at, "promote_s": promoted_at - declared_at,
                   "first_ack_s": first - promoted_at, "kill_to_first_ack_s": first - killed_at}
            out["runs"].append(doc)
            log(f"  failover run {run} ({args.failover_ack}): kill -> node declared dead {doc['detect_s']:.2f} s -> "
                f"promoted {doc['promote_s']:.2f} s -> first acknowledged write {doc['first_ack_s']:.2f} s; "
                f"kill -> first ack {doc['kill_to_first_ack_s']:.2f} s; load {os.getloadavg()[0]:.1f}")
            ray.get(standby.close.remote())
            for actor in (producer, standby):
                ray.kill(actor)
    for key in ("detect_s", "promote_s", "first_ack_s", "kill_to_first_ack_s"):
        out[key] = statistics.median(r[key] for r in out["runs"])
    return out


def embedded(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Part ``embedded``: :mod:`benchmarks.replog_overhead`'s paired run against ``main``."""
    command = [sys.executable, "-m", "benchmarks.replog_overhead", "--rounds", str(args.embedded_rounds),
               "--commits", "30"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    log("  " + " ".join(command[1:]) + f"  (load {os.getloadavg()[0]:.1f})")
    for line in done.stdout.splitlines():
        log("    " + line)
    return {"command": " ".join(command[1:]), "stdout": done.stdout}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="cost,lag,failover,embedded")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--per-step", type=int, default=8)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--commit-every", type=int, default=8)
    parser.add_argument("--in-flight", type=int, default=4, help="calls each producer's client keeps in flight")
    parser.add_argument("--rate", type=float, default=6400.0)
    parser.add_argument("--lag-seconds", type=float, default=20.0)
    parser.add_argument("--failover-ack", default="remote_durable")
    parser.add_argument("--failover-runs", type=int, default=3)
    parser.add_argument("--embedded-rounds", type=int, default=40)
    parser.add_argument("--profile", help="write a py-spy profile of the primary (the first run of --profile-mode)")
    parser.add_argument("--profile-mode", default="remote_durable", choices=MODES)
    parser.add_argument("--dir", help="directory for the stores (default: a temporary one)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.lag_seconds, args.failover_runs, args.embedded_rounds = 1, 40, 5.0, 1, 10
    parts = args.parts.split(",")
    directory = args.dir or tempfile.mkdtemp(prefix="kvckpt-repl-bench-")
    os.makedirs(directory, exist_ok=True)
    results: dict[str, Any] = {"args": vars(args), "chunk_tokens": CHUNK_TOKENS, "uptime_before": os.getloadavg()}

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        if "cost" in parts or "lag" in parts:
            init_local_ray(num_cpus=args.engines + 2, object_store_memory=1 << 29, address="local")
            if "cost" in parts:
                log(f"cost: {args.engines} engines x {args.producers} producers, {args.per_step} chunks of "
                    f"{CHUNK_TOKENS} tokens per step, a commit of {GROUP} rows every {args.commit_every} steps, "
                    f"{args.in_flight} calls in flight per producer")
                results["cost"] = cost(directory, args, log)
                log(f"  {'mode':15s} {'appends/s':>10s} {'/ none':>7s} {'groups/s':>9s} {'/ none':>7s} "
                    f"{'step p50':>9s} {'step p99':>9s} {'commit p50':>11s} {'commit p99':>11s} "
                    f"{'primary CPU':>12s} {'standby CPU':>12s} (us per append)")
                for mode, m in results["cost"]["medians"].items():
                    log(f"  {mode:15s} {m['appends_per_s']:10.0f} {m['appends_ratio']:7.3f} {m['groups_per_s']:9.1f} "
                        f"{m['groups_ratio']:7.3f} {m['step_p50_ms']:7.1f}ms {m['step_p99_ms']:7.1f}ms "
                        f"{m['commit_p50_ms']:9.1f}ms {m['commit_p99_ms']:9.1f}ms "
                        f"{m['primary_cpu_us_per_append']:12.1f} {m['standby_cpu_us_per_append']:12.1f}")
            if "lag" in parts:
                log(f"lag: async, paced to {args.rate:.0f} appends/s")
                results["lag"] = lag(directory, args, log)
            ray.shutdown()
        if "failover" in parts:
            log("failover: primary on A, standby on B (automatic promotion), producer on C; A SIGKILLed")
            results["failover"] = failover(directory, args, log)
        if "embedded" in parts:
            log("embedded: commit cost with replication off against main's")
            results["embedded"] = embedded(args, log)
    finally:
        ray.shutdown()
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    results["uptime_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
