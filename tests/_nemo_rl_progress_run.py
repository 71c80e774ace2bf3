"""Phases of tests/integrations/nemo_rl/test_nemo_rl_progress_crash.py, each a fresh process:
``python tests/_nemo_rl_progress_run.py PHASE WORK`` (PHASE: ``crash``, ``resume`` or ``straight``).

``crash``: a fresh store; NeMo-RL's ``generate_and_push`` (tests/_nemo_rl_worker.py says whose) for 2 prompts of
2 samples each (greedy, budget 40, interval 8) through the worker's ``generate_async`` over kvckpt's engine proxy;
NeMo-RL's refit call after token 11; the process group SIGKILLed after token 29 (``killed.json`` first).
``resume``: the same file, fresh objects: NeMo-RL's ``set_dispatch_index(0)`` recovers it; the durable progress
is read; a zombie of the killed attempt streams through a proxy and is refused; :func:`reissue_inflight` re-issues
every recovered prompt through ``generate_and_push``, twice (the second finds none); ``result.json``.
``straight``: the same prompts uninterrupted on a fresh store (the reference); ``straight.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import torch
from _nemo_rl import GRPO, SAMPLERS, store_config
from _nemo_rl_worker import (
    InProcessGeneration,
    RefitEngine,
    addition_prompts,
    committed_rows,
    make_manager,
    make_worker,
    nemo_rl_parts,
)
from _phases import write_json
from kvckpt.integrations.nemo_rl import TQReplayBuffer, configure
from kvckpt.integrations.nemo_rl.engine import KeyedGeneration, ProgressEngine, attach, install_worker, sequence
from kvckpt.integrations.nemo_rl.reissue import install_generate_and_push, reissue_inflight
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvckpt import READY
from kvckpt.testing.fixtures.tiny_model import ensure_tiny_model

PHASE, WORK = sys.argv[1], sys.argv[2]
EVERY, BUDGET, REFIT_AT, KILL_AT, PROMPTS, N = 8, 40, 11, 29, 2, 2


class World:
    """One process's NeMo-RL side over one store file: buffer, worker with the proxy, rollout manager."""

    def __init__(self, path: str, version: int) -> None:
        model_path = ensure_tiny_model()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.eos = AutoTokenizer.from_pretrained(model_path).eos_token_id
        manager_cls, worker_cls, self.which = nemo_rl_parts()
        install_generate_and_push(manager_cls)
        install_worker(worker_cls)
        cfg = configure({**store_config(path, SAMPLERS["windowed"], schema=GRPO, per_step=PROMPTS),
                         "progress_every_tokens": EVERY})  # the same block that selects the kvckpt buffer
        self.buffer = TQReplayBuffer(object(), partition_id="rollout_data", pad_value_dict={"token_ids": 0},
                                     require_routed_experts=False)
        self.engine = RefitEngine(self.model, self.eos, gather=PROMPTS * N)
        self.worker = make_worker(worker_cls, self.engine, budget=BUDGET, pad=0, ignore_eos=True)
        self.finished: dict[str, dict] = {}
        self.proxy = attach(self.worker, self.buffer.core, every_tokens=cfg.progress_every_tokens, eos=self.eos,
                            weight_version=version,
                            on_finish=self._finished)
        self.manager = make_manager(manager_cls, policy_generation=KeyedGeneration(InProcessGeneration(self.worker)),
                                    buffer=self.buffer, n=N, budget=BUDGET)

    def _finished(self, lease: object, index: int, ids: list, logprobs: list, versions: list) -> None:
        self.finished[f"p{lease.prompt_idx}/{index}"] = {"tokens": ids, "logprobs": logprobs, "versions": versions}

    def rows(self) -> dict[str, dict]:
        """What NeMo-RL committed: each row's generated tokens and logprobs, by prompt/sample."""
        return committed_rows(self.buffer)


def prompts() -> list[dict]:
    return addition_prompts(PROMPTS)


async def dispatch_all(world: World) -> list:
    samples = prompts()
    return await asyncio.gather(*(world.manager.generate_and_push(s) for s in samples))


def refit(world: World) -> None:
    """NeMo-RL's loop after a training step: the trainer's version moves (the store closes step 0), then the
    in-flight refit, the worker's own weight-update call."""
    world.buffer.finish_train_step()
    asyncio.get_running_loop().create_task(world.worker.update_weights_via_ipc_zmq_async())


def crash() -> None:
    world = World(os.path.join(WORK, "replay.kv"), version=0)
    world.buffer.sampler.set_dispatch_index(0)

    def on_step(step: int) -> None:
        if step == REFIT_AT:
            refit(world)
        if step == KILL_AT:
            leases = [world.buffer.handle.held(e.group_id).to_dict() for e in world.buffer.core.ledger()]
            write_json(WORK, "killed.json", {"inflight": world.proxy.stats["generated"], "leases": leases,
                                             "which": world.which, "rpcs": world.engine.rpcs})
            os.killpg(os.getpgrp(), signal.SIGKILL)

    world.engine.on_step = on_step
    asyncio.run(dispatch_all(world))
    raise SystemExit("the kill did not happen")


def durable(world: World) -> dict[str, dict]:
    out = {}
    for entry in world.buffer.core.ledger():
        for index, progress in world.buffer.core.progress(entry.group_id).items():
            out[f"p{entry.prompt_idx}/{index}"] = {"tokens": progress.tokens.tolist(),
                                                   "versions": progress.versions.tolist()}
    return out


async def zombie(world: World, killed: dict) -> str:
    """A worker of the killed attempt that kept streaming: its proxy's writes must be refused."""
    from kvckpt import Lease
    from kvckpt.errors import StaleAttempt

    old = Lease.from_dict(killed["leases"][0])
    proxy = ProgressEngine(RefitEngine(world.model, world.eos), world.buffer.core, every_tokens=1, eos=world.eos,
                           weight_version=1)
    params = world.worker.SamplingParams(max_tokens=BUDGET, temperature=0.0, logprobs=0, ignore_eos=True)
    try:
        with sequence(old, 0):
            async for _ in proxy.generate({"prompt_token_ids": [1, 2, 3]}, params, "zombie"):
                pass
    except StaleAttempt as exc:
        return f"StaleAttempt ({type(exc).__name__})"
    return "not refused"


def resume() -> None:
    with open(os.path.join(WORK, "killed.json")) as f:
        killed = json.load(f)
    world = World(os.path.join(WORK, "replay.kv"), version=1)
    world.buffer.sampler.set_dispatch_index(1)  # NeMo-RL's start-of-run call at the step it resumes: recovery
    before = durable(world)
    recovered = sorted(lease.group_id for lease in world.buffer.handle.idle_leases())
    refused = asyncio.run(zombie(world, killed))
    after_zombie = durable(world)
    samples = {s["idx"]: s for s in prompts()}

    async def twice() -> tuple[dict, dict]:
        first = await reissue_inflight(world.manager, world.buffer, lambda lease: samples[lease.prompt_idx])
        return first, await reissue_inflight(world.manager, world.buffer, lambda lease: samples[lease.prompt_idx])

    first, second = asyncio.run(twice())
    write_json(WORK, "result.json", {
        "killed": killed, "which": world.which, "durable": before, "zombie": refused,
        "zombie_left_store_unchanged": after_zombie == before, "recovered": recovered,
        "reissued": {g: str(o) for g, o in first.items()}, "second": {g: str(o) for g, o in second.items()},
        "engine": {"requests": world.proxy.stats["requests"], "generated": world.proxy.stats["generated"],
                   "resumed": world.proxy.stats["resumed"]},
        "finished": world.finished, "rows": world.rows(), "ledger": len(world.buffer.core.ledger()),
        "groups": {g.group_id: g.prompt_idx for g in world.buffer.core.groups([READY])}})


def straight() -> None:
    world = World(os.path.join(WORK, "straight.kv"), version=0)
    world.buffer.sampler.set_dispatch_index(0)

    def on_step(step: int) -> None:
        if step == REFIT_AT:
            refit(world)

    world.engine.on_step = on_step
    asyncio.run(dispatch_all(world))
    write_json(WORK, "straight.json", {"finished": world.finished, "rows": world.rows()})


if __name__ == "__main__":
    {"crash": crash, "resume": resume, "straight": straight}[PHASE]()
