"""Contract tests of the kvckpt NeMo-RL adapter's own paths (``kvckpt.integrations.nemo_rl``).

``tests/integrations/nemo_rl/test_nemo_rl_surface.py`` drives the adapter exactly as NeMo-RL does; this module covers
what kvckpt adds around that surface: the config (``async_rl.replay_buffer``), the ledger
lifecycle (reserve -> admit -> commit / discard), the one-transaction ``admit_batch``, the split
admission and its joins, and checkpoint -> ``restore_replay_buffer`` in a fresh process ->
``select`` returns the restored groups, for all four samplers.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import pytest
from _buffers import SCHEMA, dump_store, make_group
from _paths import child_env
from kvckpt.integrations.nemo_rl import (
    TQReplayBuffer,
    configure,
    create_replay_buffer,
    from_master_config,
    parse_config,
    restore_replay_buffer,
)

from kvckpt import Lease, Prompt, StaleAttempt
from kvckpt.durability.verify import check
from kvckpt.errors import BadArgument, CapacityError, GateTimeout, RecoveryError
from kvckpt.tables.records import Admission

SAMPLERS = {
    "in_order": {"name": "in_order", "max_lookahead_versions": 1},
    "weight_fifo": {"name": "weight_fifo", "max_staleness_versions": 1},
    "windowed": {"name": "windowed", "max_staleness_versions": 1, "sample_freshest_first": False},
    "ready_first": {"name": "ready_first", "max_staleness_versions": 1},
}


def config(path: str, sampler: Any, *, capacity: int = 8, per_step: int = 2) -> dict[str, Any]:
    """A kvckpt config dict with the tests' small schema and two rows per group."""
    return {"backend": "kvckpt", "path": path, "num_generations_per_prompt": 2, "num_prompts_per_step": per_step,
            "max_buffered_rollouts": capacity, "sampler": sampler, "schema": SCHEMA}


@pytest.fixture
def make(tmp_path: Any):
    """Factory of adapters on fresh store files; all closed afterwards."""
    made: list[TQReplayBuffer] = []

    def factory(sampler: Any, **kwargs: Any) -> TQReplayBuffer:
        buf = create_replay_buffer(config(str(tmp_path / f"replay{len(made)}.kv"), sampler, **kwargs))
        made.append(buf)
        return buf

    yield factory
    for buf in made:
        buf.close()


def run(coro: Any) -> Any:
    """Run one of the adapter's coroutines to completion."""
    return asyncio.run(coro)


def admit(buf: TQReplayBuffer, version: int = 0, **kwargs: Any) -> int | None:
    """``await sampler.admit(trainer_version_fn=...)`` without waiting for a closed gate."""
    return run(buf.sampler.admit(trainer_version_fn=lambda: version, timeout=kwargs.pop("timeout", 0), **kwargs))


def select(buf: TQReplayBuffer, version: int, lo: int, hi: int) -> Any:
    """``await sampler.select(...)`` with NeMo-RL's keywords."""
    return run(buf.sampler.select(current_train_weight=version, min_prompt_groups=lo, max_prompt_groups=hi))


def commit(buf: TQReplayBuffer, gid: str, weight: int, seed: int = 0) -> None:
    """Commit two deterministic rows to a reserved group, started and ended at ``weight``."""
    run(buf.commit(gid, make_group(2, seed), weight, weight))


def produce(buf: TQReplayBuffer, gids: list[str], weight: int, *, leave: tuple[str, ...] = (),
            dataloader_state: bytes | None = None) -> int | None:
    """One dataloader batch the #3480 way: reserve_group each prompt, admit, then reserve and
    commit each (except ``leave``, which stays in flight). Returns the admission's stamp."""
    for i, gid in enumerate(gids):
        buf.ledger.reserve_group(gid, prompt_idx=i, expected_generations=2)
    stamp = admit(buf, buf.core.trainer_version, dataloader_state=dataloader_state, weight_version=weight)
    for gid in gids:
        if gid not in leave:
            buf.reserve(weight_version=weight, target_step=stamp, group_id=gid)
            commit(buf, gid, weight, seed=len(gid))
    return stamp


# -- config -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_nemo_config_keys_choose_the_sampler(make: Any, name: str) -> None:
    buf = make(SAMPLERS[name], capacity=4, per_step=2)
    sampler = buf.sampler
    assert sampler.name == name
    assert sampler.config() == SAMPLERS[name]
    assert sampler.supports_buffer_checkpoint is True
    assert sampler.is_on_policy is False
    assert sampler.required_buffer_capacity(groups_per_step=2) == 4
    assert sampler.dispatch_index == -1
    assert buf.core.config.group_size == 2 and buf.core.config.max_buffered_rollouts == 4


def test_config_refuses_typos_other_backends_and_deadlocking_capacity(tmp_path: Any) -> None:
    path = str(tmp_path / "r.kv")
    with pytest.raises(BadArgument, match=r"unknown config key\(s\) \['max_bufferd_rollouts'\] in the replay-buffer"):
        parse_config({**config(path, "in_order"), "max_bufferd_rollouts": 8})
    with pytest.raises(BadArgument, match="not 'tq'"):
        parse_config({**config(path, "in_order"), "backend": "tq"})
    with pytest.raises(CapacityError, match=r"needs for 4 groups per step \(8 = groups_per_step x \(W\+1\)\)"):
        parse_config(config(path, SAMPLERS["in_order"], capacity=7, per_step=4))
    on_policy = parse_config(config(path, {"name": "windowed", "max_staleness_versions": 0}))
    assert on_policy.buffer.sampler.window == 0
    assert not os.path.exists(path)


def test_reopening_with_another_sampler_is_refused(tmp_path: Any) -> None:
    path = str(tmp_path / "r.kv")
    create_replay_buffer(config(path, SAMPLERS["in_order"])).close()
    with pytest.raises(BadArgument, match="configured with sampler="):
        create_replay_buffer(config(path, SAMPLERS["windowed"]))
    create_replay_buffer(config(path, SAMPLERS["in_order"])).close()


def test_the_async_rl_section_selects_kvckpt_for_the_tq_replay_buffer_constructor(tmp_path: Any) -> None:
    """NeMo-RL's own keys where NeMo-RL keeps them, plus ``async_rl.replay_buffer``; then
    ``TQReplayBuffer(dp_client, partition_id=..., pad_value_dict=...)`` exactly as setup.py calls it."""
    master = {"grpo": {"num_generations_per_prompt": 2, "num_prompts_per_step": 4},
              "async_rl": {"sampler": {"name": "in_order", "max_lookahead_versions": 1}, "max_buffered_rollouts": 8,
                           "replay_buffer": {"backend": "kvckpt", "path": str(tmp_path / "r.kv"), "schema": SCHEMA}}}
    cfg = from_master_config(master)
    assert (cfg.buffer.group_size, cfg.buffer.groups_per_step, cfg.buffer.max_buffered_rollouts) == (2, 4, 8)
    with pytest.raises(BadArgument, match=r"no async_rl\.replay_buffer section"):
        from_master_config({"async_rl": {}})
    configure(master)
    buf = TQReplayBuffer(object(), partition_id="rollout_data", pad_value_dict={"token_ids": 0, "input_ids": 0},
                         require_routed_experts=False)
    with buf:
        assert buf.sampler.name == "in_order" and buf.core.path == str(tmp_path / "r.kv")


# -- admission and the ledger ---------------------------------------------------------------------
def test_in_order_admit_stamps_each_batch_and_gates_at_the_lookahead(make: Any) -> None:
    buf = make(SAMPLERS["in_order"])
    assert admit(buf) == 0
    assert admit(buf) == 1
    with pytest.raises(GateTimeout, match=r"dispatch_index 1 >= trainer version 0 \+ 1"):
        admit(buf, timeout=0.02)
    assert buf.sampler.dispatch_index == 1
    assert admit(buf, 1) == 2  # the trainer moved on: the store closes step 0 first
    assert buf.core.trainer_version == 1
    with pytest.raises(BadArgument, match="trainer version 0 is behind the store's 1"):
        select(buf, 0, 1, 1)


@pytest.mark.parametrize("name", ["weight_fifo", "ready_first"])
def test_gated_samplers_without_stamps_return_none_but_advance_the_cursor(make: Any, name: str) -> None:
    buf = make(SAMPLERS[name])
    assert [admit(buf) for _ in range(2)] == [None, None]
    assert buf.sampler.dispatch_index == 1  # the live batch plus W=1 lookahead
    with pytest.raises(GateTimeout):
        admit(buf, timeout=0.01)


def test_windowed_admit_returns_at_once_and_writes_nothing(make: Any) -> None:
    buf = make(SAMPLERS["windowed"])
    before = dump_store(buf.core)
    assert [admit(buf) for _ in range(5)] == [None] * 5
    assert dump_store(buf.core) == before
    gid = buf.reserve(weight_version=0, group_id="w0", prompt_idx=3)
    assert gid == "w0" and [e.group_id for e in buf.ledger.entries()] == ["w0"]
    assert buf.sampler.dispatch_index == -1


def test_ledger_lifecycle_reserve_admit_commit_discard(make: Any) -> None:
    buf = make(SAMPLERS["in_order"])
    for idx, gid in ((70, "batch-0-prompt-70"), (71, "batch-0-prompt-71")):
        buf.ledger.reserve_group(gid, prompt_idx=idx, task_name="math", expected_generations=2)
    with pytest.raises(BadArgument, match="already reserved in the ledger"):
        buf.ledger.reserve_group("batch-0-prompt-70", prompt_idx=70)
    with pytest.raises(BadArgument, match="expected_generations 3 differs from the store's group size 2"):
        buf.ledger.reserve_group("x", prompt_idx=1, expected_generations=3)
    # Reserved (staged) prompts own nothing durable yet: the dataloader state has not moved either.
    assert len(buf.ledger) == 2 and buf.ledger.entries() == [] and buf.core.dataloader_state() is None
    assert [p.prompt_idx for p in buf.ledger.staged()] == [70, 71]

    stamp = admit(buf, dataloader_state=b"epoch0:2")
    entries = buf.ledger.entries()
    assert stamp == 0 and buf.ledger.staged() == []
    assert [(e.group_id, e.prompt_idx, e.task_name, e.target_step, e.phase, e.attempt) for e in entries] == [
        ("batch-0-prompt-70", 70, "math", 0, "admitted", 0), ("batch-0-prompt-71", 71, "math", 0, "admitted", 0)]
    assert len({e.admission_id for e in entries}) == 1
    assert buf.core.dataloader_state() == b"epoch0:2" and buf.sampler.dispatch_index == 0
    assert buf.count_for_target_step(0) == 2 and len(buf) == 0

    assert buf.reserve(weight_version=0, target_step=0, group_id="batch-0-prompt-70") == "batch-0-prompt-70"
    assert len(buf) == 1
    meta = run(buf.commit("batch-0-prompt-70", make_group(2, 1), 0, 0))
    assert meta.sample_ids == ["batch-0-prompt-70_g0", "batch-0-prompt-70_g1"]
    assert meta.tags[1] == {"weight_version": 0} and meta.sequence_lengths == [4, 5]
    group = buf.core.group("batch-0-prompt-70")
    assert (group.prompt_idx, group.task_name, group.target_step) == (70, "math", 0)
    assert [e.group_id for e in buf.ledger.entries()] == ["batch-0-prompt-71"]  # released by the commit
    assert buf.ledger.discard_group("batch-0-prompt-70") is False  # committed: not the ledger's any more

    assert buf.ledger.discard_group("batch-0-prompt-71", reason="data budget spent") is True
    assert buf.ledger.entries() == [] and buf.core.batch_shortfall() == {0: 1}
    tomb = buf.core.group("batch-0-prompt-71")
    assert (tomb.state, tomb.reason) == ("aborted", "data budget spent")
    assert buf.count_for_target_step(0) == 1 and len(buf) == 1
    assert buf.core.store.read(check).ok


def test_admit_batch_is_one_transaction_and_workers_reserve_its_groups(make: Any) -> None:
    buf = make(SAMPLERS["in_order"])
    gids = buf.admit_batch([Prompt(11, "math", "b0-p11"), Prompt(12, "math", "b0-p12")],
                           dataloader_state=b"epoch0:2", timeout=0)
    assert gids == ["b0-p11", "b0-p12"] and buf.sampler.dispatch_index == 0
    assert [(e.group_id, e.target_step, e.prompt_idx) for e in buf.ledger.entries()] == [
        ("b0-p11", 0, 11), ("b0-p12", 0, 12)]
    assert buf.core.dataloader_state() == b"epoch0:2" and buf.core.stats()["admitted"] == 2
    assert buf.admit_batch([1], timeout=0) == ["a1-p0"]  # the lookahead batch
    with pytest.raises(GateTimeout, match="gate closed: dispatch_index 1 >= trainer_version 0 \\+ window 1"):
        buf.admit_batch([2], timeout=0)
    buf.reserve(weight_version=0, target_step=0, group_id="b0-p12")
    commit(buf, "b0-p12", 0)
    assert buf.count_for_target_step(0) == 2 and len(buf) == 1


def test_replacement_prompt_joins_the_current_admission(make: Any) -> None:
    buf = make(SAMPLERS["in_order"], capacity=4)
    produce(buf, ["p0"], 0, leave=("p0",))
    buf.ledger.reserve_group("spare-9", prompt_idx=9, target_step=0, start_weight_version=0)
    first, spare = buf.ledger.entries()
    assert (spare.admission_id, spare.target_step, spare.prompt_idx) == (first.admission_id, 0, 9)
    assert buf.sampler.dispatch_index == 0  # joining consumed no admission
    with pytest.raises(BadArgument, match="no admission is stamped for target_step 5"):
        buf.ledger.reserve_group("spare-10", prompt_idx=10, target_step=5)


def test_split_admission_joins_reserves_to_the_advanced_cursor(make: Any) -> None:
    """NeMo-RL's split: ``sampler.admit`` with nothing staged advances the cursor (transaction 1),
    then each ``reserve`` joins that admission (one more transaction each)."""
    buf = make(SAMPLERS["in_order"])
    with pytest.raises(BadArgument, match=r"stamped for target_step 0: await sampler\.admit first"):
        buf.reserve(weight_version=0, target_step=0)
    assert admit(buf, dataloader_state=b"dl-1") == 0
    assert buf.ledger.entries() == [] and buf.core.dataloader_state() == b"dl-1"
    first = buf.reserve(weight_version=0, target_step=0, prompt_idx=5)
    second = buf.reserve(weight_version=0, target_step=0, prompt_idx=6)
    entries = buf.ledger.entries()
    assert [e.group_id for e in entries] == [first, second] and len(first) == 36
    assert {e.admission_id for e in entries} == {"a0"} and {e.target_step for e in entries} == {0}
    assert buf.core.state()["admissions"] == 1 and buf.sampler.dispatch_index == 0
    with pytest.raises(BadArgument, match="stamped for target_step 1"):
        buf.reserve(weight_version=0, target_step=1)
    assert buf.core.store.read(check).ok


def test_a_join_needs_an_admission_this_store_issued(make: Any) -> None:
    """The core side of the split: ``admit(admission=...)`` refuses admissions the store never made
    and stamps past its cursor, writing nothing."""
    core = make(SAMPLERS["in_order"]).core
    issued = core.advance_dispatch(timeout=0)
    assert (issued.admission_id, issued.dispatch_index, issued.target_step) == ("a0", 0, 0)
    before = dump_store(core)
    with pytest.raises(BadArgument, match=r"admission 'a1' was not issued by this store \(1 admissions so far\)"):
        core.admit([Prompt(1)], admission=Admission("a1", 1, 1))
    with pytest.raises(BadArgument, match="stamped for step 3, past the store's dispatch_index 0"):
        core.admit([Prompt(1)], admission=Admission("a0", 0, 3))
    assert dump_store(core) == before
    [lease] = core.admit([Prompt(1)], admission=issued, timeout=0)
    assert (lease.group_id, lease.admission_id, lease.target_step) == ("a0-s0", "a0", 0)


# -- checkpoint and restore in a fresh process -------------------------------------------------------
def _save_scenario(buf: TQReplayBuffer, dest: str) -> dict[str, Any]:
    """Step 0 trained; step 1's p2, p3 ready; step 2's p4 ready and p5 in flight; checkpoint at version 1."""
    produce(buf, ["p0", "p1"], 0)
    meta, _ = select(buf, 0, 2, 2)
    assert meta.group_ids == ["p0", "p1"]
    buf.finish_train_step()
    produce(buf, ["p2", "p3"], 1)
    stamp = produce(buf, ["p4", "p5"], 1, leave=("p5",), dataloader_state=b"after-batch-2")
    buf.reserve(weight_version=1, target_step=stamp, group_id="p5")
    zombie = buf.handle.held("p5")  # the lease the worker generating p5 holds when the run dies
    result = buf.save_checkpoint(dest, {"step": 1, "sampler_dispatch_index": buf.sampler.dispatch_index})
    return {"zombie": zombie.to_dict(), "dispatch_index": buf.sampler.dispatch_index,
            "checkpoint_id": result.checkpoint_id}


def test_checkpoint_then_restore_in_a_fresh_process_selects_the_restored_groups(tmp_path: Any) -> None:
    """One checkpoint per sampler; one fresh interpreter restores each and trains on."""
    jobs = []
    for name, sampler in SAMPLERS.items():
        cfg = config(str(tmp_path / f"{name}-live.kv"), sampler)
        dest = str(tmp_path / f"{name}-step1.kv")
        with create_replay_buffer(cfg) as buf:
            saved = _save_scenario(buf, dest)
        jobs.append([{**cfg, "path": str(tmp_path / f"{name}-restored.kv")}, dest, saved])
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(jobs)],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    for (name, out), (_, _, saved) in zip(seen.items(), jobs, strict=True):
        stamped = name == "in_order"
        assert out == {
            "trainer_state": {"step": 1, "sampler_dispatch_index": saved["dispatch_index"]},
            "checkpoint_id": saved["checkpoint_id"],
            "resume_version": 1, "dispatch_index": 2 if name != "windowed" else -1,
            "groups_complete_restored": 3, "groups_redispatched": 1,
            "leases": [["p5", 2 if stamped else None, 1, 1]],
            "dataloader_state": "after-batch-2", "evicted": 0, "step1": ["p2", "p3"], "zombie": "StaleAttempt",
            "step2": ["p4", "p5"], "size_after": 0,
        }, name
    assert list(seen) == list(SAMPLERS)


def _child(cfg: dict[str, Any], checkpoint_file: str, saved: dict[str, Any]) -> dict[str, Any]:
    """The fresh process: restore, check the cursor, select what the trainer trains next."""
    buf, plan = restore_replay_buffer(cfg, checkpoint_file)
    with buf:
        buf.sampler.restore_dispatch_index(plan.trainer_state["sampler_dispatch_index"])
        try:
            buf.sampler.restore_dispatch_index(saved["dispatch_index"] + 1)
        except RecoveryError:
            pass
        else:
            raise AssertionError("a skewed cursor was accepted")
        out: dict[str, Any] = {
            "trainer_state": plan.trainer_state, "checkpoint_id": plan.checkpoint_id,
            "resume_version": plan.resume_version, "dispatch_index": buf.sampler.dispatch_index,
            "groups_complete_restored": plan.groups_complete_restored,
            "groups_redispatched": plan.groups_redispatched,
            "leases": [[lease.group_id, lease.target_step, lease.start_weight, lease.attempt] for lease in plan.leases],
            "dataloader_state": plan.dataloader_state.decode(),
            "evicted": run(buf.sampler.evict(current_train_weight=1))}
        meta, _ = select(buf, 1, 1, 2)
        out["step1"] = list(meta.group_ids)
        lease = plan.leases[0]
        buf.reserve(weight_version=lease.start_weight, target_step=lease.target_step, group_id=lease.group_id)
        try:
            buf.core.commit_group(Lease.from_dict(saved["zombie"]), make_group(2, 99))
        except StaleAttempt:  # any of its kinds: the restore started a new timeline too
            out["zombie"] = StaleAttempt.__name__
        commit(buf, lease.group_id, lease.start_weight, seed=3)
        meta, _ = select(buf, 2, 1, 2)  # the store closes step 1 first
        out["step2"] = list(meta.group_ids)
        out["size_after"] = len(buf)
    return out


if __name__ == "__main__":
    jobs = json.loads(sys.argv[1])
    print(json.dumps({cfg["sampler"]["name"]: _child(cfg, dest, saved) for cfg, dest, saved in jobs}))
