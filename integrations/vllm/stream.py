"""Streaming generation with durable token progress: what the rollout worker records mid-generation.

A sequence to generate is a :class:`Continuation`: its prompt and the durable prefix an earlier
attempt left (empty for a fresh lease). A backend's ``stream`` generates every continuation from
``prompt + prefix`` with the remaining budget ``max_tokens - len(prefix)`` and calls
``on_step(deltas)`` once per engine step with the tokens each sequence added in that step.

:class:`ProgressRecorder` is that ``on_step``: it keeps, per sequence, the tokens generated since
its last durable append and records every sequence that is due (``every_tokens`` tokens, or
``every_seconds`` seconds since its last append) in ONE ``record_progress_many`` call per engine
step, so a fleet's appends of one step share one durable transaction. A lease whose append is
refused (fenced by a recovery: ``StaleAttempt``; aborted: ``UnknownGroup``) stops generating; the
worker reports the refusal and commits nothing for it. ``FutureVersion`` is not a refusal: a trainer
syncs new weights to the workers just before ``finish_step`` records their version, so a chunk
stamped with them can arrive first; it stays pending and goes with the sequence's next append.

With ``background=True`` (the TRL server path: its reader must not wait for an fsync) the records
are written by one flusher thread of the recorder instead: :meth:`ProgressRecorder.on_step` only
hands the tokens over. Tokens that arrive while a flush is in flight are never dropped: they join
their sequence's next chunk (coalesced), written by the flusher's next call. Backpressure waits: a
sequence holding :data:`BACKLOG` intervals unrecorded makes ``on_step`` wait for the flush in
flight before it takes more, so a kill costs a sequence at most one interval (plus the tokens of the
one stream event that crossed it). :meth:`ProgressRecorder.close` returns once every due chunk (at an
abort: every pending token) is durable or refused and the flusher has stopped, so the worker's
commit of a group comes after its last progress write, never beside it. A refusal found by the
flusher stops the lease at the next ``on_step``, as in the synchronous mode.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvckpt import Lease
from kvckpt.errors import FutureVersion, KvckptError

#: Unrecorded intervals a sequence may hold, in background mode, before ``on_step`` waits for the flush in flight:
#: one, so what a kill makes a sequence regenerate is at most one interval on the defaults (issue 49: with 4, a
#: flusher lagging behind the reader left up to 4 intervals acknowledged to the reader and not durable).
BACKLOG = 1

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


@dataclass
class SequenceState:
    """What the recorder knows of one sequence: its lease and row index, the tokens generated so
    far (prefix included) and the length of its durable prefix."""

    lease: Lease
    index: int
    generated: int
    durable: int
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)
    pending_versions: list[int] = field(default_factory=list)
    last_append: float = 0.0
    deferred: bool = False


class ProgressRecorder:
    """Records due sequences' new tokens through ``sink.record_progress_many``, one call per step.

    Args:
        sink: a :class:`kvckpt.ReplayBuffer` or anything with its ``record_progress_many``.
        owners: ``(lease, row index)`` of each sequence, in sequence-number order.
        prefix_lengths: the durable prefix each sequence starts from.
        weight_version: the version of the weights generating, stamped on the tokens of a delta that
            carries none (a chunk never mixes versions: a sequence's tokens of two versions go in two).
        every_tokens: append once a sequence has this many unrecorded tokens (0: never by count).
        every_seconds: append once this long passed since a sequence's last append (``None``: never by time).
        after_step: called with the :class:`SequenceState` list after each step's appends (a test
            and fault-injection hook: it may block or kill the process). In background mode it is
            called once the flusher has written what the step made due (so ``on_step`` waits for
            that flush when a hook is set), and no flush starts while it runs: every ``durable``
            it sees is what the store holds.
        clock: seconds, monotonic. Defaults to :func:`time.monotonic`.
        background: write the records from the recorder's flusher thread (see the module
            docstring); :meth:`close` must then be called once generation ends. Defaults to False.
    """

    def __init__(self, sink: Any, owners: Sequence[tuple[Lease, int]], prefix_lengths: Sequence[int],
                 weight_version: int, *, every_tokens: int, every_seconds: float | None,
                 after_step: Callable[[Sequence[SequenceState]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, background: bool = False) -> None:
        now = clock()
        self.sink, self.version, self.clock = sink, int(weight_version), clock
        self.every_tokens, self.every_seconds, self.after_step = int(every_tokens), every_seconds, after_step
        self.states = [SequenceState(lease, index, n, n, last_append=now)
                       for (lease, index), n in zip(owners, prefix_lengths, strict=True)]
        #: group id -> the error that refused one of its appends (its sequences stop).
        self.refused: dict[str, KvckptError] = {}
        self.calls = 0
        self.appends = 0
        #: In background mode: the failure (not a refusal) of a flush; every sequence stops and
        #: :meth:`close` raises it.
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._kicked, self._in_flight, self._closing = False, False, None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._flusher, name="kvckpt-progress-flusher", daemon=True)
            self._thread.start()

    def _due(self, state: SequenceState, now: float) -> bool:
        if not state.pending_ids or state.lease.group_id in self.refused:
            return False
        if self.every_tokens and len(state.pending_ids) >= self.every_tokens:
            return True
        return self.every_seconds is not None and now - state.last_append >= self.every_seconds

    def on_step(self, deltas: Sequence[Delta]) -> set[int]:
        """Take one engine step's new tokens and record the due sequences (one call; in background
        mode, by the flusher); returns the sequence numbers to stop (their lease was refused, or
        every sequence once a background flush failed)."""
        if self._thread is not None:
            return self._hand_over(deltas)
        for i, ids, logprobs, *version in deltas:
            self._take(self.states[i], ids, logprobs, version)
        now = self.clock()
        due = [i for i, state in enumerate(self.states) if self._due(state, now)]
        if due:
            items, counts = self._items(due)
            self._apply(due, counts, self.sink.record_progress_many(items), now)
        if self.after_step is not None:
            self.after_step(self.states)
        return self._stopped()

    def close(self, *, tail: bool = False) -> None:
        """Background mode: write every due chunk (``tail``: every pending token, as at an abort),
        wait until each is durable or refused, and stop the flusher. Nothing in synchronous mode.

        Raises:
            Exception: a background flush failed (:attr:`error`).
        """
        if self._thread is None:
            return
        with self._cond:
            self._closing = tail
            self._cond.notify_all()
        self._thread.join()
        self._thread = None
        if self.error is not None:
            raise self.error

    def _take(self, state: SequenceState, ids: list[int], logprobs: list[float], version: Sequence[int]) -> None:
        state.generated += len(ids)
        state.pending_ids += ids
        state.pending_logprobs += logprobs
        state.pending_versions += [int(version[0]) if version else self.version] * len(ids)
        state.deferred = False

    def _stopped(self) -> set[int]:
        if self.error is not None:
            return set(range(len(self.states)))
        return {i for i, s in enumerate(self.states) if s.lease.group_id in self.refused}

    def _held_back(self, state: SequenceState, incoming: int) -> bool:
        """Whether ``incoming`` more tokens of ``state`` must wait for the flush in flight: it holds
        an interval or more unrecorded (a flush takes them) and would pass :data:`BACKLOG` intervals."""
        unrecorded = state.generated - state.durable
        return (self.error is None and self.every_tokens > 0 and not state.deferred
                and state.lease.group_id not in self.refused and unrecorded >= self.every_tokens
                and unrecorded + incoming > BACKLOG * self.every_tokens)

    def _hand_over(self, deltas: Sequence[Delta]) -> set[int]:
        with self._cond:
            for i, ids, logprobs, *version in deltas:
                state = self.states[i]
                while self._held_back(state, len(ids)):
                    self._kicked = True
                    self._cond.notify_all()
                    self._cond.wait()
                self._take(state, ids, logprobs, version)
            self._kicked = True
            self._cond.notify_all()
            if self.after_step is not None:  # a settled view: what this step made due is durable or refused
                while (self._kicked or self._in_flight) and self.error is None:
                    self._cond.wait()
                self.after_step(self.states)
            return self._stopped()

    def _flusher(self) -> None:
        with self._cond:
            while True:
                while not self._kicked and self._closing is None:
                    self._cond.wait()
                self._kicked = False
                now, tail = self.clock(), self._closing is True
                due = [i for i, s in enumerate(self.states)
                       if not s.deferred and (self._due(s, now) or (tail and s.pending_ids
                                                                     and s.lease.group_id not in self.refused))]
                if not due:
                    self._cond.notify_all()  # a settling step waits for this answer
                    if self._closing is not None:
                        return
                    continue
                items, counts = self._items(due)
                self._in_flight = True
                self._cond.release()
                try:
                    results: Any = self.sink.record_progress_many(items)
                except BaseException as exc:  # reported by close(); on_step stops every sequence
                    results = exc
                finally:
                    self._cond.acquire()
                    self._in_flight = False
                    self._cond.notify_all()
                if isinstance(results, BaseException):
                    self.error = results
                    return
                try:
                    self._apply(due, counts, results, now)
                except BaseException as exc:
                    self.error = exc
                    return

    def _items(self, due: Sequence[int]) -> tuple[list[dict[str, Any]], list[int]]:
        items, counts = [], []
        for i in due:
            s = self.states[i]
            n = same_version_run(s.pending_versions)  # the rest (newer weights) goes in the next chunk
            items.append({"lease": s.lease, "index": s.index, "start": s.durable,
                          "tokens": torch.tensor(s.pending_ids[:n], dtype=torch.int64),
                          "logprobs": torch.tensor(s.pending_logprobs[:n], dtype=torch.float32),
                          "weight_version": s.pending_versions[0]})
            counts.append(n)
        return items, counts

    def _apply(self, due: Sequence[int], counts: Sequence[int], results: Sequence[Any], now: float) -> None:
        """The results of one call: a chunk's tokens leave the pending tail (tokens that arrived
        after it was sent stay, for the next chunk)."""
        self.calls += 1
        for i, n, result in zip(due, counts, results, strict=True):
            s = self.states[i]
            if isinstance(result, FutureVersion):
                # The worker got new weights a moment before the trainer's finish_step made
                # their version durable: the chunk stays pending and goes with the next append.
                s.deferred = True
                continue
            if isinstance(result, KvckptError):
                self.refused.setdefault(s.lease.group_id, result)
                continue
            if isinstance(result, BaseException):
                raise result
            self.appends += 1
            s.durable, s.last_append = int(result), now
            del s.pending_ids[:n], s.pending_logprobs[:n]
            del s.pending_versions[:n]


def same_version_run(versions: Sequence[int]) -> int:
    """How many of ``versions`` (non-empty) from the first are the first's version."""
    first = versions[0]
    return next((k for k, v in enumerate(versions) if v != first), len(versions))


def prefixes(sink: Any, lease: Lease) -> Mapping[int, Any]:
    """The durable prefix of each missing sample of ``lease`` (``sink.progress``). A lease of
    attempt 0 was just admitted, so it has none and the store is not asked."""
    return sink.progress(lease) if lease.attempt > 0 else {}
