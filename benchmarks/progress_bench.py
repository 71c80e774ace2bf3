"""Token progress from the workers (issue 25): the fleet's append stream, generation with it on
and off, and the tokens a crash loses, side by side in one run.

    python -m benchmarks.progress_bench                 # a few minutes on 2 shared cores
    python -m benchmarks.progress_bench --quick         # under a minute: proves it runs
    python -m benchmarks.progress_bench --json benchmarks/results/progress-DATE.json
    python -m benchmarks.progress_bench --stream-only --profile owner.txt   # (a) only, py-spy of the actor
    python -m benchmarks.progress_bench --ray-modes channel,message,channel,message   # (a) through Ray only,
                                                              # these modes in this order (issue 45's channel)

(a) **The fleet's progress stream on one store** (since issue 36: 64 producers x 8 sequences per
engine step; through Ray 8 engine processes x 8 producer threads). Today's per-item path
(``record_progress_many``) and the columnar progress step message (``record_progress_step``:
in-process, and through the actor with 1, 4 and 8 messages per call), each on a fresh store; the
ceiling is a bare LMDB loop putting the same stored records 512 to a transaction. The issue's
fleet: 1,024 engines x 256 sequences, one append per 256 tokens, so about 6,400 appends/s of 2 KB
chunks. ``engines``
producer threads each own a share of the in-flight sequences and call ``record_progress_many``
once per engine step with ``per_step`` chunks of :data:`CHUNK_TOKENS` tokens (int64 ids +
float32 logprobs = 2,040 bytes), closed loop (as fast as the store takes them). Reported:
appends/s, the owner's CPU per append (in-process: ``time.thread_time`` inside the calls, summed
over threads; through the Ray actor: the actor process's CPU from ``/proc``), fsyncs per append
(the group committer's durable transactions per transition), and the owner's share of one core
at the target rate (CPU per append x 6,400/s). Baseline in the same run: a bare LMDB loop
(:class:`benchmarks.baselines.BareLmdb`, one durable transaction per engine step, one thread)
writing the same bytes.

(b) **Generation with progress on vs off.** The rollout worker on the tiny model, the same
leases, streaming every ``every`` tokens against not streaming (one engine call, commit at the
end); throughput in tokens/s, interleaved repetitions, ratio of medians.

(c) **Tokens lost per crash.** The worker generates with progress every ``every`` tokens and
stops dead at a random token (an exception from the step hook: no further append, nothing
flushed); a fresh handle then reads the durable prefixes. Lost = generated - durable, per
in-flight sequence, against the bound of one interval.

The machine is shared (7 engineers on 2 cores): absolute rates move with the load; the ratios
(against the bare loop, on against off) are the figures to read.

The module is long because its measurements share one setup (stores, workload, repetitions and
report) that only makes sense whole; the boundary rule covers it as it covers the tools (issue 48).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from benchmarks import baselines
from benchmarks.ingest_bench import cpu_seconds, remove_store, run_threads
from benchmarks.scratch import run_in_scratch
from kvckpt import BufferConfig, ReplayBuffer, codec

#: Tokens per chunk: int64 ids + float32 logprobs = 12 bytes a token, 2,040 bytes a chunk.
CHUNK_TOKENS = 170
TARGET_APPENDS_PER_S = 6400
GROUP = 8
SCHEMA = {"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"),
          "token_mask": ("int64", "token")}


def _config() -> BufferConfig:
    return BufferConfig(group_size=GROUP, schema=SCHEMA, max_buffered_rollouts=1 << 24,
                        sampler={"name": "windowed", "max_staleness_versions": 1 << 20})


def _chunk(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 150_000, (CHUNK_TOKENS,), generator=g, dtype=torch.int64),
            -torch.rand(CHUNK_TOKENS, generator=g, dtype=torch.float32))


def _plan(engines: int, per_step: int, steps: int) -> list[list[list[tuple[int, int]]]]:
    """Per engine, per step, the ``(sequence, chunk number)`` it appends: each engine owns
    ``per_step`` x 4 sequences and appends to a quarter of them each step (staggered intervals)."""
    owned = per_step * 4
    out = []
    for e in range(engines):
        seqs = [e * owned + i for i in range(owned)]
        out.append([[(seqs[(s * per_step + j) % owned], (s * per_step + j) // owned) for j in range(per_step)]
                    for s in range(steps)])
    return out


def stream_in_process(path: str, engines: int, per_step: int, steps: int) -> dict[str, Any]:
    """(a) in-process: ``engines`` threads, one ``record_progress_many`` of ``per_step`` chunks per step."""
    buf = ReplayBuffer.create(path, _config())
    plan = _plan(engines, per_step, steps)
    sequences = engines * per_step * 4
    leases = buf.admit(list(range(sequences // GROUP)))
    tokens, logprobs = _chunk(0)
    before = dict(buf.committer.stats)

    def work(e: int) -> dict[str, float]:
        cpu = 0.0
        for step in plan[e]:
            items = [{"lease": leases[seq // GROUP], "index": seq % GROUP, "start": n * CHUNK_TOKENS,
                      "tokens": tokens, "logprobs": logprobs, "weight_version": 0} for seq, n in step]
            c0 = time.thread_time()
            results = buf.record_progress_many(items)
            cpu += time.thread_time() - c0
            assert all(isinstance(r, int) for r in results), results
        return {"cpu": cpu}

    wall, parts = run_threads(engines, work)
    stats = {k: buf.committer.stats[k] - before[k] for k in before}
    buf.close()
    remove_store(path)
    appends = engines * per_step * steps
    return _stream_result(appends, wall, sum(p["cpu"] for p in parts), stats["transactions"], stats["transitions"])


def _stream_result(appends: int, wall: float, cpu: float, transactions: int, transitions: int) -> dict[str, Any]:
    per_append = cpu / appends
    return {"appends": appends, "wall_s": wall, "appends_per_s": appends / wall, "owner_cpu_us": 1e6 * per_append,
            "owner_core_share_at_target": per_append * TARGET_APPENDS_PER_S,
            "fsyncs_per_append": transactions / max(1, transitions)}


def stream_bare(path: str, engines: int, per_step: int, steps: int) -> dict[str, Any]:
    """(a) baseline: the same chunks' bytes (encoded as kvckpt stores them) put by a bare LMDB loop,
    one durable transaction per engine step, one thread."""
    tokens, logprobs = _chunk(0)
    value = codec.encode({"tokens": tokens.numpy(), "logprobs": logprobs.numpy()})
    plan = _plan(engines, per_step, steps)
    bare = baselines.BareLmdb(path)
    c0, t0 = time.thread_time(), time.perf_counter()
    for s in range(steps):
        for e in range(engines):
            bare.put_group([(f"p/{seq:08d}/{n:06d}".encode(), value) for seq, n in plan[e][s]])
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    bare.close()
    remove_store(path)
    appends = engines * per_step * steps
    out = _stream_result(appends, wall, cpu, engines * steps, appends)
    out["value_bytes"] = len(value)
    return out


def _step_message(encoder: Any, leases: list[Any], step: list[tuple[int, int]], tokens: np.ndarray,
                  logprobs: np.ndarray) -> Any:
    """One engine step's chunks (the plan's ``(sequence, chunk number)`` pairs) as one progress message."""
    n = len(step)
    return encoder.encode([leases[seq // GROUP] for seq, _ in step], [seq % GROUP for seq, _ in step],
                          [k * CHUNK_TOKENS for _, k in step], np.tile(tokens, n), np.tile(logprobs, n),
                          np.arange(n + 1) * CHUNK_TOKENS, versions=0)


def stream_in_process_step(path: str, engines: int, per_step: int, steps: int) -> dict[str, Any]:
    """(a) in-process, the columnar message: ``engines`` threads, each engine step encoded at the edge
    (the producer's thread, timed apart) into one message and recorded with ``record_progress_step``."""
    buf = ReplayBuffer.create(path, _config())
    plan = _plan(engines, per_step, steps)
    leases = buf.admit(list(range(engines * per_step * 4 // GROUP)))
    tokens, logprobs = (x.numpy() for x in _chunk(0))
    encoder = buf.progress_encoder()
    before = dict(buf.committer.stats)

    def work(e: int) -> dict[str, float]:
        cpu = edge = 0.0
        for step in plan[e]:
            c0 = time.thread_time()
            message = _step_message(encoder, leases, step, tokens, logprobs)
            c1 = time.thread_time()
            results = buf.record_progress_step(message)
            cpu += time.thread_time() - c1
            edge += c1 - c0
            assert all(isinstance(r, int) for r in results), results
        return {"cpu": cpu, "edge": edge}

    wall, parts = run_threads(engines, work)
    stats = {k: buf.committer.stats[k] - before[k] for k in before}
    buf.close()
    remove_store(path)
    appends = engines * per_step * steps
    out = _stream_result(appends, wall, sum(p["cpu"] for p in parts), stats["transactions"], appends)
    out["edge_cpu_us"] = 1e6 * sum(p["edge"] for p in parts) / appends
    return out


def stream_bare_rounds(path: str, engines: int, per_step: int, steps: int, per_txn: int) -> dict[str, Any]:
    """(a) the ceiling: the same stored chunk records (as the message path stores them) put by a bare
    LMDB loop, ``per_txn`` values per durable transaction, one thread, nothing checked."""
    tokens, logprobs = _chunk(0)
    value = codec.encode({"tokens": tokens.numpy(), "logprobs": logprobs.numpy()},
                         {"group_id": "a0-p0", "index": 0, "start": 0, "length": CHUNK_TOKENS, "version": 0}, level=0)
    plan = _plan(engines, per_step, steps)
    puts = [(f"p/{seq:08d}/{n:06d}".encode(), value)
            for s in range(steps) for e in range(engines) for seq, n in plan[e][s]]
    bare = baselines.BareLmdb(path)
    c0, t0 = time.thread_time(), time.perf_counter()
    for i in range(0, len(puts), per_txn):
        bare.put_group(puts[i:i + per_txn])
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    bare.close()
    remove_store(path)
    out = _stream_result(len(puts), wall, cpu, -(-len(puts) // per_txn), len(puts))
    out.update(value_bytes=len(value), values_per_txn=per_txn)
    return out


#: Progress messages per actor call (``BufferClient(batch_steps=...)``) of each message mode.
BATCH_STEPS = {"message": 1, "message_batched": 4, "message_batched_8": 8}


def stream_ray_paths(path: str, actors: int, producers: int, per_step: int, steps: int,
                     modes: tuple[str, ...] = ("items", "message", "message_batched", "message_batched_8"),
                     profile: str | None = None) -> dict[str, Any]:
    """(a) through the buffer actor, each mode in turn on a fresh store: ``actors`` engine processes,
    each running ``producers`` producer threads (``actors * producers`` producers in all). ``items``:
    today's ``BufferClient.record_progress_many``, one blocking actor call per engine step;
    ``message``: one columnar message per engine step with ``BufferClient.record_progress_step``,
    pipelined (``max_in_flight`` 4), one message per call; ``message_batched`` (``_8``): the same,
    4 (8) steps' messages per call (:data:`BATCH_STEPS`); ``channel``: one message per producer call over
    the actor's direct progress channel (``BufferClient(channel=True)``, ``max_in_flight`` 4). A mode may
    be named more than once (alternating runs): ``runs`` lists every run in order, ``out[mode]`` is the
    mode's last. The owner's CPU is the actor process's (``/proc``); ``profile``: a file to write a
    py-spy profile of the owner to (the last run). A mode ``M@RATE`` is mode ``M`` paced to ``RATE``
    appends/s in all (each producer's step ``k`` leaves ``k`` intervals after its start), not closed
    loop: the owner's cost at that rate, with the rounds it makes at that rate."""
    import ray
    from kvckpt.integrations.ray import BufferClient, init_local_ray, start_buffer_actor

    @ray.remote(num_cpus=0)
    class Engines:
        """``producers`` rollout engine stand-ins in one process, one thread each."""

        def __init__(self, actor: Any) -> None:
            self.actor = actor
            self.client = BufferClient(actor)  # fetches the config once (the edge encoder's)

        def ready(self) -> bool:
            return True

        def run(self, leases: list[Any], plans: list[list[list[tuple[int, int]]]], mode: str,
                interval: float = 0.0) -> dict[str, float]:
            import threading

            tokens, logprobs = (x.numpy() for x in _chunk(0))
            encoder = self.client.progress_encoder()
            edge = [0.0] * len(plans)

            def produce(p: int) -> None:
                client = BufferClient(self.actor, encode_at_edge=False, max_in_flight=4,
                                      batch_steps=BATCH_STEPS.get(mode, 1), channel=mode == "channel")
                assert client.channel == (mode == "channel")
                futures = []
                start = time.monotonic()
                for k, step in enumerate(plans[p]):
                    if interval:  # paced: step k leaves at start + k * interval (or at once when behind)
                        time.sleep(max(0.0, start + k * interval - time.monotonic()))
                    if mode == "items":
                        items = [{"lease": leases[seq // GROUP], "index": seq % GROUP, "start": n * CHUNK_TOKENS,
                                  "tokens": tokens, "logprobs": logprobs, "weight_version": 0} for seq, n in step]
                        results = client.record_progress_many(items)
                        assert all(isinstance(r, int) for r in results), results
                    else:
                        c0 = time.thread_time()
                        message = _step_message(encoder, leases, step, tokens, logprobs)
                        edge[p] += time.thread_time() - c0
                        futures.append(client.record_progress_step(message))
                client.flush()
                for f in futures:
                    assert all(isinstance(r, int) for r in f.result()), f.result()

            threads = [threading.Thread(target=produce, args=(p,)) for p in range(len(plans))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return {"edge": sum(edge)}

    engines = actors * producers
    plan = _plan(engines, per_step, steps)
    out: dict[str, Any] = {"actors": actors, "producers_per_actor": producers, "runs": []}
    init_local_ray(num_cpus=actors + 2, object_store_memory=1 << 29, address="local")  # never join another's
    try:
        for n, named in enumerate(modes):
            mode, _, rate = named.partition("@")
            interval = engines * per_step / float(rate) if rate else 0.0
            store = f"{path}.{mode}.{n}"
            actor = start_buffer_actor(store, _config().to_dict(), name=f"progress-bench-{mode}-{n}")
            pid = ray.get(actor.info.remote())["pid"]
            leases = ray.get(actor.admit.remote(list(range(engines * per_step * 4 // GROUP))))
            workers = [Engines.remote(actor) for _ in range(actors)]
            ray.get([w.ready.remote() for w in workers])  # started before the clock
            before = ray.get(actor.stats.remote())
            spy = _py_spy(pid, profile) if profile and n == len(modes) - 1 else None
            cpu0, t0 = cpu_seconds(pid), time.perf_counter()
            parts = ray.get([w.run.remote(leases, plan[a * producers:(a + 1) * producers], mode, interval)
                             for a, w in enumerate(workers)])
            wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its profile on an interrupt
                spy.wait(timeout=120)
            after = ray.get(actor.stats.remote())
            ray.get(actor.close.remote())
            for w in [*workers, actor]:
                ray.kill(w)
            remove_store(store)
            appends = engines * per_step * steps
            doc = _stream_result(appends, wall, cpu, after["commit_transactions"] - before["commit_transactions"],
                                 appends)
            doc["calls"] = {"items": engines * steps, "channel": after["actor_channel_rounds"]}.get(
                mode, after["actor_step_calls"] - before["actor_step_calls"])  # the channel's: its record rounds
            doc["mode"], doc["loadavg"] = named, os.getloadavg()[0]
            doc["edge_cpu_us"] = 1e6 * sum(p["edge"] for p in parts) / appends
            out[named] = doc
            out["runs"].append(doc)
    finally:
        ray.shutdown()
    return out


def _py_spy(pid: int, dest: str) -> Any:
    """Start ``py-spy record`` on the owner (its native frames off: Python time per function)."""
    import subprocess

    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    return subprocess.Popen([spy, "record", "-p", str(pid), "-o", dest, "-f", "raw", "-r", "200", "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def generation(directory: str, max_tokens: int, every: int, prompts: int, reps: int) -> dict[str, Any]:
    """(b) tokens/s of the rollout worker with progress every ``every`` tokens and without."""
    from kvckpt.integrations.vllm import DEFAULT_SCHEMA, RolloutWorker, ensure_tiny_model

    model = ensure_tiny_model(os.path.join(directory, "tiny-model"))
    workers = {"off": RolloutWorker(model, max_tokens=max_tokens, progress_every_tokens=0, seed=1),
               "on": RolloutWorker(model, max_tokens=max_tokens, progress_every_tokens=every, seed=1,
                                   backend_options={"step_tokens": max_tokens})}
    # the transformers backend re-prompts at each engine step: with "step_tokens" = the budget both
    # sides run the same single engine call per batch, and "on" records its progress at the end of
    # every engine step that crossed an interval (a vLLM engine step is one token: see docs)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    appends = 0
    for rep in range(reps):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            path = os.path.join(directory, f"gen-{mode}-{rep}.kv")
            with ReplayBuffer.create(path, BufferConfig(group_size=GROUP, schema=DEFAULT_SCHEMA,
                                                        max_buffered_rollouts=prompts)) as buf:
                leases = buf.admit(list(range(prompts)))
                t0 = time.perf_counter()
                workers[mode].run(buf, leases)
                wall = time.perf_counter() - t0
                rows = buf.read_batch([lease.group_id for lease in leases], layout="list").rows
            generated = sum(int(r["token_mask"].sum()) for r in rows)
            rates[mode].append(generated / wall)
            remove_store(path)
    appends = workers["on"].progress_stats["appends"]
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    return {"max_tokens": max_tokens, "every": every, "prompts": prompts, "group": GROUP, "reps": reps,
            "tokens_per_s_off": off, "tokens_per_s_on": on, "on_over_off": on / off, "rates": rates,
            "appends_on": appends}


class _Crash(Exception):
    """The stand-in for the worker's process dying at this step (no append after it)."""


def crashes(directory: str, max_tokens: int, every: int, kills: int, seed: int) -> dict[str, Any]:
    """(c) tokens lost per in-flight sequence when the worker dies at a random token."""
    from kvckpt.integrations.vllm import DEFAULT_SCHEMA, RolloutWorker, ensure_tiny_model

    model = ensure_tiny_model(os.path.join(directory, "tiny-model"))
    worker = RolloutWorker(model, max_tokens=max_tokens, temperature=0.0, progress_every_tokens=every,
                           backend_options={"step_tokens": 1})
    rng = random.Random(seed)
    runs = []
    for k in range(kills):
        kill_at = rng.randrange(1, max_tokens)
        path = os.path.join(directory, f"crash-{k}.kv")
        seen: dict[tuple[str, int], int] = {}

        def step(states: Any, kill_at: int = kill_at, seen: dict[tuple[str, int], int] = seen) -> None:
            for s in states:
                seen[(s.lease.group_id, s.index)] = s.generated
            if states[0].generated >= kill_at:
                raise _Crash

        config = BufferConfig(group_size=GROUP, schema=DEFAULT_SCHEMA, max_buffered_rollouts=4)
        with ReplayBuffer.create(path, config) as buf, contextlib.suppress(_Crash):
            worker.run(buf, buf.admit([10, 26]), after_step=step)
        with ReplayBuffer.open(path) as buf:
            durable = {(e.group_id, i): p.length for e in buf.ledger() for i, p in buf.progress(e.group_id).items()}
        lost = [generated - durable.get(key, 0) for key, generated in seen.items()]
        runs.append({"kill_at": kill_at, "sequences": len(lost), "generated": sum(seen.values()),
                     "durable": sum(durable.values()), "lost": sum(lost), "lost_max_per_sequence": max(lost)})
        remove_store(path)
    worst = max(r["lost_max_per_sequence"] for r in runs)
    return {"max_tokens": max_tokens, "every": every, "runs": runs, "lost_max_per_sequence": worst,
            "lost_per_sequence_over_interval": worst / every,
            "lost_over_inflight": sum(r["lost"] for r in runs) / max(1, sum(r["generated"] for r in runs))}


def run(quick: bool, directory: str, log: Any = print, *, stream_only: bool = False,
        profile: str | None = None, ray_modes: tuple[str, ...] = (), steps: int | None = None) -> dict[str, Any]:
    """Every part, in order (``stream_only``: part (a) only; ``ray_modes``: only those runs through
    Ray, in that order; ``steps``: engine steps per producer instead of the default); returns the results
    document."""
    # the issue's shape: 64 producers x 8 sequences per engine step (through Ray: 8 engine processes
    # x 8 producer threads)
    actors, producers, per_step, default_steps = (2, 4, 8, 3) if quick else (8, 8, 8, 20)
    steps = steps or default_steps
    engines = actors * producers
    result: dict[str, Any] = {"argv": " ".join(shlex.quote(a) for a in sys.argv), "quick": quick,
                              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                          "loadavg_start": os.getloadavg()[0]},
                              "stream": {"engines": engines, "per_step": per_step, "steps": steps,
                                         "chunk_tokens": CHUNK_TOKENS, "target_appends_per_s": TARGET_APPENDS_PER_S}}
    s = result["stream"]
    if ray_modes:
        ray_docs = stream_ray_paths(os.path.join(directory, "stream-ray.kv"), actors, producers, per_step, steps,
                                    ray_modes, profile=profile)
        s["ray_engines"], s["ray_runs"] = {"actors": actors, "producers_per_actor": producers}, ray_docs["runs"]
        for doc in ray_docs["runs"]:
            log(f"(a) ray_{doc['mode']}: {doc['appends_per_s']:.0f} appends/s, owner CPU {doc['owner_cpu_us']:.1f} "
                f"us/append ({100 * doc['owner_core_share_at_target']:.0f}% of a core at {TARGET_APPENDS_PER_S}/s), "
                f"{doc['fsyncs_per_append']:.4f} fsyncs/append, {doc['calls']} calls, load {doc['loadavg']:.1f}")
        result["machine"]["loadavg_end"] = os.getloadavg()[0]
        return result
    parts = (("bare", lambda p: stream_bare(p, engines, per_step, steps)),
             ("bare_rounds", lambda p: stream_bare_rounds(p, engines, per_step, steps, engines * per_step)),
             ("in_process", lambda p: stream_in_process(p, engines, per_step, steps)),
             ("in_process_step", lambda p: stream_in_process_step(p, engines, per_step, steps)))
    for name, fn in parts:
        s[name] = fn(os.path.join(directory, f"stream-{name}.kv"))
    ray_docs = stream_ray_paths(os.path.join(directory, "stream-ray.kv"), actors, producers, per_step, steps,
                                profile=profile)
    s["ray_engines"] = {"actors": actors, "producers_per_actor": producers}
    s.update({f"ray_{mode}": ray_docs[mode] for mode in BATCH_STEPS.keys() | {"items"}})
    for name in ("bare", "bare_rounds", "in_process", "in_process_step", "ray_items", "ray_message",
                 "ray_message_batched", "ray_message_batched_8"):
        doc = s[name]
        log(f"(a) {name}: {doc['appends_per_s']:.0f} appends/s, owner CPU {doc['owner_cpu_us']:.0f} us/append "
            f"({100 * doc['owner_core_share_at_target']:.0f}% of a core at {TARGET_APPENDS_PER_S}/s), "
            f"{doc['fsyncs_per_append']:.3f} fsyncs/append")
    s["ratios"] = {f"{k}_over_bare_rounds": {"appends_per_s": s[k]["appends_per_s"] / s["bare_rounds"]["appends_per_s"],
                                             "owner_cpu": s[k]["owner_cpu_us"] / s["bare_rounds"]["owner_cpu_us"]}
                   for k in ("in_process", "in_process_step", "ray_items", "ray_message", "ray_message_batched",
                             "ray_message_batched_8")}
    if stream_only:
        result["machine"]["loadavg_end"] = os.getloadavg()[0]
        return result
    gen = generation(directory, 32 if quick else 128, 16 if quick else 32, 2 if quick else 4, 2 if quick else 5)
    result["generation"] = gen
    log(f"(b) generation: {gen['tokens_per_s_on']:.0f} tokens/s with progress every {gen['every']} tokens, "
        f"{gen['tokens_per_s_off']:.0f} without: {100 * gen['on_over_off']:.1f}%")
    crash = crashes(directory, 24 if quick else 48, 8 if quick else 16, 2 if quick else 6, seed=0)
    result["crashes"] = crash
    log(f"(c) crashes: at most {crash['lost_max_per_sequence']} tokens lost per sequence with progress every "
        f"{crash['every']} ({crash['lost_per_sequence_over_interval']:.2f} of an interval); "
        f"{100 * crash['lost_over_inflight']:.0f}% of the in-flight tokens lost")
    result["machine"]["loadavg_end"] = os.getloadavg()[0]
    return result


#: One in-process run of a tree (``python -c``, the tree first on ``sys.path``): ``stream_in_process_step`` 64 x 8
#: and the bare loop at 512 values per transaction beside it, with the process's CPU and context switches.
_IN_PROCESS_RUN = """
import json, os, resource, sys, tempfile
tree, steps = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, tree)
from benchmarks import progress_bench as pb
import kvckpt
assert kvckpt.__file__.startswith(tree), kvckpt.__file__
work = tempfile.mkdtemp(dir=sys.argv[3])
load = os.getloadavg()[0]
r0 = resource.getrusage(resource.RUSAGE_SELF)
r = pb.stream_in_process_step(os.path.join(work, "s.kv"), 64, 8, steps)
r1 = resource.getrusage(resource.RUSAGE_SELF)
b = pb.stream_bare_rounds(os.path.join(work, "b.kv"), 64, 8, steps, 512)
n = 64 * 8 * steps
print(json.dumps({"load": load, "appends_per_s": r["appends_per_s"], "owner_cpu_us": r["owner_cpu_us"],
                  "edge_cpu_us": r["edge_cpu_us"], "fsyncs_per_append": r["fsyncs_per_append"],
                  "process_cpu_us": 1e6 * (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / n,
                  "voluntary_switches": (r1.ru_nvcsw - r0.ru_nvcsw) / n,
                  "involuntary_switches": (r1.ru_nivcsw - r0.ru_nivcsw) / n, "bare_appends_per_s": b["appends_per_s"]}))
"""


def in_process_pairs(trees: list[str], pairs: int, steps: int, work: str) -> list[dict[str, Any]]:
    """(a) in-process, two source trees side by side (issue 45): ``pairs`` pairs of fresh-process runs of
    ``stream_in_process_step`` 64 x 8 (and the bare loop beside each), the trees' order alternating."""
    import subprocess

    out = []
    for pair in range(pairs):
        for tree in trees if pair % 2 == 0 else trees[::-1]:
            done = subprocess.run([sys.executable, "-c", _IN_PROCESS_RUN, os.path.abspath(tree), str(steps), work],
                                  capture_output=True, text=True, check=True, cwd=work)
            row = {"pair": pair, "tree": tree, **json.loads(done.stdout.strip().splitlines()[-1])}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.progress_bench [--quick] [--json PATH] [--work DIR]``, or
    ``--in-process-pairs TREE_A TREE_B [--pairs N]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.progress_bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--work", help="scratch directory, kept (default: a new one under /var/tmp, removed)")
    parser.add_argument("--stream-only", action="store_true", help="part (a) only")
    parser.add_argument("--profile", help="write a py-spy profile (raw, folded stacks) of the actor here")
    parser.add_argument("--ray-modes", default="", help="only (a) through Ray, these comma-separated modes in order "
                        "(items, message, message_batched, message_batched_8, channel; a mode may repeat)")
    parser.add_argument("--steps", type=int, help="engine steps per producer (default 20; --quick 3)")
    parser.add_argument("--in-process-pairs", nargs=2, metavar="TREE",
                        help="(a) in-process only, two source trees alternately (e.g. a `git archive` of main and .)")
    parser.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args(argv)
    if args.in_process_pairs:
        run_in_scratch("kvckpt-progress-pairs-", args.work, args.json,
                       lambda work: {"runs": in_process_pairs(args.in_process_pairs, args.pairs, args.steps or 20,
                                                              work)})
        return 0
    modes = tuple(m for m in args.ray_modes.split(",") if m)
    run_in_scratch("kvckpt-progress-bench-", args.work, args.json,
                   lambda work: run(args.quick, work, stream_only=args.stream_only, profile=args.profile,
                                    ray_modes=modes, steps=args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
