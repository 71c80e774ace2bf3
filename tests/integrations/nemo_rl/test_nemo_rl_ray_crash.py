"""In-flight tokens survive a SIGKILL of NeMo-RL's Ray generation worker and of the process that owns the store:
the worker's engine proxy, attached by the configuration alone, writes through the buffer's Ray client, and the
restart re-issues every recovered prompt through NeMo-RL's own ``generate_and_push``, once, from its durable prefix.

tests/_nemo_rl_ray_run.py runs ``crash`` and ``resume`` in fresh processes, each with a fresh Ray on loopback (the
store file is the one thing that survives); the uninterrupted reference is tests/_nemo_rl_progress_run.py's
``straight`` (the same worker, engine and prompts in one process). Whose ``generate_and_push`` and
``generate_async`` run, and the stand-ins, as in test_nemo_rl_progress_crash.py; here the worker is a Ray actor
(tests/_nemo_rl_ray_host.py stands in for NeMo-RL's ``RayWorkerBuilder``, which needs a GPU to build the worker).
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from _paths import TESTS
from _phases import run_phase

RUN = TESTS / "_nemo_rl_ray_run.py"
EVERY, BUDGET, REFIT_AT, KILL_AT = 8, 40, 11, 29
SEQUENCES = ("p0/0", "p0/1", "p1/0", "p1/1")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("nemo_rl_ray")
    os.environ.setdefault("RAY_TMPDIR", str(tmp_path_factory.mktemp("ray")))
    assert run_phase(RUN, work, "crash") == -signal.SIGKILL, (work / "crash.out").read_text()[-4000:]
    assert run_phase(RUN, work, "resume") == 0, (work / "resume.out").read_text()[-4000:]
    assert run_phase(RUN, work, "straight") == 0, (work / "straight.out").read_text()[-4000:]
    return {**json.loads((work / "result.json").read_text()),
            "straight": json.loads((work / "straight.json").read_text())}


def test_the_ray_worker_recorded_through_the_desk_and_durable_covers_what_was_acknowledged(result: dict) -> None:
    killed, durable = result["killed"], result["durable"]
    assert killed["attached"] and killed["desk"]["step_calls"] > 0  # the configuration alone attached the proxy
    assert killed["stats"]["generated"] == KILL_AT * len(SEQUENCES)  # tokens in flight at the kill
    assert sorted(durable) == sorted(killed["acknowledged"]) == list(SEQUENCES)
    kept = {s: len(durable[s]["tokens"]) for s in SEQUENCES}
    assert all(kept[s] >= killed["acknowledged"][s] for s in SEQUENCES), (kept, killed["acknowledged"])
    assert all(KILL_AT - EVERY < kept[s] <= KILL_AT for s in SEQUENCES), kept  # <= one interval regenerated
    assert result["engine"]["resumed"] == sum(kept.values())
    assert result["engine"]["generated"] == sum(BUDGET - kept[s] for s in SEQUENCES)
    assert result["desk"]["reads"] >= len(SEQUENCES)  # the resumed prefixes came through the desk too
    print(f"\nNeMo-RL on Ray ({result['which']}): {len(SEQUENCES)} sequences, tokens in flight "
          f"{killed['stats']['generated']}, acknowledged {sum(killed['acknowledged'].values())}, durable "
          f"{sum(kept.values())}, resumed {result['engine']['resumed']}, regenerated "
          f"{killed['stats']['generated'] - sum(kept.values())} (<= {EVERY} each), generated after the restart "
          f"{result['engine']['generated']}")


def test_what_nemo_rl_commits_equals_an_uninterrupted_run_bit_for_bit(result: dict) -> None:
    straight = result["straight"]
    assert result["engine"]["requests"] == len(SEQUENCES)  # one attempt each, none retried
    assert sorted(result["rows"]) == sorted(straight["rows"]) == list(SEQUENCES)
    for s in SEQUENCES:
        assert result["rows"][s] == straight["rows"][s], s
        assert len(result["rows"][s]["tokens"]) == BUDGET
        got, want = result["finished"][s], straight["finished"][s]
        assert (got["tokens"], got["logprobs"]) == (want["tokens"], want["logprobs"]), s


def test_each_token_keeps_the_weight_version_that_made_it(result: dict) -> None:
    assert result["killed"]["rpcs"] == ["update_weights_via_ipc_zmq"]
    versions = [0] * REFIT_AT + [1] * (BUDGET - REFIT_AT)
    for s in SEQUENCES:
        assert result["finished"][s]["versions"] == result["straight"]["finished"][s]["versions"] == versions
        assert result["durable"][s]["versions"] == versions[:len(result["durable"][s]["versions"])]


def test_each_recovered_prompt_is_reissued_once_and_a_zombie_is_refused(result: dict) -> None:
    assert len(result["recovered"]) == 2 and sorted(result["reissued"]) == result["recovered"]
    assert set(result["reissued"].values()) <= {"committed", "RolloutOutcome.COMMITTED"}
    assert result["second"] == {}
    assert sorted(result["groups"]) == result["recovered"]
    assert result["ledger"] == 0
    assert result["zombie"].startswith("StaleAttempt") and result["zombie_left_store_unchanged"]
