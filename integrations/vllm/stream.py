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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvckpt import Lease
from kvckpt.errors import FutureVersion, KvckptError

#: ``(sequence number, new token ids, their logprobs)`` for one sequence in one engine step.
Delta = tuple[int, list[int], list[float]]


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
    last_append: float = 0.0


class ProgressRecorder:
    """Records due sequences' new tokens through ``sink.record_progress_many``, one call per step.

    Args:
        sink: a :class:`kvckpt.ReplayBuffer` or anything with its ``record_progress_many``.
        owners: ``(lease, row index)`` of each sequence, in sequence-number order.
        prefix_lengths: the durable prefix each sequence starts from.
        weight_version: the version of the weights generating (stamped on every chunk).
        every_tokens: append once a sequence has this many unrecorded tokens (0: never by count).
        every_seconds: append once this long passed since a sequence's last append (``None``: never by time).
        after_step: called with the :class:`SequenceState` list after each step's appends (a test
            and fault-injection hook: it may block or kill the process).
        clock: seconds, monotonic. Defaults to :func:`time.monotonic`.
    """

    def __init__(self, sink: Any, owners: Sequence[tuple[Lease, int]], prefix_lengths: Sequence[int],
                 weight_version: int, *, every_tokens: int, every_seconds: float | None,
                 after_step: Callable[[Sequence[SequenceState]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        now = clock()
        self.sink, self.version, self.clock = sink, int(weight_version), clock
        self.every_tokens, self.every_seconds, self.after_step = int(every_tokens), every_seconds, after_step
        self.states = [SequenceState(lease, index, n, n, last_append=now)
                       for (lease, index), n in zip(owners, prefix_lengths, strict=True)]
        #: group id -> the error that refused one of its appends (its sequences stop).
        self.refused: dict[str, KvckptError] = {}
        self.calls = 0
        self.appends = 0

    def _due(self, state: SequenceState, now: float) -> bool:
        if not state.pending_ids or state.lease.group_id in self.refused:
            return False
        if self.every_tokens and len(state.pending_ids) >= self.every_tokens:
            return True
        return self.every_seconds is not None and now - state.last_append >= self.every_seconds

    def on_step(self, deltas: Sequence[Delta]) -> set[int]:
        """Take one engine step's new tokens, append the due sequences (one call); returns the
        sequence numbers to stop (their lease was refused)."""
        for i, ids, logprobs in deltas:
            state = self.states[i]
            state.generated += len(ids)
            state.pending_ids += ids
            state.pending_logprobs += logprobs
        now = self.clock()
        due = [i for i, state in enumerate(self.states) if self._due(state, now)]
        if due:
            self._append(due, now)
        if self.after_step is not None:
            self.after_step(self.states)
        return {i for i, s in enumerate(self.states) if s.lease.group_id in self.refused}

    def _append(self, due: Sequence[int], now: float) -> None:
        items = []
        for i in due:
            s = self.states[i]
            items.append({"lease": s.lease, "index": s.index, "start": s.durable,
                          "tokens": torch.tensor(s.pending_ids, dtype=torch.int64),
                          "logprobs": torch.tensor(s.pending_logprobs, dtype=torch.float32),
                          "weight_version": self.version})
        results = self.sink.record_progress_many(items)
        self.calls += 1
        for i, result in zip(due, results, strict=True):
            s = self.states[i]
            if isinstance(result, FutureVersion):
                # The worker got new weights a moment before the trainer's finish_step made
                # their version durable: the chunk stays pending and goes with the next append.
                continue
            if isinstance(result, KvckptError):
                self.refused.setdefault(s.lease.group_id, result)
                continue
            if isinstance(result, BaseException):
                raise result
            self.appends += 1
            s.durable, s.last_append = int(result), now
            s.pending_ids, s.pending_logprobs = [], []


def prefixes(sink: Any, lease: Lease) -> Mapping[int, Any]:
    """The durable prefix of each missing sample of ``lease`` (``sink.progress``). A lease of
    attempt 0 was just admitted, so it has none and the store is not asked."""
    return sink.progress(lease) if lease.attempt > 0 else {}
