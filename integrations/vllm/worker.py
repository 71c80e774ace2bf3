"""The rollout worker: leases in, committed groups out, new policy weights between steps.

:class:`RolloutWorker` turns leases from :meth:`kvckpt.ReplayBuffer.admit` (or a recovery plan)
into rows and commits them under those leases. Generation goes through one of the backends of
:mod:`.backends` (``vllm`` or ``transformers``, one interface: :class:`GenerationBackend`). With
progress on (the default), generation streams: every sequence's new tokens are recorded durably
every few hundred tokens (:mod:`.stream`), and a lease of a later attempt resumes each sample
from its durable prefix instead of from the prompt.

The worker is plain Python with JSON-able constructor arguments, so it runs in-process or as a Ray
actor (``ray.remote(RolloutWorker)``) and commits through anything with ``commit_group`` /
``commit_sample`` (a :class:`kvckpt.ReplayBuffer`, the in-memory buffer, a Ray buffer client).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from kvckpt.integrations.common.holder import default_holder
from kvckpt.integrations.common.progress import drain_on_sigterm
from kvckpt.integrations.vllm.backends import Sample, create_backend, grouped
from kvckpt.integrations.vllm.rows import make_row
from kvckpt.integrations.vllm.stream import Continuation, ProgressRecorder, SequenceState, prefixes

from kvckpt import CommitResult, Lease
from kvckpt.errors import KvckptError
from kvckpt.testing.fixtures.tiny_model import AdditionTask

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
#: The optional per-token field of a store's schema that :meth:`RolloutWorker.rows` fills with each
#: token's weight version (``("int64", "token")``), so a trainer can mask or reweight the tokens
#: older weights produced; declare it next to :data:`DEFAULT_SCHEMA` to keep it.
TOKEN_VERSIONS = "token_versions"
#: Default progress interval per sequence, in tokens: the issue's fleet model (1,024 engines x 256
#: sequences, one append per 256 tokens: 6,400 appends/s), which benchmarks/progress_bench.py
#: measures at 41% of one core and 0.016 fsyncs per append on one in-process store; a crash then
#: costs a sequence at most 255 tokens. Generation with progress on kept 100.9% of off there.
PROGRESS_EVERY_TOKENS = 256
#: Seconds a SIGTERM gives the worker to make every in-flight tail durable (GKE's preemption notice is 30 s:
#: this leaves the rest to the process's own exit).
DRAIN_SECONDS = 20.0


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
        progress_every_tokens: stream durable progress (see :meth:`run`): append a sequence's new
            tokens once it has this many unrecorded ones. 0 with ``progress_every_seconds=None``
            turns streaming off. Defaults to :data:`PROGRESS_EVERY_TOKENS`.
        progress_every_seconds: also append a sequence's new tokens once this long passed since
            its last append. Defaults to None (by count only).
        drain_seconds: on SIGTERM (a preemption notice), stop generating and make every in-flight
            sequence's unrecorded tail durable within this many seconds, then let the signal end the
            process (:func:`kvckpt.integrations.common.progress.drain_on_sigterm`; installed when the
            worker is built in the main thread). ``None``: leave SIGTERM alone. Defaults to
            :data:`DRAIN_SECONDS`.
        holder: the name this worker's leases record (:attr:`holder`: the trainer admits and
            redispatches for it with ``holder=worker.holder``, and after the worker dies
            ``buffer.redispatch_held_by(worker.holder)`` hands its leases on in one call). Defaults to
            ``host:pid`` (:func:`kvckpt.integrations.common.default_holder`).

    Examples:
        >>> worker = RolloutWorker(ensure_tiny_model())  # doctest: +SKIP
        >>> leases = buffer.admit([0, 1], holder=worker.holder)  # doctest: +SKIP
        >>> worker.run(buffer, leases)  # doctest: +SKIP
        [CommitResult(group_id='a0-p0', ready=True, ...), ...]
    """

    def __init__(self, model_path: str, *, backend: str = "transformers", task: Any = None, max_tokens: int = 8,
                 temperature: float = 1.0, seed: int = 0, commit: str = "group",
                 fields: Iterable[str] | None = None,
                 extra_fields: Callable[[Lease, int, Sample], Mapping[str, Any]] | None = None,
                 backend_options: Mapping[str, Any] | None = None,
                 progress_every_tokens: int = PROGRESS_EVERY_TOKENS,
                 progress_every_seconds: float | None = None, drain_seconds: float | None = DRAIN_SECONDS,
                 holder: str | None = None) -> None:
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
        self.progress_every_tokens = int(progress_every_tokens)
        self.progress_every_seconds = progress_every_seconds
        #: The lease holder name this worker gives (``admit(..., holder=worker.holder)``).
        self.holder = holder or default_holder()
        #: Cumulative counts of the streaming path: tokens generated, tokens resumed from durable
        #: prefixes, progress appends and ``record_progress_step`` calls (one step message each).
        self.progress_stats = {"tokens_generated": 0, "tokens_resumed": 0, "appends": 0, "append_calls": 0}
        self._lock = threading.Lock()
        self._version = 0
        if drain_seconds is not None and self.streams_progress:
            drain_on_sigterm(drain_seconds)

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

    def rows(self, lease: Lease, samples: Sequence[Sample], version: int | None = None,
             ) -> dict[int, dict[str, torch.Tensor]]:
        """The rows of ``lease.missing`` (row index -> field -> tensor) from their samples.

        ``input_ids`` is prompt + completion; ``generation_logprobs`` is 0 on prompt tokens and the
        engine's logprob on completion tokens; ``token_mask`` is 1 exactly on completion tokens;
        ``total_reward`` comes from ``task.reward``; ``token_versions`` (where the store declares
        it, int64 per token) is -1 on prompt tokens and each completion token's weight version:
        the durable prefix's recorded versions, then ``version`` (the generating weights').
        """
        out = {}
        for index, sample in zip(lease.missing, samples, strict=True):
            row = make_row(sample.prompt_ids, sample.completion_ids, sample.logprobs,
                           self.task.reward(lease.prompt_idx, sample.text), completion_text=sample.text)
            if TOKEN_VERSIONS in self.fields:
                tail = [self._version if version is None else version] * (len(sample.completion_ids)
                                                                            - len(sample.prefix_versions))
                row[TOKEN_VERSIONS] = torch.tensor([-1] * len(sample.prompt_ids) + [*sample.prefix_versions, *tail],
                                                   dtype=torch.int64)
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
            before_commit: Callable[[Lease], None] | None = None,
            after_step: Callable[[Sequence[SequenceState]], None] | None = None) -> list[CommitResult | KvckptError]:
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

        Streaming (progress on, and ``buffer`` has ``record_progress_step``): a lease of a later
        attempt first reads its durable prefixes (``buffer.progress``) and each sample continues
        from prompt + prefix with the remaining budget; while generating, every sequence's new
        tokens are appended every ``progress_every_tokens`` tokens or ``progress_every_seconds``
        seconds, all due sequences of one engine step in one step message (one
        ``record_progress_step`` call, one durable transaction). ``after_step`` (a test hook) sees each step's
        :class:`~kvckpt.integrations.vllm.stream.SequenceState` list after its appends. A lease
        whose append is refused stops generating and gets that error as its result.

        Returns:
            One entry per lease: its :class:`~kvckpt.CommitResult` (with ``commit="sample"``, its
            last row's), or the kvckpt error that refused it (``StaleAttempt`` for a lease fenced
            by recovery, ``UnknownGroup`` for one aborted meanwhile); a refused commit wrote
            nothing. Other errors propagate.
        """
        sink = _ActorSink(buffer, channel=self.streams_progress) if _is_actor(buffer) else buffer
        try:
            refused: dict[str, KvckptError] = {}
            if self.streams_progress and getattr(sink, "record_progress_step", None) is not None:
                samples, version, refused = self._stream(sink, leases, after_step)
            else:
                samples, version = self.generate(leases)
            out: list[Any] = [refused.get(lease.group_id) for lease in leases]
            todo = [n for n, result in enumerate(out) if result is None]
            for n, result in zip(todo, self._commit_all(sink, [leases[n] for n in todo],
                                                        [samples[n] for n in todo], version, before_commit),
                                 strict=True):
                out[n] = result
            return out
        finally:
            if isinstance(sink, _ActorSink):
                sink.close()

    @property
    def streams_progress(self) -> bool:
        """Whether :meth:`run` streams durable progress (an interval is configured)."""
        return self.progress_every_tokens > 0 or self.progress_every_seconds is not None

    def _stream(self, sink: Any, leases: Sequence[Lease],
                after_step: Callable[[Sequence[SequenceState]], None] | None,
                ) -> tuple[list[list[Sample]], int, dict[str, KvckptError]]:
        prompts = [self.prompt_ids(lease) for lease in leases]
        with self._lock:
            version = self._version
            groups, recorder = stream_leases(sink, self.backend, leases, prompts, max_tokens=self.max_tokens,
                                             temperature=self.temperature, weight_version=version,
                                             every_tokens=self.progress_every_tokens,
                                             every_seconds=self.progress_every_seconds, after_step=after_step,
                                             stats=self.progress_stats)
        return groups, version, recorder.refused

    def _commit_all(self, sink: Any, leases: Sequence[Lease], samples: Sequence[Sequence[Sample]], version: int,
                    before_commit: Callable[[Lease], None] | None) -> list[CommitResult | KvckptError]:
        if before_commit is not None or getattr(sink, "commit_many", None) is None:
            out: list[CommitResult | KvckptError] = []
            for lease, group in zip(leases, samples, strict=True):
                try:
                    out.append(self.commit(sink, lease, self.rows(lease, group, version), version, before_commit))
                except KvckptError as exc:
                    out.append(exc)
            return out
        items, owner = [], []
        for n, (lease, group) in enumerate(zip(leases, samples, strict=True)):
            rows = self.rows(lease, group, version)
            if self.commit_mode == "group":
                items.append({"lease": lease, "rows": rows, "end_weight": version})
                owner.append(n)
                continue
            for index, row in sorted(rows.items()):
                items.append({"lease": lease, "index": index, "rows": row, "end_weight": version})
                owner.append(n)
        per_lease: list[Any] = [None] * len(leases)
        if items:
            for n, result in zip(owner, sink.commit_many(items), strict=True):
                if not isinstance(per_lease[n], BaseException):  # a lease's first refusal stands
                    per_lease[n] = result
        for result in per_lease:
            if isinstance(result, BaseException) and not isinstance(result, KvckptError):
                raise result
        return per_lease


def stream_leases(sink: Any, backend: Any, leases: Sequence[Lease], prompts: Sequence[Sequence[int]], *,
                  max_tokens: int, temperature: float, weight_version: int, every_tokens: int,
                  every_seconds: float | None, after_step: Callable[[Sequence[SequenceState]], None] | None = None,
                  stats: dict[str, int] | None = None,
                  background: bool = False) -> tuple[list[list[Sample]], ProgressRecorder]:
    """Generate every missing row of ``leases`` (``prompts[i]``: lease ``i``'s prompt ids) through
    ``backend.stream``, recording durable progress in ``sink`` as it goes.

    A lease of a later attempt first reads its durable prefixes (``sink.progress``): each of its
    samples continues from prompt + prefix with the remaining budget, and its sample carries the
    prefix's tokens, logprobs and versions. While generating, a :class:`ProgressRecorder` appends
    every due sequence's new tokens (``every_tokens`` / ``every_seconds``), stamped
    ``weight_version``, in one step message per engine step (or per batch of a
    server's stream events). ``stats`` (the worker's counters, if given) gains ``tokens_generated``,
    ``tokens_resumed``, ``appends`` and ``append_calls``. ``background``: the recorder writes from
    its own flusher thread, so the stream's reader never waits for an fsync; this returns only once
    every due chunk is durable or refused (a failed stream: every pending token), so the caller's
    commit comes after the last progress write.

    Returns:
        The samples per lease (``len(lease.missing)`` each, in ``lease.missing`` order) and the
        recorder (its ``refused``: group id -> the error that fenced a lease; commit none of those).
    """
    seqs, owners = [], []
    for lease, prompt in zip(leases, prompts, strict=True):
        known = prefixes(sink, lease)
        for index in lease.missing:
            done = known.get(index)
            seqs.append(Continuation(tuple(prompt), tuple(done.tokens.tolist()), tuple(done.logprobs.tolist()),
                                     tuple(done.versions.tolist()))
                        if done is not None else Continuation(tuple(prompt)))
            owners.append((lease, index))
    recorder = ProgressRecorder(sink, owners, [len(s.prefix_ids) for s in seqs], weight_version,
                                every_tokens=every_tokens, every_seconds=every_seconds, after_step=after_step,
                                background=background)
    try:
        flat = backend.stream(seqs, max_tokens, temperature, recorder.on_step, step_tokens=every_tokens or None)
    except BaseException:
        with contextlib.suppress(Exception):  # the stream's own failure is the one to report
            recorder.close(tail=True)
        raise
    recorder.close()
    if stats is not None:
        resumed = sum(len(s.prefix_ids) for s in seqs)
        stats["tokens_resumed"] += resumed
        stats["tokens_generated"] += sum(len(s.completion_ids) for s in flat) - resumed
        stats["appends"] += recorder.appends
        stats["append_calls"] += recorder.calls
    return grouped(flat, [len(lease.missing) for lease in leases]), recorder


def _is_actor(buffer: Any) -> bool:
    return hasattr(getattr(buffer, "commit_many", None), "remote")


class _ActorSink:
    """``commit_group``/``commit_sample``/``commit_many`` and the progress stream through a buffer actor, via the Ray
    integration's :class:`~kvckpt.integrations.ray.BufferClient` (retries after an actor restart are
    idempotent); the step messages go over the actor's direct progress channel where it offers one
    (docs/ray.md, "The direct progress channel")."""

    def __init__(self, actor: Any, *, channel: bool) -> None:
        from kvckpt.integrations.ray import BufferClient

        # the channel only where the run streams progress: a connection (and an actor call) otherwise unused
        self.client = BufferClient(actor, batch_groups=1, max_in_flight=1, channel=channel)

    def close(self) -> None:
        """Close the client's progress channel connection (every call it made was answered)."""
        self.client.close()

    def commit_group(self, lease: Lease, rows: Any, *, end_weight: int | None = None) -> CommitResult:
        future = self.client.commit(lease, rows, end_weight=end_weight)
        self.client.flush()
        return future.result()

    def commit_sample(self, lease: Lease, index: int, row: Any, *, end_weight: int | None = None) -> CommitResult:
        future = self.client.commit_sample(lease, index, row, end_weight=end_weight)
        self.client.flush()
        return future.result()

    def progress_encoder(self) -> Any:
        """The encoder of the actor's store's progress step messages."""
        return self.client.progress_encoder()

    def record_progress_step(self, message: Any) -> list[int | BaseException]:
        """One engine step's progress message in one actor call, answered once durable."""
        future = self.client.record_progress_step(message)
        self.client.flush()
        return future.result()

    def progress(self, lease: Lease) -> dict[int, Any]:
        """The lease's durable prefixes, in one actor call."""
        return self.client.progress(lease)

    def commit_many(self, items: Sequence[Mapping[str, Any]]) -> list[CommitResult | BaseException]:
        """Every item (as :meth:`kvckpt.ReplayBuffer.commit_many` takes them) in one actor call."""
        self.client.batch_groups = max(1, len(items))
        futures = [self.client.commit_sample(i["lease"], i["index"], i["rows"], end_weight=i["end_weight"])
                   if "index" in i else self.client.commit(i["lease"], i["rows"], end_weight=i["end_weight"])
                   for i in items]
        self.client.flush()
        return [f.exception() or f.result() for f in futures]
