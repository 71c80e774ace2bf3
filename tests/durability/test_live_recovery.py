"""Zero-loss recovery from the live store after a SIGKILL, and the docs' worked example.

A child process runs an in_order workload (lookahead 1) on a live store: it trains steps 0..5,
checkpoints at versions 2 and 4, then at version 6 claims step 6's batch, checkpoints mid-step,
lets a producer thread commit step 7's rows one by one and SIGKILLs itself once three of them are
acknowledged (``_scenarios.live_workload``). Every acknowledged operation was fsync'd to a log first.

A fresh process then reopens the *live* store, tries a rollback older than the drop floor (refused,
nothing written), and recovers to ``resume_version = K = 4``, as a trainer whose newest usable model
checkpoint is version 4 would (the version-6 model checkpoint is taken to be lost). The test checks
that nothing generated is lost and every prompt has exactly one owner, and that steps 4..7 replay
the same batches.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import _paths
import pytest
from _scenarios import CHILD_ENV, HERE, LIVE_K, Driver, N, batch_ids, new_buffer

ROOT = str(_paths.ROOT)
STEPS = range(8)  # batches 0..7 were admitted before the kill
DROP_FLOOR = 2  # checkpoints 2 and 4 were complete when step 4 finished: rows of steps 0, 1 dropped


@pytest.fixture(scope="module")
def crash(tmp_path_factory):
    """(the killed writer, its acknowledged operations, what the recovering process observed)."""
    root = tmp_path_factory.mktemp("live")
    store, log = str(root / "live.kv"), str(root / "acks.jsonl")
    writer = subprocess.run([sys.executable, HERE, "live-workload", store, log, str(root)],
                            capture_output=True, text=True, timeout=120, env=CHILD_ENV)
    with open(log) as f:
        ops = [json.loads(line) for line in f]
    zombies = [lease for op in ops if op["op"] == "admit" for lease in op["leases"] if lease["target_step"] == 7]
    with open(root / "zombies.json", "w") as f:
        json.dump(zombies, f)
    over_capacity = str(root / "over-capacity.kv")  # see test_a_second_crash_after_a_rollback_over_capacity_...
    with new_buffer(over_capacity, "in_order", lag=1, capacity=6) as buf:
        Driver(buf).warmup(4)  # steps 0..3 trained on 12 groups; trainer version 4
    recovering = subprocess.run([sys.executable, HERE, "live-recover", store, str(LIVE_K), str(DROP_FLOOR - 1),
                                 str(root / "zombies.json"), over_capacity, "1"], capture_output=True, text=True,
                                timeout=120, env=CHILD_ENV)
    assert recovering.returncode == 0, recovering.stderr[-4000:]
    return writer, ops, json.loads(recovering.stdout)


def acked(ops, kind):
    return [op for op in ops if op["op"] == kind]


def test_the_writer_died_by_sigkill_mid_step(crash):
    writer, ops, _ = crash
    assert writer.returncode == -signal.SIGKILL, writer.stderr[-2000:]
    assert [op["version"] for op in acked(ops, "checkpoint")] == [2, 4, 6]
    assert acked(ops, "select")[-1] == {"op": "select", "step": 6, "gids": batch_ids(6)}
    assert acked(ops, "finish")[-1]["version"] == 6  # step 6 was claimed, never finished
    assert len([op for op in ops if op["op"] == "sample" and op["gid"] in batch_ids(7)]) >= 3


def test_the_live_store_is_consistent_after_the_kill(crash):
    assert crash[2]["verify_before"] == []


def test_rollback_older_than_the_drop_floor_is_refused_and_writes_nothing(crash):
    too_old = crash[2]["too_old"]
    assert (too_old["error"], too_old["unchanged"]) == ("RecoveryError", True)
    assert f"cannot resume at version {DROP_FLOOR - 1}" in too_old["message"]
    assert f"version >= {DROP_FLOOR}" in too_old["message"]


def test_cursors_after_recovery(crash):
    _, ops, got = crash
    assert got["plan"]["resume_version"] == got["state"]["trainer_version"] == LIVE_K
    assert got["plan"]["dispatch_index"] == got["state"]["dispatch_index"] == 7  # nothing re-admitted
    assert got["dataloader"] == acked(ops, "admit")[-1]["dataloader"] == "after=b7-2"
    assert got["trainer_state"] is None  # the last stamp (version 6) belongs to the abandoned run
    assert got["state"]["durable"] == [2, 4]  # the version-6 checkpoint belongs to the abandoned run


def test_every_prompt_is_accounted_for_exactly_once(crash):
    _, ops, got = crash
    admitted = [gid for op in acked(ops, "admit") for gid in op["gids"]]
    assert len(admitted) == len(set(admitted)) == got["state"]["counters"]["admitted"] == 3 * len(STEPS)
    groups, ledger = set(got["groups"]), set(got["ledger"])
    assert not groups & ledger and groups | ledger == set(admitted)
    trained = {gid: doc["consumed_step"] for gid, doc in got["groups"].items() if doc["state"] == "consumed"}
    assert trained == {gid: step for step in range(LIVE_K) for gid in batch_ids(step)}
    assert {g for g, doc in got["groups"].items() if doc["state"] == "ready"} >= {
        gid for step in range(LIVE_K, 7) for gid in batch_ids(step)}
    assert ledger <= set(batch_ids(7))


def test_every_acknowledged_commit_is_present(crash):
    _, ops, got = crash
    for op in acked(ops, "commit"):
        assert got["groups"][op["gid"]]["state"] in ("ready", "consumed"), op
    for op in acked(ops, "sample"):
        gid, index = op["gid"], op["index"]
        assert gid in got["groups"] or index in got["ledger"][gid]["siblings"], op
    for gid, rows in got["rows"].items():
        assert rows == {"ids": [f"{gid}_g{i}" for i in range(N)], "equal": True}, gid


def test_groups_claimed_or_consumed_since_k_are_selectable_again(crash):
    _, ops, got = crash
    assert got["plan"]["groups_returned_to_ready"] == 3 * (7 - LIVE_K)  # steps 4 and 5 consumed, 6 claimed
    trained = {op["step"]: op["gids"] for op in acked(ops, "select")}
    steps = [(step["step"], step["gids"]) for step in got["steps"]]
    assert steps == [(s, trained.get(s, batch_ids(s))) for s in range(LIVE_K, 8)]  # the same batches again
    assert all(step["rows_equal"] and step["rows"] == 3 * N for step in got["steps"])
    assert got["verify"] == []


def test_ledger_entries_are_redispatched_with_bumped_attempts(crash):
    _, ops, got = crash
    leases = {lease["group_id"]: lease for lease in got["leases"]}
    assert set(leases) == set(got["ledger"]) and len(leases) == len(got["leases"])
    samples = {(op["gid"], op["index"]) for op in acked(ops, "sample")}
    for gid, lease in leases.items():
        assert (lease["attempt"], lease["target_step"]) == (1, 7)
        assert not {(gid, i) for i in lease["missing"]} & samples  # acknowledged rows are reused
    plan = got["plan"]
    assert plan["groups_redispatched"] == plan["groups_unfinished_found"] == len(leases)
    assert plan["siblings_reused"] + plan["siblings_rerun"] == N * len(leases)
    assert got["completed"] == [True] * len(leases)
    zombies = [lease["group_id"] for op in acked(ops, "admit") if op["target"] == 7 for lease in op["leases"]]
    expected = ["AbandonedTimeline" if gid in leases else "accepted" for gid in zombies]  # accepted = idempotent replay
    assert got["zombies"] == {"results": expected, "unchanged": True}


def test_consumption_is_soft_until_durable_checkpoints_cover_it(crash):
    _, _, got = crash
    assert [step["drop_floor"] for step in got["steps"]] == [DROP_FLOOR] * 4
    for step in range(LIVE_K):
        for gid in batch_ids(step):
            assert got["after"][gid] == ["consumed", step >= DROP_FLOOR], gid


def test_a_second_crash_after_a_rollback_over_capacity_is_recoverable(crash):
    # Rolling back to version 1 returns the 9 groups trained in steps 1..3 to ready, more than the
    # capacity of 6 (admission then waits until training drains them). A crash before that happens,
    # or a checkpoint taken meanwhile, must still recover: that state is legitimate, not damage.
    got = crash[2]["recover_again"]
    over = ["9 ready groups exceed max_buffered_rollouts 6: admission waits until training drains them"]
    assert got["first"] == {"changes": over, "ready": 9, "verify": []}
    assert got["second"] == {"changes": over, "ready": 9, "verify": []}
    assert got["restore"] == {"changes": over, "ready": 9, "verify": []}


def test_docs_worked_example_runs(tmp_path):
    with open(os.path.join(ROOT, "docs", "recovery.md")) as f:
        code = "\n".join(re.findall(r"```python\n(.*?)```", f.read(), re.S))
    assert "restore(" in code and ".recover(" in code
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=CHILD_ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
