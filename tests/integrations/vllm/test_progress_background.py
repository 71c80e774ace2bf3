"""The progress recorder's background mode (the TRL server path): the stream's reader hands tokens
over and the recorder's flusher writes them, on a real store.

Every test orders the threads by handshakes, never by sleeps: the sink below holds a flush until the
test lets it go, and ``after_step`` (background mode: called once what the step made due is durable
or refused) gives a settled view. A ``queue.get`` timeout only turns a hang into a failure.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest
import torch
from kvckpt.integrations.vllm import ProgressRecorder, Sample, stream_leases

from kvckpt import BufferConfig, Prompt, ReplayBuffer
from kvckpt.errors import StaleAttempt
from kvckpt.storage.progress_message import decode_message

SCHEMA = {"input_ids": ("int64", "token"), "completion_mask": ("int64", "token")}
EVERY = 4
#: Seconds before a handshake that never comes fails the test (a hang guard, not a synchronisation).
HANG = 60


class HeldSink:
    """The store's ``record_progress_step``; the first ``hold`` calls each wait at ``release`` once
    they announced themselves on ``entered``. Every call's ``(start, tokens)`` per sequence is kept."""

    def __init__(self, buf: ReplayBuffer, hold: int = 0) -> None:
        self.buf, self.hold = buf, hold
        self.entered: queue.Queue = queue.Queue()
        self.release: queue.Queue = queue.Queue()
        self.calls: list[list[tuple[int, list[int]]]] = []

    def record_progress_step(self, message: Any) -> list[Any]:
        """Announce, wait if held, then write through the store."""
        m = decode_message(self.buf.schema, message)
        offsets = m.offsets.tolist()
        self.calls.append([(start, m.tokens[offsets[i]:offsets[i + 1]].tolist())
                           for i, start in enumerate(m.starts.tolist())])
        if len(self.calls) <= self.hold:
            self.entered.put(len(self.calls))
            self.release.get(timeout=HANG)
        return self.buf.record_progress_step(message)

    def progress_encoder(self) -> Any:
        """The store's encoder."""
        return self.buf.progress_encoder()

    def progress(self, lease: Any) -> Any:
        """The store's durable prefixes."""
        return self.buf.progress(lease)


@pytest.fixture
def store(tmp_path):
    config = BufferConfig(group_size=1, schema=SCHEMA, max_buffered_rollouts=4)
    with ReplayBuffer.create(str(tmp_path / "buf.kv"), config) as buf:
        yield buf


def delta(ids: list[int]) -> list[tuple[int, list[int], list[float]]]:
    return [(0, ids, [-0.5] * len(ids))]


def durable_tokens(buf: ReplayBuffer, lease: Any) -> list[int]:
    found = buf.progress(lease).get(0)
    return [] if found is None else found.tokens.tolist()


def test_tokens_that_arrive_during_a_flush_coalesce_into_the_next_one(store):
    """While a flush is in flight the reader is not held for a sequence short of an interval: the
    tokens it hands over meanwhile join the sequence's next chunk (one call, starting where the
    first ended) and none is dropped. (The first chunk falls due by time, so the sequence holds less
    than an interval: one holding a whole interval waits for the flush, see the backpressure test.)"""
    (lease,) = store.admit([Prompt(0)])
    sink = HeldSink(store, hold=1)
    now = [0.0]
    recorder = ProgressRecorder(sink, [(lease, 0)], [0], 0, every_tokens=EVERY, every_seconds=10.0,
                                clock=lambda: now[0], background=True)
    now[0] = 10.0
    assert recorder.on_step(delta([1, 2])) == set()
    assert sink.entered.get(timeout=HANG) == 1  # the first flush is in flight, held
    assert recorder.on_step(delta([3])) == set()
    assert recorder.on_step(delta([4])) == set()
    sink.release.put(None)
    now[0] = 20.0  # the rest falls due by time too, so close writes it
    recorder.close()
    assert sink.calls == [[(0, [1, 2])], [(2, [3, 4])]]
    assert durable_tokens(store, lease) == [1, 2, 3, 4]
    assert (recorder.states[0].durable, recorder.states[0].generated) == (4, 4)
    assert (recorder.calls, recorder.appends) == (2, 2)


def test_close_writes_what_is_due_before_the_commit(store):
    """Generation ends with a chunk due that the flusher has not taken (it is held on another
    sequence's): ``close`` returns only once that chunk is durable, so the group's commit follows it."""
    first, second = store.admit([Prompt(0), Prompt(1)])
    sink = HeldSink(store, hold=1)
    recorder = ProgressRecorder(sink, [(first, 0), (second, 0)], [0, 0], 0, every_tokens=EVERY,
                                every_seconds=None, background=True)
    recorder.on_step(delta([1, 2, 3, 4]))
    sink.entered.get(timeout=HANG)
    recorder.on_step([(1, [5, 6, 7, 8], [-0.5] * 4)])  # due, behind the held flush
    sink.release.put(None)
    recorder.close()
    assert durable_tokens(store, second) == [5, 6, 7, 8]
    store.commit_group(second, [{"input_ids": torch.tensor([9, 5, 6, 7, 8]),
                                 "completion_mask": torch.tensor([0] + [1] * 4)}])
    assert store.progress(second) == {}


def test_close_writes_a_chunk_that_fell_due_after_the_last_step(store):
    """A chunk that falls due with nothing more handed over (by time here: ``every_seconds``) is
    written by ``close``: generation ending is itself the flusher's cue."""
    (lease,) = store.admit([Prompt(0)])
    now = [0.0]
    recorder = ProgressRecorder(store, [(lease, 0)], [0], 0, every_tokens=EVERY, every_seconds=10.0,
                                after_step=lambda states: None, clock=lambda: now[0], background=True)
    recorder.on_step(delta([1, 2, 3]))  # settled: the flusher found nothing due
    assert durable_tokens(store, lease) == []
    now[0] = 10.0
    recorder.close()
    assert durable_tokens(store, lease) == [1, 2, 3]


def test_an_aborted_stream_makes_its_tail_durable_first(store):
    """A stream that fails mid-generation: ``stream_leases`` writes every token handed over, the
    ones short of an interval too, before the failure propagates (a redispatch resumes from them)."""
    (lease,) = store.admit([Prompt(0)])

    class Failing:
        def stream(self, seqs, max_tokens, temperature, on_step, step_tokens=None):
            on_step(delta([1, 2, 3]))  # short of an interval: only the abort writes them
            raise RuntimeError("the server went away")

    with pytest.raises(RuntimeError, match="went away"):
        stream_leases(store, Failing(), [lease], [[9]], max_tokens=16, temperature=1.0, weight_version=0,
                      every_tokens=EVERY, every_seconds=None, background=True)
    assert durable_tokens(store, lease) == [1, 2, 3]


def test_a_fenced_flush_stops_the_lease_and_writes_nothing_more(store):
    """The flush in flight is refused (a recovery fenced the lease: ``StaleAttempt``): the tokens
    coalesced behind it are never written, the lease is refused, and the reader is told to stop
    it at its next step."""
    (lease,) = store.admit([Prompt(0)])
    sink = HeldSink(store, hold=1)
    settled: list[int] = []
    recorder = ProgressRecorder(sink, [(lease, 0)], [0], 0, every_tokens=EVERY, every_seconds=None,
                                background=True, after_step=lambda states: settled.append(states[0].durable))
    store.redispatch(lease.group_id)  # the lease this recorder holds is now fenced
    steps: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: steps.put(recorder.on_step(delta([1, 2, 3, 4]))))
    reader.start()
    sink.entered.get(timeout=HANG)
    sink.release.put(None)
    reader.join(timeout=HANG)
    assert steps.get(timeout=HANG) == {0}  # the refusal is known to the step whose flush it was
    assert recorder.on_step(delta([5, 6, 7, 8])) == {0}
    recorder.close()
    assert isinstance(recorder.refused[lease.group_id], StaleAttempt)
    assert sink.calls == [[(0, [1, 2, 3, 4])]]
    assert settled == [0, 0]


def test_a_failed_flush_stops_every_sequence_and_stream_leases_raises_it(store):
    """A flush that fails (not a refusal) stops every sequence and the stream's caller gets the
    error, as a synchronous flush's caller does."""
    (lease,) = store.admit([Prompt(0)])

    class Broken:
        def progress_encoder(self):
            return store.progress_encoder()

        def record_progress_step(self, message):
            raise OSError("disk gone")

        def progress(self, lease):
            return {}

    stopped: list[set[int]] = []

    class OneStep:
        def stream(self, seqs, max_tokens, temperature, on_step, step_tokens=None):
            stopped.append(on_step(delta([1, 2, 3, 4])))
            return [Sample(seqs[0].prompt_ids, (1, 2, 3, 4), (-0.5,) * 4, "", "length", ())]

    with pytest.raises(OSError, match="disk gone"):
        stream_leases(Broken(), OneStep(), [lease], [[9]], max_tokens=4, temperature=1.0, weight_version=0,
                      every_tokens=EVERY, every_seconds=None, after_step=lambda states: None, background=True)
    assert stopped == [{0}]


def test_backpressure_waits_for_the_flush_and_drops_nothing(store):
    """A sequence holding BACKLOG intervals unrecorded makes the reader wait for the flush in
    flight (so a kill costs it at most BACKLOG intervals: one, issue 49); after it every token is
    durable, in order, none twice."""
    from kvckpt.integrations.vllm.stream import BACKLOG

    (lease,) = store.admit([Prompt(0)])
    sink = HeldSink(store, hold=1)
    recorder = ProgressRecorder(sink, [(lease, 0)], [0], 0, every_tokens=EVERY, every_seconds=None, background=True)
    total = 3 * BACKLOG * EVERY
    reader = threading.Thread(target=lambda: [recorder.on_step(delta([t])) for t in range(1, total + 1)])
    reader.start()
    sink.entered.get(timeout=HANG)
    sink.release.put(None)
    reader.join(timeout=HANG)
    recorder.close()
    assert durable_tokens(store, lease) == list(range(1, total + 1))
    assert max(len(tokens) for call in sink.calls for _, tokens in call) <= BACKLOG * EVERY
