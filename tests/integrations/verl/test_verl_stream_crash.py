"""In-flight tokens survive a SIGKILL inside verl's own generation path (verl's server and client code).

tests/_verl_stream_run.py runs verl's ``FullyAsyncLLMServerClient`` (in kvckpt's ``ProgressClient``) over verl's
``vLLMHttpServer`` request path (``KvckptHttpServer``) with kvckpt's tiny step-wise engine behind it (vLLM's CPU
build does not install beside verl 0.9.1: tests/_verl_engine.py), the ledger a real Ray actor on a real file.
Phase ``crash`` streams 4 greedy samples (interval 8 tokens, budget 40), runs a weight sync (verl's
``abort_all_requests``, ``set_global_steps``, ``resume_generation``) after token 11, and SIGKILLs its whole process
group after token 29. Phase ``resume`` (a fresh process, Ray and ledger actor, a new run) first lets a zombie
server of the killed run stream with its run token, then resumes every sample through kvckpt's client and
compares with a reference run of the same samples that was never interrupted.
"""

from __future__ import annotations

import importlib.util
import json
import signal
from pathlib import Path

import pytest
from _paths import TESTS
from _phases import run_phase

pytestmark = pytest.mark.verl
RUN = TESTS / "_verl_stream_run.py"  # a helper script of tests/, run in a fresh process
EVERY, BUDGET, KILL_AT, SYNC_AT = 8, 40, 29, 11


def _phase(work: Path, phase: str) -> int:
    return run_phase(RUN, work, phase, deadline_s=300)


def test_verl_still_builds_its_server_from_the_name_kvckpt_replaces() -> None:
    """``server.install`` swaps verl's module-level ``vLLMHttpServer``; verl's replica must still read it there."""
    import inspect

    from _verl_engine import install_vllm_standin

    if importlib.util.find_spec("vllm") is None:
        install_vllm_standin()
    from kvckpt.integrations.verl import server
    from verl.workers.rollout.vllm_rollout import vllm_async_server

    assert server.VERL_SERVER is vllm_async_server.vLLMReplica.__init__.__globals__["vLLMHttpServer"] or (
        vllm_async_server.vLLMHttpServer is server.KvckptHttpServer)
    assert "ray.remote(vLLMHttpServer)" in inspect.getsource(vllm_async_server.vLLMReplica.__init__)
    assert issubclass(server.KvckptHttpServer, server.VERL_SERVER)


def test_sigkill_mid_generation_resumes_each_sample_from_its_durable_prefix(tmp_path: Path) -> None:
    assert _phase(tmp_path, "crash") == -signal.SIGKILL, (tmp_path / "crash.out").read_text()[-4000:]
    assert _phase(tmp_path, "resume") == 0, (tmp_path / "resume.out").read_text()[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    inflight, durable = result["killed"]["inflight"], result["durable"]
    samples = sorted(durable)
    assert len(samples) == 4 and all(inflight[s] == KILL_AT for s in samples)
    regenerated = {s: inflight[s] - durable[s] for s in samples}
    assert all(0 <= regenerated[s] < EVERY for s in samples), regenerated  # at most one interval per sequence
    client = result["client"]
    assert client["samples_resumed"] == 4 and client["tokens_resumed"] == sum(durable.values())
    assert client["tokens_generated"] == sum(BUDGET - durable[s] for s in samples)
    print(f"\nverl path, 4 sequences: tokens in flight {sum(inflight.values())}, durable {sum(durable.values())}, "
          f"resumed {client['tokens_resumed']}, regenerated {sum(regenerated.values())} (<= {EVERY} each); "
          f"zombie: {result['zombie_stats']}")
    for s in samples:  # greedy resume is bit-exact: tokens, logprobs and each token's weight version
        assert result["resumed"][s] == result["expected"][s], s
        versions = result["resumed"][s]["versions"]
        assert versions == [0] * SYNC_AT + [1] * (BUDGET - SYNC_AT)  # the sync kept the earlier tokens' version
        assert (result["resumed"][s]["min"], result["resumed"][s]["max"]) == (0, 1)
        left = result["left"][s]  # kept, done, until the put that ends its group (none here: no agent-loop worker)
        assert left["done"] and left["tokens"] == result["resumed"][s]["tokens"]
    zombie = result["zombie_stats"]
    assert not result["zombie_changed"] and zombie["chunks"] == 0 and zombie["tokens"] == 0
    # each chunk refused (StaleRun per item, as the buffer refuses a fenced lease's), so no call raised
    assert zombie["refused_calls"] == 0 and zombie["refused_tokens"] == 3 * EVERY
