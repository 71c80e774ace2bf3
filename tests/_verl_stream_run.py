"""verl's generation path with token progress, in one process: ``python _verl_stream_run.py crash|resume WORKDIR``.

For tests/integrations/verl/test_verl_stream_crash.py. verl's ``FullyAsyncLLMServerClient`` (wrapped in kvckpt's
``ProgressClient``, as kvckpt's agent loop wraps it) drives verl's ``vLLMHttpServer`` request path
(``KvckptHttpServer``) over kvckpt's tiny step-wise engine (tests/_verl_engine.py says why not vLLM), through an
in-process stand-in of verl's load balancer; the ledger is the real Ray actor on a real file.

``crash``: :data:`SAMPLES` samples, greedy, ``max_tokens`` :data:`BUDGET`, interval :data:`EVERY`. After engine step
:data:`SYNC_STEP` a weight sync runs as verl's ``abort_replicas`` / ``update_weights`` drive a server
(``abort_all_requests``, ``set_global_steps(1)``, ``resume_generation``): verl's client resumes each sample from its
partial output. After engine step :data:`KILL_STEP` the engine stops, the flusher settles, each sample's tokens in
flight are logged (fsync'd) with the run token, and the process SIGKILLs its own process group (itself, Ray, the
ledger actor).

``resume``: a fresh Ray and ledger actor on the same file, a new run. First a zombie server of the killed run
streams one sample with the killed run's token: nothing may change in the ledger. Then every sample resumes
through kvckpt's client from its durable prefix (the server at version 1, as after the sync), and a reference run
of the same samples (fresh server and engine, the same weight sync at the same step, no crash) gives what an
uninterrupted run returns. Writes ``result.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _phases import write_json
from _verl_engine import InProcessHandle, OneServerBalancer, TinyEngine, install_vllm_standin, make_server

install_vllm_standin()

import ray  # noqa: E402
import torch  # noqa: E402
from kvckpt.integrations.ray import init_local_ray  # noqa: E402
from kvckpt.integrations.verl.client import ProgressClient, generating  # noqa: E402
from kvckpt.integrations.verl.ledger import ledger_actor  # noqa: E402
from kvckpt.integrations.verl.mirror import NAMESPACE, Mirror, install  # noqa: E402
from kvckpt.integrations.verl.progress import SampleKey, ServerProgress  # noqa: E402
from kvckpt.integrations.verl.server import KvckptHttpServer, ledger_sink  # noqa: E402
from kvckpt.integrations.vllm.tiny_model import AdditionTask, ensure_tiny_model  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient  # noqa: E402

MODE, WORK = sys.argv[1], sys.argv[2]
ACTOR = "kvckpt_verl_stream"
EVERY, BUDGET, SYNC_STEP, KILL_STEP = 8, 40, 11, 29
SAMPLES = [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]
ZOMBIE_TOKENS = 3 * EVERY


class World:
    """One server over one tiny engine, verl's client over it, the ledger actor."""

    def __init__(self, model: torch.nn.Module, eos: int, version: int, gather: int = len(SAMPLES)) -> None:
        self.engine = TinyEngine(model, eos, gather=gather)
        self.server = make_server(KvckptHttpServer, self.engine, response_length=BUDGET, ignore_eos=True)
        self.server.global_steps = version
        self.server.attach_progress(ServerProgress(ledger_sink(ACTOR)))
        config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False,
                                                                     "response_length": BUDGET}}})
        balancer = InProcessHandle(OneServerBalancer(self.server))
        self.client = ProgressClient(FullyAsyncLLMServerClient(config, balancer), EVERY)

    def sync_at(self, step: int) -> None:
        """A weight sync after engine step ``step``, as verl's checkpoint engine drives a replica's server."""
        hook = self.engine.on_step

        def on_step(n: int) -> None:
            if hook is not None:
                hook(n)
            if n == step:
                asyncio.get_running_loop().create_task(self._sync())

        self.engine.on_step = on_step

    async def _sync(self) -> None:
        await self.server.abort_all_requests()
        await self.server.set_global_steps(self.server.global_steps + 1)
        await self.server.resume_generation()

    async def sample(self, uid: str, session: int, prompt: list[int]) -> dict:
        with generating(uid, session):
            out = await self.client.generate(uuid.uuid4().hex, prompt_ids=prompt,
                                             sampling_params={"temperature": 0.0, "logprobs": True})
        return {"tokens": out.token_ids, "logprobs": out.log_probs, "versions": out.extra_fields["token_versions"],
                "min": out.extra_fields["min_global_steps"], "max": out.extra_fields["max_global_steps"]}


async def crash(model: torch.nn.Module, eos: int, prompts: dict[str, list[int]], token: str) -> None:
    world = World(model, eos, version=0)
    world.sync_at(SYNC_STEP)
    hook = world.engine.on_step

    async def kill() -> None:
        await world.server.kvckpt_progress.idle()
        inflight = {f"{s.key.uid}/{s.key.session}": s.durable + len(s.ids)
                    for s in world.server.kvckpt_progress.samples}
        write_json(WORK, "killed.json",
                   {"token": token, "inflight": inflight, "stats": world.server.kvckpt_progress.stats})
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def on_step(n: int) -> None:
        hook(n)
        if n == KILL_STEP:
            world.engine.paused = True  # the kill point: generation stops here, the flusher settles, then SIGKILL
            asyncio.get_running_loop().create_task(kill())

    world.engine.on_step = on_step
    await asyncio.gather(*(world.sample(uid, s, prompts[uid]) for uid, s in SAMPLES))
    raise SystemExit("the crash run finished without being killed")


async def resume(model: torch.nn.Module, eos: int, prompts: dict[str, list[int]], token: str, actor: object) -> None:
    with open(os.path.join(WORK, "killed.json")) as f:
        killed = json.load(f)

    def progress() -> dict[str, dict | None]:
        return {f"{u}/{s}": ray.get(actor.progress.remote(u, s)) for u, s in SAMPLES}

    before = progress()
    durable = {k: len(v["tokens"]) if v else 0 for k, v in before.items()}

    # A zombie server of the killed run streams on with that run's token: every chunk of its flushes is refused.
    zombie = World(model, eos, version=1, gather=1)
    stale = SampleKey(ACTOR, killed["token"], "p0", 0, len(prompts["p0"]) + durable["p0/0"], EVERY)
    await zombie.server.generate(prompts["p0"] + before["p0/0"]["tokens"],
                                 {"temperature": 0.0, "logprobs": True, "max_tokens": ZOMBIE_TOKENS},
                                 uuid.uuid4().hex, kvckpt=stale.to_dict())
    after = progress()

    world = World(model, eos, version=1)  # the restarted replica serves the synced weights
    resumed = await asyncio.gather(*(world.sample(uid, s, prompts[uid]) for uid, s in SAMPLES))

    reference = World(model, eos, version=0)
    reference.sync_at(SYNC_STEP)
    expected = await asyncio.gather(*(reference.sample(f"ref-{uid}", s, prompts[uid]) for uid, s in SAMPLES))
    left = progress()
    write_json(WORK, "result.json", {
        "killed": killed, "durable": durable, "zombie_stats": zombie.server.kvckpt_progress.stats,
        "zombie_changed": json.dumps(before) != json.dumps(after), "resumed": dict(zip(durable, resumed, strict=True)),
        "expected": dict(zip(durable, expected, strict=True)), "client": world.client.stats,
        "resumed_server": world.server.kvckpt_progress.stats, "left": left})


def main() -> None:
    init_local_ray(num_cpus=2, object_store_memory=128 << 20, namespace="kvckpt_verl_stream")
    path = ensure_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = AdditionTask()
    prompts = {uid: tokenizer(task.prompt(int(uid[1:])), add_special_tokens=False)["input_ids"]
               for uid in {u for u, _ in SAMPLES}}
    actor = ledger_actor(os.path.join(WORK, "ledger.kv"), ACTOR, NAMESPACE)
    token = ray.get(actor.open_run.remote())["token"]
    install(Mirror(ACTOR, token))
    try:
        if MODE == "crash":
            asyncio.run(crash(model, tokenizer.eos_token_id, prompts, token))
        else:
            asyncio.run(resume(model, tokenizer.eos_token_id, prompts, token, actor))
    finally:
        ray.kill(actor)
        ray.shutdown()


if __name__ == "__main__":
    main()
