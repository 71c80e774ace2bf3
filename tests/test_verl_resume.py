"""verl's V1 re-issue and custom-sampler tests, ported onto the kvckpt buffer.

Sources (verl-project/verl at 1dda039b9): ``tests/trainer/ppo/v1/test_reissue_inflight_on_cpu.py``
and ``test_trainer_base_on_cpu.py``; each test names the verl test and line it ports. verl's own
``PPOTrainer._reissue_inflight_prompts`` is bound to a stub exactly as verl's ``_make_trainer_stub``
(line 117) binds it; prompts are written as verl's ``_submit_prompt`` (line 127) and
``_add_trajectory`` (line 144) write them; ``tq.save_checkpoint`` / ``tq.load_checkpoint`` are
called with verl's arguments. The kvckpt buffer (built once per module, as a trainer builds it)
has installed its mirror, so every one of those calls goes through the ledger.

Deviation: where verl's save/load tests wipe the partition with ``kv_clear`` "to simulate a fresh
process", the port drops TransferQueue's copy only (TransferQueue's own ``kv_clear``): with kvckpt a
``kv_clear`` is a durable transition the next load keeps, while a process restart loses
TransferQueue and keeps the ledger, which is the case verl's comment describes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

import ray
import torch
import transfer_queue as tq
from _verl_support import StubTrainer, transferqueue
from kvckpt.integrations.verl import KvckptReplayBufferAsync
from kvckpt.integrations.verl.mirror import LEDGER_FILE, MANIFEST_FILE, RAW
from omegaconf import OmegaConf
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils import tensordict_utils as tu

pytestmark = pytest.mark.verl
ACTOR = f"kvckpt_verl_resume_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """verl's module ``tq_init`` (line 59) on loopback Ray, and the kvckpt buffer a trainer would build."""
    with transferqueue("kvckpt-verl-resume", ACTOR):
        path = str(tmp_path_factory.mktemp("verl_resume") / "ledger.kv")
        yield KvckptReplayBufferAsync(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=2,
                                      max_off_policy_strategy="drop",
                                      sampler_kwargs={"kvckpt": {"path": path, "actor_name": ACTOR}})


@pytest.fixture
def partition_id(buffer: Any) -> Iterator[str]:
    """verl's per-test partition (line 77)."""
    pid = f"test-{uuid.uuid4().hex}"
    yield pid
    keys = list(tq.kv_list(partition_id=pid).get(pid, {}))
    if keys:
        tq.kv_clear(keys=keys, partition_id=pid)


class _Manager:
    """verl's ``FakeAgentLoopManager`` (line 106)."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def generate_sequences(self, batch: Any) -> None:
        self.batches.append(batch)


def _stub(trainer_mode: str = "separate_async", global_steps: int = 8) -> Any:
    """verl's ``_make_trainer_stub`` (line 117)."""
    stub = type("Stub", (), {})()
    stub.trainer_mode, stub.global_steps, stub.agent_loop_manager = trainer_mode, global_steps, _Manager()
    stub._reissue_inflight_prompts = PPOTrainer._reissue_inflight_prompts.__get__(stub)
    return stub


def _uid() -> str:
    return uuid.uuid4().hex


def _submit(partition_id: str, uid: str, status: str, global_steps: int) -> None:
    """verl's ``_submit_prompt`` (line 127)."""
    batch = tu.get_tensordict({"uid": [uid], "raw_prompt": [f"prompt-for-{uid}"], "index": torch.tensor([0])})
    tq.kv_batch_put(keys=[uid], partition_id=partition_id, fields=batch,
                    tags=[{"is_prompt": True, "status": status, "global_steps": global_steps}])


def _trajectory(partition_id: str, uid: str, session: int, global_steps: int) -> str:
    """verl's ``_add_trajectory`` (line 144)."""
    key = f"{uid}_{session}_0"
    tq.kv_put(key=key, partition_id=partition_id, fields={"input_ids": torch.tensor([1, 2, 3])},
              tag={"is_prompt": False, "seq_len": 3, "global_steps": global_steps})
    return key


def _status(partition_id: str, uid: str) -> str | None:
    return tq.kv_list(partition_id=partition_id).get(partition_id, {}).get(uid, {}).get("status")


def _ledger_tags(buffer: Any, partition_id: str) -> dict[str, dict]:
    items = ray.get(buffer.ledger.snapshot.remote())["items"].get(partition_id, {})
    return {key: item["tags"] for key, item in items.items()}


def _restart_transferqueue(partition_id: str) -> None:
    """The port's "fresh process" (see the module docstring): TransferQueue forgets, the ledger does not."""
    keys = list(RAW["kv_list"](partition_id=partition_id).get(partition_id, {}))
    if keys:
        RAW["kv_clear"](keys=keys, partition_id=partition_id)


def test_reissue_resubmits_only_inflight_prompts(partition_id: str, buffer: Any) -> None:
    """verl line 236; the ledger follows every step (reset to pending, old trajectories gone)."""
    pending, running, finished = _uid(), _uid(), _uid()
    for uid, status in ((pending, "pending"), (running, "running"), (finished, "finished")):
        _submit(partition_id, uid, status, 2)
    keys = {uid: _trajectory(partition_id, uid, 0, 2) for uid in (pending, running, finished)}
    stub = _stub(global_steps=3)
    assert stub._reissue_inflight_prompts(partition_id) == 2
    assert {u for b in stub.agent_loop_manager.batches for u in b["uid"]} == {pending, running}
    assert [_status(partition_id, u) for u in (pending, running, finished)] == ["pending", "pending", "finished"]
    remaining = tq.kv_list(partition_id=partition_id)[partition_id]
    assert keys[pending] not in remaining and keys[running] not in remaining and keys[finished] in remaining
    assert _ledger_tags(buffer, partition_id) == remaining


def test_reissue_preserves_prompt_data_and_resets_global_steps(partition_id: str) -> None:
    """verl line 271."""
    uid = _uid()
    _submit(partition_id, uid, "running", 7)
    stub = _stub(global_steps=8)
    stub._reissue_inflight_prompts(partition_id)
    [batch] = stub.agent_loop_manager.batches
    assert list(batch["uid"]) == [uid] and list(batch["raw_prompt"]) == [f"prompt-for-{uid}"]
    assert int(batch["global_steps"]) == 8
    assert tq.kv_list(partition_id=partition_id)[partition_id][uid]["global_steps"] == 8


def test_reissue_combines_original_steps_under_resumed_step(partition_id: str) -> None:
    """verl line 291."""
    step2, step5 = [_uid(), _uid()], [_uid()]
    for uid in step2:
        _submit(partition_id, uid, "pending", 2)
    for uid in step5:
        _submit(partition_id, uid, "running", 5)
    stub = _stub(global_steps=6)
    assert stub._reissue_inflight_prompts(partition_id) == 3
    [batch] = stub.agent_loop_manager.batches
    assert int(batch["global_steps"]) == 6 and set(batch["uid"]) == set(step2 + step5)


def test_reissue_noop_without_inflight(partition_id: str) -> None:
    """verl line 313."""
    _submit(partition_id, _uid(), "finished", 1)
    _submit(partition_id, _uid(), "failure", 1)
    stub = _stub()
    assert stub._reissue_inflight_prompts(partition_id) == 0 and stub.agent_loop_manager.batches == []


def test_reissue_noop_on_empty_partition(partition_id: str) -> None:
    """verl line 328."""
    stub = _stub()
    assert stub._reissue_inflight_prompts(partition_id) == 0 and stub.agent_loop_manager.batches == []


def test_reissue_noop_for_sync_mode(partition_id: str) -> None:
    """verl line 335."""
    _submit(partition_id, _uid(), "pending", 1)
    stub = _stub(trainer_mode="sync")
    assert stub._reissue_inflight_prompts(partition_id) == 0 and stub.agent_loop_manager.batches == []


def test_save_load_roundtrip_restores_prompts(partition_id: str, tmp_path: Path) -> None:
    """verl line 358; the checkpoint is one ledger file plus its manifest."""
    pending, running, finished = _uid(), _uid(), _uid()
    for uid, status in ((pending, "pending"), (running, "running"), (finished, "finished")):
        _submit(partition_id, uid, status, 3)
    _trajectory(partition_id, finished, 0, 3)
    ckpt_dir = str(tmp_path / "transfer_queue")
    tq.save_checkpoint(ckpt_dir, metadata={"global_steps": 3})
    assert sorted(p.name for p in Path(ckpt_dir).iterdir()) == sorted([LEDGER_FILE, MANIFEST_FILE])
    _restart_transferqueue(partition_id)
    assert tq.kv_list(partition_id=partition_id).get(partition_id, {}) == {}
    tq.load_checkpoint(ckpt_dir)
    assert [_status(partition_id, u) for u in (pending, running, finished)] == ["pending", "running", "finished"]
    batch = tq.kv_batch_get(keys=[pending], partition_id=partition_id)
    assert list(batch["uid"]) == [pending] and list(batch["raw_prompt"]) == [f"prompt-for-{pending}"]
    assert f"{finished}_0_0" in tq.kv_list(partition_id=partition_id)[partition_id]


def test_save_load_then_reissue_only_inflight(partition_id: str, tmp_path: Path) -> None:
    """verl line 397."""
    pending, finished = _uid(), _uid()
    _submit(partition_id, pending, "pending", 4)
    _submit(partition_id, finished, "finished", 4)
    _trajectory(partition_id, finished, 0, 4)
    ckpt_dir = str(tmp_path / "transfer_queue")
    tq.save_checkpoint(ckpt_dir, metadata={"global_steps": 4})
    _restart_transferqueue(partition_id)
    tq.load_checkpoint(ckpt_dir)
    stub = _stub(global_steps=5)
    assert stub._reissue_inflight_prompts(partition_id) == 1
    assert {u for b in stub.agent_loop_manager.batches for u in b["uid"]} == {pending}
    assert int(stub.agent_loop_manager.batches[0]["global_steps"]) == 5


def test_load_of_an_older_checkpoint_replaces_the_live_ledger(partition_id: str, tmp_path: Path) -> None:
    """Not verl's: a checkpoint the live ledger moved past (a later one was saved) is copied in whole."""
    first, later = _uid(), _uid()
    _submit(partition_id, first, "finished", 1)
    tq.save_checkpoint(str(tmp_path / "s1"), metadata={"global_steps": 1})
    _submit(partition_id, later, "finished", 2)
    tq.save_checkpoint(str(tmp_path / "s2"), metadata={"global_steps": 2})
    tq.load_checkpoint(str(tmp_path / "s1"))
    assert set(tq.kv_list(partition_id=partition_id)[partition_id]) == {first}


def test_custom_sampler_gets_verls_constructor_contract(buffer: Any) -> None:
    """verl ``test_trainer_base_on_cpu.py`` line 74, with the real kvckpt class behind ``custom_sampler``
    (``pkg://`` path, no ``load_extern_type`` patch) and verl's ``_StubTrainer`` (line 23): built with the six
    contract arguments only."""

    trainer = StubTrainer.__new__(StubTrainer)
    trainer.trainer_mode = "separate_async"
    trainer.config = OmegaConf.create({
        "algorithm": {"filter_groups": {"enable": True, "metric": "acc"}},
        "data": {"train_batch_size": 64, "gen_batch_size": 8},
        "trainer": {"v1": {"separate_async": {}, "sampler": {
            "custom_sampler": {"path": "pkg://kvckpt.integrations.verl", "name": "KvckptReplayBufferAsync"},
            "max_off_policy_threshold": 1, "max_off_policy_strategy": "drop",
            "sampler_kwargs": {"kvckpt": {"path": ray.get(buffer.ledger.info.remote())["path"],
                                          "actor_name": ACTOR}}}}}})
    with patch.object(trainer, "_resolve_filter_groups_metric") as resolve:
        sampler = trainer._build_replay_buffer()
    resolve.assert_not_called()
    assert type(sampler) is KvckptReplayBufferAsync
    assert sampler.filter_groups_metric is None and sampler.train_batch_size is None
    assert sampler.refill_fn == trainer._add_prompts_to_generate


def _documented_configuration() -> dict:
    """The YAML block under docs/integrations.md's verl "The configuration"."""
    import re

    import yaml

    text = (Path(__file__).parents[1] / "docs" / "integrations.md").read_text()
    section = text[text.index("## verl V1 replay buffer"):]
    section = section[section.index("### The configuration"):]
    return yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))


def test_the_documented_configuration_builds_the_buffer(buffer: Any) -> None:
    """The configuration a verl user writes (docs/integrations.md), through verl's ``_build_replay_buffer``."""

    documented = _documented_configuration()
    sampler = documented["trainer"]["v1"]["sampler"]
    sampler["sampler_kwargs"]["kvckpt"] = {"path": ray.get(buffer.ledger.info.remote())["path"], "actor_name": ACTOR}
    trainer = StubTrainer.__new__(StubTrainer)
    trainer.trainer_mode = documented["trainer"]["v1"]["trainer_mode"]
    trainer.config = OmegaConf.merge(OmegaConf.create({
        "algorithm": {"filter_groups": {"enable": False}}, "data": {"train_batch_size": 8},
        "trainer": {"v1": {trainer.trainer_mode: {}, "sampler": {"max_off_policy_threshold": 2,
                                                                  "max_off_policy_strategy": "drop"}}}}),
        documented)
    rb = trainer._build_replay_buffer()
    assert type(rb) is KvckptReplayBufferAsync and rb.trainer_mode == "separate_async"
    assert ray.get(rb.ledger.info.remote())["run"] >= 2  # it opened a run of its own
