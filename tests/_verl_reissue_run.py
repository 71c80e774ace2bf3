"""A crash and a job restart through verl's own re-issue and agent-loop worker: ``python _verl_reissue_run.py
crash|resume WORKDIR``. For tests/integrations/verl/test_verl_reissue_crash.py (whose docstring lists the
stand-ins and why).

What runs is verl's: the kvckpt buffer built as ``custom_sampler`` builds it (``KvckptReplayBufferAsync``), verl's
``PPOTrainer._submit_batch_to_rollout`` and ``_reissue_inflight_prompts`` bound to a stub as verl's
``test_reissue_inflight_on_cpu.py`` binds them, verl's ``AgentLoopWorkerTQ`` (its ``__init__`` with verl's composed
``ppo_trainer`` config, ``generate_sequences``, ``_run_prompt``, ``_run_agent_loop``, ``_agent_loop_postprocess``)
running kvckpt's ``KvckptSingleTurnAgentLoop`` (registered through ``agent_loop_config_path``), verl's
``FullyAsyncLLMServerClient`` and ``vLLMHttpServer`` request path (``KvckptHttpServer``) over kvckpt's tiny
step-wise engine, TransferQueue and the ledger actor on a real file.

``crash``: the ledger is checkpointed (step 0), then prompt ``p0`` (rollout.n = 2, greedy, budget
:data:`BUDGET`, interval :data:`EVERY`) is dispatched. Its two samples finish; each reaches verl's trajectory put
(``tq.async_kv_batch_put`` in ``_agent_loop_postprocess``), where it is held: the window between the client's
return and the stored trajectory. Then ``p1`` is dispatched; after its :data:`KILL_AT`-th token the engine stops,
the flusher settles, each sample's tokens in flight are logged (fsync'd), and the process SIGKILLs its process
group (itself, Ray, TransferQueue, the ledger actor).

``resume``: a fresh Ray, TransferQueue and buffer (a new run; the ledger refills TransferQueue with both prompts,
still ``running``), fresh worker, client and server (at weight version 1). verl's ``_reissue_inflight_prompts``
re-issues both prompts through the worker; once both groups are ``finished`` it reads the stored trajectories, the
ledger's leftover progress and the counters, then dispatches ``r0`` / ``r1`` (the same prompts, never
interrupted) for the reference. Writes ``result.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _phases import write_json
from _verl_engine import InProcessHandle, OneServerBalancer, TinyEngine, install_vllm_standin, make_server

install_vllm_standin()

import ray  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
import verl  # noqa: E402
from _verl_support import transferqueue  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from kvckpt.integrations.verl.buffer import KvckptReplayBufferAsync  # noqa: E402
from kvckpt.integrations.verl.client import AGENT_LOOP  # noqa: E402
from kvckpt.integrations.verl.server import KvckptHttpServer  # noqa: E402
from omegaconf import open_dict  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ  # noqa: E402
from verl.trainer.ppo.v1.trainer_base import PPOTrainer  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient  # noqa: E402

from kvckpt.testing.fixtures.tiny_model import AdditionTask, ensure_tiny_model  # noqa: E402

MODE, WORK = sys.argv[1], sys.argv[2]
ACTOR = "kvckpt_verl_reissue"
EVERY, BUDGET, KILL_AT, N = 8, 40, 29, 2
WINDOW, MIDWAY = "p0", "p1"  # held in the window after generation / killed mid-generation
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def verl_config(model_path: str, registry: str) -> Any:
    """verl's composed ``ppo_trainer`` config, set as a user sets it for this run (the two kvckpt keys included)."""
    folder = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    sampler = "trainer.v1.sampler.sampler_kwargs"
    with initialize_config_dir(config_dir=folder, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_path}",
            "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.response_length={BUDGET}",
            "actor_rollout_ref.rollout.prompt_length=64", f"actor_rollout_ref.rollout.n={N}",
            "actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.calculate_log_probs=true",
            f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_LOOP}",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={registry}",
            f"+{sampler}.kvckpt.path={os.path.join(WORK, 'ledger.kv')}", f"+{sampler}.kvckpt.actor_name={ACTOR}",
            f"+{sampler}.kvckpt.progress_every_tokens={EVERY}"])
    with open_dict(config):
        config.actor_rollout_ref.model.custom_chat_template = TEMPLATE  # the tiny tokenizer has none
    return config


class Rollout:
    """verl's agent-loop worker over one server, on an event loop of its own (as a Ray async actor's)."""

    def __init__(self, config: Any, model: torch.nn.Module, eos: int, version: int) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.engine = TinyEngine(model, eos, gather=N)
        self.server = make_server(KvckptHttpServer, self.engine, response_length=BUDGET, ignore_eos=True)
        self.server.global_steps = version
        client = FullyAsyncLLMServerClient(config, InProcessHandle(OneServerBalancer(self.server)))
        self.worker = AgentLoopWorkerTQ.__ray_metadata__.modified_class(config, client)  # verl's own __init__

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def generate_sequences(self, batch: Any) -> None:
        """verl's ``AgentLoopManagerTQ.generate_sequences`` with one worker: hand it the batch, wait for dispatch."""
        self.call(self.worker.generate_sequences(batch))


def trainer(rollout: Rollout, global_steps: int) -> Any:
    """verl's ``_make_trainer_stub`` (``test_reissue_inflight_on_cpu.py``) with verl's dispatch bound too."""
    stub = type("Stub", (), {})()
    stub.trainer_mode, stub.global_steps, stub.agent_loop_manager = "separate_async", global_steps, rollout
    stub._reissue_inflight_prompts = PPOTrainer._reissue_inflight_prompts.__get__(stub)
    stub._submit_batch_to_rollout = PPOTrainer._submit_batch_to_rollout.__get__(stub)
    return stub


def dispatch(stub: Any, uids: list[str], texts: list[str]) -> None:
    batch = tu.get_tensordict({"uid": uids, "raw_prompt": [[{"role": "user", "content": t}] for t in texts],
                               "index": torch.arange(len(uids))})
    tu.assign_non_tensor_data(batch, "global_steps", stub.global_steps)
    stub._submit_batch_to_rollout(batch)


def status(uid: str) -> str | None:
    return (tq.kv_list(partition_id="train").get("train", {}).get(uid) or {}).get("status")


def wait_finished(uids: list[str]) -> None:
    deadline = time.monotonic() + 300
    while any(status(u) != "finished" for u in uids):
        if time.monotonic() > deadline or "failure" in {status(u) for u in uids}:
            raise SystemExit(f"groups not finished: {[(u, status(u)) for u in uids]}")
        time.sleep(0.05)


def samples(uids: list[str]) -> list[tuple[str, int]]:
    return [(u, s) for u in uids for s in range(N)]


def trajectories(uids: list[str]) -> dict[str, dict[str, list]]:
    """The stored trajectories, as TransferQueue gives them to the trainer."""
    keys = [f"{u}_{s}_0" for u, s in samples(uids)]
    batch = tq.kv_batch_get(keys=keys, partition_id="train")
    out = {}
    for i, (u, s) in enumerate(samples(uids)):
        extra = batch["extra_fields"][i]
        extra = extra.data if hasattr(extra, "data") else extra
        out[f"{u}/{s}"] = {"tokens": batch["responses"][i].tolist(), "logprobs": batch["rollout_log_probs"][i].tolist(),
                           "versions": list(extra["token_versions"]),
                           "min": extra["min_global_steps"], "max": extra["max_global_steps"]}
    return out


def crash(rollout: Rollout, stub: Any, texts: list[str], token: str) -> None:
    held: list[list[str]] = []
    window = threading.Event()
    put = tq.async_kv_batch_put  # the mirror's: the ledger first, then TransferQueue

    async def holding_put(keys: list[str], partition_id: str, **kwargs: Any) -> Any:
        if keys[0].startswith(f"{WINDOW}_"):  # the client returned; the trajectory is not stored yet
            held.append(list(keys))
            if len(held) == N:
                window.set()
            await asyncio.Event().wait()  # held here until the kill
        return await put(keys=keys, partition_id=partition_id, **kwargs)

    tq.async_kv_batch_put = holding_put

    async def kill() -> None:
        progress = rollout.server.kvckpt_progress
        await progress.idle()
        inflight = {f"{s.key.uid}/{s.key.session}": s.durable + len(s.ids) for s in progress.samples}
        inflight.update({f"{WINDOW}/{s}": BUDGET for s in range(N)})  # generated whole, held before the put
        write_json(WORK, "killed.json", {"token": token, "inflight": inflight, "held": held})
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def on_step(n: int) -> None:
        if n == BUDGET + KILL_AT:  # p1's KILL_AT-th token: generation stops, the flusher settles, SIGKILL
            rollout.engine.paused = True
            asyncio.get_running_loop().create_task(kill())

    rollout.engine.on_step = on_step
    dispatch(stub, [WINDOW], texts[:1])
    if not window.wait(300):
        raise SystemExit("the window prompt's samples never reached their trajectory put")
    rollout.engine.gather_next()
    dispatch(stub, [MIDWAY], texts[1:])
    time.sleep(300)
    raise SystemExit("the crash run finished without being killed")


def resume(rollout: Rollout, stub: Any, texts: list[str], buffer: Any) -> None:
    with open(os.path.join(WORK, "killed.json")) as f:
        killed = json.load(f)
    uids = [WINDOW, MIDWAY]

    def progress() -> dict[str, Any]:
        return {f"{u}/{s}": ray.get(buffer.ledger.progress.remote(u, s)) for u, s in samples(uids)}

    before = progress()
    statuses = {u: status(u) for u in uids}
    reissued = stub._reissue_inflight_prompts()
    wait_finished(uids)
    resumed, left = trajectories(uids), progress()
    server_stats, admitted = dict(rollout.server.kvckpt_progress.stats), rollout.engine.admitted
    rollout.engine.gather_next()
    rollout.engine.gather = 2 * N
    dispatch(stub, ["r0", "r1"], texts)
    wait_finished(["r0", "r1"])
    reference = trajectories(["r0", "r1"])
    write_json(WORK, "result.json", {
        "killed": killed, "statuses": statuses, "reissued": reissued, "restored": buffer.restored,
        "durable": {k: {"tokens": len(v["tokens"]), "done": v["done"], "versions": v["versions"]} if v else None
                    for k, v in before.items()},
        "resumed": resumed, "expected": {k.replace("r", "p", 1): v for k, v in reference.items()},
        "left": left, "server": server_stats, "admitted": admitted})


def main() -> None:
    model_path = ensure_tiny_model()
    registry = os.path.join(WORK, "agent_loop.yaml")
    with open(registry, "w") as f:
        f.write(f"- name: {AGENT_LOOP}\n  _target_: kvckpt.integrations.verl.client.KvckptSingleTurnAgentLoop\n")
    config = verl_config(model_path, registry)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    task = AdditionTask()
    texts = [task.prompt(0), task.prompt(1)]
    with transferqueue("kvckpt-verl-reissue", ACTOR):
        buffer = KvckptReplayBufferAsync(trainer_mode="separate_async", trainer_config=config,
                                         max_off_policy_threshold=8, max_off_policy_strategy="drop",
                                         sampler_kwargs=config.trainer.v1.sampler.sampler_kwargs)
        eos = AutoTokenizer.from_pretrained(model_path).eos_token_id
        rollout = Rollout(config, model, eos, version=0 if MODE == "crash" else 1)
        stub = trainer(rollout, global_steps=1)
        if MODE == "crash":
            tq.save_checkpoint(os.path.join(WORK, "global_step_0", "transfer_queue"), metadata={"global_steps": 0})
            crash(rollout, stub, texts, buffer.mirror.token)
        else:
            resume(rollout, stub, texts, buffer)


if __name__ == "__main__":
    main()
