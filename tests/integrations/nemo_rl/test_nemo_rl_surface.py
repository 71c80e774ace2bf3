"""The kvckpt NeMo-RL adapter driven exactly as NeMo-RL drives ``TQReplayBuffer`` and its samplers.

Every call below is one NeMo-RL makes, with its keywords and awaits: the SingleController
(``create_sampler(buffer, cfg)``, ``set_dispatch_index``, ``required_buffer_capacity``,
``await sampler.admit(trainer_version_fn=...)``, ``count_for_target_step``,
``promote_ready_group(to_target_step=...)``, ``await sampler.evict/select(current_train_weight=...)``,
``len(buffer)``, ``should_abort_inflight(...)``, ``await buffer.state_dict(saved_capacity=...)`` /
``load_state_dict(...)``), its rollout manager's ``generate_and_push`` retry loop (``reserve``,
``await commit``, ``await remove_group``), and the cases of NeMo-RL's
``tests/unit/single_controller/test_sampler_interface.py`` and ``test_tq_replay_buffer.py``,
rewritten against a real store: where NeMo-RL's tests poke slots into a fake buffer, these reach
the same ``(weight, ready, target_step)`` slots through real admissions and commits. Expected
outcomes are NeMo-RL's; the few deviations (docs/integrations.md) are asserted as such.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from _buffers import dump_store
from _nemo_rl import (
    GRPO,
    N_GENS,
    SAMPLERS,
    SCHEMA,
    Completion,
    PromptGroupRecord,
    add_group,
    batch,
    grpo_record,
    run,
    stamp,
    store_config,
)
from _paths import child_env
from kvckpt.integrations.nemo_rl import (
    InOrderSampler,
    ReadyFirstSampler,
    TQReplayBuffer,
    WeightFifoSampler,
    WindowedSampler,
    configure,
    create_sampler,
)
from kvckpt.integrations.nemo_rl import gate as nemo_rl_gate

from kvckpt import ReplayBuffer, StaleAttempt
from kvckpt import samplers as core_samplers
from kvckpt.durability.verify import check
from kvckpt.errors import BadArgument, CapacityError, RecoveryError, SchemaMismatch
from kvckpt.tables.records import ABORTED


class EchoSampler(core_samplers.InOrderSampler):
    """A user's sampler outside kvckpt, loaded by ``module:Class`` (NeMo-RL's tests' ``EchoSampler``)."""

    name = "echo_in_order"


class NotASampler:
    """A class a ``custom`` target may name by mistake."""


# == test_sampler_interface.py ===================================================================
class TestBuiltinsAndFactory:
    @pytest.mark.parametrize(("name", "cls", "attr", "value"), [
        ("windowed", WindowedSampler, "max_staleness_versions", 3),
        ("in_order", InOrderSampler, "max_lookahead_versions", 2),
        ("weight_fifo", WeightFifoSampler, "max_staleness_versions", 4),
        ("ready_first", ReadyFirstSampler, "max_staleness_versions", 3)])
    def test_config_builds_the_named_sampler(self, make: Any, name: str, cls: type, attr: str, value: int) -> None:
        cfg = {"name": name, attr: value}
        buf = make(cfg, capacity=32)
        s = create_sampler(buf, cfg)
        assert isinstance(s, cls) and getattr(s, attr) == value
        assert s.supports_buffer_checkpoint is True

    @pytest.mark.parametrize("name", list(SAMPLERS))
    def test_every_prompt_group_sampler_member_with_its_keywords(self, make: Any, name: str) -> None:
        """NeMo-RL's ``PromptGroupSampler`` protocol, member by member (what its isinstance checks)."""
        s = create_sampler(make(SAMPLERS[name]), SAMPLERS[name])
        keyword_only = {"admit": ["trainer_version_fn"], "evict": ["current_train_weight"],
                        "select": ["current_train_weight", "min_prompt_groups", "max_prompt_groups"],
                        "should_abort_inflight": ["start_weight_version", "current_train_weight"]}
        for member, names in keyword_only.items():
            params = inspect.signature(getattr(s, member)).parameters
            assert [n for n in names if params[n].kind is inspect.Parameter.KEYWORD_ONLY] == names, member
        for member in ("admit", "select", "evict"):
            assert inspect.iscoroutinefunction(getattr(s, member)), member
        assert isinstance(s.is_on_policy, bool) and callable(s.set_dispatch_index)
        assert isinstance(s.required_buffer_capacity(1), int) and isinstance(s.dispatch_index, int)

    def test_negative_staleness_is_rejected(self, tmp_path: Any) -> None:
        with pytest.raises(ValueError, match="max_staleness_versions"):
            configure(store_config(str(tmp_path / "r.kv"), {"name": "ready_first", "max_staleness_versions": -1}))

    def test_a_pydantic_sampler_config_is_read_through_model_dump(self, make: Any) -> None:
        class InOrderSamplerConfig:  # NeMo-RL's config objects are pydantic models
            def model_dump(self) -> dict[str, Any]:
                return {"name": "in_order", "max_lookahead_versions": 1}

        assert isinstance(create_sampler(make(SAMPLERS["in_order"]), InOrderSamplerConfig()), InOrderSampler)

    def test_a_config_other_than_the_stores_is_refused(self, make: Any) -> None:
        with pytest.raises(BadArgument, match="configured with sampler"):
            create_sampler(make(SAMPLERS["in_order"]), {"name": "windowed", "max_staleness_versions": 1})

    def test_custom_target_loads_out_of_tree_sampler(self, make: Any) -> None:
        cfg = {"name": "custom", "target": f"{__name__}:EchoSampler", "max_lookahead_versions": 1}
        s = create_sampler(make(cfg), cfg)
        assert isinstance(s, InOrderSampler) and s.name == "echo_in_order" and s.max_lookahead_versions == 1
        assert run(s.admit(trainer_version_fn=lambda: 0)) == 0  # stamps as its base does

    def test_custom_sampler_resumes_from_the_seeded_step(self, tmp_path: Any) -> None:
        cfg = {"name": "custom", "target": f"{__name__}:EchoSampler", "max_lookahead_versions": 1}
        buf, s = TestDispatchCursorRestore.seven_steps_then_a_fresh_handle(tmp_path, cfg)
        with buf:
            assert run(s.admit(trainer_version_fn=lambda: 7)) == 7

    @pytest.mark.parametrize(("target", "message"), [
        ("no_colon", "must be 'module:ClassName'"),
        ("no_such_module_kvckpt:X", "cannot import 'no_such_module_kvckpt'"),
        (f"{__name__}:Missing", "has no 'Missing'"), (f"{__name__}:NotASampler", "not a kvckpt.samplers.Sampler")])
    def test_a_bad_custom_target_is_refused_naming_why(self, tmp_path: Any, target: str, message: str) -> None:
        with pytest.raises(BadArgument, match=message):
            configure(store_config(str(tmp_path / "r.kv"), {"name": "custom", "target": target}))
        assert not os.path.exists(tmp_path / "r.kv")

    def test_required_capacity_covers_live_and_lookahead_batches(self, make: Any) -> None:
        s = create_sampler(make({"name": "ready_first", "max_staleness_versions": 2}, capacity=12),
                           {"name": "ready_first", "max_staleness_versions": 2})
        assert s.required_buffer_capacity(groups_per_step=4) == 12
        assert s.is_on_policy is False


class TestAdmission:
    def test_windowed_never_gates_and_never_stamps(self, make: Any) -> None:
        s = create_sampler(make({"name": "windowed", "max_staleness_versions": 2}),
                           {"name": "windowed", "max_staleness_versions": 2})
        assert run(s.admit(trainer_version_fn=lambda: 0)) is None
        assert run(s.admit(trainer_version_fn=lambda: 0)) is None

    def test_in_order_stamps_monotonic_dispatch_index(self, make: Any) -> None:
        s = create_sampler(make({"name": "in_order", "max_lookahead_versions": 5}, capacity=32),
                           {"name": "in_order", "max_lookahead_versions": 5})
        assert run(s.admit(trainer_version_fn=lambda: 10)) == 0
        assert run(s.admit(trainer_version_fn=lambda: 10)) == 1

    def test_weight_fifo_gates_on_lookahead_and_does_not_stamp(self, make: Any) -> None:
        s = create_sampler(make({"name": "weight_fifo", "max_staleness_versions": 0}),
                           {"name": "weight_fifo", "max_staleness_versions": 0})
        assert run(s.admit(trainer_version_fn=lambda: 0)) is None
        with pytest.raises(asyncio.TimeoutError):
            run(asyncio.wait_for(s.admit(trainer_version_fn=lambda: 0), timeout=0.05))

    def test_ready_first_opens_one_more_batch_after_trainer_advances(self, make: Any) -> None:
        trainer_version = 0
        s = create_sampler(make(SAMPLERS["ready_first"]), SAMPLERS["ready_first"])
        assert run(s.admit(trainer_version_fn=lambda: trainer_version)) is None
        assert run(s.admit(trainer_version_fn=lambda: trainer_version)) is None
        with pytest.raises(asyncio.TimeoutError):
            run(asyncio.wait_for(s.admit(trainer_version_fn=lambda: trainer_version), timeout=0.05))
        trainer_version = 1
        assert run(s.admit(trainer_version_fn=lambda: trainer_version)) is None
        with pytest.raises(asyncio.TimeoutError):
            run(asyncio.wait_for(s.admit(trainer_version_fn=lambda: trainer_version), timeout=0.05))

    def test_a_closed_gate_never_blocks_the_event_loop(self, make: Any) -> None:
        """Issue 17 item 1: the train step that opens the gate runs on the same loop while admit waits."""
        buf = make(SAMPLERS["in_order"])
        s = create_sampler(buf, SAMPLERS["in_order"])
        trainer = {"version": 0}
        order: list[str] = []

        async def train_step() -> None:
            while len(order) < 1:  # runs only if admit yields to the loop while it waits
                await asyncio.sleep(0)
            trainer["version"] = 1
            order.append("trained")

        async def main() -> list[Any]:
            assert await s.admit(trainer_version_fn=lambda: trainer["version"]) == 0
            assert await s.admit(trainer_version_fn=lambda: trainer["version"]) == 1
            waiting = asyncio.create_task(s.admit(trainer_version_fn=lambda: trainer["version"]))
            await asyncio.sleep(0)
            order.append("admit waiting")
            stamp_, _ = await asyncio.wait_for(asyncio.gather(waiting, train_step()), timeout=60)
            return [stamp_, order]

        assert run(main()) == [2, ["admit waiting", "trained"]]
        assert buf.core.trainer_version == 1  # the store followed the trainer (one finish_step)

    def test_the_train_pumps_next_sampler_call_wakes_the_gate(self, make: Any, monkeypatch: Any) -> None:
        """The wait is an event: with the re-read fallback pushed out of reach, the train pump's
        ``evict`` with the new version is what opens the gate."""
        monkeypatch.setattr(nemo_rl_gate, "RECHECK_SECONDS", 1e6)
        buf = make(SAMPLERS["in_order"])
        s = create_sampler(buf, SAMPLERS["in_order"])
        trainer = {"version": 0}

        async def main() -> int:
            await s.admit(trainer_version_fn=lambda: trainer["version"])
            await s.admit(trainer_version_fn=lambda: trainer["version"])
            waiting = asyncio.create_task(s.admit(trainer_version_fn=lambda: trainer["version"]))
            await asyncio.sleep(0)
            trainer["version"] = 1
            await s.evict(current_train_weight=trainer["version"])  # the train pump's next call
            return await asyncio.wait_for(waiting, timeout=60)

        assert run(main()) == 2


class TestInOrderEvictMatchesSelect:
    def test_future_target_not_evicted_even_if_weight_out_of_window(self, make: Any) -> None:
        buf = make(SAMPLERS["in_order"])
        s = create_sampler(buf, SAMPLERS["in_order"])
        stamp(buf, s, 2)
        add_group(buf, 0, target_step=2)
        assert run(s.evict(current_train_weight=2)) == 0
        assert buf.target_step_list == [2]

    def test_past_target_ready_slot_is_evicted(self, make: Any) -> None:
        buf = make(SAMPLERS["in_order"])
        s = create_sampler(buf, SAMPLERS["in_order"])
        stamp(buf, s, 1)
        add_group(buf, 0, target_step=1)
        assert run(s.evict(current_train_weight=3)) == 1
        assert buf.size() == 0

    def test_unready_slot_is_never_evicted(self, make: Any) -> None:
        buf = make(SAMPLERS["in_order"])
        s = create_sampler(buf, SAMPLERS["in_order"])
        stamp(buf, s, 1)
        buf.reserve(weight_version=0, target_step=1)
        assert run(s.evict(current_train_weight=5)) == 0
        assert buf.ready_list == [False]


class TestSelect:
    def test_windowed_selects_ready_groups_in_window(self, make: Any) -> None:
        buf = make({"name": "windowed", "max_staleness_versions": 2})
        s = create_sampler(buf, {"name": "windowed", "max_staleness_versions": 2})
        for w in (3, 5, 1):
            add_group(buf, w)
        meta, n = run(s.select(current_train_weight=5, min_prompt_groups=1, max_prompt_groups=8))
        assert n == 2 and buf.start_weight_list == [1]
        assert meta.sample_ids[0].rpartition("_g")[0] == meta.group_ids[0] and len(meta.sequence_lengths) == 4

    def test_windowed_below_min_returns_none_and_unready_is_excluded(self, make: Any) -> None:
        buf = make({"name": "windowed", "max_staleness_versions": 2})
        s = create_sampler(buf, {"name": "windowed", "max_staleness_versions": 2})
        add_group(buf, 5)
        assert run(s.select(current_train_weight=5, min_prompt_groups=2, max_prompt_groups=8)) == (None, 0)
        buf.reserve(weight_version=5)
        assert run(s.select(current_train_weight=5, min_prompt_groups=2, max_prompt_groups=8)) == (None, 0)

    def test_windowed_freshest_first_orders_by_lag(self, make: Any) -> None:
        cfg = {"name": "windowed", "max_staleness_versions": 10, "sample_freshest_first": True}
        buf = make(cfg, capacity=32)
        s = create_sampler(buf, cfg)
        add_group(buf, 1)
        add_group(buf, 5)
        _, n = run(s.select(current_train_weight=5, min_prompt_groups=1, max_prompt_groups=1))
        assert n == 1 and buf.start_weight_list == [1]

    def test_weight_fifo_drains_oldest_in_window_weight_first_and_waits_for_it(self, make: Any) -> None:
        cfg = {"name": "weight_fifo", "max_staleness_versions": 5}
        buf = make(cfg, capacity=32)
        s = create_sampler(buf, cfg)
        run(s.admit(trainer_version_fn=lambda: 0))
        for w in (3, 5, 3):
            add_group(buf, w)
        _, n = run(s.select(current_train_weight=5, min_prompt_groups=1, max_prompt_groups=8))
        assert n == 2 and buf.start_weight_list == [5]
        add_group(buf, 4)
        buf.reserve(weight_version=4)  # the oldest weight's batch is not full yet: wait, do not skip ahead
        assert run(s.select(current_train_weight=5, min_prompt_groups=2, max_prompt_groups=8)) == (None, 0)

    def test_weight_fifo_empty_window_returns_none(self, make: Any) -> None:
        cfg = {"name": "weight_fifo", "max_staleness_versions": 2}
        buf = make(cfg)
        s = create_sampler(buf, cfg)
        run(s.admit(trainer_version_fn=lambda: 0))
        add_group(buf, 9)
        assert run(s.select(current_train_weight=5, min_prompt_groups=1, max_prompt_groups=8)) == (None, 0)

    def test_ready_first_mixes_ready_weight_versions_in_buffer_order(self, make: Any) -> None:
        buf = make(SAMPLERS["ready_first"])
        s = create_sampler(buf, SAMPLERS["ready_first"])
        run(s.admit(trainer_version_fn=lambda: 0))
        gids = [add_group(buf, w).group_ids[0] for w in (1, 3, 2, 4)]
        meta, n = run(s.select(current_train_weight=3, min_prompt_groups=3, max_prompt_groups=3))
        assert n == 3 and meta.group_ids == gids[:3] and buf.start_weight_list == [4]

    def test_ready_first_never_evicts_a_late_straggler(self, make: Any) -> None:
        buf = make(SAMPLERS["ready_first"])
        s = create_sampler(buf, SAMPLERS["ready_first"])
        run(s.admit(trainer_version_fn=lambda: 0))
        gid = add_group(buf, 0).group_ids[0]
        assert run(s.evict(current_train_weight=5)) == 0
        meta, n = run(s.select(current_train_weight=5, min_prompt_groups=1, max_prompt_groups=1))
        assert (n, meta.sample_ids) == (1, [f"{gid}_g0", f"{gid}_g1"])

    def test_in_order_matches_target_step_ignoring_weight_window(self, make: Any) -> None:
        buf = make(SAMPLERS["in_order"])
        s = create_sampler(buf, SAMPLERS["in_order"])
        stamp(buf, s, 5)
        add_group(buf, 100, target_step=5)
        stamp(buf, s, 6)
        add_group(buf, 5, target_step=6)
        _, n = run(s.select(current_train_weight=5, min_prompt_groups=1, max_prompt_groups=8))
        assert n == 1 and buf.target_step_list == [6]  # the step-6 group is not selected at 5
        assert run(s.select(current_train_weight=5, min_prompt_groups=1, max_prompt_groups=8)) == (None, 0)

    @pytest.mark.parametrize(("lo", "hi", "message"), [(0, 1, "min_prompt_groups must be >= 1"),
                                                        (3, 2, r"max_prompt_groups \(2\) must be >=")])
    def test_group_bounds_raise_value_error(self, make: Any, lo: int, hi: int, message: str) -> None:
        s = create_sampler(make(), SAMPLERS["windowed"])
        with pytest.raises(ValueError, match=message):
            run(s.select(current_train_weight=0, min_prompt_groups=lo, max_prompt_groups=hi))

    def test_windowed_evict_drops_ready_below_window_and_skips_unready(self, make: Any) -> None:
        buf = make()
        s = create_sampler(buf, SAMPLERS["windowed"])
        add_group(buf, 0)
        add_group(buf, 5)
        buf.reserve(weight_version=0)
        assert run(s.evict(current_train_weight=5)) == 1
        assert buf.start_weight_list == [5, 0] and buf.ready_list == [True, False]


class TestDispatchCursorRestore:
    def test_fresh_start_is_a_noop_seed(self, make: Any) -> None:
        s = create_sampler(make(SAMPLERS["in_order"]), SAMPLERS["in_order"])
        s.set_dispatch_index(0)
        s.set_dispatch_index(resume_from_trainer_version=0)  # #3480's keyword
        assert run(s.admit(trainer_version_fn=lambda: 0)) == 0

    def test_negative_resume_step_rejected(self, make: Any) -> None:
        with pytest.raises(ValueError, match="resume_from_step"):
            create_sampler(make(), SAMPLERS["windowed"]).set_dispatch_index(-1)

    @staticmethod
    def seven_steps_then_a_fresh_handle(tmp_path: Any, sampler: dict[str, Any]) -> tuple[TQReplayBuffer, Any]:
        """Seven real steps (one batch each), the handle gone, a fresh one seeded at step 7."""
        cfg = store_config(str(tmp_path / "r.kv"), sampler)
        buf = TQReplayBuffer(None, partition_id="rollout_data", pad_value_dict={}, config=cfg)
        s = create_sampler(buf, sampler)
        for step in range(7):
            t = run(s.admit(trainer_version_fn=lambda step=step: step))
            add_group(buf, step, target_step=t)
            run(s.select(current_train_weight=step, min_prompt_groups=1, max_prompt_groups=1))
        run(s.evict(current_train_weight=7))
        buf.close()
        buf = TQReplayBuffer(None, partition_id="rollout_data", pad_value_dict={}, config=cfg)
        s = create_sampler(buf, sampler)
        s.set_dispatch_index(7)
        return buf, s

    def test_resumed_in_order_stamps_from_trainer_version(self, tmp_path: Any) -> None:
        buf, s = self.seven_steps_then_a_fresh_handle(tmp_path, SAMPLERS["in_order"])
        with buf:
            assert run(s.admit(trainer_version_fn=lambda: 7)) == 7
            assert run(s.admit(trainer_version_fn=lambda: 8)) == 8

    def test_resumed_gate_admits_window_then_blocks(self, tmp_path: Any) -> None:
        buf, s = self.seven_steps_then_a_fresh_handle(tmp_path, {"name": "weight_fifo", "max_staleness_versions": 0})
        with buf:
            assert run(s.admit(trainer_version_fn=lambda: 7)) is None
            with pytest.raises(asyncio.TimeoutError):
                run(asyncio.wait_for(s.admit(trainer_version_fn=lambda: 7), timeout=0.05))

    def test_a_store_behind_the_resumed_step_refuses_admission_until_loaded(self, make: Any) -> None:
        s = create_sampler(make(SAMPLERS["in_order"]), SAMPLERS["in_order"])
        s.set_dispatch_index(7)
        with pytest.raises(RecoveryError, match="load_state_dict"):
            run(s.admit(trainer_version_fn=lambda: 7))


class TestInflightAbortPolicy:
    def test_windowed_aborts_only_below_weight_window(self, make: Any) -> None:
        cfg = {"name": "windowed", "max_staleness_versions": 2}
        s = create_sampler(make(cfg), cfg)
        assert s.should_abort_inflight(start_weight_version=2, current_train_weight=5)
        assert not s.should_abort_inflight(start_weight_version=3, current_train_weight=5)

    def test_abort_stale_inflight_gives_up_what_should_abort_inflight_names(self, make: Any) -> None:
        """kvckpt's one-transaction form of the controller's ``_abort_stale_inflight``."""
        buf = make()
        s = create_sampler(buf, SAMPLERS["windowed"])
        stale, fresh = buf.reserve(weight_version=0), buf.reserve(weight_version=4)
        run(s.evict(current_train_weight=5))  # the store follows the trainer to version 5
        verdicts = [s.should_abort_inflight(start_weight_version=w, current_train_weight=5) for w in (0, 4)]
        assert verdicts == [True, False]
        assert buf.abort_stale_inflight() == [stale]
        assert buf._group_ids == [fresh] and buf.core.group(stale).state == ABORTED

    @pytest.mark.parametrize("name", ["weight_fifo", "in_order"])
    def test_gated_samplers_never_abort_inflight(self, make: Any, name: str) -> None:
        s = create_sampler(make(SAMPLERS[name]), SAMPLERS[name])
        assert not s.should_abort_inflight(start_weight_version=0, current_train_weight=5)


# == test_tq_replay_buffer.py ====================================================================
class TestReserveCommit:
    def test_reserve_appends_placeholder_unready(self, make: Any) -> None:
        buf = make()
        group_id = buf.reserve(weight_version=3)
        assert isinstance(group_id, str) and group_id
        assert (buf.size(), buf.start_weight_list, buf.end_weight_list) == (1, [3], [-1])
        assert (buf.ready_list, buf.meta_list) == ([False], [None])

    def test_commit_writes_rows_then_fills_meta(self, make: Any) -> None:
        buf = make()
        group_id = buf.reserve(weight_version=3)
        meta = run(buf.commit(group_id, batch(), start_weight_version=3, end_weight_version=4))
        head, _, idx = meta.sample_ids[0].rpartition("_g")
        assert len(meta.sample_ids) == N_GENS and head == group_id and idx == "0"
        assert (buf.start_weight_list, buf.end_weight_list, buf.ready_list) == ([3], [4], [True])
        assert buf.meta_list[0].sample_ids == meta.sample_ids
        assert meta.tags == [{"weight_version": 3}] * N_GENS  # a list, as KVBatchMeta's (TQRB l.259)
        assert meta.sequence_lengths == [3, 3]
        rows = buf.get_samples(meta, ["input_ids"]).tensors["input_ids"]
        assert rows.tolist() == [[1, 1, 1], [1, 1, 1]]

    def test_commit_tensorises_a_prompt_group_record(self, tmp_path: Any) -> None:
        buf = TQReplayBuffer(None, partition_id="rollout_data", pad_value_dict={"input_ids": 99},
                             config=store_config(str(tmp_path / "r.kv"), SAMPLERS["windowed"], schema=GRPO))
        with buf:
            gid = buf.reserve(weight_version=0, prompt_idx=41, task_name="math")
            meta = run(buf.commit(gid, grpo_record(41), start_weight_version=0, end_weight_version=1))
            assert meta.sequence_lengths == [4, 5]
            got = buf.get_samples(meta)
            assert got.tensors["input_ids"].tolist() == [[1, 2, 7, 8, 99], [1, 2, 7, 8, 9]]
            assert got.tensors["token_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
            assert got.tensors["total_reward"].tolist() == [0.0, 1.0]
            assert (buf.core.group(gid).prompt_idx, buf.core.group(gid).task_name) == (41, "math")

    def test_a_failed_commit_writes_nothing_and_leaves_the_slot(self, make: Any) -> None:
        buf = make()
        group_id = buf.reserve(weight_version=3)
        before = dump_store(buf.core)
        with pytest.raises(SchemaMismatch):
            run(buf.commit(group_id, {**batch(), "total_reward": torch.zeros(N_GENS + 1)},
                           start_weight_version=3, end_weight_version=3))
        assert dump_store(buf.core) == before
        assert (buf.size(), buf.ready_list, buf.meta_list) == (1, [False], [None])

    @pytest.mark.parametrize("record", [
        PromptGroupRecord(0, [], None, {}, []),  # no completions
        PromptGroupRecord(0, [], None, {}, [Completion([{"role": "user", "token_ids": "abc"}], 0.0)] * N_GENS),
        {**batch(), "input_ids": torch.ones(N_GENS, dtype=torch.long)},  # a token field without a token axis
        {**batch(), "input_lengths": torch.full((N_GENS,), 9, dtype=torch.long)},  # longer than the rows
        "not a record"])
    def test_a_record_that_does_not_tensorise_is_refused_before_writing(self, make: Any, record: Any) -> None:
        buf = make()
        group_id = buf.reserve(weight_version=0)
        before = dump_store(buf.core)
        with pytest.raises(SchemaMismatch):
            run(buf.commit(group_id, record, start_weight_version=0, end_weight_version=0))
        assert dump_store(buf.core) == before and buf.ready_list == [False]

    def test_commit_requires_routed_experts_before_writing(self, tmp_path: Any) -> None:
        """NeMo-RL's RuntimeError at commit, nothing written; a schema and record with the field commit."""
        routed = {**SCHEMA, "routed_experts": ("int64", "token")}
        for schema, record, fails in ((SCHEMA, batch(), True), (routed, batch(), True),
                                      (routed, {**batch(), "routed_experts": torch.ones((N_GENS, 3), dtype=torch.long)},
                                       False)):
            configure(store_config(str(tmp_path / f"r{len(schema)}{fails}.kv"), SAMPLERS["windowed"], schema=schema))
            with TQReplayBuffer(object(), partition_id="rollout_data", pad_value_dict={"token_ids": 0},
                                require_routed_experts=True) as buf:
                group_id = buf.reserve(weight_version=3)
                before = dump_store(buf.core)
                if not fails:
                    run(buf.commit(group_id, record, start_weight_version=3, end_weight_version=3))
                    assert buf.ready_list == [True]
                    continue
                with pytest.raises(RuntimeError, match=r"router_replay\.enabled=true requires routed_experts"):
                    run(buf.commit(group_id, record, start_weight_version=3, end_weight_version=3))
                assert dump_store(buf.core) == before and buf.ready_list == [False]

    def test_commit_raises_for_unknown_group_id_before_writing(self, make: Any) -> None:
        buf = make()
        buf.reserve(weight_version=3)
        before = dump_store(buf.core)
        with pytest.raises(ValueError, match="reserve"):
            run(buf.commit("not-a-real-id", batch(), start_weight_version=3, end_weight_version=3))
        assert dump_store(buf.core) == before

    def test_reserve_then_commit_preserves_dispatch_order(self, make: Any) -> None:
        buf = make()
        gids = [buf.reserve(weight_version=w) for w in (1, 2, 3)]
        for i in (2, 0, 1):
            run(buf.commit(gids[i], batch(), start_weight_version=i + 1, end_weight_version=i + 1))
        assert (buf.size(), buf.start_weight_list, buf.ready_list) == (3, [1, 2, 3], [True] * 3)
        assert buf._group_ids == gids
        assert [m.sample_ids[0] for m in buf.meta_list] == [f"{g}_g0" for g in gids]


class TestRemove:
    def test_remove_drops_indices_and_their_rows(self, make: Any) -> None:
        buf = make()
        metas = [add_group(buf, 1) for _ in range(3)]
        assert run(buf.remove([0, 2], remove_in_dp=True)) == 2
        assert buf.size() == 1 and buf.meta_list[0].sample_ids == metas[1].sample_ids
        assert [buf.core.group(m.group_ids[0]).rows_stored for m in metas] == [False, True, False]

    def test_remove_rejects_out_of_range_before_mutating(self, make: Any) -> None:
        buf = make()
        add_group(buf, 1)
        add_group(buf, 2)
        before = dump_store(buf.core)
        with pytest.raises(IndexError, match=r"out of range: 5; size=2"):
            run(buf.remove([0, 5], remove_in_dp=True))
        assert dump_store(buf.core) == before and buf.size() == 2

    def test_remove_empty_is_noop_and_size_tracks_len(self, make: Any) -> None:
        buf = make()
        assert (buf.size(), len(buf)) == (0, 0)
        add_group(buf, 1)
        buf.reserve(weight_version=1)
        assert (buf.size(), len(buf)) == (2, 2)
        assert run(buf.remove([], remove_in_dp=True)) == 0
        assert run(buf.remove([0], remove_in_dp=True)) == 1
        assert (buf.size(), len(buf)) == (1, 1)

    def test_remove_without_dp_keeps_the_rows_of_a_ready_slot_until_the_step_closes(self, make: Any) -> None:
        """A NeMo-RL sampler's select: the slots leave, the rows stay readable (the current step
        claims them, one transaction) until the trainer's next version consumes them."""
        buf = make()
        metas = [add_group(buf, 1) for _ in range(3)]
        before = buf.core.trainer_version
        assert run(buf.remove([0, 2], remove_in_dp=False)) == 2
        assert buf.size() == 1 and buf.meta_list[0].sample_ids == metas[1].sample_ids
        taken = [metas[0].group_ids[0], metas[2].group_ids[0]]
        assert [buf.core.group(g).state for g in taken] == ["claimed", "claimed"]
        assert buf.get_samples(metas[0].concat(metas[2])).tensors["input_ids"].shape == (2 * N_GENS, 3)
        assert buf.finish_train_step() == before + 1
        assert [buf.core.group(g).state for g in taken] == ["consumed", "consumed"]
        assert buf.core.group(metas[1].group_ids[0]).state == "ready"

    def test_remove_without_dp_claims_for_the_current_step_only_a_restart_returns_it(self, make: Any,
                                                                                        tmp_path: Any) -> None:
        """The claim is the current step's: a restart before the step closes gives the group back."""
        buf = make()
        meta = add_group(buf, 1)
        assert run(buf.remove([0], remove_in_dp=False)) == 1
        assert (buf.size(), buf.core.group(meta.group_ids[0]).state) == (0, "claimed")
        with pytest.raises(ValueError, match="unknown group_id"):  # it has no slot any more
            run(buf.remove_group(meta.group_ids[0]))
        buf.close()
        fresh = TQReplayBuffer(object(), partition_id="rollout_data",
                               config=store_config(str(tmp_path / "replay0.kv"), SAMPLERS["windowed"]))
        with fresh:
            create_sampler(fresh, SAMPLERS["windowed"]).set_dispatch_index(0)
            assert fresh.ready_list == [True] and fresh._group_ids == meta.group_ids

    def test_remove_group_without_dp_refuses_a_committed_group(self, make: Any) -> None:
        """Deviation: the rollout manager's call for a failed attempt does not claim a committed
        group for a step that would not train it."""
        buf = make()
        meta = add_group(buf, 1)
        before = dump_store(buf.core)
        with pytest.raises(ValueError, match="not a failed attempt"):
            run(buf.remove_group(meta.group_ids[0]))
        assert dump_store(buf.core) == before and buf.size() == 1

    def test_remove_group_of_an_unknown_id_raises_value_error(self, make: Any) -> None:
        with pytest.raises(ValueError, match="unknown group_id"):
            run(make().remove_group("nope"))


class TestTargetSteps:
    def test_count_for_target_step_includes_reserved_slots(self, make: Any) -> None:
        buf = make(SAMPLERS["in_order"])
        s = create_sampler(buf, SAMPLERS["in_order"])
        stamp(buf, s, 5)
        add_group(buf, 0, target_step=5)
        buf.reserve(weight_version=0, target_step=5)
        stamp(buf, s, 6)
        add_group(buf, 0, target_step=6)
        assert [buf.count_for_target_step(t) for t in (5, 6, 7)] == [2, 1, 0]

    def test_the_furthest_step_lends_and_an_unready_group_is_not_borrowed(self, make: Any) -> None:
        buf = make(SAMPLERS["in_order"])
        s = create_sampler(buf, SAMPLERS["in_order"])
        stamp(buf, s, 6)
        add_group(buf, 0, target_step=6)
        stamp(buf, s, 7)
        add_group(buf, 0, target_step=7)
        buf.reserve(weight_version=0, target_step=7)
        assert buf.promote_ready_group(to_target_step=6) == 7
        assert buf.target_step_list == [6, 6, 7]
        assert buf.promote_ready_group(to_target_step=6) is None  # step 7's last slot is unready

    def test_only_later_steps_lend_and_borrowing_twice_takes_two_groups(self, make: Any) -> None:
        buf = make(SAMPLERS["in_order"])
        s = create_sampler(buf, SAMPLERS["in_order"])
        assert buf.promote_ready_group(to_target_step=5) is None  # an empty buffer has nothing to lend
        stamp(buf, s, 4)
        add_group(buf, 0, target_step=4)
        stamp(buf, s, 5)
        add_group(buf, 0, target_step=5)
        assert buf.promote_ready_group(to_target_step=5) is None
        stamp(buf, s, 6)
        add_group(buf, 0, target_step=6)
        add_group(buf, 0, target_step=6)
        assert buf.promote_ready_group(to_target_step=5) == 6
        assert buf.promote_ready_group(to_target_step=5) == 6
        assert buf.promote_ready_group(to_target_step=5) is None
        assert buf.count_for_target_step(5) == 3 and buf.target_step_list == [4, 5, 5, 5]

    def test_unstamped_groups_are_never_borrowed(self, make: Any) -> None:
        buf = make()
        add_group(buf, 0)
        assert buf.promote_ready_group(to_target_step=5) is None
        assert buf.target_step_list == [None]


# == state_dict / load_state_dict (the controller's checkpoint and restore) =======================
def _child_restore(cfg: dict[str, Any], state_file: str, step: int) -> dict[str, Any]:
    """A fresh process on a fresh live path: NeMo-RL's restore order, then one train step."""
    buf = TQReplayBuffer(None, partition_id="rollout_data", pad_value_dict={}, config=cfg)
    sampler = create_sampler(buf, cfg["sampler"])
    sampler.set_dispatch_index(step)
    state = torch.load(state_file, weights_only=True)
    restored = run(buf.load_state_dict(state, max_groups=cfg["max_buffered_rollouts"],
                                       expected_partition_id="rollout_data", expected_group_size=N_GENS))
    out = {"restored": restored, "slots": [buf.start_weight_list, buf.end_weight_list, buf.target_step_list],
           "ledger": [[lease.group_id, lease.target_step] for lease in buf.handle.idle_leases()]}
    meta, n = run(sampler.select(current_train_weight=step, min_prompt_groups=1, max_prompt_groups=8))
    out["selected"] = sorted(meta.group_ids) if n else []
    out["next_stamp"] = run(sampler.admit(trainer_version_fn=lambda: step + 1))
    buf.close()
    return out


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_state_dict_round_trip_in_a_fresh_process(tmp_path: Any, name: str) -> None:
    """Checkpoint at step 1 with two ready groups and one in flight; a new process restores it."""
    cfg = store_config(str(tmp_path / "live.kv"), SAMPLERS[name])
    buf = TQReplayBuffer(None, partition_id="rollout_data", pad_value_dict={}, config=cfg)
    sampler = create_sampler(buf, SAMPLERS[name])
    sampler.set_dispatch_index(0)
    t = run(sampler.admit(trainer_version_fn=lambda: 0))
    add_group(buf, 0, target_step=t)
    add_group(buf, 0, target_step=t)
    run(sampler.select(current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2))
    buf.ledger.reserve_group("p-inflight", prompt_idx=9)  # leaves the dataloader; admitted with the batch
    t = run(sampler.admit(trainer_version_fn=lambda: 1, weight_version=1))
    ready = [add_group(buf, 1, end_weight=2, target_step=t).group_ids[0] for _ in range(2)]
    state = run(buf.state_dict(saved_capacity=16))
    torch.save(state, str(tmp_path / "replay_buffer.pt"))
    assert len(buf.ledger.entries()) == 1 and os.path.getsize(tmp_path / "replay_buffer.pt") < 4096
    assert [g["group_id"] for g in state["groups"]] == ready
    buf.close()
    os.unlink(cfg["path"])  # a new machine: only the checkpoint directory survives
    child = {**cfg, "path": str(tmp_path / "new-live.kv")}
    argv = [sys.executable, os.path.abspath(__file__), json.dumps([child, str(tmp_path / "replay_buffer.pt"), 1])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    stamped = name == "in_order"
    assert out == {"restored": 2, "slots": [[1, 1], [2, 2], [1, 1] if stamped else [None, None]],
                   "ledger": [["p-inflight", 1 if stamped else None]], "selected": sorted(ready),
                   "next_stamp": 2 if stamped else None}


def test_state_dict_skips_pending_slots_and_an_empty_buffer_round_trips(make: Any) -> None:
    kwargs = {"max_groups": 16, "expected_partition_id": "rollout_data", "expected_group_size": N_GENS}
    buf = make()
    empty = run(buf.state_dict(saved_capacity=16))
    assert empty["groups"] == []
    assert run(make().load_state_dict(empty, **kwargs)) == 0
    first = add_group(buf, 1).group_ids[0]
    buf.reserve(weight_version=2)  # in flight, sandwiched: in the file's ledger, not in "groups"
    last = add_group(buf, 3).group_ids[0]
    state = run(buf.state_dict(saved_capacity=16))
    assert [(g["group_id"], g["start_weight"]) for g in state["groups"]] == [(first, 1), (last, 3)]
    assert [g["sequence_lengths"] for g in state["groups"]] == [[3, 3], [3, 3]]  # the groups' KVBatchMeta lengths
    assert state["saved_capacity"] == 16 and state["partition_id"] == "rollout_data"
    with pytest.raises(RecoveryError, match="a later save of the same step replaced it"):
        run(buf.load_state_dict(empty, **kwargs))  # the step-0 file now holds the second save


def test_state_dict_follows_the_trainer_version_the_controller_already_advanced(make: Any) -> None:
    """The controller saves right after ``self._trainer_version += 1``, before any sampler call."""
    buf = make(SAMPLERS["in_order"])
    s = create_sampler(buf, SAMPLERS["in_order"])
    trainer = {"version": 0}
    t = run(s.admit(trainer_version_fn=lambda: trainer["version"]))
    add_group(buf, 0, target_step=t)
    add_group(buf, 0, target_step=t)
    run(s.select(current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2))
    trainer["version"] = 1
    state = run(buf.state_dict(saved_capacity=16))
    assert state["trainer_version"] == 1 == buf.core.trainer_version
    assert state["checkpoint_file"].endswith("step_1.kv") and state["groups"] == []


def test_load_state_dict_validates_the_envelope_first(make: Any) -> None:
    buf = make()
    add_group(buf, 0)
    state = run(buf.state_dict(saved_capacity=16))
    before = dump_store(buf.core)
    kwargs = {"max_groups": 16, "expected_partition_id": "rollout_data", "expected_group_size": N_GENS}
    cases = [({k: v for k, v in state.items() if k != "groups"}, {}, ValueError, "missing required keys"),
             ({**state, "backend": "tq"}, {}, ValueError, "backend 'tq'"),
             (state, {"expected_partition_id": "other"}, ValueError, "partition_id mismatch"),
             (state, {"expected_group_size": 3}, ValueError, "misaligned.*expected_group_size=3"),
             ({**state, "groups": [{**state["groups"][0], "sequence_lengths": [3]}]}, {}, ValueError,
              "misaligned: 2 sample_ids and 1 sequence_lengths"),
             ({**state, "groups": state["groups"] * 2}, {}, ValueError, "duplicate sample_id"),
             ({**state, "groups": [{"group_id": "g"}]}, {}, ValueError, "group missing keys"),
             (state, {"max_groups": 0}, CapacityError, "max_buffered_rollouts=0 is below")]
    for bad, override, exc, message in cases:
        with pytest.raises(exc, match=message):
            run(buf.load_state_dict(bad, **{**kwargs, **override}))
    assert dump_store(buf.core) == before


def test_a_smaller_capacity_keeps_the_freshest_unstamped_groups(make: Any, caplog: Any) -> None:
    """NeMo-RL's truncation on resume: the oldest groups are dropped (evicted, recorded), the
    freshest kept in order, the capacity switched; a second call (the crash path) changes nothing."""
    kwargs = {"expected_partition_id": "rollout_data", "expected_group_size": N_GENS}
    buf = make(SAMPLERS["windowed"], per_step=1)
    gids = [add_group(buf, w).group_ids[0] for w in (1, 2, 3)]
    state = run(buf.state_dict(saved_capacity=16))
    fresh = make(SAMPLERS["windowed"], per_step=1)  # another live path: the file is restored into it
    with caplog.at_level(logging.WARNING, logger="kvckpt.integrations.nemo_rl"):
        assert run(fresh.load_state_dict(state, max_groups=2, **kwargs)) == 2
    assert "capacity changed to max_buffered_rollouts=2" in caplog.text
    assert (fresh.start_weight_list, fresh._group_ids) == ([2, 3], gids[1:])
    assert fresh.core.config.max_buffered_rollouts == 2 and fresh.core.group(gids[0]).state == "evicted"
    assert run(fresh.load_state_dict(state, max_groups=2, **kwargs)) == 2
    assert fresh._group_ids == gids[1:] and fresh.core.store.read(lambda txn: check(txn).ok)


def test_over_capacity_target_stamped_groups_are_refused_before_anything_changes(make: Any) -> None:
    buf = make(SAMPLERS["in_order"], per_step=1, capacity=4)
    s = create_sampler(buf, SAMPLERS["in_order"])
    for _ in range(2):
        t = run(s.admit(trainer_version_fn=lambda: 0))
        add_group(buf, 0, target_step=t)
    state = run(buf.state_dict(saved_capacity=4))
    fresh = make(SAMPLERS["in_order"], per_step=1, capacity=4)
    before = dump_store(fresh.core)
    with pytest.raises(CapacityError, match=r"target_step stamps.*max_buffered_rollouts >= 2"):
        run(fresh.load_state_dict(state, max_groups=1, expected_partition_id="rollout_data",
                                  expected_group_size=N_GENS))
    assert dump_store(fresh.core) == before


# == generate_and_push's retry loop under failures ===============================================
class InfraError(RuntimeError):
    """A failure NeMo-RL classifies as infrastructure (retried on another shard)."""


class DataError(ValueError):
    """A deterministic failure (its own, smaller budget)."""


async def generate_and_push(buf: TQReplayBuffer, weight: dict[str, int], prompt_idx: int, target_step: int | None,
                            failures: list[type[Exception] | None], stats: dict[str, int],
                            max_infra: int = 3, max_data: int = 2) -> str:
    """NeMo-RL's retry loop, call for call: a fresh ``reserve`` per attempt, ``commit``, and
    ``remove_group`` of the failed attempt; ``failures[k]`` is what attempt ``k`` raises."""
    infra = data = 0
    while infra < max_infra:
        start = weight["v"]
        group_id = buf.reserve(weight_version=start, target_step=target_step)
        try:
            await asyncio.sleep(0)  # the rollout: other prompts' attempts interleave here
            failure = failures.pop(0) if failures else None
            if failure is not None:
                raise failure(f"prompt {prompt_idx}")
            await buf.commit(group_id, grpo_record(prompt_idx), start_weight_version=start,
                             end_weight_version=weight["v"])
        except Exception as error:
            await buf.remove_group(group_id)
            stats["removed"] += 1
            if isinstance(error, InfraError):
                infra += 1
                continue
            data += 1
            if data >= max_data:
                return "SKIPPED"
            continue
        return "COMMITTED"
    return "SKIPPED"


@pytest.mark.parametrize("name", ["in_order", "windowed"])
def test_retry_loop_under_failures_keeps_one_owner_and_leaks_no_capacity(tmp_path: Any, name: str) -> None:
    """Four steps of four prompts; a fixed schedule of infra and data failures. Every prompt ends
    committed or skipped, every failed attempt is an aborted tombstone, and the capacity the
    failures used is all free again (issue 17 item 7: count 2, not 4; no capacity error at step 1)."""
    schedule = {1: [InfraError], 2: [DataError, InfraError], 5: [InfraError, InfraError], 6: [DataError, DataError],
                9: [InfraError] * 3, 13: [DataError]}
    cfg = store_config(str(tmp_path / "r.kv"), SAMPLERS[name], capacity=8, per_step=4, schema=GRPO)
    buf = TQReplayBuffer(None, partition_id="rollout_data", pad_value_dict={}, config=cfg)
    sampler = create_sampler(buf, SAMPLERS[name])
    sampler.set_dispatch_index(0)
    weight, stats, outcomes = {"v": 0}, {"removed": 0}, {}

    async def step(version: int) -> None:
        target = await sampler.admit(trainer_version_fn=lambda: version)
        prompts = range(4 * version, 4 * version + 4)
        results = await asyncio.gather(*(generate_and_push(buf, weight, p, target, list(schedule.get(p, [])), stats)
                                         for p in prompts))
        outcomes.update(zip(prompts, results, strict=True))
        if target is not None:
            assert buf.count_for_target_step(target) == results.count("COMMITTED")
        assert buf.size() == results.count("COMMITTED") and buf.core.state()["inflight"] == 0
        await sampler.evict(current_train_weight=version)
        _, n = await sampler.select(current_train_weight=version, min_prompt_groups=1, max_prompt_groups=4)
        assert n == results.count("COMMITTED")
        weight["v"] = version + 1

    async def main() -> None:
        for version in range(4):
            await step(version)

    run(main())
    assert [p for p, o in outcomes.items() if o == "SKIPPED"] == [6, 9]
    aborted = buf.core.groups([ABORTED])
    assert len(aborted) == stats["removed"] == sum(len(v) for v in schedule.values())
    state = buf.core.state()
    assert (state["inflight"], state["ready"]) == (0, 0)
    assert state["counters"]["committed"] == 14
    buf.close()
    core = ReplayBuffer.open(cfg["path"])
    assert core.store.read(lambda txn: check(txn).ok)
    core.close()


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_a_single_controller_run_with_both_pumps_on_one_event_loop(tmp_path: Any, name: str) -> None:
    """The controller's two pumps as concurrent tasks, with its capacity semaphore and calls: the
    rollout pump admits (gated), tops up and launches ``generate_and_push`` per prompt; the train
    pump evicts, selects and advances the trainer. Every prompt is trained exactly once."""
    steps, per_step = 4, 2
    spec, capacity_groups = SAMPLERS[name], 4
    if name == "windowed":
        # windowed has no gate: with a window shorter than the run, a prompt that the machine's load
        # keeps generating past the window is discarded and never retried by this fixed-size pump,
        # so whether the run finishes would depend on timing. A window as long as the run keeps
        # this test about the two pumps; windowed's discards are covered in test_samplers.
        spec, capacity_groups = {**spec, "max_staleness_versions": steps}, per_step * (steps + 1)
    cfg = store_config(str(tmp_path / "r.kv"), spec, capacity=capacity_groups, per_step=per_step, schema=GRPO)
    buf = TQReplayBuffer(None, partition_id="rollout_data", pad_value_dict={"token_ids": 0, "input_ids": 0},
                         config=cfg)
    sampler = create_sampler(buf, spec)
    sampler.set_dispatch_index(0)
    assert sampler.required_buffer_capacity(per_step) <= capacity_groups
    capacity = asyncio.Semaphore(4)
    trainer = {"version": 0}
    weight = {"v": 0}
    dispatched: dict[int, int | None] = {}
    trained: list[tuple[int, str]] = []
    schedule = {3: [InfraError], 6: [DataError]}  # retried, each succeeds on its next attempt

    async def rollout_pump(tasks: asyncio.TaskGroup) -> None:
        for batch_index in range(steps):
            target = await sampler.admit(trainer_version_fn=lambda: trainer["version"])
            if target is not None:
                assert buf.count_for_target_step(target) == 0  # no restored groups: dispatch the whole batch
            for j in range(per_step):
                prompt = batch_index * per_step + j
                await capacity.acquire()
                dispatched[prompt] = target
                tasks.create_task(generate_and_push(buf, weight, prompt, target, list(schedule.get(prompt, [])),
                                                    {"removed": 0}))

    async def train_pump() -> None:
        while trainer["version"] < steps:
            got = 0
            while got < per_step:
                await asyncio.sleep(0)
                for _ in range(await sampler.evict(current_train_weight=trainer["version"])):
                    capacity.release()
                meta, n = await sampler.select(current_train_weight=trainer["version"],
                                               min_prompt_groups=1, max_prompt_groups=per_step - got)
                if meta is None:
                    continue
                for _ in range(n):
                    capacity.release()
                got += n
                rows = buf.get_samples(meta, ["input_ids", "total_reward"])
                trained.extend((trainer["version"], gid) for gid in meta.group_ids)
                assert rows.tensors["total_reward"].tolist() == [0.0, 1.0] * n
            trainer["version"] += 1
            weight["v"] = trainer["version"]
            assert not sampler.should_abort_inflight(start_weight_version=weight["v"],
                                                     current_train_weight=trainer["version"])

    async def main() -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(rollout_pump(tasks))
            tasks.create_task(train_pump())

    run(asyncio.wait_for(main(), timeout=300))
    assert len(trained) == steps * per_step == len({gid for _, gid in trained})
    assert [v for v, _ in trained] == sorted(v for v, _ in trained)
    if name == "in_order":  # each step trains exactly the batch stamped for it
        assert sorted(dispatched.values()) == sorted(v for v, _ in trained)
    assert len(buf) == 0 and buf.core.state()["inflight"] == 0
    assert len(buf.core.groups([ABORTED])) == 2 and buf.core.store.read(lambda txn: check(txn).ok)
    buf.close()


def test_main_controller_restart_gives_up_anonymous_prompts_and_refills_the_short_step(tmp_path: Any) -> None:
    """NeMo-RL main after a crash: step 0 had one group committed and one in flight, step 1 (the
    lookahead) was complete. A fresh handle resumes at step 0 with NeMo-RL's calls only: the
    anonymous in-flight prompt is given up, admit hands out stamp 0 again without moving the
    cursor, the top-up guard dispatches the one missing prompt, and both steps train."""
    cfg = store_config(str(tmp_path / "r.kv"), SAMPLERS["in_order"], capacity=4)
    buf = TQReplayBuffer(None, partition_id="rollout_data", pad_value_dict={}, config=cfg)
    s = create_sampler(buf, SAMPLERS["in_order"])
    s.set_dispatch_index(0)
    assert run(s.admit(trainer_version_fn=lambda: 0)) == 0
    done = add_group(buf, 0, target_step=0).group_ids[0]
    lost = buf.reserve(weight_version=0, target_step=0)  # its worker dies with the process
    assert run(s.admit(trainer_version_fn=lambda: 0)) == 1
    step1 = sorted(add_group(buf, 0, target_step=1).group_ids[0] for _ in range(2))
    buf.close()

    buf = TQReplayBuffer(None, partition_id="rollout_data", pad_value_dict={}, config=cfg)
    s = create_sampler(buf, SAMPLERS["in_order"])
    s.set_dispatch_index(0)
    assert buf.core.group(lost).state == ABORTED and buf.ledger.entries() == []
    target = run(s.admit(trainer_version_fn=lambda: 0))
    assert (target, s.dispatch_index) == (0, 1)  # the short step again, no cursor move
    missing = 2 - buf.count_for_target_step(target)  # NeMo-RL's top-up guard
    assert missing == 1
    refill = add_group(buf, 0, target_step=target).group_ids[0]
    meta, n = run(s.select(current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2))
    assert (n, sorted(meta.group_ids)) == (2, sorted([done, refill]))
    meta, n = run(s.select(current_train_weight=1, min_prompt_groups=2, max_prompt_groups=2))
    assert (n, sorted(meta.group_ids)) == (2, step1)
    assert run(s.admit(trainer_version_fn=lambda: 1)) == 2
    assert buf.core.store.read(lambda txn: check(txn).ok)
    buf.close()


def test_weight_fifo_restart_after_losing_both_admitted_batches_does_not_deadlock(tmp_path: Any) -> None:
    """Both admitted batches were in flight (anonymous) at the crash, so the gate is closed and
    nothing is ready: admit re-admits two batches without moving the cursor, and training goes on."""
    cfg = store_config(str(tmp_path / "r.kv"), SAMPLERS["weight_fifo"], capacity=4)
    buf = TQReplayBuffer(None, partition_id="rollout_data", pad_value_dict={}, config=cfg)
    s = create_sampler(buf, SAMPLERS["weight_fifo"])
    for _ in range(2):
        assert run(s.admit(trainer_version_fn=lambda: 0)) is None
        buf.reserve(weight_version=0)
        buf.reserve(weight_version=0)
    buf.close()

    buf = TQReplayBuffer(None, partition_id="rollout_data", pad_value_dict={}, config=cfg)
    s = create_sampler(buf, SAMPLERS["weight_fifo"])
    s.set_dispatch_index(0)
    assert len(buf.core.groups([ABORTED])) == 4 and s.dispatch_index == 1
    for _ in range(2):
        assert run(s.admit(trainer_version_fn=lambda: 0)) is None
        add_group(buf, 0)
        add_group(buf, 0)
    assert s.dispatch_index == 1
    for version in (0, 1):
        _, n = run(s.select(current_train_weight=version, min_prompt_groups=2, max_prompt_groups=2))
        assert n == 2
    assert run(s.admit(trainer_version_fn=lambda: 1)) is None and s.dispatch_index == 2
    buf.close()


def test_a_fenced_attempt_of_a_ledger_owned_prompt_cannot_commit(make: Any) -> None:
    """#3480's path: the ledger owns the prompt; remove_group fences the failed attempt and hands
    the prompt back, so the retry reserves the same group id and the zombie's commit is refused."""
    buf = make(SAMPLERS["in_order"])
    s = create_sampler(buf, SAMPLERS["in_order"])
    buf.ledger.reserve_group("batch-0-prompt-0", prompt_idx=0, expected_generations=N_GENS)
    t = run(s.admit(trainer_version_fn=lambda: 0))
    gid = buf.reserve(weight_version=0, target_step=t, group_id="batch-0-prompt-0")
    zombie = buf.handle.held(gid)
    run(buf.remove_group(gid))
    assert "batch-0-prompt-0" in buf.ledger and buf.count_for_target_step(0) == 1
    buf.reserve(weight_version=0, target_step=t, group_id="batch-0-prompt-0")
    with pytest.raises(StaleAttempt):
        buf.core.commit_group(zombie, [dict(zip(("input_ids", "input_lengths", "total_reward"),
                                                (torch.ones(3, dtype=torch.long), torch.tensor(3), torch.tensor(0.0)),
                                                strict=True))] * N_GENS)
    run(buf.commit(gid, batch(), start_weight_version=0, end_weight_version=0))
    assert buf.ready_list == [True] and "batch-0-prompt-0" not in buf.ledger


if __name__ == "__main__":
    child_cfg, state_path, resume_step = json.loads(sys.argv[1])
    print(json.dumps(_child_restore(child_cfg, state_path, resume_step)))
