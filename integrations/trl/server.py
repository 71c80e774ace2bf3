"""TRL's vLLM-server generation path, streamed: the backend of :class:`~kvckpt.integrations.trl.KvckptRolloutWorker`
when it keeps the user's ``vllm serve`` (``backend="server"``, the default).

TRL 1.16's ``AsyncRolloutWorker`` asks the server for each completion with one
``POST /v1/completions`` (``_AsyncRolloutLoop._generate_one_turn``): token-id prompt, ``n=1``,
``return_token_ids``, ``logprobs=0``, the config's sampling fields and a fresh ``seed``, and waits
for the whole answer. :class:`VLLMServerBackend` sends the same request with ``stream: true``, so
the server's stream events arrive as the tokens are produced, and its :meth:`~VLLMServerBackend.stream`
hands ``on_step`` every batch of events that arrived together; the worker's ``on_step`` is a
:class:`kvckpt.integrations.vllm.ProgressRecorder` in background mode, which takes the tokens and
leaves the durable calls to its flusher thread, so reading never waits for an fsync. A continuation of a durable
prefix is requested as prompt + prefix with ``max_tokens`` the remaining budget, so a redispatched
sample resumes where its last durable append ended. Weight sync is not here: it stays TRL's own
(the trainer's default ``WeightTransferClient``, NCCL into the same server), told to the stream by
:mod:`~kvckpt.integrations.trl.sync`, so every token carries the version of the weights that made it.
"""

from __future__ import annotations

import json
import queue
import random
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
from kvckpt.integrations.trl.sync import WeightEpochs
from kvckpt.integrations.vllm.backends import Sample, grouped
from kvckpt.integrations.vllm.stream import Continuation, Delta, finish

from kvckpt.errors import KvckptError

#: The sampling fields of TRL's request that come from ``AsyncGRPOConfig`` (same names there).
SAMPLING_FIELDS = ("top_p", "top_k", "min_p", "repetition_penalty")


class ServerGenerationError(KvckptError):
    """The vLLM server refused or broke a generation request (the status and body are in the message)."""


class VLLMServerBackend:
    """A kvckpt generation backend that is TRL's vLLM-server request, streamed.

    Guarantees: every token ``on_step`` sees is one the server streamed for that sequence, in order,
    with its sampled logprob; a sequence ``on_step`` returns is cancelled (its connection closed)
    and gets no further deltas; an HTTP or protocol failure of any request raises
    :class:`ServerGenerationError` after every request has stopped.

    Args:
        model_path: the policy's directory (its tokenizer encodes prompts and decodes completions).
        server_url: the server's base URL (TRL's ``vllm_server_base_url``).
        model_name: the served model's name (TRL sends ``get_config_model_id(model.config)``).
            Defaults to ``model_path``.
        sampling: TRL's sampling fields (``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``).
        request_timeout: seconds a request may take (TRL's ``request_timeout``). Defaults to 120.
        seed: seeds the per-request sampling seeds (TRL draws them unseeded). Defaults to 0.
    """

    def __init__(self, model_path: str, *, server_url: str, model_name: str | None = None,
                 sampling: dict[str, Any] | None = None, request_timeout: float = 120.0, seed: int = 0) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.server_url = server_url.rstrip("/")
        self.model_name = model_name or model_path
        self.sampling = {k: v for k, v in dict(sampling or {}).items() if k in SAMPLING_FIELDS and v is not None}
        self.request_timeout = float(request_timeout)
        self._seeds = random.Random(seed)
        self._seed_lock = threading.Lock()
        #: The worker's :class:`~kvckpt.integrations.trl.sync.WeightEpochs` (set by the worker), or None:
        #: no weight version is tracked (every delta is the caller's).
        self.epochs: WeightEpochs | None = None

    def payload(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float) -> dict[str, Any]:
        """TRL's ``/v1/completions`` request for ``prompt_ids``, streamed."""
        with self._seed_lock:
            seed = self._seeds.getrandbits(63)
        return {"model": self.model_name, "prompt": list(prompt_ids), "max_tokens": int(max_tokens),
                "temperature": float(temperature), **self.sampling, "n": 1, "return_token_ids": True,
                "logprobs": 0, "seed": seed, "stream": True}

    def generate(self, prompts: Sequence[Sequence[int]], counts: Sequence[int], max_tokens: int,
                 temperature: float) -> list[list[Sample]]:
        """``counts[i]`` completions of every prompt (one streamed request each), grouped per prompt."""
        seqs = [Continuation(tuple(p)) for p, n in zip(prompts, counts, strict=True) for _ in range(n)]
        return grouped(self.stream(seqs, max_tokens, temperature), counts)

    def stream(self, seqs: Sequence[Continuation], max_tokens: int, temperature: float,
               on_step: Callable[[Sequence[Delta]], Collection[int]] | None = None,
               step_tokens: int | None = None) -> list[Sample]:
        """Request every continuation at once (one streamed request each, from prompt + prefix with
        the remaining budget) and call ``on_step`` with each batch of stream events that arrived
        together; ``step_tokens`` is ignored (the server decides its steps).

        With :attr:`epochs` (the worker's :class:`~kvckpt.integrations.trl.sync.WeightEpochs`), every
        delta carries the weight version that generated it: a request's tokens taken while its epoch
        is current are its weights'; once the server paused for a weight sync, what arrives for it is
        dropped, the request closed, and the sequence asked again, after the resume, from prompt +
        every token kept, with the new weights. Each sample's ``prefix_versions`` then holds the
        version of every completion token.

        Raises:
            ServerGenerationError: a request failed (after all requests stopped).
        """
        import requests

        eos = self.tokenizer.eos_token_id
        epochs = self.epochs
        events: queue.Queue = queue.Queue()
        cancel = [threading.Event() for _ in seqs]
        stopped: set[int] = set()
        asked = [(0, 0)] * len(seqs)  # (epoch, weight version) of each sequence's request
        new: list[list[int]] = [[] for _ in seqs]
        logps: list[list[float]] = [[] for _ in seqs]
        versions: list[list[int]] = [[] for _ in seqs]
        session = requests.Session()
        threads = []

        def ask(i: int, epoch: int, version: int) -> int:
            seq = seqs[i]
            left = Continuation(seq.prompt_ids, seq.prefix_ids + tuple(new[i])).remaining(max_tokens, eos)
            if not left:
                return 0
            body = self.payload(seq.prompt_ids + seq.prefix_ids + tuple(new[i]), left, temperature)
            asked[i], cancel[i] = (epoch, version), threading.Event()
            thread = threading.Thread(target=self._request, args=(session, i, body, cancel[i], events),
                                      name=f"kvckpt-trl-stream-{i}", daemon=True)
            threads.append(thread)
            thread.start()
            return 1

        start = epochs.running() if epochs is not None else (0, 0)
        running, errors = sum(ask(i, *start) for i in range(len(seqs))), []
        while running:
            batch = [events.get()]
            while True:
                try:
                    batch.append(events.get_nowait())
                except queue.Empty:
                    break
            deltas: list[Delta] = []
            for i, ids, lps in batch:
                if ids is None:
                    running -= 1
                    if lps is not None:
                        errors.append(lps)
                    elif epochs is not None and asked[i][0] != epochs.epoch and i not in stopped:
                        running += ask(i, *epochs.running())  # cut by a weight sync: on with the new weights
                elif ids and not cancel[i].is_set():
                    if epochs is not None and asked[i][0] != epochs.epoch:
                        cancel[i].set()  # the server paused since: these may be the next weights' tokens
                        continue
                    new[i] += ids
                    logps[i] += lps
                    versions[i] += [asked[i][1]] * len(ids)
                    deltas.append((i, ids, lps, asked[i][1]) if epochs is not None else (i, ids, lps))
            if deltas and on_step is not None:
                for i in on_step(deltas):
                    cancel[i].set()
                    stopped.add(i)
        for thread in threads:
            thread.join()
        session.close()
        if errors:
            raise ServerGenerationError(f"{len(errors)} of {len(threads)} requests to {self.server_url}/v1/completions "
                                        f"failed; first: {errors[0]}")
        return [Sample(seq.prompt_ids, seq.prefix_ids + tuple(ids), seq.prefix_logprobs + tuple(lps),
                       self.tokenizer.decode(seq.prefix_ids + tuple(ids), skip_special_tokens=True),
                       finish(seq, ids, eos, max_tokens),
                       seq.prefix_versions + tuple(vs) if epochs is not None else seq.prefix_versions)
                for seq, ids, lps, vs in zip(seqs, new, logps, versions, strict=True)]

    def _request(self, session: Any, i: int, body: dict[str, Any], cancel: threading.Event,
                 events: queue.Queue) -> None:
        """Stream one request, putting ``(i, token ids, logprobs)`` per event and ``(i, None, error
        or None)`` when it ends."""
        error = None
        try:
            with session.post(f"{self.server_url}/v1/completions", json=body, stream=True,
                              timeout=self.request_timeout) as response:
                if response.status_code != 200:
                    raise ServerGenerationError(f"HTTP {response.status_code}: {response.text[:500]}")
                for line in response.iter_lines():
                    if cancel.is_set():
                        break
                    event = _event(line)
                    if event is not None:
                        events.put((i, *event))
        except Exception as exc:  # reported by stream() once every request stopped
            error = f"{type(exc).__name__}: {exc}"
        events.put((i, None, error))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Not a path of this backend: the trainer's weight sync (TRL's) updates the server."""
        raise KvckptError("the server backend's weights are synced by TRL's weight transfer, not by the worker")


def _event(line: bytes) -> tuple[list[int], list[float]] | None:
    """The ``(token ids, logprobs)`` of one server-sent-events line (``None``: no tokens in it).

    Raises:
        ServerGenerationError: an event without token ids or with as many logprobs as ids missing.
    """
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return None
    choice = json.loads(data)["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        if choice.get("text"):
            raise ServerGenerationError("the server streamed text without token_ids: it must support "
                                        "return_token_ids in streamed completions (vLLM >= 0.10.2)")
        return None
    lps = list((choice.get("logprobs") or {}).get("token_logprobs") or [])
    if len(lps) != len(ids):
        raise ServerGenerationError(f"the server streamed {len(ids)} token ids with {len(lps)} logprobs")
    return list(ids), [float(x) for x in lps]
