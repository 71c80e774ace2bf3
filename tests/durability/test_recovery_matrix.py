"""The round-trip matrix (replay_semantics.md §E.1): four samplers x ten scenarios.

Each scenario is built through the real buffer API (explicit ``gNN`` group ids, n = 2, three
groups per step, capacity 64), checkpointed with ``buf.checkpoint(path, state).wait()`` while the
live buffer keeps working, and restored in one fresh interpreter that shares nothing with the saving
side but the files (see ``_scenarios.run_job``). The restoring side then does what a
trainer does next: redispatch the leases (generating only the missing rows), ``evict``, and train
until nothing is selectable.

kvckpt adaptations of the NeMo table (details in ``_scenarios``): every sampler reads one current
version, ``trainer_version``, so a batch's weight is the trainer version it was admitted at and the
history before g09 is a few filler steps; g10 is discarded with ``evict(["g10"])``; the "hole" is a
mid-step checkpoint with g13 claimed. One scenario is added to the table: the older of two lag-2
batches still generating, which pins that a restored weight_fifo waits for in-flight groups.
The current version at selection is the stamped one, which is already the first outstanding step
(in_order) or inside every sampler's window (others), as E.1's "selectable at gate lags" asks.
"""

from __future__ import annotations

import os

import pytest
from _scenarios import SAMPLERS, SCENARIOS, N, build_matrix, run_fresh

NAMES = [sc.name for sc in SCENARIOS]
BY_NAME = {sc.name: sc for sc in SCENARIOS}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Saved views and restored observations, keyed by sampler then scenario."""
    root = str(tmp_path_factory.mktemp("matrix"))
    saved = build_matrix(root)
    jobs = [{"ckpt": os.path.join(root, sampler, f"{name}.kvckpt"), "live": os.path.join(root, sampler, f"{name}.live"),
             "complete": True, "evict": True, "train": True} for sampler in SAMPLERS for name in NAMES]
    results = iter(run_fresh(jobs, root))
    restored = {sampler: {name: next(results) for name in NAMES} for sampler in SAMPLERS}
    return saved, restored


def case(matrix, sampler, name):
    saved, restored = matrix
    got = restored[sampler][name]
    assert "error" not in got, got
    return BY_NAME[name].expect[sampler], saved[sampler][name], got


with_cases = pytest.mark.parametrize(("sampler", "name"), [(s, n) for s in SAMPLERS for n in NAMES],
                                     ids=[f"{s}-{n}" for s in SAMPLERS for n in NAMES])


@with_cases
def test_cursors_and_dataloader_are_exact(matrix, sampler, name):
    exp, saved, got = case(matrix, sampler, name)
    dispatch = -1 if sampler == "windowed" else exp.dispatch_index  # windowed is ungated: no cursor
    assert saved["trainer_version"] == got["plan"]["resume_version"] == got["state"]["trainer_version"] == exp.version
    assert saved["dispatch_index"] == got["plan"]["dispatch_index"] == got["state"]["dispatch_index"] == dispatch
    assert saved["dataloader"] == got["dataloader"] == exp.dataloader
    assert got["trainer_state"] == {"scenario": name}
    assert got["state"]["counters"]["admitted"] == saved["admitted"]


@with_cases
def test_completed_groups_come_back_with_identical_stamps_and_rows(matrix, sampler, name):
    exp, saved, got = case(matrix, sampler, name)
    ready = {gid: doc["start_weight"] for gid, doc in got["groups"].items() if doc["state"] == "ready"}
    assert ready == exp.ready
    for gid in ready:
        assert got["groups"][gid]["target_step"] == (exp.targets[gid] if sampler == "in_order" else None)
    assert set(got["groups"]) == set(saved["groups"])
    for gid, doc in saved["groups"].items():
        want = dict(doc)
        if want["state"] == "claimed":  # the model checkpoint has not trained on it: back to ready
            want.update(state="ready", claimed_step=None)
        assert got["groups"][gid] == want, gid
    assert got["plan"]["groups_returned_to_ready"] == exp.returned
    assert got["plan"]["groups_complete_restored"] == len(exp.ready)
    stored = {gid for gid, doc in got["groups"].items() if doc["rows_stored"]}
    assert set(got["rows"]) == stored >= set(exp.ready)
    for gid, rows in got["rows"].items():
        assert rows == {"ids": [f"{gid}_g{i}" for i in range(N)], "equal": True}, gid


@with_cases
def test_discarded_groups_stay_discarded(matrix, sampler, name):
    exp, saved, got = case(matrix, sampler, name)
    for gid, state in exp.gone.items():
        assert saved["groups"][gid]["state"] == got["groups"][gid]["state"] == state
        assert not got["groups"][gid]["rows_stored"]
        assert gid not in got["ledger"] and gid not in got["rows"]
        assert all(gid not in step["gids"] for step in got["steps"])


@with_cases
def test_unfinished_groups_are_leased_exactly_once(matrix, sampler, name):
    exp, saved, got = case(matrix, sampler, name)
    lease_ids = [lease["group_id"] for lease in got["leases"]]
    assert len(lease_ids) == len(set(lease_ids))
    assert {lease["group_id"]: tuple(lease["missing"]) for lease in got["leases"]} == exp.leases
    assert set(got["ledger"]) == set(saved["ledger"]) == set(exp.leases)
    for lease in got["leases"]:
        gid, before = lease["group_id"], saved["ledger"][lease["group_id"]]
        assert lease["attempt"] == got["ledger"][gid]["attempt"] == before["attempt"] + 1 == 1
        assert lease["target_step"] == (exp.targets[gid] if sampler == "in_order" else None)
        assert lease["start_weight"] == before["start_weight"]
        assert (lease["prompt_idx"], lease["admission_id"]) == (before["prompt_idx"], before["admission_id"])
        assert got["ledger"][gid]["siblings"] == before["siblings"]
    plan = got["plan"]
    assert plan["groups_unfinished_found"] == plan["groups_redispatched"] == len(exp.leases)
    assert plan["siblings_reused"] == sum(N - len(m) for m in exp.leases.values())
    assert plan["siblings_rerun"] == sum(len(m) for m in exp.leases.values())
    assert got["completed"] == [True] * len(exp.leases)


@with_cases
def test_every_dispatched_prompt_has_exactly_one_owner(matrix, sampler, name):
    _, saved, got = case(matrix, sampler, name)
    groups, ledger = set(got["groups"]), set(got["ledger"])
    assert not groups & ledger
    assert groups | ledger == set(saved["groups"]) | set(saved["ledger"])
    assert len(groups) + len(ledger) == saved["admitted"]


@with_cases
def test_restored_sampler_selects_the_expected_groups(matrix, sampler, name):
    exp, _, got = case(matrix, sampler, name)
    assert got["eligible_now"] == exp.eligible_now
    assert got["evicted"] == exp.evicted
    assert [step["gids"] for step in got["steps"]] == exp.steps
    assert [step["step"] for step in got["steps"]] == list(range(exp.version, exp.version + len(exp.steps)))
    assert all(step["rows_equal"] and step["rows"] == N * len(step["gids"]) for step in got["steps"])
    assert got["verify"] == []
