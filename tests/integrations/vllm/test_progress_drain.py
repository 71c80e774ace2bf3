"""Preemption: a drain makes every in-flight sequence's unrecorded tail durable before the kill.

The first test is the preemption itself, in a fresh process on a real store: the worker streams four
sequences through the shipped path (``stream_leases``, the recorder in background mode, as TRL's server
worker runs it) with the SIGTERM drain installed (``drain_on_sigterm``, as ``RolloutWorker`` installs it
by default); the test sends SIGTERM mid-generation, then SIGKILL once the grace period is over, and
counts, from the store a fresh process reopens, the tokens a redispatch would have to generate again.
The second drains against a store that never answers: the drain stops at its deadline and says how many
tail tokens were not made durable.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _fresh import run_fresh
from kvckpt.integrations.vllm import ProgressRecorder

from kvckpt import BufferConfig, Prompt, ReplayBuffer

SCHEMA = {"input_ids": ("int64", "token"), "completion_mask": ("int64", "token")}
EVERY = 16
#: Seconds the preemption notice gives the worker (SIGKILL follows).
GRACE = 10.0
#: Seconds before a child that never reports fails the test (a hang guard, not a synchronisation).
HANG = 120

CHILD = """
import json, sys, time
from kvckpt import ReplayBuffer, Prompt
from kvckpt.integrations.common.progress import drain_on_sigterm
from kvckpt.integrations.vllm.worker import stream_leases

path, grace, every, out = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
buf = ReplayBuffer.open(path)
leases = buf.admit([Prompt(0), Prompt(1)])

def drained(reports):
    with open(out + ".tmp", "w") as f:
        json.dump([r.__dict__ for r in reports], f)
    import os
    os.replace(out + ".tmp", out)

drain_on_sigterm(grace, then=drained)

class Endless:
    # one token per sequence per engine step, until the recorder stops the sequences
    def stream(self, seqs, max_tokens, temperature, on_step, step_tokens=None):
        step = 0
        while True:
            step += 1
            stopped = on_step([(i, [step % 50 + i], [-0.5]) for i in range(len(seqs))])
            if step == 3 * every + 5:  # past three intervals, five tokens into the fourth: an undurable tail
                print("generating", flush=True)
                time.sleep(600)  # the engine's next step, when SIGTERM comes (its handler runs here)
            if len(stopped) == len(seqs):
                raise SystemExit("stopped")
            time.sleep(0.002)

stream_leases(buf, Endless(), leases, [[1, 2]] * 2, max_tokens=10**6, temperature=1.0, weight_version=0,
              every_tokens=every, every_seconds=None, background=True)
"""


def test_sigterm_mid_generation_then_sigkill_leaves_no_token_to_regenerate(tmp_path):
    path = str(tmp_path / "buf.kv")
    config = BufferConfig(group_size=2, schema=SCHEMA, max_buffered_rollouts=4)
    ReplayBuffer.create(path, config).close()
    report = str(tmp_path / "drained.json")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), path, str(GRACE), str(EVERY), report],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "generating"
        child.send_signal(signal.SIGTERM)  # the preemption notice
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=GRACE)
        child.kill()  # the end of the grace period (a no-op if the drained worker has already exited)
        child.wait(timeout=HANG)
    finally:
        child.kill()
    [drain] = json.loads(Path(report).read_text())
    found = run_fresh("""
        with ReplayBuffer.open(ARGS["path"]) as buf:
            prefixes = [len(p.tokens) for gid in ("a0-p0", "a0-p1") for p in buf.progress(gid).values()]
        print(json.dumps(prefixes))
    """, path=path)
    durable = found["out"]
    regenerate = drain["generated"] - sum(durable)
    print(f"drain: {drain}; durable per sequence {durable}; tokens to regenerate {regenerate}")
    assert drain["in_time"] and drain["drained"] == 4 and drain["tokens_not_durable"] == 0
    assert durable == [3 * EVERY + 5] * 4  # each tail of 5 tokens, short of an interval, made durable by the drain
    assert regenerate == 0


class Unanswered:
    """A store that takes the first write and never answers it (the owner is gone) until ``release``."""

    def __init__(self, buf: ReplayBuffer) -> None:
        self.buf, self.release, self.entered = buf, queue.Queue(), queue.Queue()

    def progress_encoder(self):
        return self.buf.progress_encoder()

    def record_progress_step(self, message):
        self.entered.put(None)
        self.release.get(timeout=HANG)
        return self.buf.record_progress_step(message)


@pytest.fixture
def store(tmp_path):
    with ReplayBuffer.create(str(tmp_path / "buf.kv"), BufferConfig(group_size=1, schema=SCHEMA,
                                                                     max_buffered_rollouts=4)) as buf:
        yield buf


def test_a_drain_past_its_deadline_stops_and_counts_the_tail_not_made_durable(store):
    (lease,) = store.admit([Prompt(0)])
    sink = Unanswered(store)
    recorder = ProgressRecorder(sink, [(lease, 0)], [0], 0, every_tokens=EVERY, every_seconds=None, background=True)
    recorder.on_step([(0, list(range(EVERY + 3)), [-0.5] * (EVERY + 3))])  # a chunk goes out and hangs
    sink.entered.get(timeout=HANG)
    started = time.monotonic()
    report = recorder.recorder.drain(started + 0.05)
    assert not report.in_time and (report.drained, report.undrained, report.tokens_not_durable) == (0, 1, EVERY + 3)
    assert recorder.on_step([(0, [1], [-0.5])]) == {0}  # no more admitted: the sequence is stopped
    sink.release.put(None)
    recorder.close()
    assert len(store.progress(lease)[0].tokens) == EVERY + 3  # what was in flight lands once answered


def test_a_drain_in_synchronous_mode_writes_a_tail_short_of_an_interval(store):
    (lease,) = store.admit([Prompt(0)])
    recorder = ProgressRecorder(store, [(lease, 0)], [0], 0, every_tokens=EVERY, every_seconds=None)
    recorder.on_step([(0, [1, 2, 3], [-0.5] * 3)])
    assert store.progress(lease) == {}
    report = recorder.recorder.drain(time.monotonic() + HANG)
    assert report.in_time and (report.drained, report.tokens_not_durable, report.generated) == (1, 0, 3)
    assert store.progress(lease)[0].tokens.tolist() == [1, 2, 3]
