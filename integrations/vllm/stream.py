"""Streaming generation with durable token progress: what the rollout worker records mid-generation.

A sequence to generate is a :class:`Continuation`: its prompt and the durable prefix an earlier
attempt left (empty for a fresh lease). A backend's ``stream`` generates every continuation from
``prompt + prefix`` with the remaining budget ``max_tokens - len(prefix)`` and calls
``on_step(deltas)`` once per engine step with the tokens each sequence added in that step.

:class:`ProgressRecorder` is that ``on_step``: the shared producer-side recorder
(:class:`kvckpt.integrations.common.progress.ProgressRecorder`: coalescing, background flush,
backpressure, close before commit, fenced stop, drain) with this worker's wire form. Every flush is
ONE columnar step message (:class:`kvckpt.ProgressMessage`, built with the store's encoder) sent
through ``sink.record_progress_step``, so a fleet's appends of one step share one durable
transaction and a resend of a message is answered as its first try was. A lease whose append is
refused (fenced by a recovery: ``StaleAttempt``; aborted: ``UnknownGroup``) stops generating; the
worker reports the refusal and commits nothing for it. ``FutureVersion`` is not a refusal: a trainer
syncs new weights to the workers just before ``finish_step`` records their version, so a chunk
stamped with them can arrive first; it stays pending and goes with the sequence's next append.

With ``background=True`` (the TRL server path: its reader must not wait for an fsync) the records
are written by the recorder's flusher thread; :meth:`ProgressRecorder.close` returns once every due
chunk (at an abort: every pending token) is durable or refused, so the worker's commit of a group
comes after its last progress write, never beside it. Backpressure holds a sequence to one unrecorded
interval (:data:`BACKLOG`), so a kill costs a sequence at most one interval (plus the tokens of the one
stream event that crossed it).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from kvckpt.integrations.common.progress import BACKLOG, Pending
from kvckpt.integrations.common.progress import ProgressRecorder as Recorder

from kvckpt import Lease
from kvckpt.errors import KvckptError

__all__ = ["BACKLOG", "Continuation", "Delta", "ProgressRecorder", "SequenceState", "finish", "prefixes"]

#: ``(sequence number, new token ids, their logprobs)`` for one sequence in one engine step, optionally followed
#: by the weight version that generated those tokens (default: the recorder's ``weight_version``).
Delta = tuple[int, list[int], list[float]] | tuple[int, list[int], list[float], int]


@dataclass(frozen=True)
class Continuation:
    """One sequence to generate: ``prompt_ids``, then the durable ``prefix_ids`` it continues from
    (with the ``prefix_logprobs`` and ``prefix_versions`` recorded for them)."""

    prompt_ids: tuple[int, ...]
    prefix_ids: tuple[int, ...] = ()
    prefix_logprobs: tuple[float, ...] = ()
    prefix_versions: tuple[int, ...] = ()

    def remaining(self, max_tokens: int, eos: int | None) -> int:
        """Tokens left to generate: 0 once the prefix fills ``max_tokens`` or ends with ``eos``."""
        if self.prefix_ids and eos is not None and self.prefix_ids[-1] == eos:
            return 0
        return max(0, max_tokens - len(self.prefix_ids))


def finish(seq: Continuation, new_ids: Sequence[int], eos: int | None, max_tokens: int) -> str:
    """The finish reason of ``seq`` after ``new_ids``: ``"stop"`` (ends with ``eos``) or ``"length"``."""
    ids = list(seq.prefix_ids) + list(new_ids)
    return "stop" if ids and eos is not None and ids[-1] == eos and len(ids) <= max_tokens else "length"


@dataclass(frozen=True)
class SequenceState:
    """What the recorder knows of one sequence (the view ``after_step`` gets): its lease and row index,
    the tokens generated so far (prefix included) and the length of its durable prefix."""

    lease: Lease
    index: int
    generated: int
    durable: int


class ProgressRecorder:
    """Records due sequences' new tokens as one step message per flush through ``sink.record_progress_step``.

    Args:
        sink: a :class:`kvckpt.ReplayBuffer` or anything with its ``record_progress_step`` and
            ``progress_encoder``.
        owners: ``(lease, row index)`` of each sequence, in sequence-number order.
        prefix_lengths: the durable prefix each sequence starts from.
        weight_version: the version of the weights generating, stamped on the tokens of a delta that
            carries none (a chunk never mixes versions: a sequence's tokens of two versions go in two).
        every_tokens: append once a sequence has this many unrecorded tokens (0: never by count).
        every_seconds: append once this long passed since a sequence's last append (``None``: never by time).
        after_step: called with the :class:`SequenceState` list after each step's appends (a test
            and fault-injection hook: it may block or kill the process). In background mode it is
            called once what the step made due is durable or refused (so ``on_step`` waits for
            that flush when a hook is set): every ``durable`` it sees is what the store holds.
        clock: seconds, monotonic. Defaults to :func:`time.monotonic`.
        background: write the records from the recorder's flusher thread; :meth:`close` must then be
            called once generation ends. Defaults to False.
    """

    def __init__(self, sink: Any, owners: Sequence[tuple[Lease, int]], prefix_lengths: Sequence[int],
                 weight_version: int, *, every_tokens: int, every_seconds: float | None,
                 after_step: Callable[[Sequence[SequenceState]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, background: bool = False) -> None:
        self.sink, self.version, self.after_step = sink, int(weight_version), after_step
        self.encoder = sink.progress_encoder()
        self.recorder = Recorder(self._write, every_seconds=every_seconds, background=background, clock=clock)
        self.tails = [self.recorder.open(owner, n, int(every_tokens))
                      for owner, n in zip(owners, prefix_lengths, strict=True)]

    @property
    def states(self) -> list[SequenceState]:
        """Each sequence's :class:`SequenceState`, in sequence-number order."""
        return [SequenceState(t.key[0], t.key[1], t.generated, t.durable) for t in self.tails]

    @property
    def refused(self) -> dict[str, KvckptError]:
        """Group id -> the error that refused one of its appends (its sequences stop)."""
        out: dict[str, KvckptError] = {}
        for t in self.tails:
            if t.refused is not None:
                out.setdefault(t.key[0].group_id, t.refused)
        return out

    @property
    def calls(self) -> int:
        """Flushes written (one store call each)."""
        return self.recorder.stats["calls"]

    @property
    def appends(self) -> int:
        """Chunks made durable."""
        return self.recorder.stats["chunks"]

    @property
    def error(self) -> BaseException | None:
        """The failure (not a refusal) of a flush: every sequence stops and :meth:`close` raises it."""
        return self.recorder.error

    def on_step(self, deltas: Sequence[Delta]) -> set[int]:
        """Take one engine step's new tokens and record the due sequences (one call; in background
        mode, by the flusher); returns the sequence numbers to stop (their lease was refused, every
        sequence once a background flush failed or a drain began)."""
        for i, ids, logprobs, *version in deltas:
            self.recorder.take(self.tails[i], ids, logprobs, [int(version[0]) if version else self.version] * len(ids))
        self.recorder.step(settle=self.after_step is not None)
        if self.after_step is not None:
            self.after_step(self.states)
        return self.recorder.stopped()

    def close(self, *, tail: bool = False) -> None:
        """Write every due chunk (``tail``: every pending token, as at an abort), wait until each is
        durable or refused, and stop the flusher.

        Raises:
            Exception: a flush failed (:attr:`error`).
        """
        self.recorder.close(tail=tail)

    def _write(self, batch: list[Pending]) -> list[Any]:
        """One flush as one step message: one weight version per sequence, or one per token where a weight
        sync landed inside a sequence's chunk (the store then writes one chunk per version)."""
        lengths, total = [len(p.ids) for p in batch], sum(len(p.ids) for p in batch)
        mixed = any(p.versions.count(p.versions[0]) != len(p.versions) for p in batch)
        stamps: dict[str, Any] = (
            {"token_versions": np.fromiter(itertools.chain.from_iterable(p.versions for p in batch), np.int64, total)}
            if mixed else {"versions": [p.versions[0] for p in batch]})
        message = self.encoder.encode(
            [p.tail.key[0] for p in batch], [p.tail.key[1] for p in batch], [p.start for p in batch],
            np.fromiter(itertools.chain.from_iterable(p.ids for p in batch), np.int64, total),
            np.fromiter(itertools.chain.from_iterable(p.logprobs for p in batch), np.float32, total),
            np.concatenate([[0], np.cumsum(lengths)]), **stamps)
        return self.sink.record_progress_step(message)


def prefixes(sink: Any, lease: Lease) -> Mapping[int, Any]:
    """The durable prefix of each missing sample of ``lease`` (``sink.progress``). A lease of
    attempt 0 was just admitted, so it has none and the store is not asked."""
    return sink.progress(lease) if lease.attempt > 0 else {}
