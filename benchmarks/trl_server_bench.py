"""Generation through TRL's vLLM-server path with durable token progress on vs off (issue 39).

    .venv-vllm/bin/python -m benchmarks.trl_server_bench              # about 3 minutes on 2 shared cores
    .venv-vllm/bin/python -m benchmarks.trl_server_bench --quick      # about a minute: proves it runs
    .venv-vllm/bin/python -m benchmarks.trl_server_bench --json benchmarks/results/trl-server-DATE.json

One real vLLM OpenAI-compatible server (vLLM's CPU build, the tiny model, 127.0.0.1), the same
prompts and the same request (TRL's ``/v1/completions`` body, streamed: :class:`kvckpt.integrations.trl.
server.VLLMServerBackend`). "Off": the backend's ``stream`` with no progress. "On": the same call
through :func:`kvckpt.integrations.vllm.stream_leases` as the TRL worker makes it (``background=True``:
the recorder's flusher writes, the stream's reader only hands tokens over), every sample's tokens
recorded durably every ``every`` tokens on a real store. "On, synchronous": the same with the durable
call on the reader (the mode before issue 39's fix, kept for in-process engines), for the profile.
Greedy (``top_k=1``), so every arm generates the same tokens.

Noise: the machine is shared, so one arm's median against another's says little. Each round runs
every arm once, back to back, in a rotating order (ABC, BCA, CAB, ...), and the figure is the median
over rounds of the paired ratio on / off (of the same round), with its range and interquartile
spread. Throughput is completion tokens/s over the whole ``stream_leases`` call (its final flush
included). The profile: the share of each on run spent inside the sink's record calls (on the
flusher or on the reader) and inside ``on_step`` (what the reader waits for).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from kvckpt.integrations.trl.server import VLLMServerBackend
from kvckpt.integrations.vllm import AdditionTask, Continuation, ensure_tiny_model, stream_leases

from kvckpt import BufferConfig, Prompt, ReplayBuffer
from kvckpt.testing.fixtures.vllm_server import VLLMServer

SCHEMA = {"input_ids": ("int64", "token"), "completion_mask": ("int64", "token")}


class TimedSink:
    """The store, with the seconds spent inside its recording calls summed (since issue 45 the
    recorder sends one ``record_progress_step`` message per flush)."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer, self.seconds = buffer, 0.0

    def record_progress_step(self, message: object) -> list:
        """The store's call, timed."""
        start = time.perf_counter()
        try:
            return self.buffer.record_progress_step(message)
        finally:
            self.seconds += time.perf_counter() - start

    def record_progress_many(self, items: list) -> list:
        """The store's call, timed."""
        start = time.perf_counter()
        try:
            return self.buffer.record_progress_many(items)
        finally:
            self.seconds += time.perf_counter() - start

    def progress_encoder(self) -> object:
        """The store's edge encoder (the recorder builds its step messages with it)."""
        return self.buffer.progress_encoder()

    def progress(self, lease: object) -> dict:
        """The store's durable prefixes (unused: every lease here is a first attempt)."""
        return self.buffer.progress(lease)


class TimedBackend:
    """The backend, with the seconds its stream's reader spends inside ``on_step`` summed."""

    def __init__(self, backend: VLLMServerBackend) -> None:
        self.backend, self.seconds = backend, 0.0

    def stream(self, seqs: list, max_tokens: int, temperature: float, on_step: Callable, step_tokens: int | None = None,
               ) -> list:
        """The backend's stream, its ``on_step`` timed."""
        def timed(deltas: list) -> set[int]:
            start = time.perf_counter()
            try:
                return on_step(deltas)
            finally:
                self.seconds += time.perf_counter() - start

        return self.backend.stream(seqs, max_tokens, temperature, timed, step_tokens)


ARMS = ("off", "on", "on_sync")


def _arm(arm: str, backend: VLLMServerBackend, seqs: list, ids: list, work: str, rnd: int, prompts: int,
         samples: int, max_tokens: int, every: int) -> dict:
    """One run of ``arm``: tokens/s, and for an on arm its appends, calls and time shares."""
    if arm == "off":
        start = time.perf_counter()
        done = backend.stream(seqs, max_tokens, 1.0)
        return {"tokens_per_s": sum(len(s.completion_ids) for s in done) / (time.perf_counter() - start)}
    config = BufferConfig(group_size=samples, schema=SCHEMA, max_buffered_rollouts=prompts)
    with ReplayBuffer.create(os.path.join(work, f"buf-{rnd}-{arm}.kv"), config) as buf:
        leases = buf.admit([Prompt(i) for i in range(prompts)])
        sink, timed = TimedSink(buf), TimedBackend(backend)
        start = time.perf_counter()
        groups, recorder = stream_leases(sink, timed, leases, ids, max_tokens=max_tokens, temperature=1.0,
                                         weight_version=0, every_tokens=every, every_seconds=None,
                                         background=arm == "on")
        took = time.perf_counter() - start
    return {"tokens_per_s": sum(len(s.completion_ids) for g in groups for s in g) / took,
            "appends": recorder.appends, "calls": recorder.calls, "share_in_record_calls": sink.seconds / took,
            "share_in_on_step": timed.seconds / took}


def _spread(values: list[float]) -> dict:
    """Median, range and interquartile range."""
    qs = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "q1": qs[0], "q3": qs[2]}


def run(prompts: int, samples: int, max_tokens: int, every: int, rounds: int) -> dict:
    """``rounds`` rounds of every arm on one server, in rotating order; paired ratios per round."""
    work = tempfile.mkdtemp(prefix="kvckpt-trl-server-bench-")
    model = ensure_tiny_model(os.path.join(work, "model"))
    task = AdditionTask()
    per_round = []
    with VLLMServer(model, os.path.join(work, "server.log")) as server:
        backend = VLLMServerBackend(model, server_url=server.url, sampling={"top_k": 1})
        ids = [backend.tokenizer(task.prompt(i), add_special_tokens=False)["input_ids"] for i in range(prompts)]
        seqs = [Continuation(tuple(p)) for p in ids for _ in range(samples)]
        backend.stream(seqs, max_tokens, 1.0)  # warm-up
        for rnd in range(rounds):
            order = ARMS[rnd % len(ARMS):] + ARMS[:rnd % len(ARMS)]
            got = {arm: _arm(arm, backend, seqs, ids, work, rnd, prompts, samples, max_tokens, every)
                   for arm in order}
            per_round.append({"order": list(order), **got})
    out = {"prompts": prompts, "samples": samples, "max_tokens": max_tokens, "every": every, "rounds": rounds,
           "per_round": per_round}
    for arm in ("on", "on_sync"):
        out[f"{arm}_over_off"] = _spread([r[arm]["tokens_per_s"] / r["off"]["tokens_per_s"] for r in per_round])
        out[f"{arm}_share_in_record_calls"] = _spread([r[arm]["share_in_record_calls"] for r in per_round])
        out[f"{arm}_share_in_on_step"] = _spread([r[arm]["share_in_on_step"] for r in per_round])
        out[f"{arm}_calls"] = _spread([float(r[arm]["calls"]) for r in per_round])
    out["off_tokens_per_s"] = _spread([r["off"]["tokens_per_s"] for r in per_round])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run that proves the benchmark runs")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args(argv)
    result = (run(prompts=2, samples=4, max_tokens=64, every=16, rounds=3) if args.quick
              else run(prompts=8, samples=8, max_tokens=192, every=32, rounds=9))
    off = result["off_tokens_per_s"]
    print(f"{result['rounds']} rounds, each arm once per round in rotating order; off: "
          f"{off['median']:,.0f} tokens/s median ({off['min']:,.0f}-{off['max']:,.0f})")
    print("| arm | on / off, paired per round: median (IQR; range) | record calls (median) | "
          "share inside the sink's record calls | share the reader waits in on_step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for arm, label in (("on", "on (background flusher)"), ("on_sync", "on, synchronous (before)")):
        r, rec = result[f"{arm}_over_off"], result[f"{arm}_share_in_record_calls"]
        wait = result[f"{arm}_share_in_on_step"]
        print(f"| {label}, every {result['every']} | {100 * r['median']:.1f}% "
              f"({100 * r['q1']:.1f}-{100 * r['q3']:.1f}%; {100 * r['min']:.1f}-{100 * r['max']:.1f}%) | "
              f"{result[f'{arm}_calls']['median']:.0f} | "
              f"{100 * rec['median']:.0f}% | {100 * wait['median']:.0f}% |")
    print("target: on >= 97% of off")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
