"""The agent-loop side of token progress: each sample resumes from its durable prefix (:class:`ProgressClient`),
through verl's own agent loop and client (:class:`KvckptSingleTurnAgentLoop`).

Select it in verl's config (``actor_rollout_ref.rollout.agent.default_agent_loop=kvckpt_single_turn_agent``, with
``agent_loop_config_path`` naming a two-line file that registers it; docs/integrations.md, "verl V1"). It is verl's
``SingleTurnAgentLoop``; its ``run`` knows the sample (``uid``, ``session_id``) and its server manager (verl's
``FullyAsyncLLMServerClient`` in async modes) is wrapped in :class:`ProgressClient`, which

1. reads the sample's durable progress from the ledger (``VerlLedger.progress``): after a crash or a job restart,
   ``_reissue_inflight_prompts`` dispatches the prompt again and each sample continues from
   ``prompt + prefix`` with the remaining budget, instead of regenerating it (a prefix marked done is the whole
   response: nothing is generated);
2. sends the sample's :class:`~.progress.SampleKey` with every call (verl's client passes extra keywords to the
   server's ``generate``, and makes a fresh vLLM request id per call, abort resumes included), so
   :class:`~.server.KvckptHttpServer` records the tokens as they stream;
3. when verl's client returns (its own abort-resume loop finished), reads the sample back: the response is the
   durable tokens, logprobs and per-token weight versions (``extra_fields["token_versions"]``, which verl stores
   with the trajectory; ``min_global_steps`` / ``max_global_steps`` from them), checked equal to what the
   server returned. The sample's progress (marked done) stays: verl's worker stores the trajectory after reward
   and teacher calls, and ``_reissue_inflight_prompts`` clears the trajectories of a prompt still in flight, so a
   crash anywhere before the group ends would otherwise regenerate a finished sample. The put of the group's
   ``finished`` / ``failure`` status deletes the progress of all its samples in its own transaction
   (``VerlLedger.put``'s ``ended``); a re-issued sample whose progress is done generates nothing.

A call made outside a sample, or in a process with no run (no mirror installed), is verl's, untouched.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import ray
from kvckpt.integrations.verl.config import LedgerSettings
from kvckpt.integrations.verl.mirror import NAMESPACE, active
from kvckpt.integrations.verl.progress import SampleKey
from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.workers.rollout.replica import TokenOutput

from kvckpt.errors import KvckptError

#: ``(uid, session_id)`` of the sample the current agent-loop task generates.
_SAMPLE: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("kvckpt_verl_sample", default=None)

#: The name the agent loop is registered under.
AGENT_LOOP = "kvckpt_single_turn_agent"


@contextlib.contextmanager
def generating(uid: str, session: int) -> Iterator[None]:
    """Within it, the current task generates sample ``session`` of prompt ``uid`` (what :class:`ProgressClient`
    resumes and records); the agent loop's ``run`` enters it."""
    token = _SAMPLE.set((str(uid), int(session)))
    try:
        yield
    finally:
        _SAMPLE.reset(token)


class ProgressMismatch(KvckptError):
    """The tokens verl's client returned are not the sample's durable ones (a refused flush: this run was
    replaced); the sample is not handed to the trainer as if it were whole."""


class ProgressClient:
    """verl's LLM server client with each sample resumed from and recorded into the ledger (module docstring).

    Args:
        inner: verl's client (``FullyAsyncLLMServerClient`` in async modes).
        every: the interval in tokens; 0 passes every call through unrecorded.
    """

    def __init__(self, inner: Any, every: int) -> None:
        self.inner, self.every = inner, int(every)
        #: tokens_resumed (from durable prefixes), tokens_generated (by this process's calls), samples_resumed.
        self.stats = {"tokens_resumed": 0, "tokens_generated": 0, "samples_resumed": 0}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> TokenOutput:
        """verl's ``generate`` for one sample, resumed from its durable prefix and recorded (module docstring).

        Raises:
            ProgressMismatch: the returned tokens are not the durable ones.
        """
        where, mirror = _SAMPLE.get(), active()
        if where is None or mirror is None or self.every <= 0:
            return await self.inner.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
                                              **kwargs)
        uid, session = where
        ledger = ray.get_actor(mirror.actor_name, namespace=NAMESPACE)
        prefix = await ledger.progress.remote(uid, session) or {"tokens": [], "logprobs": [], "versions": [],
                                                                "done": False}
        key = SampleKey(mirror.actor_name, mirror.token, uid, session, len(prompt_ids), self.every)
        params = dict(sampling_params)
        limit = "max_new_tokens" if "max_new_tokens" in params else "max_tokens"
        budget = params.get(limit) or _response_length(self.inner.config)
        if prefix["tokens"]:
            self.stats["samples_resumed"] += 1
            self.stats["tokens_resumed"] += len(prefix["tokens"])
        if prefix["done"] or (budget is not None and len(prefix["tokens"]) >= budget):
            output = TokenOutput(token_ids=[], log_probs=[], stop_reason="completed", extra_fields={})
        else:
            if budget is not None:
                params[limit] = budget - len(prefix["tokens"])
            output = await self.inner.generate(request_id, prompt_ids=list(prompt_ids) + prefix["tokens"],
                                               sampling_params=params, kvckpt=key.to_dict(), **kwargs)
        self.stats["tokens_generated"] += len(output.token_ids)
        durable = await ledger.progress.remote(uid, session)
        tokens = prefix["tokens"] + list(output.token_ids)
        if durable is None or durable["tokens"] != tokens:
            raise ProgressMismatch(f"kvckpt verl progress: sample {uid}/{session} returned {len(tokens)} tokens, "
                                   f"but {0 if durable is None else len(durable['tokens'])} differing ones are "
                                   "durable (its run was replaced?)")
        output.token_ids = tokens
        if sampling_params.get("logprobs"):
            output.log_probs = durable["logprobs"]
        versions = durable["versions"]
        extra = dict(output.extra_fields or {})
        extra["token_versions"] = versions
        if versions:
            extra["min_global_steps"], extra["max_global_steps"] = min(versions), max(versions)
        output.extra_fields = extra
        return output


def _response_length(config: Any) -> int | None:
    """``actor_rollout_ref.rollout.response_length``: the budget verl's client pins when a call names none."""
    rollout = getattr(getattr(config, "actor_rollout_ref", None), "rollout", None)
    length = getattr(rollout, "response_length", None)
    return length if isinstance(length, int) and length > 0 else None


@register(AGENT_LOOP)
class KvckptSingleTurnAgentLoop(SingleTurnAgentLoop):
    """verl's ``SingleTurnAgentLoop`` whose generation resumes from and records durable progress (module
    docstring). The interval is ``trainer.v1.sampler.sampler_kwargs.kvckpt.progress_every_tokens``."""

    def __init__(self, *args: Any, server_manager: Any, **kwargs: Any) -> None:
        super().__init__(*args, server_manager=server_manager, **kwargs)
        sampler = self.config.trainer.v1.sampler
        every = LedgerSettings.from_sampler_kwargs(sampler.get("sampler_kwargs")).progress_every_tokens
        self.server_manager = ProgressClient(server_manager, every)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        """verl's ``run``, with the sample (``uid``, ``session_id``) known to the client."""
        with generating(kwargs["uid"], kwargs["session_id"]):
            return await super().run(sampling_params, **kwargs)
