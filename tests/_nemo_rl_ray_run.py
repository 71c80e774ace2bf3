"""Phases of tests/integrations/nemo_rl/test_nemo_rl_ray_crash.py, each a fresh process with a fresh Ray instance on
loopback: ``python tests/_nemo_rl_ray_run.py PHASE WORK`` (PHASE: ``crash``, ``resume`` or ``straight``).

Process layout as NeMo-RL's: the ``TQReplayBuffer`` and NeMo-RL's ``generate_and_push`` (tests/_nemo_rl_worker.py
says whose) in this driver, which owns the store; the generation worker a Ray actor (tests/_nemo_rl_ray_host.py),
called as NeMo-RL's ``VllmGeneration`` calls it (a streaming actor call per sample). The buffer's config sets
``progress_every_tokens``; nothing keys the manager by hand: the wrapped ``generate_and_push`` starts the progress
desk in this process and keys the rollouts, and the worker's proxy writes through the buffer's Ray client.

``crash``: 2 prompts of 2 samples (greedy, budget 40, interval 8); after token 11 the trainer's step closes and the
worker's refit call runs; after token 29 the worker actor's process and this process group are SIGKILLed
(``killed.json`` first: tokens generated, each sequence's acknowledged length, the leases). ``resume``: the same
file, fresh objects, a fresh Ray and worker: NeMo-RL's ``set_dispatch_index(1)`` recovers; a zombie of the killed
attempt writes through the new desk and is refused; :func:`reissue_inflight` re-issues every recovered prompt
through ``generate_and_push``, twice (the second finds none); ``result.json``. ``straight``: the same prompts
uninterrupted on another file, in the same layout (the reference); ``straight.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import ray
import torch
from _nemo_rl import GRPO, SAMPLERS, store_config
from _nemo_rl_ray_host import WorkerHost
from _nemo_rl_worker import addition_prompts, committed_rows, generation_input, make_manager, nemo_rl_parts
from _paths import TESTS
from _phases import write_json
from kvckpt.integrations.nemo_rl import TQReplayBuffer, configure
from kvckpt.integrations.nemo_rl.engine import KEY
from kvckpt.integrations.nemo_rl.reissue import install_generate_and_push, reissue_inflight
from kvckpt.integrations.nemo_rl.remote import service_for
from kvckpt.integrations.ray import init_local_ray

from kvckpt import READY

PHASE, WORK = sys.argv[1], sys.argv[2]
EVERY, BUDGET, REFIT_AT, KILL_AT, PROMPTS, N = 8, 40, 11, 29, 2, 2


class RayGeneration:
    """``policy_generation``: NeMo-RL's ``VllmGeneration.generate_async`` routed to the one worker actor (a
    streaming actor call; the last item is the sample's result)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def generate_async(self, data: Any, greedy: bool = False) -> Any:
        async for ref in self.actor.generate_async.remote(data, greedy=greedy):
            yield await ref


class World:
    """This process's side: Ray, the buffer (the store's owner), the worker actor, NeMo-RL's rollout manager."""

    def __init__(self, pause_at: list[int], path: str) -> None:
        init_local_ray(num_cpus=2, namespace="kvckpt-nemo-rl-ray-test",
                       runtime_env={"env_vars": {"PYTHONPATH": str(TESTS)}})
        manager_cls, _worker_cls, self.which = nemo_rl_parts()
        install_generate_and_push(manager_cls)
        configure({**store_config(path, SAMPLERS["windowed"], schema=GRPO,
                                  per_step=PROMPTS), "progress_every_tokens": EVERY})
        self.buffer = TQReplayBuffer(object(), partition_id="rollout_data", pad_value_dict={"token_ids": 0},
                                     require_routed_experts=False)
        self.host = ray.remote(WorkerHost).options(max_concurrency=64).remote(
            budget=BUDGET, gather=PROMPTS * N, pause_at=pause_at)
        self.manager = make_manager(manager_cls, policy_generation=RayGeneration(self.host), buffer=self.buffer,
                                    n=N, budget=BUDGET)

    def durable(self) -> dict[str, dict]:
        out = {}
        for entry in self.buffer.core.ledger():
            for index, progress in self.buffer.core.progress(entry.group_id).items():
                out[f"{entry.group_id}/{index}"] = {"tokens": progress.tokens.tolist(),
                                                    "versions": progress.versions.tolist()}
        return out

    def rows(self) -> dict[str, dict]:
        """What NeMo-RL committed: each row's generated tokens and logprobs, by prompt/sample."""
        return committed_rows(self.buffer)


def prompts() -> list[dict]:
    return addition_prompts(PROMPTS)


def crash(kill: bool = True) -> None:
    world = World(pause_at=[REFIT_AT, KILL_AT] if kill else [REFIT_AT],
                  path=os.path.join(WORK, "replay.kv" if kill else "straight.kv"))
    world.buffer.sampler.set_dispatch_index(0)

    async def run() -> None:
        dispatched = asyncio.gather(*(world.manager.generate_and_push(s) for s in prompts()))
        await world.host.wait_paused.remote(REFIT_AT)
        world.buffer.finish_train_step()  # NeMo-RL's loop: the trainer's step closes, then the in-flight refit
        assert await world.host.update_weights_via_ipc_zmq_async.remote()
        await world.host.resume.remote()
        if not kill:
            await dispatched
            return
        state = await world.host.wait_paused.remote(KILL_AT)
        leases = {e.group_id: world.buffer.handle.held(e.group_id).to_dict() for e in world.buffer.core.ledger()}
        write_json(WORK, "killed.json", {**state, "leases": leases, "desk": service_for(world.buffer, eos=None).stats})
        os.kill(state["pid"], signal.SIGKILL)  # the worker actor's process
        os.killpg(os.getpgrp(), signal.SIGKILL)  # this driver, the store's owner, with its desk
        await dispatched

    asyncio.run(run())
    if kill:
        raise SystemExit("the kill did not happen")
    state = ray.get(world.host.state.remote())
    prompt_of = {g.group_id: g.prompt_idx for g in world.buffer.core.groups([READY])}
    finished = {f"p{prompt_of[k.split('/')[0]]}/{k.split('/')[1]}": v for k, v in state["finished"].items()}
    write_json(WORK, "straight.json", {"finished": finished, "rows": world.rows()})
    world.buffer.close()
    ray.shutdown()


def straight() -> None:
    """The same prompts uninterrupted, in the same process layout (a Ray worker: same threads, same floats)."""
    crash(kill=False)


def resume() -> None:
    with open(os.path.join(WORK, "killed.json")) as f:
        killed = json.load(f)
    world = World(pause_at=[], path=os.path.join(WORK, "replay.kv"))
    world.buffer.sampler.set_dispatch_index(1)  # NeMo-RL's start-of-run call at the step it resumes: recovery
    before = world.durable()
    recovered = sorted(lease.group_id for lease in world.buffer.handle.idle_leases())
    samples = {s["idx"]: s for s in prompts()}
    old = next(iter(killed["leases"].values()))
    ids = samples[old["prompt_idx"]]["message_log"][0]["token_ids"]
    zombie_data = generation_input({  # as NeMo-RL's rollout manager builds it, with the killed attempt's key
        "input_ids": ids[None], "input_lengths": torch.tensor([len(ids)], dtype=torch.int32), "stop_strings": [None],
        KEY: [{"lease": old, "index": 0, "progress": service_for(world.buffer, eos=None).settings()}]})

    async def run() -> tuple[str, dict, dict, dict]:
        refused = await world.host.zombie.remote(zombie_data)
        after = world.durable()
        first = await reissue_inflight(world.manager, world.buffer, lambda lease: samples[lease.prompt_idx])
        second = await reissue_inflight(world.manager, world.buffer, lambda lease: samples[lease.prompt_idx])
        return refused, after, first, second

    refused, after_zombie, first, second = asyncio.run(run())
    state = ray.get(world.host.state.remote())
    prompt_of = {g: lease["prompt_idx"] for g, lease in killed["leases"].items()}

    def by_prompt(doc: dict) -> dict:
        return {f"p{prompt_of[k.split('/')[0]]}/{k.split('/')[1]}": v for k, v in doc.items()}

    write_json(WORK, "result.json", {
        "killed": {**killed, "acknowledged": by_prompt(killed["acknowledged"])}, "which": state["which"],
        "durable": by_prompt(before), "zombie": refused, "zombie_left_store_unchanged": after_zombie == before,
        "recovered": recovered, "reissued": {g: str(o) for g, o in first.items()},
        "second": {g: str(o) for g, o in second.items()}, "engine": state["stats"], "attached": state["attached"],
        "finished": by_prompt(state["finished"]), "rows": world.rows(), "ledger": len(world.buffer.core.ledger()),
        "desk": service_for(world.buffer, eos=None).stats,
        "groups": {g.group_id: g.prompt_idx for g in world.buffer.core.groups([READY])}})
    world.buffer.close()
    ray.shutdown()


if __name__ == "__main__":
    {"crash": crash, "resume": resume, "straight": straight}[PHASE]()
