"""verl's vLLM rollout server with durable token progress: :class:`KvckptHttpServer`.

It is verl's ``vLLMHttpServer`` (verl 0.9.1, ``workers/rollout/vllm_rollout/vllm_async_server.py``): every
request runs verl's own ``generate`` (its budget, sampling parameters, submission gate and stream loop), and
verl's ``abort_all_requests`` / ``resume_generation`` run unchanged. What it adds: a request that carries a
``kvckpt`` key (:class:`~.progress.SampleKey`, sent by kvckpt's agent loop, :mod:`.client`) has its stream
observed — the engine's async generator is tapped, so verl's loop sees the same outputs — and recorded by the
server's :class:`~.progress.ServerProgress` every ``every`` tokens, each token stamped with the server's
``global_steps`` when the output carrying it arrived; when verl's ``generate`` returns (a weight-sync abort or
completion) the sample's tail is durable before the response reaches the client, so before the client resumes.
A request without the key is verl's, untouched.

Selected at import, not by configuration: verl 0.9.1 declares ``rollout.custom_async_server`` but never reads
it, and its ``vLLMReplica`` builds ``ray.remote(vLLMHttpServer)`` from its module's global name when a replica
starts. :func:`install` (run by the kvckpt replay buffer, built before verl starts its replicas, when
``progress_every_tokens`` is set) points that name at :class:`KvckptHttpServer`.
``tests/integrations/verl/test_verl_stream_crash.py`` fails if verl moves the name.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator
from typing import Any

import ray
from kvckpt.integrations.verl.mirror import NAMESPACE
from kvckpt.integrations.verl.progress import Sample, SampleKey, ServerProgress
from verl.workers.rollout.vllm_rollout import vllm_async_server

#: The request being generated in the current task (set around verl's ``generate``).
_SAMPLE: contextvars.ContextVar[Sample | None] = contextvars.ContextVar("kvckpt_verl_sample", default=None)


class _Logprobs:
    """A completion's sampled-token logprobs, read only for the slice asked (the new tokens of one output)."""

    def __init__(self, completion: Any) -> None:
        self.completion = completion

    def __getitem__(self, part: slice) -> list[float]:
        ids, entries = self.completion.token_ids[part], self.completion.logprobs[part]
        return [entry[token].logprob for token, entry in zip(ids, entries, strict=True)]


class EngineTap:
    """verl's ``self.engine`` (vLLM's ``AsyncLLM``) with ``generate``'s outputs observed for the current sample."""

    def __init__(self, engine: Any, server: KvckptHttpServer) -> None:
        self._engine, self._server = engine, server

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        sample = _SAMPLE.get()
        async for output in self._engine.generate(*args, **kwargs):
            if sample is not None and output.outputs:
                completion = output.outputs[0]
                logprobs = None if completion.logprobs is None else _Logprobs(completion)
                await self._server.kvckpt_progress.observe(sample, completion.token_ids, logprobs,
                                                           self._server.global_steps)
            yield output


class KvckptHttpServer(vllm_async_server.vLLMHttpServer):
    """verl's ``vLLMHttpServer`` whose requests with a ``kvckpt`` key record their tokens (module docstring)."""

    kvckpt_progress: ServerProgress

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       *args: Any, kvckpt: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """verl's ``generate``; with ``kvckpt`` (a :class:`SampleKey` as a dict) the sample's tokens are recorded
        while it streams and its tail is durable before this returns."""
        if kvckpt is None:
            return await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        key = SampleKey.from_dict(kvckpt)
        if not isinstance(self.engine, EngineTap):
            self.attach_progress(ServerProgress(ledger_sink(key.actor)))
        sample = self.kvckpt_progress.open(key, len(prompt_ids))
        token = _SAMPLE.set(sample)
        try:
            output = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        finally:
            _SAMPLE.reset(token)
        await self.kvckpt_progress.close(sample, final=output.stop_reason != "aborted")
        return output

    def attach_progress(self, progress: ServerProgress) -> None:
        """Record through ``progress`` (done on the first request with a key, writing to the key's ledger actor)."""
        self.kvckpt_progress = progress
        if not isinstance(self.engine, EngineTap):
            self.engine = EngineTap(self.engine, self)

    async def kvckpt_stats(self) -> dict[str, int]:
        """The progress counters (:attr:`ServerProgress.stats`): calls, chunks, tokens, refusals, waits."""
        progress = getattr(self, "kvckpt_progress", None)
        return {} if progress is None else dict(progress.stats)


def ledger_sink(actor_name: str) -> Any:
    """``VerlLedger.record_progress`` of the named ledger actor, awaited (a :data:`~.progress.Sink`)."""
    actor = ray.get_actor(actor_name, namespace=NAMESPACE)

    async def sink(run: str, items: list[dict[str, Any]]) -> list[Any]:
        return await actor.record_progress.remote(run, items)

    return sink


#: verl's own class, as :func:`install` found it.
VERL_SERVER = vllm_async_server.vLLMHttpServer


def install() -> None:
    """Make verl start :class:`KvckptHttpServer` for its vLLM replicas in this process (module docstring)."""
    vllm_async_server.vLLMHttpServer = KvckptHttpServer
