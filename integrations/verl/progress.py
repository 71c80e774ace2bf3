"""What a verl rollout server records of its in-flight samples while they stream: :class:`ServerProgress`.

A request that carries a :class:`SampleKey` (kvckpt's agent loop sends one; verl's client makes a fresh vLLM
request id per call, so the logical identity travels in it) is a *sample*: ``session`` of prompt ``uid``,
recorded into the ledger actor ``actor`` under run ``run``. The server's streaming loop hands each cumulative
output to :meth:`ServerProgress.observe` with the server's weight version (verl's ``global_steps``) at that
moment, so every token carries the version that made it.

Batching: one flusher task per server writes every due sample of every request in ONE
``VerlLedger.record_progress`` call (one durable transaction): a sample is due once it has ``every`` unrecorded
tokens, and all samples that became due while a call was in flight go in the next one. Backpressure: a chunk is
never dropped. While the ledger is behind, tokens keep accumulating into the sample's next chunk (coalesced);
once a sample holds :data:`BACKLOG` intervals unrecorded, its stream waits for the flush before taking more
output. :meth:`ServerProgress.close` (a request ends: weight-sync abort or completion) writes the sample's
remaining tokens and returns only once they are durable, so an aborted request's partial output, which verl's
``FullyAsyncLLMServerClient`` resumes from, is durable before generation resumes.

A refusal stops a sample's recording and is counted (:attr:`ServerProgress.stats`): ``StaleRun`` (a zombie
server of a run a restart replaced: nothing it streams is written) and ``ProgressGap``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvckpt.errors import BadArgument, KvckptError

#: Unrecorded intervals a sample may hold before its stream waits for the ledger.
BACKLOG = 4

#: ``(run token, items) -> per-item results``: ``VerlLedger.record_progress`` (through its Ray actor).
Sink = Callable[[str, list[dict[str, Any]]], Awaitable[Sequence[Any]]]


class ProgressUnavailable(KvckptError):
    """A flush failed for a reason other than a kvckpt refusal (the ledger actor is gone); the samples in it stop
    recording, and kvckpt's client refuses their output (``ProgressMismatch``) rather than hand on a partial one."""


@dataclass(frozen=True)
class SampleKey:
    """The logical identity of a request's sample, sent with the request by kvckpt's agent loop.

    Attributes:
        actor: the ledger actor's name. run: the run token of the process that dispatched the sample.
        uid: verl's prompt uid. session: the sample's index among the prompt's ``rollout.n``.
        prompt_len: the prompt's length without any resumed prefix (a request's prompt beyond it is the sample's
            tokens so far: a resumed prefix or the output of calls before an abort).
        every: the interval in tokens (``sampler_kwargs.kvckpt.progress_every_tokens``).
    """

    actor: str
    run: str
    uid: str
    session: int
    prompt_len: int
    every: int

    def to_dict(self) -> dict[str, Any]:
        """As a plain dict (what crosses the Ray call)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, value: Any) -> SampleKey:
        """The key a request carried.

        Raises:
            BadArgument: it is not one.
        """
        try:
            key = cls(**value)
        except TypeError as exc:
            raise BadArgument(f"kvckpt verl progress: a request's kvckpt key is not a SampleKey: {exc}") from None
        if (not all(isinstance(v, str) and v for v in (key.actor, key.run, key.uid))
                or not all(type(v) is int and v >= 0 for v in (key.session, key.prompt_len))
                or type(key.every) is not int or key.every < 1):
            raise BadArgument(f"kvckpt verl progress: malformed kvckpt key {value!r}")
        return key


@dataclass(eq=False)
class Sample:
    """One request's recording state: the key, the tokens it has seen, the durable count, the unrecorded tail
    (not yet sent), how many tokens a flush in flight carries, and whether its end is still to be written."""

    key: SampleKey
    durable: int
    seen: int = 0
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    final: bool = False
    sending: int = 0
    refused: KvckptError | None = None
    written: asyncio.Event = field(default_factory=asyncio.Event)


class ServerProgress:
    """The recorder of one rollout server (see the module docstring).

    Args:
        sink: writes one flush: ``VerlLedger.record_progress`` through its actor.
    """

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.samples: set[Sample] = set()
        #: calls (ledger calls), chunks and tokens written; refused_calls / refused_tokens (a stale run's or a gap's).
        self.stats = {"calls": 0, "chunks": 0, "tokens": 0, "refused_calls": 0, "refused_tokens": 0, "waits": 0}
        self._due: dict[int, Sample] = {}
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._flushing = False

    def open(self, key: SampleKey, prompt_len_sent: int) -> Sample:
        """A request of ``key``'s sample whose prompt (with any prefix) is ``prompt_len_sent`` tokens long."""
        if prompt_len_sent < key.prompt_len:
            raise BadArgument(f"kvckpt verl progress: a request of {key.uid}/{key.session} sends {prompt_len_sent} "
                              f"prompt tokens, fewer than its prompt's {key.prompt_len}")
        sample = Sample(key, durable=prompt_len_sent - key.prompt_len)
        self.samples.add(sample)
        return sample

    async def observe(self, sample: Sample, token_ids: Sequence[int], logprobs: Any,
                      version: int | None) -> None:
        """Take the request's cumulative output (``logprobs``: aligned with ``token_ids``, sliceable, or ``None``):
        its new tokens join the sample's unrecorded tail, stamped with ``version``. Waits only while the sample
        holds :data:`BACKLOG` intervals unrecorded."""
        new = list(token_ids[sample.seen:])
        if not new:
            return
        lps = [math.nan] * len(new) if logprobs is None else [float(x) for x in logprobs[sample.seen:]]
        sample.seen += len(new)
        if sample.refused is not None:
            self.stats["refused_tokens"] += len(new)
            return
        sample.ids += new
        sample.logprobs += lps
        sample.versions += [-1 if version is None else int(version)] * len(new)
        if len(sample.ids) >= sample.key.every:
            self._mark(sample)
        while len(sample.ids) >= BACKLOG * sample.key.every and sample.refused is None:
            self.stats["waits"] += 1
            await self._written(sample)

    async def close(self, sample: Sample, *, final: bool) -> None:
        """The request ended: write its unrecorded tail (``final``: and mark the sample done) and return once it
        is durable (or refused)."""
        try:
            if sample.refused is None and (sample.ids or final):
                sample.final = final
                self._mark(sample)
            if sample.refused is None:
                while (sample.ids or sample.final or sample.sending) and sample.refused is None:
                    await self._written(sample)
        finally:
            self.samples.discard(sample)

    async def idle(self) -> None:
        """Return once nothing is due and no flush is in flight (every due chunk is durable or refused)."""
        while self._due or (self._task is not None and not self._task.done() and self._flushing):
            await asyncio.sleep(0.001)

    def _mark(self, sample: Sample) -> None:
        self._due[id(sample)] = sample
        self._kick.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._flusher())

    async def _written(self, sample: Sample) -> None:
        sample.written.clear()
        await sample.written.wait()

    async def _flusher(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            due, self._due = self._due, {}
            by_run: dict[str, list[Sample]] = {}
            for sample in due.values():
                by_run.setdefault(sample.key.run, []).append(sample)
            self._flushing = True
            try:
                for run, samples in by_run.items():
                    await self._flush(run, samples)
            finally:
                self._flushing = False

    async def _flush(self, run: str, samples: list[Sample]) -> None:
        taken, items = [], []
        for s in samples:  # the tokens sent leave the unrecorded tail now: the next ones count towards the next chunk
            n, final = len(s.ids), s.final
            items.append({"uid": s.key.uid, "session": s.key.session, "start": s.durable, "tokens": s.ids[:n],
                          "logprobs": s.logprobs[:n], "versions": s.versions[:n], "final": final})
            del s.ids[:n], s.logprobs[:n], s.versions[:n]
            s.sending, s.final = n, False
            taken.append((s, n, final))
        self.stats["calls"] += 1
        try:
            results: Sequence[Any] = await self.sink(run, items)
        except KvckptError as exc:  # StaleRun: this run was replaced; none of its samples records again
            self.stats["refused_calls"] += 1
            results = [exc] * len(items)
        except Exception as exc:  # the ledger unreachable: these samples stop recording (their client then fails)
            self.stats["refused_calls"] += 1
            results = [ProgressUnavailable(f"kvckpt verl progress: the ledger refused a flush: {exc!r}")] * len(items)
        for (sample, n, _), result in zip(taken, results, strict=True):
            sample.sending = 0
            if isinstance(result, KvckptError):
                sample.refused = result
                self.stats["refused_tokens"] += n + len(sample.ids)
                sample.ids, sample.logprobs, sample.versions = [], [], []
            else:
                self.stats["chunks"] += 1
                self.stats["tokens"] += n
                sample.durable = int(result)
            sample.written.set()
