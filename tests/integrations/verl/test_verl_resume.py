"""verl's V1 re-issue tests ported onto the kvckpt buffer, and the ledger's restart guarantees.

Sources (verl-project/verl at 1dda039b9): ``tests/trainer/ppo/v1/test_reissue_inflight_on_cpu.py``
(11 of its 13 tests; lines 82 and 421 need ``trainer_base._tq_supports_checkpoint``, absent in verl
0.9.1); each test names the verl test and line it ports. verl's own
``PPOTrainer._reissue_inflight_prompts`` is bound to a stub exactly as verl's ``_make_trainer_stub``
(line 117) binds it; prompts are written as verl's ``_submit_prompt`` (line 127) and
``_add_trajectory`` (line 144) write them; ``tq.save_checkpoint`` / ``tq.load_checkpoint`` are
called with verl's arguments. The kvckpt buffer (built once per module, as a trainer builds it)
has installed its mirror, so every one of those calls goes through the ledger.

Deviation: where verl's save/load tests wipe the partition with ``kv_clear`` "to simulate a fresh
process", the port drops TransferQueue's copy only (TransferQueue's own ``kv_clear``): with kvckpt a
``kv_clear`` is a durable transition the next load keeps, while a process restart loses
TransferQueue and keeps the ledger, which is the case verl's comment describes.

The second half tests the ledger itself: a superseded run's checkpoint / load / resume refused,
consumed marks bounded by the last checkpoint, ``clear`` and checkpoints reading only what they
touch, a run that starts over no longer descending from its last checkpoint, and a restart (a
SIGKILLed process, then a fresh actor) of a run that never checkpointed.
It is one file, past 400 lines, because all of it shares the module's one Ray and TransferQueue
(about 40 s to start here).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from _paths import ROOT

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

import ray
import torch
import transfer_queue as tq
from _verl_support import StubTrainer, transferqueue
from kvckpt.integrations.transferqueue.values import encode_value, new_write_id
from kvckpt.integrations.verl import KvckptReplayBufferAsync, StaleRun, VerlLedger
from kvckpt.integrations.verl import ledger as ledger_module
from kvckpt.integrations.verl.mirror import LEDGER_FILE, MANIFEST_FILE, RAW, MirrorRef, active, install, publish
from kvckpt.integrations.verl.records import (
    CHECKPOINT_KEY,
    CONSUMED,
    CURSOR_KEY,
    FIELD,
    RUN_KEY,
    TAG,
    item_prefix,
    mark_index_key,
    record_key,
)
from omegaconf import OmegaConf
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils import tensordict_utils as tu

from kvckpt import ValueStore, ValueView
from kvckpt.buffer import values as values_module

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


def _clear_train(uids: list[str]) -> None:
    listed = tq.kv_list(partition_id="train").get("train", {})
    keys = [k for k in listed if k.split("_", 1)[0] in set(uids)]
    if keys:
        tq.kv_clear(keys=keys, partition_id="train")


def test_async_submission_persists_reissuable_prompt_fields(buffer: Any) -> None:
    """verl line 168. verl swaps ``tq.kv_batch_put`` for a recorder; the port lets the real call run (the mirror,
    then TransferQueue) and reads the ledger instead: each prompt's fields are exactly the three per-row columns
    (``global_steps``, non-tensor data, left out), so a re-issue after a crash has its prompt."""
    stub = type("Stub", (), {})()
    stub.trainer_mode, stub.global_steps, stub.agent_loop_manager = "separate_async", 4, _Manager()
    stub._submit_batch_to_rollout = PPOTrainer._submit_batch_to_rollout.__get__(stub)
    uids = [_uid(), _uid()]
    batch = tu.get_tensordict({"uid": uids, "raw_prompt": ["prompt-a", "prompt-b"], "index": torch.tensor([0, 1])})
    tu.assign_non_tensor_data(batch, "global_steps", stub.global_steps)
    try:
        assert stub._submit_batch_to_rollout(batch) == 2
        held = ray.get(buffer.ledger.snapshot.remote())["items"]["train"]
        assert all(set(held[uid]["fields"]) == {"uid", "raw_prompt", "index"} for uid in uids)
        assert [held[uid]["fields"]["raw_prompt"] for uid in uids] == ["prompt-a", "prompt-b"]
        assert [held[uid]["tags"]["status"] for uid in uids] == ["pending", "pending"]
        assert stub.agent_loop_manager.batches == [batch]
    finally:
        _clear_train(uids)


def test_add_prompts_to_generate_uses_exact_count(buffer: Any) -> None:
    """verl line 191, with verl's two stubs; then once more with verl's own ``_submit_batch_to_rollout`` in place
    of the second stub (the kvckpt buffer's ``refill_fn`` is this method): exactly the three prompts land in the
    ledger as pending, in TransferQueue's order."""
    stub = type("Stub", (), {})()
    uids = [_uid(), _uid(), _uid()]
    batch = tu.get_tensordict({"uid": uids, "raw_prompt": ["prompt-a", "prompt-b", "prompt-c"],
                               "index": torch.tensor([0, 1, 2])})
    requested, submitted = [], []
    stub._next_train_batch = lambda num_prompts: requested.append(num_prompts) or batch
    stub._submit_batch_to_rollout = lambda value: submitted.append(value) or len(value)
    stub._add_prompts_to_generate = PPOTrainer._add_prompts_to_generate.__get__(stub)

    assert stub._add_prompts_to_generate(3) == 3
    assert requested == [3]
    assert submitted == [batch]

    stub.trainer_mode, stub.global_steps, stub.agent_loop_manager = "separate_async", 2, _Manager()
    stub._submit_batch_to_rollout = PPOTrainer._submit_batch_to_rollout.__get__(stub)
    try:
        assert stub._add_prompts_to_generate(3) == 3 and requested == [3, 3]
        held = ray.get(buffer.ledger.snapshot.remote())["items"]["train"]
        assert {uid: held[uid]["tags"]["status"] for uid in uids} == dict.fromkeys(uids, "pending")
    finally:
        _clear_train(uids)


def test_next_train_batch_coalesces_gen_batches(buffer: Any, tmp_path: Path) -> None:
    """verl line 211, with verl's stub of ``_fetch_one_gen_batch``; then through verl's own fetch from a
    ``StatefulDataLoader`` (train 4, gen 2), a trainer whose kvckpt buffer ``_build_replay_buffer`` built: the
    coalesced batch is one dispatch, and the dataloader position the ledger records with it is the one after
    both fetches (what a restart resumes from)."""
    from kvckpt.integrations.verl.records import state_to_json
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.utils.dataset.rl_dataset import collate_fn

    stub = type("Stub", (), {})()
    stub.config = OmegaConf.create({"data": {"train_batch_size": 4, "gen_batch_size": 2}})
    stub.global_steps = 5
    chunks = iter([
        tu.get_tensordict({"uid": ["a", "b"], "raw_prompt": ["a", "b"], "index": torch.tensor([0, 1])}),
        tu.get_tensordict({"uid": ["c", "d"], "raw_prompt": ["c", "d"], "index": torch.tensor([2, 3])}),
    ])
    stub._fetch_one_gen_batch = lambda: next(chunks)
    stub._next_train_batch = PPOTrainer._next_train_batch.__get__(stub)

    batch = stub._next_train_batch()

    assert list(batch["uid"]) == ["a", "b", "c", "d"]
    assert list(batch["index"]) == [0, 1, 2, 3]
    assert int(batch["global_steps"]) == 5

    trainer = StubTrainer.__new__(StubTrainer)
    trainer.trainer_mode, trainer.global_steps, trainer.agent_loop_manager = "separate_async", 5, _Manager()
    trainer.config = OmegaConf.create({
        "algorithm": {"filter_groups": {"enable": False}}, "data": {"train_batch_size": 4, "gen_batch_size": 2},
        "trainer": {"v1": {"separate_async": {}, "sampler": {
            "custom_sampler": {"path": "pkg://kvckpt.integrations.verl", "name": "KvckptReplayBufferAsync"},
            "max_off_policy_threshold": 2, "max_off_policy_strategy": "drop",
            "sampler_kwargs": {"kvckpt": {"path": ray.get(buffer.ledger.info.remote())["path"],
                                          "actor_name": ACTOR}}}}},
    })
    dataset = [{"raw_prompt": f"question {i}", "index": torch.tensor(i)} for i in range(8)]
    trainer.train_dataloader = StatefulDataLoader(dataset, batch_size=2, shuffle=False, collate_fn=collate_fn)
    trainer.train_dataloader_it = None
    trainer.replay_buffer = trainer._build_replay_buffer()  # a new run of the module's ledger; its mirror
    batch = trainer._next_train_batch()
    try:
        assert list(batch["index"]) == [0, 1, 2, 3] and trainer._submit_batch_to_rollout(batch) == 4
        snapshot = ray.get(buffer.ledger.snapshot.remote())
        assert snapshot["cursor"] == state_to_json(trainer.train_dataloader.state_dict())
        assert snapshot["cursor"] != state_to_json(StatefulDataLoader(dataset, batch_size=2).state_dict())
        assert {snapshot["items"]["train"][uid]["fields"]["index"].item() for uid in batch["uid"]} == {0, 1, 2, 3}
    finally:
        _clear_train(list(batch["uid"]))


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


def test_the_put_ending_a_group_drops_its_progress_and_no_other_put_does(partition_id: str, buffer: Any) -> None:
    """Through the mirror, called as verl calls it: a prompt's ``finished`` put (``AgentLoopWorkerTQ._run_prompt``)
    deletes its samples' token progress; a trajectory's ``success`` put and a put of fields without tags (the
    trainer writing ``ref_log_prob`` back, verl 0.9.1 ``trainer_base.py`` line 1717) keep it."""
    from tensordict import TensorDict

    uid = _uid()
    _submit(partition_id, uid, "running", 1)
    key = _trajectory(partition_id, uid, 0, 1)
    chunk = {"uid": uid, "session": 0, "start": 0, "tokens": [1], "logprobs": [0.0], "versions": [0], "final": True}
    ray.get(buffer.ledger.record_progress.remote(active().token, [chunk]))  # the run this process mirrors now
    tq.kv_batch_put(keys=[key], partition_id=partition_id,
                    fields=TensorDict({"ref_log_prob": torch.zeros(1, 3)}, batch_size=[1]))
    tq.kv_put(key=key, partition_id=partition_id, tag={"status": "success"})
    assert ray.get(buffer.ledger.progress.remote(uid, 0))["done"]
    tq.kv_put(key=uid, partition_id=partition_id, tag={"status": "finished"})
    assert ray.get(buffer.ledger.progress.remote(uid, 0)) is None
    assert _ledger_tags(buffer, partition_id)[uid]["status"] == "finished"


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
    # the copied-in file was snapshotted before its own step was recorded: the load records it
    assert ray.get(active().actor.info.remote())["checkpoint_step"] == 1


def _documented_configuration() -> dict:
    """The YAML block under docs/integrations.md's verl "The configuration"."""
    import re

    import yaml

    text = (ROOT / "docs" / "integrations.md").read_text()
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
    assert type(rb) is ReplayBufferAsync and rb.trainer_mode == "separate_async"
    assert ray.get(rb.ledger.info.remote())["run"] >= 2  # it opened a run of its own


# -- the ledger's own guarantees (in-process, no Ray: the actor runs exactly this object) -----------
def _finish(ledger: VerlLedger, token: str, partition_id: str, uid: str, step: int) -> list[str]:
    """A finished group as the mirror records it: the prompt's tags and one trajectory's tags."""
    keys, values = [], []
    for key, tags in ((uid, {"is_prompt": True, "status": "finished", "global_steps": step}),
                      (f"{uid}_0_0", {"is_prompt": False, "seq_len": 3, "global_steps": step})):
        for name, value in tags.items():
            keys.append(record_key(partition_id, key, TAG, name))
            values.append(encode_value(keys[-1], value, new_write_id(), 1))
    ledger.put(token, keys, values)
    return [uid, f"{uid}_0_0"]


def _digest(*paths: Path) -> dict[str, str]:
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def test_a_superseded_run_can_neither_checkpoint_nor_load_nor_resume(tmp_path: Path) -> None:
    """Gap closed: ``checkpoint`` / ``load`` / ``resume`` carry the run token like ``put`` / ``clear``. With the
    token of a run a restart replaced, each is refused with ``StaleRun`` and changes nothing: not the ledger
    file, not the checkpoint it would load, and no checkpoint directory appears."""
    live, first = tmp_path / "live.kv", tmp_path / "global_step_1" / "transfer_queue"
    ledger = VerlLedger(str(live))
    try:
        old = ledger.open_run()["token"]
        _finish(ledger, old, "train", "a", 1)
        stamp = ledger.checkpoint(old, str(first / LEDGER_FILE), 1)
        _finish(ledger, old, "train", "b", 2)
        new = ledger.open_run()["token"]  # the restart
        before, later = _digest(live, first), tmp_path / "global_step_2" / "transfer_queue"
        for call in (lambda: ledger.checkpoint(old, str(later / LEDGER_FILE), 2),
                     lambda: ledger.load(str(first / LEDGER_FILE), stamp["checkpoint_id"], old),
                     lambda: ledger.resume(old), lambda: ledger.resume(old, 0),
                     lambda: ledger.clear(old, "train", ["b"], consumed_step=2)):
            with pytest.raises(StaleRun, match="refused"):
                call()
        assert _digest(live, first) == before and not later.parent.exists()
        assert ledger.info()["checkpoint_step"] == 1 and set(ledger.snapshot()["items"]["train"]) == {
            "a", "a_0_0", "b", "b_0_0"}
        assert set(ledger.resume(new)["items"]["train"]) == {"a", "a_0_0", "b", "b_0_0"}  # the current run passes
    finally:
        ledger.close()


def test_consumed_marks_never_outlive_the_next_checkpoint(tmp_path: Path) -> None:
    """Gap closed: a sampled group is marked only while a checkpoint exists to resume from (before the first,
    a restart trains from scratch, as verl's ``_load_checkpoint`` finding no ``global_step_N``), and each
    checkpoint drops the marks it covers: nine steps, a checkpoint every third, at most two steps' marks."""
    ledger = VerlLedger(str(tmp_path / "live.kv"))
    try:
        token = ledger.open_run()["token"]
        held = []
        for step in range(1, 10):
            uid = f"u{step}"
            _finish(ledger, token, "train", uid, step)
            ledger.clear(token, "train", [uid], consumed_step=step)  # sample's kv_clear of the prompt
            ledger.clear(token, "train", [f"{uid}_0_0"])  # fit's kv_clear: marked with its prompt's step
            if step % 3 == 0:
                ledger.checkpoint(token, str(tmp_path / f"s{step}" / LEDGER_FILE), step)
            held.append(ledger.info()["consumed_marks"])
            if step == 8:
                assert ledger.snapshot()["consumed"] == {"train": {"u7": 7, "u7_0_0": 7, "u8": 8, "u8_0_0": 8}}
                assert ledger.snapshot()["items"].get("train", {}) == {}
        assert held == [0, 0, 0, 2, 4, 0, 2, 4, 0]
        assert ledger.snapshot()["items"].get("train", {}) == {} and ledger.snapshot()["consumed"] == {}
    finally:
        ledger.close()


def test_a_run_that_starts_over_no_longer_descends_from_its_last_checkpoint(tmp_path: Path) -> None:
    """Window 2's follow-up: after a start over (``retain``: verl loads no checkpoint, e.g. ``resume_mode=disable``)
    the live store holds the new run's groups, not the checkpoint's; a later restart that loads that checkpoint
    (``auto`` finding the old tracker) must copy its file in, although the live stamp is still its stamp."""
    step2 = tmp_path / "global_step_2" / "transfer_queue" / LEDGER_FILE
    ledger = VerlLedger(str(tmp_path / "live.kv"))
    try:
        token = ledger.open_run()["token"]
        _finish(ledger, token, "train", "old", 2)
        stamp = ledger.checkpoint(token, str(step2), 2)
        assert not ledger.load(str(step2), stamp["checkpoint_id"], token)  # descends: the live store is kept
        token = ledger.open_run()["token"]  # the start over
        ledger.retain(token, {})
        assert ledger.info()["checkpoint_step"] is None and ledger.snapshot()["items"] == {}
        _finish(ledger, token, "train", "new", 1)
        token = ledger.open_run()["token"]  # a later restart loads the old checkpoint
        assert ledger.load(str(step2), stamp["checkpoint_id"], token)
        assert set(ledger.resume(token, 2)["items"]["train"]) == {"old", "old_0_0"}
    finally:
        ledger.close()


class _CountingStore(ValueStore):
    """The ledger's value store, recording the prefixes it scans and how many keys it reads."""

    scans: ClassVar[list[str]] = []
    reads: ClassVar[list[int]] = []

    def keys(self, prefix: str = "") -> list[str]:
        self.scans.append(prefix)
        return super().keys(prefix)

    def get(self, keys: list[str]) -> list[bytes | None]:
        self.reads.append(len(keys))
        return super().get(keys)


class _CountingView(ValueView):
    """A write transaction's view (what the ledger's calls read inside their transaction), counted as the store."""

    def keys(self, prefix: str) -> list[str]:
        _CountingStore.scans.append(prefix)
        return super().keys(prefix)

    def get(self, key: str) -> bytes | None:
        _CountingStore.reads.append(1)
        return super().get(key)


def test_clear_and_checkpoint_read_only_what_they_touch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gap closed: ``clear`` reads the consumed marks of the keys it clears (point reads of the marks' keys), and
    a checkpoint finds the marks it covers through their step index: neither scans a partition, however many
    marks and items it holds."""
    monkeypatch.setattr(ledger_module, "ValueStore", _CountingStore)
    monkeypatch.setattr(values_module, "ValueView", _CountingView)
    ledger = VerlLedger(str(tmp_path / "live.kv"))
    try:
        token = ledger.open_run()["token"]
        ledger.checkpoint(token, str(tmp_path / "s1" / LEDGER_FILE), 1)
        for i in range(60):
            ledger.clear(token, "train", _finish(ledger, token, "train", f"m{i}", 2), consumed_step=2)
        for i in range(60):
            _finish(ledger, token, "train", f"k{i}", 2)
        _CountingStore.scans.clear()
        _CountingStore.reads.clear()
        cleared = ["k0", "k1_0_0", "m0_0_0"]
        ledger.clear(token, "train", cleared)
        assert set(_CountingStore.scans) == {item_prefix("train", "k0"), item_prefix("train", "k1_0_0")}
        assert sum(_CountingStore.reads) <= 2 + 2 * len(cleared)  # run and checkpoint records, the marks
        assert ledger.snapshot()["consumed"]["train"]["m0_0_0"] == 2  # its prompt's mark
        _CountingStore.scans.clear()
        ledger.checkpoint(token, str(tmp_path / "s2" / LEDGER_FILE), 2)
        partition_scans = [p for p in _CountingStore.scans if p.startswith("p/") and p.count("/") < 3]
        assert partition_scans == [] and ledger.info()["consumed_marks"] == 0
        assert set(ledger.snapshot()["items"]["train"]) == {f"k{i}{s}" for i in range(60) for s in ("", "_0_0")} - {
            "k0", "k1_0_0"}
    finally:
        ledger.close()


def _landing_at(monkeypatch: pytest.MonkeyPatch, ledger: VerlLedger, records: dict[str, Any], *,
                skip: int = 0) -> list[dict[str, Any]]:
    """``records`` (``{ledger key: value}``) land through the ledger's value store (no mutex held, as a writer in
    another concurrency group or process) when the ledger file's next LMDB write transaction is about to open,
    after ``skip`` of them: after the call that opens it began, before its transaction opens. Returns the pending
    list, empty once they landed."""
    store, pending = ledger._values, [records]
    write, passed = store._store.write, [0]

    def late_writer_then(fn: Any) -> Any:  # every LMDB write transaction of the ledger file opens here
        if pending and passed[0] >= skip:
            landing = pending.pop()
            store.write(list(landing), [encode_value(k, v, new_write_id(), 1) for k, v in landing.items()], [])
        passed[0] += 1
        return write(fn)

    monkeypatch.setattr(store._store, "write", late_writer_then)
    return pending


def _mark(partition_id: str, key: str, step: int) -> dict[str, Any]:
    """A consumed mark and its index entry, as a clear writes them."""
    return {record_key(partition_id, key, CONSUMED): {"step": step}, mark_index_key(step, partition_id, key): {}}


def test_clear_reads_what_it_writes_inside_its_write_transaction(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``clear`` reads the checkpoint record, the marks of its keys and the records it deletes inside its one
    write transaction, not before it, so it relies on no mutex: what lands after the call began and before its
    transaction opens is seen. A checkpoint's step record landing then (a sample's clear beside a checkpoint's
    purge) makes the cleared group marked, not deleted: a crash before the next checkpoint returns it; a read
    before the transaction deletes a group the checkpoint's restart needs. A prompt's mark landing then marks its
    trajectory with the prompt's step; a record of a cleared key landing then is deleted with the rest."""
    ledger = VerlLedger(str(tmp_path / "live.kv"))
    try:
        token = ledger.open_run()["token"]
        _finish(ledger, token, "train", "g", 2)
        pending = _landing_at(monkeypatch, ledger, {CHECKPOINT_KEY: {"step": 1}})
        ledger.clear(token, "train", ["g"], consumed_step=2)
        assert not pending and ledger.snapshot()["consumed"] == {"train": {"g": 2}}
        _finish(ledger, token, "train", "k", 2)
        pending.append(_mark("train", "k", 2))  # the prompt's mark lands: its trajectory is marked with its step
        ledger.clear(token, "train", ["k_0_0"])
        assert not pending and ledger.snapshot()["consumed"] == {"train": {"g": 2, "k": 2, "k_0_0": 2}}
        _finish(ledger, token, "train", "h", 2)
        pending.append({record_key("train", "h", FIELD, "late"): "a field put beside the clear"})
        ledger.clear(token, "train", ["h"])
        assert not pending and ledger._values.keys(item_prefix("train", "h")) == []
    finally:
        ledger.close()


def test_retain_lists_what_it_deletes_inside_its_write_transaction(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``retain`` (a start over) lists what it deletes inside its one write transaction: an unlisted item, a mark
    and a checkpoint record landing after the call began and before its transaction opens are deleted with the
    rest, so the live store holds only what TransferQueue lists and no longer descends from a checkpoint. A
    listing taken before the transaction keeps them."""
    ledger = VerlLedger(str(tmp_path / "live.kv"))
    try:
        token = ledger.open_run()["token"]
        _finish(ledger, token, "train", "kept", 1)
        pending = _landing_at(monkeypatch, ledger, {record_key("train", "late", TAG, "status"): "finished",
                                                    **_mark("train", "marked", 1), CHECKPOINT_KEY: {"step": 1}})
        assert ledger.retain(token, {"train": ["kept", "kept_0_0"]}) == 4
        assert not pending and set(ledger.snapshot()["items"]["train"]) == {"kept", "kept_0_0"}
        assert ledger.snapshot()["consumed"] == {} and ledger.info()["checkpoint_step"] is None
        assert ledger.info()["consumed_marks"] == 0
    finally:
        ledger.close()


def test_resume_settles_what_it_reads_inside_its_write_transaction(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``resume`` reads the checkpoint's step, every item and mark and the cursor inside its one write
    transaction: a mark landing after the call began and before its transaction opens is settled with the rest
    (a group consumed at or before the checkpoint is deleted, not handed back to TransferQueue to train on
    twice; one consumed after it is finished again). Reading before the transaction hands the first back and
    leaves both marks."""
    ledger = VerlLedger(str(tmp_path / "live.kv"))
    try:
        token = ledger.open_run()["token"]
        for uid in ("before", "after", "live"):
            _finish(ledger, token, "train", uid, 1)
        pending = _landing_at(monkeypatch, ledger, {**_mark("train", "before", 2), **_mark("train", "after", 3),
                                                    CURSOR_KEY: {"fetched": 6}})
        settled = ledger.resume(token, 2)
        assert not pending and set(settled["items"]["train"]) == {"after", "after_0_0", "before_0_0", "live",
                                                                  "live_0_0"}
        assert settled["cursor"] == {"fetched": 6} and settled["step"] == 2
        assert ledger.snapshot()["consumed"] == {} and ledger.info()["consumed_marks"] == 0
        assert "before" not in ledger.snapshot()["items"]["train"]
    finally:
        ledger.close()


def test_a_checkpoints_purge_lists_the_marks_inside_its_write_transaction(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """What a checkpoint does after its copy (its step record and the purge of the marks it covers) lists the
    marks inside its one write transaction: a mark the checkpoint covers that lands after the copy and before
    that transaction opens (a clear in the default group, which holds no lock the copy waits for) is purged with
    its group. A listing taken before the transaction leaves the mark, and the group, past the checkpoint that
    covers it."""
    ledger = VerlLedger(str(tmp_path / "live.kv"))
    try:
        token = ledger.open_run()["token"]
        ledger.checkpoint(token, str(tmp_path / "s1" / LEDGER_FILE), 1)
        _finish(ledger, token, "train", "g", 2)
        pending = _landing_at(monkeypatch, ledger, _mark("train", "g", 2), skip=1)  # after the stamp transaction
        ledger.checkpoint(token, str(tmp_path / "s3" / LEDGER_FILE), 3)
        assert not pending and ledger.info()["consumed_marks"] == 0 and ledger.info()["checkpoint_step"] == 3
        assert ledger._values.keys(item_prefix("train", "g")) == [] and "g_0_0" in ledger.snapshot()["items"]["train"]
    finally:
        ledger.close()


def test_open_run_numbers_the_run_inside_its_write_transaction(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``open_run`` reads the run number inside its write transaction: a run record landing after the call began
    and before its transaction opens is counted, so run numbers never go back."""
    ledger = VerlLedger(str(tmp_path / "live.kv"))
    try:
        assert ledger.open_run()["run"] == 1
        pending = _landing_at(monkeypatch, ledger, {RUN_KEY: {"run": 7}})
        assert ledger.open_run()["run"] == 8 and not pending and ledger.info()["run"] == 8
    finally:
        ledger.close()

# The killed run of the next test: verl's async traffic as the mirror records it (dispatches with the
# dataloader position, finished groups, sampled and trained groups), three steps, never a checkpoint.
_NEVER_CHECKPOINTED = r"""
import json, sys, time
from kvckpt.integrations.transferqueue.values import encode_value, new_write_id
from kvckpt.integrations.verl.ledger import VerlLedger
from kvckpt.integrations.verl.records import TAG, record_key

path, partition, out = sys.argv[1:4]
ledger = VerlLedger(path)
token = ledger.open_run()["token"]

def tags(entries):
    keys, values = [], []
    for key, tag in entries:
        for name, value in tag.items():
            keys.append(record_key(partition, key, TAG, name))
            values.append(encode_value(keys[-1], value, new_write_id(), 1))
    return keys, values

marks = []
for step in range(1, 5):
    uids = [f"s{step}a", f"s{step}b"]
    ledger.set_cursor(token, {"fetched": 2 * step}, *tags([(u, {"is_prompt": True, "status": "pending",
                                                                 "global_steps": step}) for u in uids]))
    ledger.put(token, *tags([(f"{u}_0_0", {"status": "success", "global_steps": step}) for u in uids]
                            + [(u, {"status": "finished"}) for u in uids]))
    if step < 4:  # step 4's groups finish and are never sampled
        ledger.clear(token, partition, uids, consumed_step=step)
        ledger.clear(token, partition, [f"{u}_0_0" for u in uids])
    marks.append(ledger.info()["consumed_marks"])
with open(out, "w") as f:
    json.dump({"marks": marks, "held": sorted(ledger.snapshot()["items"][partition])}, f)
time.sleep(3600)
"""


def test_a_restart_without_a_checkpoint_starts_from_scratch(buffer: Any, tmp_path: Path) -> None:
    """Gap closed, decided by verl's semantics: with no checkpoint verl's ``_load_checkpoint`` trains from scratch
    (step 0, the initial weights, the dataloader from its start, an empty TransferQueue), so a killed async run
    that never checkpointed needs none of its consumed groups back, and none is kept: the marks stay at zero
    while it runs. The restart (a fresh ledger actor opening the file the SIGKILLed process wrote) keeps
    nothing, not even the finished groups or the dataloader position: reusing them under a dataloader that
    starts again would train their prompts twice."""
    path, partition, out = str(tmp_path / "ledger.kv"), f"test-{_uid()}", tmp_path / "run.json"
    child = subprocess.Popen([sys.executable, "-c", _NEVER_CHECKPOINTED, path, partition, str(out)],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert out.exists(), f"the killed run did not get ready (exit {child.poll()})"
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    killed = json.loads(out.read_text())
    assert killed == {"marks": [0, 0, 0, 0], "held": ["s4a", "s4a_0_0", "s4b", "s4b_0_0"]}

    actor, current = f"{ACTOR}_scratch", active()
    try:
        rb = KvckptReplayBufferAsync(trainer_mode="colocate_async", trainer_config={}, max_off_policy_threshold=2,
                                     max_off_policy_strategy="drop",
                                     sampler_kwargs={"kvckpt": {"path": path, "actor_name": actor}})
        assert rb.restored == 0 and rb.mirror.pending_cursor is None
        assert ray.get(rb.ledger.snapshot.remote()) == {"items": {}, "consumed": {}, "cursor": None}
        assert ray.get(rb.ledger.info.remote())["checkpoint_step"] is None
        assert partition not in RAW["kv_list"]()
    finally:
        install(current)  # the module's ledger mirrors this process again, and joining workers
        publish(MirrorRef(current.actor_name, current.token))
        ray.kill(ray.get_actor(actor, namespace="kvckpt"))
