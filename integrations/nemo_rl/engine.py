"""Token progress from NeMo-RL's own vLLM worker: an engine proxy in place of the worker's ``AsyncLLM``.

NeMo-RL (``7ea279ab``) generates every rollout of both async drivers through
``VllmAsyncGenerationWorkerImpl.generate_async``: one request per sample to ``self.llm.generate``, of whose
cumulative outputs it keeps only the last. :class:`ProgressEngine` takes ``self.llm``'s place
(:func:`attach`), so NeMo-RL's code runs unchanged and every request passes through it:

* **The sequence's key comes from the caller.** NeMo-RL's request id is random per request, so the
  (lease, sample index) of a request travels from the controller: :class:`KeyedGeneration` wraps the
  controller's ``policy_generation`` and adds a ``kvckpt_sequence`` entry to the ``data`` of a call made while
  ``reserve`` bound an attempt (:mod:`.dispatch`); the worker's ``generate_async``, wrapped by
  :func:`install_worker`, takes it out of ``data`` (NeMo-RL's body never sees it) and binds it for the
  proxy. The index is the order in which the group's per-sample tasks first call the engine: NeMo-RL's
  ``run_rollout`` starts them in ``traj_idx`` order and each calls it before its first ``await``. A
  request without a key (the HTTP path, a later turn) passes through untouched.
* **Recording.** Each cumulative output's new tokens, their logprobs and the weight version current when they
  arrived go to the sequence's recorder, which writes every ``every_tokens`` through the store's progress
  call; a weight update (``collective_rpc`` of NeMo-RL's refit methods, answered all ``True``) moves the
  version, so one sequence spans versions token by token. A sequence's tail is written when it ends, so a
  finished sample is durable whole until its group commits.
* **Resume.** A request whose lease has durable progress asks the engine for ``prompt + prefix`` with the
  remaining budget, and each output it yields is the whole sequence: the durable tokens and logprobs, then
  the engine's, with the engine's finish reason (so NeMo-RL's ``truncated`` is the uninterrupted run's). A
  prefix already complete (the budget, or EOS) makes no engine request.
* **Fenced.** A write of a fenced attempt (a worker of a killed run) is refused by the store; the proxy
  then stops the request and raises that refusal, having written nothing.

THE RECORDER SEAM: :class:`_Sequence` is the one place that talks to the producer recorder the trainers share
(:mod:`kvckpt.integrations.common.progress`, through the vLLM workers' step-message adapter
``kvckpt.integrations.vllm.stream.ProgressRecorder``): one synchronous recorder per sequence, each delta
carrying its weight version, so a chunk that spans a refit is written as one step message that the store
cuts into one chunk per version.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from kvckpt.integrations.nemo_rl.dispatch import bound_lease
from kvckpt.integrations.vllm.stream import Continuation, ProgressRecorder, finish, prefixes

from kvckpt import Lease
from kvckpt.errors import InvariantViolation

#: NeMo-RL's refit calls on its engine (``vllm_worker_async.py``): each moves the weight version once answered.
WEIGHT_UPDATES = ("update_weights_via_ipc_zmq", "update_weights_from_collective", "nccl_reshard_refit")
#: The ``data`` entry :class:`KeyedGeneration` adds and :func:`install_worker` takes out.
KEY = "kvckpt_sequence"

_SEQUENCE: ContextVar[tuple[Lease, int] | None] = ContextVar("kvckpt_nemo_rl_sequence", default=None)


@dataclass
class PrefixLogprob:
    """A durable token's logprob as vLLM's ``Logprob`` reads (NeMo-RL reads ``.logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Any]] | None
    finish_reason: str | None


@dataclass
class _Output:
    """The whole output of a sequence whose durable prefix was complete (no engine request was made)."""

    request_id: str
    outputs: list[_Completion] = field(default_factory=list)
    finished: bool = True


class _Sequence:
    """THE RECORDER SEAM (module docstring): one sequence's tail in the engine's shared producer recorder."""

    def __init__(self, recorder: ProgressRecorder, lease: Lease, index: int, durable: int, every: int) -> None:
        self._recorder = recorder
        self._tail = recorder.recorder.open((lease, index), durable, every)

    def take(self, ids: list[int], logprobs: list[float], version: int) -> None:
        """Add new tokens made by weights ``version``; a due chunk goes out with the engine's next flush (one step
        message for every due sequence, written by the recorder's flusher thread, off the event loop)."""
        self._recorder.recorder.take(self._tail, ids, logprobs, [version] * len(ids))
        self._recorder.recorder.step()
        self._check()

    async def finish(self) -> None:
        """The sequence ended: write its whole tail, however short of an interval, and return once it is durable
        (waited for in a thread, so the other sequences keep generating)."""
        await asyncio.get_running_loop().run_in_executor(None, self._recorder.recorder.finish, self._tail)
        self._check()

    def _check(self) -> None:
        if self._tail.refused is not None:
            raise self._tail.refused
        if self._recorder.error is not None:
            raise InvariantViolation(f"token progress stopped: a flush failed ({self._recorder.error!r}); nothing "
                                     "more is written")


class ProgressEngine:
    """NeMo-RL's worker engine (``worker.llm``) with token progress (module docstring).

    Args:
        engine: vLLM's ``AsyncLLM`` the worker built (or a stand-in with its ``generate``/``collective_rpc``).
        sink: the store's progress calls (a kvckpt ``ReplayBuffer``, e.g. ``buffer.core``, or its Ray client).
        every_tokens: record a sequence every this many new tokens (at most this many are regenerated after a
            crash, per sequence).
        eos: the end-of-sequence token (a prefix ending with it is complete); ``None`` for none.
        weight_version: the version of the weights the engine starts with.
        on_finish: called with ``(lease, index, token_ids, logprobs, versions)`` of each keyed sequence's whole
            output when it ends (a test's or a metrics hook).
    """

    def __init__(self, engine: Any, sink: Any, *, every_tokens: int, eos: int | None, weight_version: int = 0,
                 on_finish: Callable[[Lease, int, list[int], list[float], list[int]], None] | None = None) -> None:
        self.engine, self.sink, self.every_tokens, self.eos = engine, sink, int(every_tokens), eos
        self.weight_version, self.on_finish = int(weight_version), on_finish
        self._recorder: ProgressRecorder | None = None  # the engine's one recorder, made at its first keyed request
        #: requests made to the engine, tokens it generated for keyed sequences, tokens taken from durable progress,
        #: refused requests, and ``loop_s``: seconds the event loop spent handing tokens to the recorder (its only
        #: wait: the flusher writes off the loop, unless a sequence holds a whole interval unrecorded)
        self.stats: dict[str, float] = {"requests": 0, "generated": 0, "resumed": 0, "refused": 0, "loop_s": 0.0}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)  # the rest of AsyncLLM (the HTTP path's model_config, renderer, ...)

    async def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The engine's ``collective_rpc``; a weight update all workers answered ``True`` moves the version."""
        result = self.engine.collective_rpc(method, *args, **kwargs)
        result = await result if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future) else result
        if method in WEIGHT_UPDATES and result and all(result):
            self.weight_version += 1
        return result

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any,
                       **kwargs: Any) -> AsyncIterator[Any]:
        """``AsyncLLM.generate``; a keyed request records its progress and resumes from it (module docstring)."""
        key = _SEQUENCE.get()
        if key is None:
            async for out in self.engine.generate(prompt, sampling_params, request_id, *args, **kwargs):
                yield out
            return
        lease, index = key
        # a later attempt's prefix read is a store call (a blocking Ray call on a worker): off the event loop
        durable = (await asyncio.to_thread(prefixes, self.sink, lease)).get(index)
        prefix = Continuation(tuple(prompt["prompt_token_ids"]),
                              *(() if durable is None else (tuple(durable.tokens.tolist()),
                                                            tuple(durable.logprobs.tolist()),
                                                            tuple(durable.versions.tolist()))))
        eos = None if getattr(sampling_params, "ignore_eos", False) else self.eos
        budget = int(sampling_params.max_tokens)
        ids, logprobs, versions = list(prefix.prefix_ids), list(prefix.prefix_logprobs), list(prefix.prefix_versions)
        self.stats["resumed"] += len(ids)
        if self._recorder is None:
            self._recorder = ProgressRecorder(self.sink, [], [], self.weight_version, every_tokens=self.every_tokens,
                                              every_seconds=None, background=True)
        recorder = _Sequence(self._recorder, lease, index, len(ids), self.every_tokens)
        want_logprobs = getattr(sampling_params, "logprobs", None) is not None
        remaining = prefix.remaining(budget, eos)
        if remaining == 0:
            yield _Output(request_id, [_Completion(ids, self._logprobs(ids, logprobs) if want_logprobs else None,
                                                   finish(prefix, [], eos, budget))])
        else:
            params = copy.copy(sampling_params)
            params.max_tokens = remaining
            self.stats["requests"] += 1
            request = {**prompt, "prompt_token_ids": list(prefix.prompt_ids) + ids}
            seen = 0
            try:
                async for out in self.engine.generate(request, params, request_id, *args, **kwargs):
                    c = out.outputs[0]
                    new = list(c.token_ids[seen:])
                    new_lp = [float(d[t].logprob) for d, t in zip(c.logprobs[seen:], new, strict=True)] \
                        if c.logprobs is not None else [0.0] * len(new)
                    seen += len(new)
                    self.stats["generated"] += len(new)
                    ids += new
                    logprobs += new_lp
                    versions += [self.weight_version] * len(new)
                    if new:
                        handed = time.perf_counter()
                        recorder.take(new, new_lp, self.weight_version)
                        self.stats["loop_s"] += time.perf_counter() - handed
                    # the engine's output is already the whole sequence unless a durable prefix came first
                    yield self._spliced(out, ids, logprobs if c.logprobs is not None else None) if prefix.prefix_ids \
                        else out
            except Exception:
                self.stats["refused"] += 1
                with contextlib.suppress(Exception):
                    await recorder.finish()  # what was generated stays durable; the sequence leaves the recorder
                raise
        await recorder.finish()
        if self.on_finish is not None:
            self.on_finish(lease, index, ids, logprobs, versions)

    def acknowledged(self) -> dict[tuple[str, int], int]:
        """``(group id, sample index) -> tokens the store acknowledged durable`` of each sequence still generating."""
        tails = [] if self._recorder is None else list(self._recorder.recorder.tails)
        return {(t.key[0].group_id, int(t.key[1])): int(t.durable) for t in tails}

    def close(self) -> None:
        """Make every sequence's due chunks durable and stop the recorder's flusher (the worker shuts down)."""
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None

    @staticmethod
    def _logprobs(ids: Sequence[int], logprobs: Sequence[float]) -> list[dict[int, Any]]:
        return [{t: PrefixLogprob(lp)} for t, lp in zip(ids, logprobs, strict=True)]

    def _spliced(self, out: Any, ids: list[int], logprobs: list[float] | None) -> Any:
        """The engine's output with its first completion holding the whole sequence (prefix first)."""
        c = out.outputs[0]
        whole = dataclasses.replace(c, token_ids=list(ids),
                                    logprobs=None if logprobs is None else self._logprobs(ids, logprobs))
        spliced = copy.copy(out)
        spliced.outputs = [whole, *out.outputs[1:]]
        return spliced


def attach(worker: Any, sink: Any, *, every_tokens: int, eos: int | None, weight_version: int = 0,
           **kwargs: Any) -> ProgressEngine:
    """Put a :class:`ProgressEngine` in place of ``worker.llm`` (NeMo-RL's worker, after its engine is built)."""
    if not isinstance(worker.llm, ProgressEngine):
        worker.llm = ProgressEngine(worker.llm, sink, every_tokens=every_tokens, eos=eos,
                                    weight_version=weight_version, **kwargs)
    return worker.llm


@contextlib.contextmanager
def sequence(lease: Lease | None, index: int) -> Iterator[None]:
    """Bind the sequence key ``(lease, index)`` (``None``: no key) for the proxy's requests made inside the block
    (and the tasks started there): what :func:`install_worker` does with the key a request's ``data`` carries."""
    token = _SEQUENCE.set(None if lease is None else (lease, int(index)))
    try:
        yield
    finally:
        _SEQUENCE.reset(token)


def install_worker(worker_cls: type) -> None:
    """Wrap ``worker_cls.generate_async`` (NeMo-RL's ``VllmAsyncGenerationWorkerImpl``) so the sequence key a
    :class:`KeyedGeneration` put in ``data`` is taken out and bound for the proxy (idempotent)."""
    original = worker_cls.generate_async
    if getattr(original, "kvckpt_original", None) is not None:
        return

    @functools.wraps(original)
    async def generate_async(self: Any, data: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        keys = data.pop(KEY, None) if hasattr(data, "pop") else None
        settings = keys[0].get("progress") if keys else None
        if settings is not None and not isinstance(self.llm, ProgressEngine):  # a Ray worker's first keyed request
            from kvckpt.integrations.nemo_rl.remote import desk_sink

            attach(self, desk_sink(settings), every_tokens=int(settings["every"]), eos=settings["eos"],
                   weight_version=int(settings["version"]), on_finish=getattr(self, "kvckpt_on_finish", None))
        with sequence(*((Lease.from_dict(keys[0]["lease"]), int(keys[0]["index"])) if keys else (None, 0))):
            async for item in original(self, data, *args, **kwargs):
                yield item

    generate_async.kvckpt_original = original  # type: ignore[attr-defined]
    worker_cls.generate_async = generate_async


class KeyedGeneration:
    """The controller's ``policy_generation`` with the sequence key added to each first call of a sample's task
    (module docstring); every other member is the wrapped object's."""

    def __init__(self, inner: Any, settings: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.inner, self.settings = inner, settings
        self._order: dict[tuple[str, int], weakref.WeakKeyDictionary[asyncio.Task, int]] = {}
        self._calls: weakref.WeakKeyDictionary[asyncio.Task, int] = weakref.WeakKeyDictionary()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate_async(self, data: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """``policy_generation.generate_async``: the first call of a sample's task carries its key."""
        lease, task = bound_lease(), asyncio.current_task()
        if lease is not None and task is not None:
            calls = self._calls.get(task, 0)
            self._calls[task] = calls + 1
            if calls == 0:  # a later turn of the same sample is another sequence: not keyed (single-turn only)
                for done in [k for k, tasks in self._order.items() if not tasks]:  # attempts whose tasks ended
                    del self._order[done]
                order = self._order.setdefault((lease.group_id, lease.attempt), weakref.WeakKeyDictionary())
                order[task] = index = len(order)
                data[KEY] = [{"lease": lease.to_dict(), "index": index,
                              **({} if self.settings is None else {"progress": dict(self.settings())})}]
        async for item in self.inner.generate_async(data, *args, **kwargs):
            yield item
