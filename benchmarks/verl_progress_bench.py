"""Generation throughput through verl's server loop with kvckpt's token progress on vs off (issue 38).

    .venv-verl/bin/python -m benchmarks.verl_progress_bench                  # several minutes on 2 shared cores
    .venv-verl/bin/python -m benchmarks.verl_progress_bench --json benchmarks/results/verl-progress-DATE.json

Runs in ``.venv-verl``. verl's ``FullyAsyncLLMServerClient`` drives verl's ``vLLMHttpServer.generate``
(``KvckptHttpServer``) over kvckpt's tiny step-wise engine (tests/_verl_engine.py: vLLM's CPU build does not
install beside verl 0.9.1), ``--requests`` concurrent greedy samples of ``--tokens`` tokens each. *On*: every call
goes through kvckpt's ``ProgressClient`` (the durable-prefix read, the ``kvckpt`` key, the server's recording every
``--every`` tokens into the ledger, a real Ray actor on a real file, the final read-back and drop). *Off*: the same
calls through verl's client alone. Interleaved repetitions (ABBA: each repetition one off run and one on run, the
order reversed every other one); tokens/s; the figure is the median of the paired ratios (each repetition's on over
its off, run back to back, so a load change on a shared machine falls on both) with their range and quartiles (the
target: on >= 97% of off). Where the server loop waits for the recorder: ``close_wait_s`` (a request's end waiting
for its tail to be durable, summed over requests), ``sink_s`` (time inside the ledger calls, on the flusher task, not
the loop) and the backlog ``waits``; and this process's CPU time per token (the engine, the loop, the client and the
recorder; the ledger actor's process is not counted), paired the same way: less noisy than wall time on a shared
machine. The tiny engine's step (a 2-layer model, well under a millisecond per token) is
far cheaper than a real LLM's decode step, so the recorder's share of the time here is an upper bound of its share on
a real engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from _verl_engine import InProcessHandle, OneServerBalancer, TinyEngine, install_vllm_standin, make_server

install_vllm_standin()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--every", type=int, default=32)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    import ray
    import torch
    from kvckpt.integrations.ray import init_local_ray
    from kvckpt.integrations.verl.client import ProgressClient, generating
    from kvckpt.integrations.verl.ledger import ledger_actor
    from kvckpt.integrations.verl.mirror import NAMESPACE, Mirror, install
    from kvckpt.integrations.verl.progress import ServerProgress
    from kvckpt.integrations.verl.server import KvckptHttpServer, ledger_sink
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    from kvckpt.testing.fixtures.tiny_model import AdditionTask, ensure_tiny_model

    torch.set_num_threads(1)  # the engine and the ledger actor share the cores: no intra-op oversubscription
    init_local_ray(num_cpus=2, object_store_memory=128 << 20, namespace="kvckpt_verl_bench")
    path = ensure_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = AdditionTask()
    prompts = [tokenizer(task.prompt(i), add_special_tokens=False)["input_ids"] for i in range(args.requests)]
    actor_name = "kvckpt_verl_bench"
    work = tempfile.mkdtemp(prefix="verl-progress-bench-")
    actor = ledger_actor(os.path.join(work, "ledger.kv"), actor_name, NAMESPACE)
    install(Mirror(actor_name, ray.get(actor.open_run.remote())["token"]))
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False,
                                                                 "response_length": args.tokens}}})

    profile: dict[str, list[float]] = {"close_wait_s": [], "sink_s": [], "waits": [], "calls": []}

    class TimedProgress(ServerProgress):
        """The recorder, timing how long requests' ends wait for their tails to be durable."""

        close_wait = 0.0

        async def close(self, sample, *, final):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                await super().close(sample, final=final)
            finally:
                self.close_wait += time.perf_counter() - t0

    def timed_sink(inner, spent):  # type: ignore[no-untyped-def]
        async def sink(run, items):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return await inner(run, items)
            finally:
                spent[0] += time.perf_counter() - t0
        return sink

    def key(progress: bool) -> str:
        return "on" if progress else "off"

    async def one_run(progress: bool, rep: int) -> float:
        engine = TinyEngine(model, tokenizer.eos_token_id, gather=args.requests)
        server = make_server(KvckptHttpServer, engine, response_length=args.tokens, ignore_eos=True)
        verl_client = FullyAsyncLLMServerClient(config, InProcessHandle(OneServerBalancer(server)))
        client = ProgressClient(verl_client, args.every) if progress else verl_client
        spent = [0.0]
        if progress:
            server.attach_progress(TimedProgress(timed_sink(ledger_sink(actor_name), spent)))

        async def sample(i: int) -> int:
            with generating(f"r{rep}-{int(progress)}-{i}", 0):
                out = await client.generate(uuid.uuid4().hex, prompt_ids=prompts[i],
                                            sampling_params={"temperature": 0.0, "logprobs": True})
            return len(out.token_ids)

        start, cpu = time.perf_counter(), time.process_time()
        tokens = sum(await asyncio.gather(*(sample(i) for i in range(args.requests))))
        elapsed = time.perf_counter() - start
        if rep >= 0:
            cpu_per_token[key(progress)].append((time.process_time() - cpu) / tokens * 1e3)
        assert tokens == args.requests * args.tokens
        stats = server.kvckpt_progress.stats if progress else {}
        assert not progress or stats["tokens"] == tokens  # every token recorded, none dropped
        if progress and rep >= 0:
            for name, value in (("close_wait_s", server.kvckpt_progress.close_wait), ("sink_s", spent[0]),
                                ("waits", stats["waits"]), ("calls", stats["calls"])):
                profile[name].append(value)
        return tokens / elapsed

    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu_per_token: dict[str, list[float]] = {"off": [], "on": []}  # this process's CPU ms per token (engine + loop)
    load_start = os.getloadavg()[0]
    try:
        asyncio.run(one_run(True, -1))  # warm-up: the first forward passes and the actor's first transaction
        for rep in range(args.reps):
            for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                rates[mode].append(asyncio.run(one_run(mode == "on", rep)))
    finally:
        ray.kill(actor)
        ray.shutdown()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    paired = [b / a for a, b in zip(rates["off"], rates["on"], strict=True)]
    cpu_paired = [b / a for a, b in zip(cpu_per_token["off"], cpu_per_token["on"], strict=True)]
    quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
    result = {"requests": args.requests, "tokens": args.tokens, "every": args.every, "reps": args.reps,
              "tokens_per_s": rates, "median_off": off, "median_on": on, "ratio_of_medians": on / off,
              "cpu_ms_per_token": cpu_per_token, "cpu_paired_ratios": cpu_paired,
              "cpu_ratio": statistics.median(cpu_paired), "paired_ratios": paired, "ratio": statistics.median(paired),
              "ratio_quartiles": [quartiles[0], quartiles[2]], "ratio_range": [min(paired), max(paired)],
              "profile": profile,
              "load_average": [load_start, *os.getloadavg()]}
    run_s = [args.requests * args.tokens / r for r in rates["on"]]
    print(f"through verl's server loop, {args.requests} requests x {args.tokens} tokens, every {args.every}, "
          f"{args.reps} paired repetitions (load average {load_start:.1f} -> {os.getloadavg()[0]:.1f}): "
          f"off {off:,.1f} tok/s, on {on:,.1f} tok/s (medians); on/off paired: median {result['ratio']:.1%}, "
          f"quartiles {quartiles[0]:.1%}-{quartiles[2]:.1%}, range {min(paired):.1%}-{max(paired):.1%}")
    med = {name: statistics.median(values) for name, values in profile.items()}
    print(f"on runs: {statistics.median(run_s):.2f} s each (median); close waits {med['close_wait_s']:.3f} s "
          f"summed over requests, ledger calls {med['calls']:.0f} taking "
          f"{med['sink_s']:.3f} s on the flusher, backlog waits "
          f"{med['waits']:.0f} (medians per run); this process's CPU per token on/off paired: median "
          f"{statistics.median(cpu_paired):.1%}, range {min(cpu_paired):.1%}-{max(cpu_paired):.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
