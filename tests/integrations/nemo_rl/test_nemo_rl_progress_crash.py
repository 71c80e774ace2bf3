"""In-flight tokens survive a SIGKILL inside NeMo-RL's vLLM worker, and the restart re-issues every recovered
prompt through NeMo-RL's own ``generate_and_push``, once, from its durable prefix.

tests/_nemo_rl_progress_run.py runs three fresh processes (the store file is the one thing that survives):
``crash`` (killed with its process group after token 29), ``resume`` and ``straight`` (the uninterrupted
reference). Whose ``generate_and_push`` and ``generate_async`` run: NeMo-RL's own with ``KVCKPT_NEMO_RL_SOURCE``
set to a source checkout (7ea279ab), the contract stand-ins of tests/_nemo_rl_worker.py otherwise (CI); the engine
is kvckpt's tiny step-wise model either way (reasons in tests/_nemo_rl_worker.py).
"""

from __future__ import annotations

import json
import signal

import pytest
from _paths import TESTS
from _phases import run_phase

RUN = TESTS / "_nemo_rl_progress_run.py"  # a helper script of tests/, run in a fresh process
EVERY, BUDGET, REFIT_AT, KILL_AT = 8, 40, 11, 29
SEQUENCES = ("p0/0", "p0/1", "p1/0", "p1/1")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("nemo_rl_progress")
    assert run_phase(RUN, work, "crash") == -signal.SIGKILL, (work / "crash.out").read_text()[-4000:]
    assert run_phase(RUN, work, "resume") == 0, (work / "resume.out").read_text()[-4000:]
    assert run_phase(RUN, work, "straight") == 0, (work / "straight.out").read_text()[-4000:]
    return {**json.loads((work / "result.json").read_text()),
            "straight": json.loads((work / "straight.json").read_text())}


def test_inflight_tokens_survive_and_resume_with_at_most_one_interval_regenerated(result: dict) -> None:
    inflight, durable = result["killed"]["inflight"], result["durable"]
    assert inflight == KILL_AT * len(SEQUENCES)
    assert sorted(durable) == list(SEQUENCES)
    kept = {s: len(durable[s]["tokens"]) for s in SEQUENCES}
    assert all(KILL_AT - EVERY < kept[s] <= KILL_AT for s in SEQUENCES), kept  # <= one interval regenerated
    assert result["engine"]["resumed"] == sum(kept.values())  # every durable token resumed, none asked again
    assert result["engine"]["generated"] == sum(BUDGET - kept[s] for s in SEQUENCES)
    print(f"\nNeMo-RL ({result['which']}): {len(SEQUENCES)} sequences, tokens in flight {inflight}, durable "
          f"{sum(kept.values())}, resumed {result['engine']['resumed']}, regenerated "
          f"{inflight - sum(kept.values())} (<= {EVERY} each), generated after the restart "
          f"{result['engine']['generated']}")


def test_what_nemo_rl_commits_equals_an_uninterrupted_run_bit_for_bit(result: dict) -> None:
    straight = result["straight"]
    # whole sequences although the engine made only the missing tails (the prefix came from the store)
    assert result["engine"]["generated"] == sum(BUDGET - len(result["durable"][s]["tokens"]) for s in SEQUENCES)
    kept = sum(len(result["durable"][s]["tokens"]) for s in SEQUENCES)
    assert result["engine"]["requests"] == len(SEQUENCES)  # one attempt each: none failed and was retried
    assert result["engine"]["resumed"] == kept  # (a failed first attempt would read a prefix again)
    assert sorted(result["rows"]) == sorted(straight["rows"]) == list(SEQUENCES)
    for s in SEQUENCES:
        assert result["rows"][s] == straight["rows"][s], s  # NeMo-RL's committed tokens and logprobs
        assert len(result["rows"][s]["tokens"]) == BUDGET
        got, want = result["finished"][s], straight["finished"][s]
        assert (got["tokens"], got["logprobs"]) == (want["tokens"], want["logprobs"]), s


def test_each_token_keeps_the_weight_version_that_made_it(result: dict) -> None:
    assert result["killed"]["rpcs"] == ["update_weights_via_ipc_zmq"]  # NeMo-RL's refit call reached the engine
    for s in SEQUENCES:
        versions = [0] * REFIT_AT + [1] * (BUDGET - REFIT_AT)
        assert result["finished"][s]["versions"] == result["straight"]["finished"][s]["versions"] == versions
        assert result["durable"][s]["versions"] == versions[:len(result["durable"][s]["versions"])]


def test_each_recovered_prompt_is_reissued_once_and_a_zombie_is_refused(result: dict) -> None:
    assert len(result["recovered"]) == 2 and sorted(result["reissued"]) == result["recovered"]
    assert set(result["reissued"].values()) <= {"committed", "RolloutOutcome.COMMITTED"}
    assert result["second"] == {}  # a second walk finds nothing left to re-issue
    assert sorted(result["groups"]) == result["recovered"]  # committed under their recovered group ids
    assert result["ledger"] == 0
    assert result["zombie"].startswith("StaleAttempt") and result["zombie_left_store_unchanged"]
