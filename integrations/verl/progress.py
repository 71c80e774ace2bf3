"""What a verl rollout server records of its in-flight samples while they stream: :class:`ServerProgress`.

A request that carries a :class:`SampleKey` (kvckpt's agent loop sends one; verl's client makes a fresh vLLM
request id per call, so the logical identity travels in it) is a *sample*: ``session`` of prompt ``uid``,
recorded into the ledger actor ``actor`` under run ``run``. The server's streaming loop hands each cumulative
output to :meth:`ServerProgress.observe` with the server's weight version (verl's ``global_steps``) at that
moment, so every token carries the version that made it.

The recording is kvckpt's one producer-side recorder (:class:`kvckpt.integrations.common.progress.ProgressRecorder`:
coalescing, background flush, :data:`BACKLOG` backpressure, close before commit, fenced stop, drain), with the
ledger's wire form: its flusher thread writes every due sample of every request in ONE
``VerlLedger.record_progress`` call per run (one durable transaction), run on the server's event loop. A sample
is due once it has ``every`` unrecorded tokens; the flusher is woken once per turn of the loop, so the samples
that became due in one engine step go in one call. A stream waits (off the loop) only while its sample holds
:data:`BACKLOG` intervals unrecorded. :meth:`ServerProgress.close` (a request ends: weight-sync abort or
completion) writes the sample's remaining tokens and returns only once they are durable, so an aborted request's
partial output, which verl's ``FullyAsyncLLMServerClient`` resumes from, is durable before generation resumes.

A refusal stops a sample's recording and is counted (:attr:`ServerProgress.stats`): ``StaleRun`` (a zombie
server of a run a restart replaced: nothing it streams is written) and ``ProgressGap``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvckpt.integrations.common.progress import BACKLOG, Pending, ProgressRecorder, Tail

from kvckpt.errors import BadArgument, KvckptError

__all__ = ["BACKLOG", "ProgressUnavailable", "Sample", "SampleKey", "ServerProgress", "Sink"]

#: ``(run token, items) -> per-item results``: ``VerlLedger.record_progress`` (through its Ray actor).
Sink = Callable[[str, list[dict[str, Any]]], Awaitable[Sequence[Any]]]

#: One request's recording state: the shared recorder's :class:`~kvckpt.integrations.common.progress.Tail`
#: of the sample (its ``key`` the :class:`SampleKey`).
Sample = Tail


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


class ServerProgress:
    """The recorder of one rollout server (see the module docstring).

    Args:
        sink: writes one run's part of a flush: ``VerlLedger.record_progress`` through its actor, awaited on
            the event loop of the server's first request.
    """

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.recorder = ProgressRecorder(self._write, background=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kick_scheduled = False

    @property
    def stats(self) -> dict[str, int]:
        """Flushes (``calls``), chunks and tokens written, ``refused_calls`` / ``refused_tokens`` (a stale run's
        or a gap's) and backpressure ``waits``."""
        return self.recorder.stats

    @property
    def samples(self) -> list[Sample]:
        """The requests' samples being recorded (opened and not closed)."""
        return list(self.recorder.tails)

    def open(self, key: SampleKey, prompt_len_sent: int) -> Sample:
        """A request of ``key``'s sample whose prompt (with any prefix) is ``prompt_len_sent`` tokens long."""
        if prompt_len_sent < key.prompt_len:
            raise BadArgument(f"kvckpt verl progress: a request of {key.uid}/{key.session} sends {prompt_len_sent} "
                              f"prompt tokens, fewer than its prompt's {key.prompt_len}")
        self._loop = asyncio.get_running_loop()
        return self.recorder.open(key, prompt_len_sent - key.prompt_len, key.every)

    async def observe(self, sample: Sample, token_ids: Sequence[int], logprobs: Any,
                      version: int | None) -> None:
        """Take the request's cumulative output (``logprobs``: aligned with ``token_ids``, sliceable, or ``None``):
        its new tokens join the sample's unrecorded tail, stamped with ``version``. Waits only while the sample
        holds :data:`BACKLOG` intervals unrecorded."""
        new = list(token_ids[sample.received:])
        if not new:
            return
        lps = [math.nan] * len(new) if logprobs is None else [float(x) for x in logprobs[sample.received:]]
        versions = [-1 if version is None else int(version)] * len(new)
        if self.recorder.held_back(sample, len(new)):  # wait off the loop: the flush it waits for runs on it
            await asyncio.to_thread(self.recorder.take, sample, new, lps, versions)
        else:
            self.recorder.take(sample, new, lps, versions)
        if not self._kick_scheduled:  # once per turn of the loop: one engine step's samples go in one call
            self._kick_scheduled = True
            asyncio.get_running_loop().call_soon(self._kick)

    async def close(self, sample: Sample, *, final: bool) -> None:
        """The request ended: write its unrecorded tail (``final``: and mark the sample done) and return once it
        is durable (or refused)."""
        await asyncio.to_thread(self.recorder.finish, sample, final=final)

    async def idle(self) -> None:
        """Return once nothing is due and no flush is in flight (every due chunk is durable or refused)."""
        self._kick_scheduled = False
        await asyncio.to_thread(self.recorder.step, settle=True)

    def _kick(self) -> None:
        self._kick_scheduled = False
        self.recorder.step()

    def _write(self, batch: list[Pending]) -> list[Any]:
        """One flush, from the recorder's flusher thread: one ledger call per run, each awaited on the loop."""
        assert self._loop is not None  # a sample was opened on it
        by_run: dict[str, list[int]] = {}
        for n, p in enumerate(batch):
            by_run.setdefault(p.tail.key.run, []).append(n)
        out: list[Any] = [None] * len(batch)
        for run, positions in by_run.items():
            items = [{"uid": batch[n].tail.key.uid, "session": batch[n].tail.key.session, "start": batch[n].start,
                      "tokens": batch[n].ids, "logprobs": batch[n].logprobs, "versions": batch[n].versions,
                      "final": batch[n].final} for n in positions]
            try:
                results: Sequence[Any] = asyncio.run_coroutine_threadsafe(self.sink(run, items), self._loop).result()
            except KvckptError as exc:  # StaleRun: this run was replaced; none of its samples records again
                self.stats["refused_calls"] += 1
                results = [exc] * len(items)
            except Exception as exc:  # the ledger unreachable: these samples stop recording (their client then fails)
                self.stats["refused_calls"] += 1
                failed = ProgressUnavailable(f"kvckpt verl progress: the ledger refused a flush: {exc!r}")
                results = [failed] * len(items)
            for n, result in zip(positions, results, strict=True):
                out[n] = result
        return out
