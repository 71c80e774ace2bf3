"""TRL's server worker drains on SIGTERM by default (issue 45), and its leases name it.

The preemption, at the worker's level, in a fresh process on a real store: a
:class:`~kvckpt.integrations.trl.KvckptRolloutWorker` built for the server path with its defaults
(no ``drain_on_sigterm`` call of its own: the worker installs it) runs its generation thread as TRL
starts it, and records through the one recorder in background mode, as on the server path. The
engine is a stand-in for the vLLM server's stream (one token per sequence per step, deterministic,
no server to start); everything else is the shipped path: the worker's admission, the recorder, the
step messages, the store. The test sends SIGTERM mid-generation, five tokens into an interval,
then SIGKILL once the grace period is over, and counts from a fresh process the tokens a
redispatch would generate again: 0. The same process's leases record the worker's holder name.

The second test is the same preemption past its deadline: the store stops answering once three intervals are
durable, so the drain returns at the worker's ``drain_seconds``, says on its logger how many tail tokens it could
not make durable, and lets SIGTERM end the process; a fresh process counts exactly those tokens to regenerate.
The real vLLM server's path is tests/integrations/trl/test_trl_server_drain.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import subprocess
import sys
import textwrap

import pytest
from _fresh import run_fresh

pytestmark = [pytest.mark.trl,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL not installed")]

EVERY = 16
#: Tokens per sequence when SIGTERM comes: three intervals durable, a tail of five short of the fourth.
AT_SIGTERM = 3 * EVERY + 5
#: Seconds before a child that never reports fails the test (a hang guard, not a synchronisation).
HANG = 120

CHILD = """
import json, sys, threading, time, types
from kvckpt import ReplayBuffer
from kvckpt.integrations.trl import KvckptRolloutWorker
from kvckpt.integrations.vllm.worker import DRAIN_SECONDS

path, model, every, at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
# with a grace period (the past-deadline test): the worker's drain_seconds, and the store stops answering at `at`
grace = float(sys.argv[5]) if len(sys.argv) > 5 else None
args = types.SimpleNamespace(num_generations=2, max_completion_length=10**6, temperature=1.0, max_staleness=1,
                             weight_sync_steps=1, vllm_server_base_url="http://127.0.0.1:9/", request_timeout=5.0)
worker = KvckptRolloutWorker(path, model, [{"prompt": "1+1=", "answer": "2"}], [lambda completions, **_: [0.0]],
                             args, backend="server", progress_every_tokens=every,
                             **({} if grace is None else {"drain_seconds": grace}))
buf = ReplayBuffer.create(path, worker.config)
answer, gone = buf.record_progress_step, threading.Event()

def record_progress_step(message):  # the store's owner: from `gone` on it never answers
    if gone.is_set():
        threading.Event().wait()
    return answer(message)

buf.record_progress_step = record_progress_step

def durable():
    return sorted(len(p.tokens) for e in buf.ledger() for p in buf.progress(e.group_id).values())

class ServerStream:
    # the server's stream: one token per sequence per step until the recorder stops the sequences
    def stream(self, seqs, max_tokens, temperature, on_step, step_tokens=None):
        step = 0
        while True:
            step += 1
            stopped = on_step([(i, [step % 50 + i], [-0.5]) for i in range(len(seqs))])
            if step == at:
                if grace is not None:
                    while durable() != [at - at % every] * len(seqs):  # the intervals landed (the test's hang guard)
                        time.sleep(0.01)
                    gone.set()
                print(json.dumps({"holder": worker.holder, "grace": grace or DRAIN_SECONDS}), flush=True)
                time.sleep(600)  # the next step, when SIGTERM comes (its handler runs in the main thread)
            if len(stopped) == len(seqs):
                raise SystemExit("stopped")
            time.sleep(0.002)

worker.backend = ServerStream()
worker.attach(buf)
worker.epochs.resume(0)  # TRL's cold weight sync at train begin
worker.start()
while True:  # TRL's training loop, in the main thread
    time.sleep(1)
"""


def test_sigterm_mid_generation_then_sigkill_leaves_no_token_to_regenerate(tmp_path, model_path):
    path = str(tmp_path / "buffer.kv")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), path, model_path, str(EVERY),
                              str(AT_SIGTERM)], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line, "the worker never reached the chosen step"
        told = json.loads(line)
        child.send_signal(signal.SIGTERM)  # the preemption notice
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=told["grace"])
        child.kill()  # the end of the grace period (a no-op if the drained worker has already exited)
        child.wait(timeout=HANG)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGTERM  # the drain let the signal end the process, before the SIGKILL
    found = run_fresh("""
        with ReplayBuffer.open(ARGS["path"]) as buf:
            [lease] = buf.leases_held_by(ARGS["holder"])
            held = [len(p.tokens) for p in buf.progress(lease).values()]
            print(json.dumps({"held": held, "ledger": [e.group_id for e in buf.ledger()], "gid": lease.group_id,
                              "redispatched": buf.stats()["redispatched"]}))
    """, path=path, holder=told["holder"])
    assert found["rc"] == 0, found["err"]
    durable = found["out"]["held"]
    regenerate = 2 * AT_SIGTERM - sum(durable)
    print(f"generated {2 * AT_SIGTERM}, durable per sequence {durable}, tokens to regenerate {regenerate}")
    assert found["out"]["ledger"] == [found["out"]["gid"]]  # the one lease in flight is the worker's,
    assert found["out"]["redispatched"] == 0  # admitted under its name (not redispatched to it afterwards)
    assert durable == [AT_SIGTERM] * 2  # each tail of 5 tokens, short of an interval, made durable by the drain
    assert regenerate == 0


#: The grace period of the past-deadline test: the worker's own ``drain_seconds``.
SHORT_GRACE = 2.0
#: Per sequence when SIGTERM comes: three intervals durable (waited for), a tail of five the store never takes.
TAIL = 5



def test_a_sigterm_drain_past_its_deadline_stops_and_says_how_many_tail_tokens_were_not_made_durable(tmp_path,
                                                                                                   model_path):
    """The worker's store stops answering (its owner is gone) just before the preemption notice: the drain waits
    for its deadline (the worker's ``drain_seconds``), stops, says how many tail tokens it could not make durable
    (on the ``kvckpt.integrations.common.progress`` logger: a warning) and lets SIGTERM end the process, before
    the SIGKILL; a fresh process finds the three intervals durable, and exactly the tokens the drain reported to
    generate again."""
    path = str(tmp_path / "buffer.kv")
    at = 3 * EVERY + TAIL
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), path, model_path, str(EVERY),
                              str(at), str(SHORT_GRACE)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line, "the worker never reached the chosen step"
        told = json.loads(line)
        child.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=HANG)  # the drain's own deadline ends it; this only guards a hang
        child.kill()
        err = child.stderr.read()
    finally:
        child.kill()
    assert child.returncode == -signal.SIGTERM, err  # stopped by the drain's handler, not by the SIGKILL
    said = [x for x in err.splitlines() if x.startswith("kvckpt progress drain:")]
    assert said == [f"kvckpt progress drain: 0 sequences drained, 2 not drained by the deadline, {2 * TAIL} tail "
                    "tokens not made durable"], err
    found = run_fresh("""
        with ReplayBuffer.open(ARGS["path"]) as buf:
            [lease] = buf.leases_held_by(ARGS["holder"])
            print(json.dumps([len(p.tokens) for p in buf.progress(lease).values()]))
    """, path=path, holder=told["holder"])
    assert found["rc"] == 0, found["err"]
    durable = found["out"]
    print(f"generated {2 * at}, durable per sequence {durable}, tokens to regenerate {2 * at - sum(durable)}, "
          f"reported not durable {2 * TAIL}")
    assert durable == [3 * EVERY] * 2 and 2 * at - sum(durable) == 2 * TAIL
