"""Generation through TRL's vLLM-server path with durable token progress on vs off (issue 39).

    .venv-vllm/bin/python -m benchmarks.trl_server_bench              # about 3 minutes on 2 shared cores
    .venv-vllm/bin/python -m benchmarks.trl_server_bench --quick      # about a minute: proves it runs
    .venv-vllm/bin/python -m benchmarks.trl_server_bench --json benchmarks/results/trl-server-DATE.json

One real vLLM OpenAI-compatible server (vLLM's CPU build, the tiny model, 127.0.0.1), the same
prompts and the same request (TRL's ``/v1/completions`` body, streamed: :class:`kvckpt.integrations.trl.
server.VLLMServerBackend`). "Off": the backend's ``stream`` with no progress. "On": the same call
through :func:`kvckpt.integrations.vllm.stream_leases`, every sample's tokens recorded durably every
``every`` tokens on a real store (one ``record_progress_many`` per batch of stream events). Greedy
(``top_k=1``), so both sides generate the same tokens. Off and on alternate, ``reps`` times each;
throughput is completion tokens/s, ratio of medians (target: on >= 97% of off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from kvckpt.integrations.trl.server import VLLMServerBackend
from kvckpt.integrations.vllm import AdditionTask, Continuation, ensure_tiny_model, stream_leases

from kvckpt import BufferConfig, Prompt, ReplayBuffer
from kvckpt.testing.vllm_server import VLLMServer

SCHEMA = {"input_ids": ("int64", "token"), "completion_mask": ("int64", "token")}


class TimedSink:
    """The store, with the seconds spent inside its ``record_progress_many`` calls summed."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer, self.seconds = buffer, 0.0

    def record_progress_many(self, items: list) -> list:
        """The store's call, timed."""
        start = time.perf_counter()
        try:
            return self.buffer.record_progress_many(items)
        finally:
            self.seconds += time.perf_counter() - start

    def progress(self, lease: object) -> dict:
        """The store's durable prefixes (unused: every lease here is a first attempt)."""
        return self.buffer.progress(lease)


def run(prompts: int, samples: int, max_tokens: int, every: int, reps: int) -> dict:
    """Alternate off/on ``reps`` times on one server; tokens/s of each and the ratio of medians."""
    work = tempfile.mkdtemp(prefix="kvckpt-trl-server-bench-")
    model = ensure_tiny_model(os.path.join(work, "model"))
    task = AdditionTask()
    with VLLMServer(model, os.path.join(work, "server.log")) as server:
        backend = VLLMServerBackend(model, server_url=server.url, sampling={"top_k": 1})
        ids = [backend.tokenizer(task.prompt(i), add_special_tokens=False)["input_ids"] for i in range(prompts)]
        seqs = [Continuation(tuple(p)) for p in ids for _ in range(samples)]
        backend.stream(seqs, max_tokens, 1.0)  # warm-up
        off, on, appends, calls, inside = [], [], [], [], []
        for rep in range(reps):
            start = time.perf_counter()
            done = backend.stream(seqs, max_tokens, 1.0)
            off.append(sum(len(s.completion_ids) for s in done) / (time.perf_counter() - start))
            config = BufferConfig(group_size=samples, schema=SCHEMA, max_buffered_rollouts=prompts)
            with ReplayBuffer.create(os.path.join(work, f"buf-{rep}.kv"), config) as buf:
                leases = buf.admit([Prompt(i) for i in range(prompts)])
                start = time.perf_counter()
                sink = TimedSink(buf)
                groups, recorder = stream_leases(sink, backend, leases, ids, max_tokens=max_tokens, temperature=1.0,
                                                 weight_version=0, every_tokens=every, every_seconds=None)
                on.append(sum(len(s.completion_ids) for g in groups for s in g) / (time.perf_counter() - start))
                appends.append(recorder.appends)
                calls.append(recorder.calls)
                inside.append(sink.seconds / (time.perf_counter() - start))
    return {"prompts": prompts, "samples": samples, "max_tokens": max_tokens, "every": every, "reps": reps,
            "off_tokens_per_s": off, "on_tokens_per_s": on, "appends": appends, "append_calls": calls,
            "share_of_on_time_inside_record_calls": inside,
            "ratio_of_medians": statistics.median(on) / statistics.median(off)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run that proves the benchmark runs")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args(argv)
    result = (run(prompts=2, samples=4, max_tokens=64, every=16, reps=2) if args.quick
              else run(prompts=8, samples=8, max_tokens=192, every=32, reps=5))
    med_off, med_on = statistics.median(result["off_tokens_per_s"]), statistics.median(result["on_tokens_per_s"])
    print(f"| progress | tokens/s (median of {result['reps']}) | appends | record_progress_many calls |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| off | {med_off:,.0f} | 0 | 0 |")
    print(f"| on, every {result['every']} tokens | {med_on:,.0f} | {statistics.median(result['appends']):.0f} | "
          f"{statistics.median(result['append_calls']):.0f} |")
    inside = statistics.median(result["share_of_on_time_inside_record_calls"])
    print(f"on / off: {100 * result['ratio_of_medians']:.1f}% (target >= 97%); share of the on runs' time inside "
          f"record_progress_many (median): {100 * inside:.0f}%")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
