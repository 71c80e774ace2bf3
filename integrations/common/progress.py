"""The producer side of token progress, once for every engine: :class:`ProgressRecorder`.

An engine generates many sequences at once; each sequence's new tokens must become durable every
``every`` tokens (or ``every_seconds`` seconds) without the engine waiting for an fsync, without a
token dropped, and without a write landing after the sequence's commit. The recorder holds, per
sequence (a :class:`Tail`, opened with :meth:`ProgressRecorder.open`), the tokens generated since its
last durable append, and hands every due sequence of a flush to ONE call of ``write`` (a list of
:class:`Pending`), which the integration turns into its wire form: the own vLLM worker and TRL's
server worker send one columnar step message (:class:`kvckpt.ProgressMessage`), verl's server loop
one ledger call per run. The rules, each in one place:

* **Coalescing**: tokens that arrive while a flush is in flight join their sequence's next chunk
  (a chunk leaves the tail only once its write answered).
* **Background flush**: with ``background=True`` one flusher thread writes; :meth:`~ProgressRecorder.take`
  only hands tokens over. Otherwise :meth:`~ProgressRecorder.step` writes the due sequences inline.
* **Backpressure**: a sequence holding :data:`BACKLOG` intervals unrecorded (in flight included)
  makes :meth:`~ProgressRecorder.take` wait for the flush before it takes more; nothing is dropped.
* **Close before commit**: :meth:`~ProgressRecorder.finish` (one sequence) and
  :meth:`~ProgressRecorder.close` (all) return once the tail is durable or refused, so the caller's
  commit comes after the last progress write, never beside it.
* **Fenced stop**: a write refused with a kvckpt error (a fenced lease, a replaced run, a gap) stops
  that sequence (:attr:`Tail.refused`; its later tokens are counted, not written). A
  :class:`~kvckpt.errors.FutureVersion` is not a refusal: the tokens stay and go with the next chunk.
  Any other failure of ``write`` stops every sequence (:attr:`~ProgressRecorder.error`).
* **Drain**: :meth:`~ProgressRecorder.drain` (a preemption notice) stops admitting tokens and makes
  every sequence's whole tail durable, however short of an interval, by a deadline
  (:func:`drain_on_sigterm` runs it on SIGTERM).

Storage-agnostic (it moves lists and calls ``write``): it lives with the code every integration shares.

Long (over 400 lines): the one recorder of every engine, each of its rules above and the process's drain on
SIGTERM beside it, so no integration keeps a rule of its own.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvckpt.errors import FutureVersion, KvckptError

#: Unrecorded intervals a sequence may hold (a flush in flight included) before ``take`` waits for the flush: one,
#: so a kill costs a sequence at most one interval (with 4, a lagging flusher left 4 not durable: issue 49).
BACKLOG = 1


@dataclass(eq=False)
class Tail:
    """One sequence's recording state: the integration's ``key`` for it, its interval ``every`` (tokens;
    0: by time only), its durable length and the tokens since (``ids``, ``logprobs``, ``versions``), how
    many of them a flush in flight carries (``sending``), whether its end is still to be written
    (``final``), whether the store found its version from the future (``deferred``) and the error that
    refused it (``refused``)."""

    key: Any
    every: int
    durable: int
    last_append: float
    received: int = 0  # tokens handed over so far (kept or not): where its next new token is in its output
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    sending: int = 0
    final: bool = False
    ending: bool = False  # finish() was called: its whole tail is due
    deferred: bool = False
    refused: KvckptError | None = None

    @property
    def generated(self) -> int:
        """Tokens the sequence holds so far: its durable prefix and its unrecorded tail."""
        return self.durable + len(self.ids)


class Pending(NamedTuple):
    """One sequence's chunk of a flush: its tail, start, tokens, logprobs, weight versions, and whether it ends."""

    tail: Tail
    start: int
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    final: bool


#: One flush: per :class:`Pending`, the durable length after it, or the kvckpt error that refused it.
Write = Callable[[list[Pending]], Sequence[Any]]


@dataclass(frozen=True)
class DrainReport:
    """What :meth:`ProgressRecorder.drain` achieved: sequences it drained (whole tail durable), those whose
    tail was not made durable by the deadline (refused ones excluded), how many tokens those hold, whether
    every tail was in time, and how many tokens the live sequences held."""

    drained: int
    undrained: int
    tokens_not_durable: int
    in_time: bool
    #: tokens the live sequences held when the drain ended (durable prefix and tail)
    generated: int


class ProgressRecorder:
    """The recorder of one engine (module docstring).

    Args:
        write: one flush's chunks to the store (see :data:`Write`).
        every_seconds: also due once this long passed since a sequence's last append (``None``: by count only).
        background: write from the recorder's flusher thread; :meth:`close` must end it.
        clock: seconds, monotonic.
    """

    def __init__(self, write: Write, *, every_seconds: float | None = None, background: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.write, self.every_seconds, self.clock = write, every_seconds, clock
        self.tails: list[Tail] = []
        #: calls (flushes written), chunks and tokens made durable, refused calls and tokens, backpressure waits.
        self.stats = {"calls": 0, "chunks": 0, "tokens": 0, "refused_calls": 0, "refused_tokens": 0, "waits": 0}
        #: The failure (not a refusal) of a flush: every sequence stops and :meth:`close` raises it.
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._kicked = self._in_flight = self._draining = False
        self._handoff: list[Pending] = []  # a batch a step took for the flusher
        self._closing: bool | None = None  # None: running; False: close (due chunks); True: close with every tail
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._flusher, name="kvckpt-progress-flusher", daemon=True)
            self._thread.start()
        _LIVE.add(self)

    # -- the engine's side -------------------------------------------------------------------------
    def open(self, key: Any, durable: int, every: int) -> Tail:
        """A new sequence, ``durable`` tokens of it already durable, due every ``every`` tokens."""
        with self._cond:
            tail = Tail(key, int(every), int(durable), self.clock())
            self.tails.append(tail)
            return tail

    def take(self, tail: Tail, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        """Add ``tail``'s new tokens; in background mode first wait while it holds :data:`BACKLOG` intervals
        unrecorded. Tokens of a refused, stopped or drained sequence are counted, not kept."""
        with self._cond:
            if self.held_back(tail, len(ids)):
                self.stats["waits"] += 1
                while self.held_back(tail, len(ids)):
                    self._kick()
                    self._cond.wait()
            self._add(tail, ids, logprobs, versions)

    def held_back(self, tail: Tail, incoming: int) -> bool:
        """Whether ``incoming`` more tokens of ``tail`` must wait for a flush (background mode only): it holds
        an interval or more unrecorded and would pass :data:`BACKLOG` intervals."""
        unrecorded = len(tail.ids)
        return (self._thread is not None and self.error is None and not self._draining and tail.every > 0
                and not tail.deferred and tail.refused is None
                and unrecorded >= tail.every and unrecorded + incoming > BACKLOG * tail.every)

    def step(self, *, settle: bool = False) -> None:
        """An engine step ended: write what is due (inline, or by waking the flusher). ``settle`` (background
        mode): return only once what is due is durable or refused (a consistent view for a test hook)."""
        if self._thread is None:
            self._flush_due(tail=False)
            return
        with self._cond:
            if not self._in_flight and not self._handoff:  # the flush's chunks are what is due now, at the step
                self._handoff = self._batch(self._due(self.clock(), False))
            self._kick()
            if settle:
                self._settled(lambda: not self._kicked and not self._in_flight)

    def finish(self, tail: Tail, *, final: bool = False) -> None:
        """The sequence ended: write its whole tail (``final``: and mark it ended) and return once that is
        durable or refused; it then leaves the recorder."""
        with self._cond:
            tail.ending = True
            if tail.refused is None and (tail.ids or final):
                tail.final = final
                tail.deferred = False
        if self._thread is None:
            with self._cond:
                self._write_batch(self._batch([tail]))
        else:
            with self._cond:
                self._kick()
                self._settled(lambda: tail.refused is not None or not (tail.ids or tail.final or tail.sending))
        with self._cond:
            if tail in self.tails:
                self.tails.remove(tail)

    def close(self, *, tail: bool = False) -> None:
        """Write every due chunk (``tail``: every sequence's whole tail, as at an abort), wait until each is
        durable or refused, and stop the flusher.

        Raises:
            Exception: a flush failed (:attr:`error`).
        """
        if self._thread is None:
            self._flush_due(tail=tail)
        else:
            with self._cond:
                self._closing = tail
                self._cond.notify_all()
            self._thread.join()
            self._thread = None
        _LIVE.discard(self)
        if self.error is not None:
            raise self.error

    def drain(self, deadline: float) -> DrainReport:
        """Preemption: stop admitting tokens (every sequence is then stopped, :meth:`stopped`) and make every
        sequence's whole unrecorded tail durable, however short of an interval, by ``deadline`` (this
        recorder's clock). Returns what was drained; a drain past its deadline returns then, the flush in
        flight left to finish or die with the process, and counts the tail tokens not made durable."""
        with self._cond:
            self._draining = True
            for t in self.tails:
                t.deferred = False
        if self._thread is None:
            self._flush_due(tail=True)
        else:
            with self._cond:
                self._kick()
                while self._undrained() and self.error is None:
                    left = deadline - self.clock()
                    if left <= 0:
                        break
                    self._cond.wait(left)
        with self._cond:
            left_over = self._undrained()
            live = [t for t in self.tails if t.refused is None]
            return DrainReport(len(live) - len(left_over), len(left_over), sum(len(t.ids) for t in left_over),
                               not left_over, sum(t.generated for t in live))

    def stopped(self) -> set[int]:
        """Positions in :attr:`tails` of the sequences to stop: refused, or all once a flush failed or a drain began."""
        with self._cond:
            if self.error is not None or self._draining:
                return set(range(len(self.tails)))
            return {i for i, t in enumerate(self.tails) if t.refused is not None}

    # -- internals -----------------------------------------------------------------------------------
    def _add(self, tail: Tail, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        tail.received += len(ids)
        if tail.refused is not None or self.error is not None or self._draining:
            self.stats["refused_tokens"] += len(ids)
            return
        tail.ids += ids
        tail.logprobs += logprobs
        tail.versions += versions
        tail.deferred = False

    def _kick(self) -> None:
        self._kicked = True
        self._cond.notify_all()

    def _settled(self, done: Callable[[], bool]) -> None:
        while not done() and self.error is None:
            self._cond.wait()

    def _undrained(self) -> list[Tail]:
        return [t for t in self.tails if t.refused is None and (t.ids or t.final)]

    def _due(self, now: float, tail: bool) -> list[Tail]:
        """The sequences a flush now writes: every ``every`` tokens, ``every_seconds``, their end, or (``tail``,
        a close with every tail or a drain) any tokens at all."""
        tail = tail or self._draining
        out = []
        for t in self.tails:
            if t.refused is not None or t.deferred or not (t.ids or t.final):
                continue
            if (tail or t.final or t.ending or (t.every and len(t.ids) >= t.every)
                    or (self.every_seconds is not None and t.ids and now - t.last_append >= self.every_seconds)):
                out.append(t)
        return out

    def _flush_due(self, *, tail: bool) -> None:
        """Synchronous mode: write what is due now, in the caller's thread."""
        with self._cond:
            if not self._in_flight:  # (a drain from a signal handler while this thread writes: the step after does)
                self._write_batch(self._batch(self._due(self.clock(), tail)))

    def _batch(self, tails: list[Tail]) -> list[Pending]:
        """The chunks of ``tails`` as they stand (the lock held): each marked in flight."""
        batch = [Pending(t, t.durable, t.ids[:], t.logprobs[:], t.versions[:], t.final) for t in tails
                 if t.refused is None and (t.ids or t.final)]
        for p in batch:
            p.tail.sending = len(p.ids)
        self._in_flight = bool(batch)
        return batch

    def _write_batch(self, batch: list[Pending]) -> None:
        """Write ``batch`` (the caller holds the lock once; it is released while ``write`` runs, and the answers
        are applied before anything else can take tokens)."""
        if not batch:
            self._cond.notify_all()
            return
        now = self.clock()
        self._cond.release()
        failure = None
        try:
            results: Any = self.write(batch)
        except KvckptError as exc:  # the whole call refused (a replaced run): every chunk of it
            results = [exc] * len(batch)
            self.stats["refused_calls"] += 1
        except BaseException as exc:  # reported by close(); every sequence stops
            results, failure = None, exc
        finally:
            self._cond.acquire()
            self._in_flight = False
        try:
            if failure is not None:
                self.error = failure
            else:
                self._apply(batch, results, now)
        except BaseException as exc:
            self.error = exc
        finally:
            for p in batch:
                p.tail.sending = 0
            self._cond.notify_all()

    def _apply(self, batch: list[Pending], results: Sequence[Any], now: float) -> None:
        """One flush's answers: a written chunk leaves the tail (tokens that arrived after it stay, coalesced
        into the next one); a refusal stops its sequence and drops its tail."""
        self.stats["calls"] += 1
        for p, result in zip(batch, results, strict=True):
            t, n = p.tail, len(p.ids)
            if isinstance(result, FutureVersion):
                t.deferred = True  # new weights arrived a moment before their version is durable: next chunk
            elif isinstance(result, KvckptError):
                t.refused = result
                self.stats["refused_tokens"] += len(t.ids)
                t.ids, t.logprobs, t.versions = [], [], []
            elif isinstance(result, BaseException):
                raise result
            else:
                self.stats["chunks"] += 1
                self.stats["tokens"] += n
                t.durable, t.last_append = int(result), now
                del t.ids[:n], t.logprobs[:n], t.versions[:n]
                t.final = t.final and not p.final

    def _flusher(self) -> None:
        with self._cond:
            while True:
                while not self._kicked and self._closing is None:
                    self._cond.wait()
                self._kicked = False
                batch, self._handoff = self._handoff or self._batch(self._due(self.clock(), self._closing is True)), []
                if not batch:
                    self._cond.notify_all()  # a settling caller waits for this answer
                    if self._closing is not None or self.error is not None:
                        return
                    continue
                self._write_batch(batch)
                if self.error is not None:
                    self._cond.notify_all()
                    return
                self._kicked = True  # what arrived during the flush is judged at once


_log = logging.getLogger(__name__)

#: Every recorder not closed yet (what a SIGTERM drains).
_LIVE: weakref.WeakSet[ProgressRecorder] = weakref.WeakSet()
#: Whether :func:`drain_on_sigterm` installed its handler in this process (once is enough: it drains every recorder).
_INSTALLED = False


def drain_all(grace: float, *, clock: Callable[[], float] = time.monotonic) -> list[DrainReport]:
    """:meth:`ProgressRecorder.drain` every live recorder of this process, all by ``grace`` seconds from now."""
    deadline = clock() + grace
    return [r.drain(deadline) for r in list(_LIVE)]


def drain_summary(reports: Sequence[DrainReport]) -> str:
    """What a drain of these recorders achieved, in one line: sequences drained, those whose tail was not made
    durable by the deadline and how many tail tokens that leaves to generate again."""
    drained, undrained = sum(r.drained for r in reports), sum(r.undrained for r in reports)
    lost = sum(r.tokens_not_durable for r in reports)
    return (f"kvckpt progress drain: {drained} sequences drained, {undrained} not drained by the deadline, "
            f"{lost} tail tokens not made durable")


def drain_on_sigterm(grace: float, then: Callable[[list[DrainReport]], None] | None = None) -> bool:
    """On SIGTERM (a preemption notice), drain every live recorder of the process within ``grace`` seconds,
    say what it achieved (:func:`drain_summary`, logged on this module's logger: a warning when a tail was not
    made durable by the deadline, else info), call ``then`` with the reports, and let the signal's previous
    handling go on. Installs only from the main thread (Python's rule for signal handlers); returns whether it
    did."""
    global _INSTALLED
    if threading.current_thread() is not threading.main_thread():
        return False
    if _INSTALLED:
        return True
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        reports = drain_all(grace)
        _log.log(logging.INFO if all(r.in_time for r in reports) else logging.WARNING, drain_summary(reports))
        if then is not None:
            then(reports)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
    _INSTALLED = True
    return True
