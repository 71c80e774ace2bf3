"""TRL's SIGTERM drain through the real vLLM server path (issue 45): a preemption regenerates nothing.

A real vLLM OpenAI-compatible server (vLLM's CPU build, ``.venv-vllm``) on 127.0.0.1, as in
tests/integrations/trl/test_trl_server.py; AsyncGRPOTrainer with kvckpt's worker on its defaults
(``backend="server"``, the SIGTERM drain installed by the worker) in a fresh process
(tests/integrations/trl/trl_server_drain_run.py). Its probe holds the stream reader inside an engine step,
once the recorder took the step's tokens, at the first step where a sample holds an unrecorded tail short
of an interval: what each sequence generated is then fixed (no luck about where SIGTERM lands). The test
sends SIGTERM (the preemption notice), then SIGKILL after the grace period (the worker's
``DRAIN_SECONDS``), and counts from a fresh process the tokens a redispatch would generate again: for
every sequence drained in time, 0.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from _fresh import run_fresh

from kvckpt.testing.fixtures.vllm_server import VLLMServer, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.trl,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL not installed"),
              pytest.mark.skipif(vllm_python() is None,
                                 reason="no .venv-vllm for the server (bash scripts/setup_peer_env.sh vllm)")]

RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_server_drain_run.py")
EVERY, MAX_TOKENS = 8, 64
#: Seconds before a child that never reaches the hold, or never ends, fails the test (a hang guard only).
HANG = 600


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvckpt.integrations.vllm import ensure_tiny_model

    work = tmp_path_factory.mktemp("trl-server-drain")
    model = ensure_tiny_model(str(work / "model"))
    with VLLMServer(model, str(work / "server.log"), max_num_seqs=1) as srv:
        yield model, srv


def _held(log: str, child: subprocess.Popen) -> dict:
    """The probe's ``held`` event, once the child logged it (polled: the hold lasts until the signal)."""
    deadline = time.monotonic() + HANG
    while time.monotonic() < deadline and child.poll() is None:
        if os.path.exists(log):
            with open(log) as fh:
                events = [json.loads(line) for line in fh if line.strip()]
            found = [e for e in events if "held" in e]
            if found:
                return found[0]
        time.sleep(0.2)
    raise AssertionError(f"the child never held a batch mid-generation (rc {child.poll()})")


def test_sigterm_mid_generation_through_the_vllm_server_then_sigkill_regenerates_nothing(tmp_path, server):
    from kvckpt.integrations.vllm.worker import DRAIN_SECONDS

    model, srv = server
    log = str(tmp_path / "log.jsonl")
    cfg = {"workdir": str(tmp_path), "model": model, "server": srv.url, "every": EVERY, "max_tokens": MAX_TOKENS,
           "log": log}
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    child = subprocess.Popen([sys.executable, RUN, json.dumps(cfg)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        held = _held(log, child)
        child.send_signal(signal.SIGTERM)  # the preemption notice
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=DRAIN_SECONDS)
        child.kill()  # the end of the grace period (a no-op if the drained worker has already exited)
        err = child.communicate(timeout=HANG)[1]
    finally:
        child.kill()
    assert child.returncode == -signal.SIGTERM, err[-3000:] + srv.tail()  # the drain ended it, not the SIGKILL
    said = [x[x.index("kvckpt progress drain:"):] for x in err.splitlines() if "kvckpt progress drain:" in x]
    assert len(said) == 1 and said[0].endswith("0 not drained by the deadline, 0 tail tokens not made durable"), \
        err[-3000:]
    found = run_fresh("""
        with ReplayBuffer.open(ARGS["path"]) as buf:
            held = {lease.group_id: {i: len(p.tokens) for i, p in buf.progress(lease).items()}
                    for lease in buf.leases_held_by(ARGS["holder"])}
        print(json.dumps(held))
    """, path=str(tmp_path / "buffer.kv"), holder=held["holder"])
    assert found["rc"] == 0, found["err"]
    durable = {(g, int(i)): n for g, rows in found["out"].items() for i, n in rows.items()}
    # the sequences of the groups still in flight (a group whose samples all ended was committed: its rows
    # are stored, nothing of it is generated again)
    generated = {(s["group"], s["index"]): s["generated"] for s in held["held"] if s["group"] in found["out"]}
    tails = {k: n % EVERY for k, n in generated.items() if n < MAX_TOKENS}
    regenerate = {k: n - durable.get(k, 0) for k, n in generated.items()}
    print(f"drain: {said[0]}; in flight {len(generated)} sequences, "
          f"generated {[generated[k] for k in sorted(generated)]}"
          f", durable {[durable.get(k, 0) for k in sorted(generated)]}, tails short of an interval at SIGTERM "
          f"{[tails.get(k, 0) for k in sorted(generated)]}, tokens to regenerate {sum(regenerate.values())}")
    assert any(tails.values())  # at least one tail was short of an interval when SIGTERM came
    assert regenerate == dict.fromkeys(generated, 0)  # every sequence drained in time: nothing to generate again
