"""The Ray actor of tests/_nemo_rl_ray_run.py: one NeMo-RL generation worker in its own Ray process.

A stand-in for NeMo-RL's ``RayWorkerBuilder`` and actor class (both need a GPU and vLLM to build): :class:`WorkerHost`
builds the worker as tests/_nemo_rl_worker.py does (NeMo-RL's ``VllmAsyncGenerationWorkerImpl`` from
``KVCKPT_NEMO_RL_SOURCE``, else the contract stand-in; kvckpt's tiny step-wise engine), with
:func:`~kvckpt.integrations.nemo_rl.engine.install_worker` applied to its class as kvckpt's worker actor class
(``kvckpt.integrations.nemo_rl.worker_actor``) applies it, and exposes the worker's ``generate_async`` and refit
call as Ray methods, as NeMo-RL's actor does. Nothing here attaches the engine proxy: the first request whose key
carries progress settings does, inside the worker's own ``generate_async``, writing through the buffer's Ray client.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import torch
from _nemo_rl_worker import RefitEngine, make_worker, nemo_rl_parts
from kvckpt.integrations.nemo_rl.engine import ProgressEngine, install_worker
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvckpt.errors import StaleAttempt
from kvckpt.testing.fixtures.tiny_model import ensure_tiny_model


class WorkerHost:
    """One worker with the tiny engine; the engine pauses after each step in ``pause_at`` until :meth:`resume`."""

    def __init__(self, *, budget: int, gather: int, pause_at: list[int]) -> None:
        _manager_cls, self.worker_cls, self.which = nemo_rl_parts()
        install_worker(self.worker_cls)
        path = ensure_tiny_model()
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.eos = AutoTokenizer.from_pretrained(path).eos_token_id
        self.budget = budget
        self.engine = RefitEngine(self.model, self.eos, gather=gather)
        self.worker = self._worker(self.engine)
        self.pause_at, self.paused_at = set(pause_at), 0
        self.engine.on_step = self._on_step
        self.finished: dict[str, dict] = {}

    def _worker(self, engine: Any) -> Any:
        worker = make_worker(self.worker_cls, engine, budget=self.budget, pad=0, ignore_eos=True)
        worker.kvckpt_on_finish = self._finished  # the proxy's on_finish, once a keyed request attaches it
        return worker

    def _finished(self, lease: Any, index: int, ids: list, logprobs: list, versions: list) -> None:
        self.finished[f"{lease.group_id}/{index}"] = {"tokens": ids, "logprobs": logprobs, "versions": versions}

    def _on_step(self, step: int) -> None:
        if step in self.pause_at:
            self.engine.paused, self.paused_at = True, step

    async def generate_async(self, data: Any, greedy: bool = False) -> Any:
        """The worker's ``generate_async`` (NeMo-RL's actor method)."""
        async for item in self.worker.generate_async(data, greedy=greedy):
            yield item

    async def update_weights_via_ipc_zmq_async(self) -> bool:
        """The worker's refit call (NeMo-RL's actor method)."""
        return await self.worker.update_weights_via_ipc_zmq_async()

    async def wait_paused(self, step: int) -> dict[str, Any]:
        """Wait until the engine paused after ``step``; returns :meth:`state`."""
        while self.paused_at < step:
            await asyncio.sleep(0.05)
        return self.state()

    async def resume(self) -> None:
        """Let the paused engine go on."""
        await self.engine.resume_generation()

    def state(self) -> dict[str, Any]:
        """The process, which worker ran, the proxy's counters and acknowledged lengths, the engine's refit calls."""
        proxy = self.worker.llm
        keyed = isinstance(proxy, ProgressEngine)
        return {"pid": os.getpid(), "which": self.which, "attached": keyed, "rpcs": list(self.engine.rpcs),
                "stats": dict(proxy.stats) if keyed else {},
                "acknowledged": {f"{g}/{i}": n for (g, i), n in proxy.acknowledged().items()} if keyed else {},
                "finished": self.finished}

    async def zombie(self, data: Any) -> str:
        """A worker of the killed run still streaming its old lease (the key in ``data``): its writes must be
        refused. A second worker in this process, its own engine and proxy."""
        worker = self._worker(RefitEngine(self.model, self.eos, gather=1))
        try:
            async for _ in worker.generate_async(data):
                pass
        except StaleAttempt as exc:
            return f"StaleAttempt ({type(exc).__name__})"
        return "not refused"
