"""What streaming progress costs the generating engine, measured with vLLM (issue 36's third target).

    .venv-vllm/bin/python -m benchmarks.vllm_progress_cost          # a few minutes on 2 shared cores
    .venv-vllm/bin/python -m benchmarks.vllm_progress_cost --quick  # about a minute: proves it runs
    .venv-vllm/bin/python -m benchmarks.vllm_progress_cost --json benchmarks/results/vllm-progress-DATE.json
    .venv-vllm/bin/python -m benchmarks.vllm_progress_cost --worker   # the shipped worker, paired on/off
    .venv-vllm/bin/python -m benchmarks.vllm_progress_cost --worker --rounds 20  # and its parts: worker_rounds

Build ``.venv-vllm`` first (``bash scripts/setup_peer_env.sh vllm``). It has no Ray, and needs
none here: the engine side of a fleet's progress is the producer's edge, which this measures
without importing Ray. vLLM's CPU engine (:class:`kvckpt.integrations.vllm.backends.VLLMBackend`,
in-process, the tiny model of :mod:`kvckpt.testing.fixtures.tiny_model`) generates ``sequences``
sequences greedily, one token per sequence per engine step, with an ``on_step`` hook:

* ``off``: no hook (vLLM alone);
* ``on``: the producer's edge per engine step, as a fleet's engine runs it: take the step's new
  tokens, and when sequences are due (``every`` unrecorded tokens) encode ONE progress step
  message of them (:class:`kvckpt.ProgressEncoder`, cast + concatenate + checksum) and send its
  bytes over a loopback TCP socket, pipelined (a reader thread takes the acknowledgements, as
  Ray's client threads do; the engine waits for the last one before its clock stops).

The other end is a separate process, one of two kinds, each a row of the table:

* ``sink``: it reads each message and acknowledges it: the engine-side cost alone (on a fleet
  the owner runs on another node);
* ``owner``: it records each message with :meth:`kvckpt.ReplayBuffer.record_progress_steps` on a
  real store and acknowledges once durable; on this 2-core box it takes CPU from the engine, so
  this is an upper bound of the engine-side cost, not the cost itself.

Reported per interval: generated tokens/s with progress on and off (interleaved repetitions,
median), their ratio (the target: ``on`` keeps >= 97% of ``off``), the engine step time, and the
producer's CPU per message and per step (``time.thread_time`` of the hook). Greedy sampling
generates the same tokens in both modes. Absolute rates move with the shared machine's load;
read the ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from benchmarks.scratch import run_in_scratch
from kvckpt import BufferConfig, Lease, ProgressEncoder, ReplayBuffer

GROUP = 8
#: a message's frame: its length, then its bytes; an acknowledgement: the sequences it recorded
_FRAME = struct.Struct("<I")


def serve(port: int, store: str) -> None:
    """The other end (a separate process): accept one connection, then per message frame
    acknowledge it: read only (``store`` empty) or recorded on the store at ``store``, every
    message available at once in one ``record_progress_steps`` (durable before the acknowledgement)."""
    buf = ReplayBuffer.open(store) if store else None
    with socket.create_server(("127.0.0.1", port)) as server:
        print("ready", flush=True)
        conn, _ = server.accept()
    data = bytearray()
    with conn:
        while chunk := conn.recv(1 << 20):
            data += chunk
            frames, pos, done = [], 0, False
            while len(data) - pos >= _FRAME.size:
                (size,) = _FRAME.unpack_from(data, pos)
                done = size == 0  # the engine is done
                if done or len(data) - pos - _FRAME.size < size:
                    break
                frames.append(bytes(data[pos + _FRAME.size:pos + _FRAME.size + size]))
                pos += _FRAME.size + size
            del data[:pos]
            results = buf.record_progress_steps(frames) if buf is not None else [[0]] * len(frames)
            for result in results:
                if isinstance(result, BaseException) or any(isinstance(r, BaseException) for r in result):
                    raise SystemExit(f"the owner refused a message: {result}")
            conn.sendall(b"".join(_FRAME.pack(len(r)) for r in results) + (_FRAME.pack(0) if done else b""))
            if done:
                break
    if buf is not None:
        buf.close()


class Edge:
    """The producer's edge of one engine: per engine step, the due sequences' new tokens as one
    progress message, sent pipelined to the other end."""

    def __init__(self, encoder: ProgressEncoder, owners: list[tuple[Lease, int]], every: int, port: int) -> None:
        self.encoder, self.owners, self.every = encoder, owners, every
        self.pending: list[list[int]] = [[] for _ in owners]
        self.pending_logprobs: list[list[float]] = [[] for _ in owners]
        self.durable = [0] * len(owners)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sent = self.acked = self.steps = 0
        self.cpu = 0.0
        self._reader = threading.Thread(target=self._read_acks, daemon=True)
        self._reader.start()

    def _read_acks(self) -> None:
        with self.sock.makefile("rb") as f:
            while (head := f.read(_FRAME.size)) and len(head) == _FRAME.size:
                if _FRAME.unpack(head)[0] == 0:
                    return
                self.acked += 1

    def on_step(self, deltas: Any) -> tuple[()]:
        """vLLM's ``on_step``: one engine step's ``(sequence, new ids, logprobs)``."""
        c0 = time.thread_time()
        self.steps += 1
        for i, ids, logprobs in deltas:
            self.pending[i] += ids
            self.pending_logprobs[i] += logprobs
        self._send([i for i, p in enumerate(self.pending) if len(p) >= self.every])
        self.cpu += time.thread_time() - c0
        return ()

    def _send(self, due: list[int]) -> None:
        if not due:
            return
        lengths = [len(self.pending[i]) for i in due]
        message = self.encoder.encode(
            [self.owners[i][0] for i in due], [self.owners[i][1] for i in due], [self.durable[i] for i in due],
            np.fromiter((t for i in due for t in self.pending[i]), np.int64, sum(lengths)),
            np.fromiter((x for i in due for x in self.pending_logprobs[i]), np.float32, sum(lengths)),
            np.concatenate([[0], np.cumsum(lengths)]), versions=0)
        self.sock.sendall(_FRAME.pack(len(message.value)) + message.value)
        self.sent += 1
        for i, n in zip(due, lengths, strict=True):
            self.durable[i] += n
            self.pending[i], self.pending_logprobs[i] = [], []

    def finish(self) -> None:
        """Send what is pending (the sequences' last chunks), then wait for every acknowledgement."""
        c0 = time.thread_time()
        self._send([i for i, p in enumerate(self.pending) if p])
        self.cpu += time.thread_time() - c0
        self.sock.sendall(_FRAME.pack(0))
        self._reader.join()
        self.sock.close()


def start_other_end(directory: str, kind: str, config: BufferConfig, prompts: int) -> tuple[Any, int, list[Lease]]:
    """Start the other end; returns the process, its port and the leases to stream under."""
    store = os.path.join(directory, f"owner-{time.monotonic_ns()}.kv")
    with ReplayBuffer.create(store, config) as buf:
        leases = buf.admit(list(range(prompts)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.vllm_progress_cost", "--serve", str(port),
                             store if kind == "owner" else ""], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the other end did not start")
    return proc, port, leases


def run(quick: bool, directory: str, log: Any = print) -> dict[str, Any]:
    """Every interval and kind, ``off`` and ``on`` interleaved; returns the results document."""
    from kvckpt.integrations.vllm import DEFAULT_SCHEMA, ensure_tiny_model
    from kvckpt.integrations.vllm.backends import VLLMBackend
    from kvckpt.integrations.vllm.stream import Continuation

    sequences, max_tokens, reps = (16, 48, 2) if quick else (32, 128, 5)
    configs = (("sink", 1), ("owner", 16)) if quick else (("sink", 1), ("sink", 16), ("sink", 64), ("owner", 16))
    model = ensure_tiny_model(os.path.join(directory, "tiny-model"))
    backend = VLLMBackend(model, seed=1)
    prompt_ids = backend.tokenizer.encode("12+34=")
    seqs = [Continuation((*prompt_ids, i % 7)) for i in range(sequences)]
    config = BufferConfig(group_size=GROUP, schema=DEFAULT_SCHEMA, max_buffered_rollouts=sequences // GROUP)
    encoder = ProgressEncoder.from_config(config.to_dict())
    backend.stream(seqs, max_tokens, 0.0)  # warm-up: the first engine steps compile and allocate
    result: dict[str, Any] = {"argv": " ".join(shlex.quote(a) for a in sys.argv), "quick": quick,
                              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                          "loadavg_start": os.getloadavg()[0]},
                              "sequences": sequences, "max_tokens": max_tokens, "reps": reps, "runs": {}}
    for kind, every in configs:
        rates: dict[str, list[float]] = {"off": [], "on": []}
        on_docs = []
        for rep in range(reps):
            for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                edge = proc = None
                if mode == "on":
                    proc, port, leases = start_other_end(directory, kind, config, sequences // GROUP)
                    edge = Edge(encoder, [(leases[i // GROUP], i % GROUP) for i in range(sequences)], every, port)
                t0 = time.perf_counter()
                samples = backend.stream(seqs, max_tokens, 0.0, None if edge is None else edge.on_step)
                if edge is not None:
                    edge.finish()
                wall = time.perf_counter() - t0
                generated = sum(len(s.completion_ids) for s in samples)
                rates[mode].append(generated / wall)
                if edge is not None:
                    proc.wait(timeout=60)
                    if proc.returncode:
                        raise RuntimeError(f"the {kind} process failed ({proc.returncode})")
                    on_docs.append({"steps": edge.steps, "messages": edge.sent, "acked": edge.acked,
                                    "edge_cpu_s": edge.cpu, "wall_s": wall, "tokens": generated})
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        cpu, wall = sum(d["edge_cpu_s"] for d in on_docs), sum(d["wall_s"] for d in on_docs)
        steps, messages = sum(d["steps"] for d in on_docs), sum(d["messages"] for d in on_docs)
        run_doc = {"kind": kind, "every": every, "tokens_per_s_off": off, "tokens_per_s_on": on,
                   "on_over_off": on / off,
                   "paired_on_over_off": statistics.median(a / b for a, b in zip(rates["on"], rates["off"],
                                                                                 strict=True)),
                   "rates": rates, "engine_steps": on_docs[-1]["steps"], "messages": on_docs[-1]["messages"],
                   "step_ms_off": 1e3 * on_docs[-1]["tokens"] / off / on_docs[-1]["steps"],
                   "edge_us_per_step": 1e6 * cpu / steps, "edge_us_per_message": 1e6 * cpu / max(1, messages),
                   "edge_share_of_wall": cpu / wall}
        result["runs"][f"{kind}-every-{every}"] = run_doc
        log(f"{kind}, every {every} tokens: {on:.0f} tokens/s with progress, {off:.0f} without: "
            f"{100 * on / off:.1f}% (paired {100 * run_doc['paired_on_over_off']:.1f}%); "
            f"edge {run_doc['edge_us_per_message']:.0f} us per message, "
            f"{100 * run_doc['edge_share_of_wall']:.2f}% of the engine's wall time; "
            f"{run_doc['messages']} messages over {run_doc['engine_steps']} engine steps")
    result["machine"]["loadavg_end"] = os.getloadavg()[0]
    return result


#: The runs of one ``--worker`` round: the shipped worker with progress off and on, and the three parts of the
#: difference, each alone: the engine's one-call path, its streaming path, and streaming with the recorder and a store.
WORKER_MODES = ("off", "on", "generate", "stream", "recorded")
#: The paired ratios ``--worker`` reports: (name, numerator mode, denominator mode).
WORKER_RATIOS = (("on/off", "on", "off"), ("stream/generate", "stream", "generate"),
                 ("recorded/stream", "recorded", "stream"), ("recorded/generate", "recorded", "generate"))


def _quartiles(values: list[float]) -> dict[str, float]:
    """Median, quartiles and range of ``values`` (statistics.quantiles' inclusive method)."""
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": q2, "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def worker_rounds(quick: bool, directory: str, log: Any = print, rounds: int | None = None) -> dict[str, Any]:
    """The shipped vLLM worker (:class:`kvckpt.integrations.vllm.RolloutWorker`, vLLM backend, in-process
    store) with progress on (every ``every`` tokens, through its one recorder and the step message) and
    off, and the parts of the difference, in paired rounds (:data:`WORKER_MODES`, each round in a rotated
    order, every store fresh):

    * ``off`` / ``on``: ``worker.run`` (generation, progress when on, the final commit);
    * ``generate``: ``backend.generate`` alone (what ``off`` generates with: one ``LLM.generate``);
    * ``stream``: ``backend.stream`` with no ``on_step`` (the engine's streaming path alone);
    * ``recorded``: ``stream_leases`` on a fresh store (streaming, the recorder and its durable appends; no commit).

    Every completion is exactly ``max_tokens`` long (``min_tokens=max_tokens``: end-of-text is not sampled
    early), so every mode generates the same number of tokens (asserted). Per run: tokens/s, this
    process's CPU seconds per token (the engine runs in it), and the run's wall time split in two: the
    engine core's (``engine_core.get_output``: scheduling and the model step, the same work in every mode)
    and the host's (the rest: vLLM's output processing, the worker's loop, the recorder, the store). On a
    shared machine the core's time swings with whoever else runs on its cores; the host-projected ratio
    (``off``'s wall with its host time replaced by ``on``'s, per round) keeps that swing out of the
    comparison of what progress adds."""
    from kvckpt.integrations.vllm import DEFAULT_SCHEMA, RolloutWorker, ensure_tiny_model
    from kvckpt.integrations.vllm.stream import Continuation
    from kvckpt.integrations.vllm.worker import stream_leases

    prompts, max_tokens, every, default_rounds = (2, 48, 16, 3) if quick else (4, 128, 32, 10)
    rounds = rounds or default_rounds
    model = ensure_tiny_model(os.path.join(directory, "tiny-model"))
    worker = RolloutWorker(model, backend="vllm", max_tokens=max_tokens, temperature=1.0, seed=1,
                           progress_every_tokens=every, drain_seconds=None,
                           backend_options={"min_tokens": max_tokens})
    backend = worker.backend
    core = backend.llm.llm_engine.engine_core
    core_s = [0.0]
    get_output = core.get_output

    def timed_get_output() -> Any:
        """The engine core's step (scheduling and the model), timed."""
        t = time.perf_counter()
        try:
            return get_output()
        finally:
            core_s[0] += time.perf_counter() - t

    core.get_output = timed_get_output
    config = BufferConfig(group_size=GROUP, schema=DEFAULT_SCHEMA, max_buffered_rollouts=prompts)
    expected = prompts * GROUP * max_tokens

    def one(mode: str, n: int) -> tuple[float, float, float, float]:
        """Tokens/s, this process's CPU seconds per token, and the engine core's and the host's wall seconds
        per token of one run of ``mode``."""
        worker.progress_every_tokens = every if mode == "on" else 0  # the same worker, streaming or not
        with ReplayBuffer.create(os.path.join(directory, f"worker-{mode}-{n}.kv"), config) as buf:
            leases = buf.admit(list(range(prompts)))
            ids = [worker.prompt_ids(lease) for lease in leases]
            t0, c0, core_s[0] = time.perf_counter(), time.process_time(), 0.0
            if mode in ("off", "on"):
                results = worker.run(buf, leases)
            elif mode == "generate":
                samples = backend.generate(ids, [GROUP] * prompts, max_tokens, worker.temperature)
            elif mode == "stream":
                samples = backend.stream([Continuation(tuple(p)) for p in ids for _ in range(GROUP)], max_tokens,
                                         worker.temperature)
            else:
                samples, _ = stream_leases(buf, backend, leases, ids, max_tokens=max_tokens,
                                           temperature=worker.temperature, weight_version=0, every_tokens=every,
                                           every_seconds=None)
            wall, cpu, in_core = time.perf_counter() - t0, time.process_time() - c0, core_s[0]
            if mode in ("off", "on"):
                assert all(getattr(r, "ready", False) for r in results), results
                tokens = sum(int(r["token_mask"].sum())
                             for r in buf.read_batch([lease.group_id for lease in leases], layout="list").rows)
            else:
                flat = [s for group in samples for s in group] if mode != "stream" else samples
                tokens = sum(len(s.completion_ids) for s in flat)
        assert tokens == expected, f"{mode}: {tokens} tokens, not {expected}"
        return tokens / wall, cpu / tokens, in_core / tokens, (wall - in_core) / tokens

    one("off", -1)  # warm-up: the engine's first steps compile and allocate
    one("on", -1)
    rates: dict[str, list[float]] = {m: [] for m in WORKER_MODES}
    cpu: dict[str, list[float]] = {m: [] for m in WORKER_MODES}
    core_t: dict[str, list[float]] = {m: [] for m in WORKER_MODES}
    host_t: dict[str, list[float]] = {m: [] for m in WORKER_MODES}
    loads = []
    appends0 = worker.progress_stats["appends"]
    for n in range(rounds):
        order = WORKER_MODES[n % len(WORKER_MODES):] + WORKER_MODES[:n % len(WORKER_MODES)]
        loads.append(os.getloadavg()[0])
        for mode in order if n % 2 == 0 else order[::-1]:
            rate, per_token, in_core, host = one(mode, n)
            rates[mode].append(rate)
            cpu[mode].append(per_token)
            core_t[mode].append(in_core)
            host_t[mode].append(host)
    ratios = {name: {"tokens_per_s": _quartiles([a / b for a, b in zip(rates[x], rates[y], strict=True)]),
                     "cpu_per_token": _quartiles([a / b for a, b in zip(cpu[x], cpu[y], strict=True)]),
                     # y's wall per token with its host time replaced by x's: x's throughput at y's core time
                     "host_projected": _quartiles([(cy + hy) / (cy + hx) for cy, hy, hx in
                                                   zip(core_t[y], host_t[y], host_t[x], strict=True)])}
              for name, x, y in WORKER_RATIOS}
    on_off = ratios["on/off"]["tokens_per_s"]
    doc = {"prompts": prompts, "group": GROUP, "max_tokens": max_tokens, "min_tokens": max_tokens, "every": every,
           "rounds": rounds, "tokens_per_run": expected, "modes": list(WORKER_MODES), "rates": rates,
           "cpu_s_per_token": cpu, "core_s_per_token": core_t, "host_s_per_token": host_t,
           "loadavg_per_round": loads, "ratios": ratios,
           "median_us_per_token": {m: {"core": 1e6 * statistics.median(core_t[m]),
                                       "host": 1e6 * statistics.median(host_t[m])} for m in WORKER_MODES},
           "median_tokens_per_s": {m: statistics.median(v) for m, v in rates.items()},
           # the figures of the first --worker runs, kept under their names
           "paired_on_over_off": on_off["median"], "paired_quartiles": [on_off["q1"], on_off["q3"]],
           "paired_range": [on_off["min"], on_off["max"]],
           "paired_cpu_per_token_on_over_off": ratios["on/off"]["cpu_per_token"]["median"],
           "appends_on": worker.progress_stats["appends"] - appends0}
    for name, _, _ in WORKER_RATIOS:
        r, c, h = ratios[name]["tokens_per_s"], ratios[name]["cpu_per_token"], ratios[name]["host_projected"]
        log(f"{name:>17}: tokens/s paired median {100 * r['median']:.1f}% (quartiles {100 * r['q1']:.1f}-"
            f"{100 * r['q3']:.1f}%, range {100 * r['min']:.1f}-{100 * r['max']:.1f}%); CPU per token "
            f"{100 * c['median']:.1f}% ({100 * c['q1']:.1f}-{100 * c['q3']:.1f}%); host-projected "
            f"{100 * h['median']:.1f}% ({100 * h['q1']:.1f}-{100 * h['q3']:.1f}%)")
    log("median us per token, engine core / host: " + ", ".join(
        f"{m} {v['core']:.0f}/{v['host']:.0f}" for m, v in doc["median_us_per_token"].items()))
    log("median tokens/s: " + ", ".join(f"{m} {v:.0f}" for m, v in doc["median_tokens_per_s"].items())
        + f"; {rounds} rounds of {expected} tokens per run; load {min(loads):.1f}-{max(loads):.1f}")
    return doc


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.vllm_progress_cost [--quick] [--json PATH] [--work DIR]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_progress_cost")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--worker", action="store_true",
                        help="the shipped vLLM worker (RolloutWorker) with progress on vs off, paired rounds")
    parser.add_argument("--rounds", type=int, help="--worker: paired rounds (default 10; --quick 3)")
    parser.add_argument("--work", help="scratch directory, kept (default: a new one under /var/tmp, removed)")
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "STORE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(int(args.serve[0]), args.serve[1])
        return 0
    if args.worker:
        run_in_scratch("kvckpt-vllm-progress-", args.work, args.json,
                       lambda work: {"argv": " ".join(shlex.quote(a) for a in sys.argv), "quick": args.quick,
                                     "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                 "loadavg_start": os.getloadavg()[0]},
                                     "worker": worker_rounds(args.quick, work, rounds=args.rounds),
                                     "loadavg_end": os.getloadavg()[0]})
        return 0
    run_in_scratch("kvckpt-vllm-progress-", args.work, args.json, lambda work: run(args.quick, work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
