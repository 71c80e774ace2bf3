"""verl's V1 replay-buffer tests, ported onto the kvckpt buffer (``KvckptReplayBuffer[Async]``).

Source: verl's ``tests/trainer/ppo/v1/test_replay_buffer_on_cpu.py`` (verl-project/verl at
1dda039b9; its V1 ``replay_buffer.py`` differs from the 0.9.1 wheel's only by the wheel's
``max_off_policy_threshold=None`` and canonical-reward DAPO additions). Each test names the verl
test and line it ports. The calls are verl's: the buffer is built with verl's constructor keywords
(``_make_rb``, verl line 51), prompts and trajectories are written with ``tq.kv_put`` exactly as
verl's ``RolloutProducer`` (line 152) writes them, and the buffer is driven through ``sample``,
``get_sampleable_count`` and ``wait_for_sampleable`` with verl's arguments, against a real
TransferQueue on a loopback Ray with 8 logical CPUs (3 hang ``tq.init`` on a 2-core machine).

One deviation in every test: ``sampler_kwargs`` carries the ledger section (``{"kvckpt": {...}}``)
where verl's pass ``{}``. One addition in every test: after the scenario, the ledger holds exactly
what TransferQueue lists (tags compared key by key; sampled prompts as consumed marks). Runs in
``.venv-verl`` (``scripts/peer_envs/verl.txt``); skipped where verl is not installed.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

import ray
import torch
import transfer_queue as tq
from _verl_support import transferqueue
from kvckpt.integrations.verl import KvckptReplayBuffer, KvckptReplayBufferAsync
from kvckpt.integrations.verl.mirror import RAW, active

pytestmark = pytest.mark.verl

POLL = 0.05  # verl's POLL_INTERVAL (line 35)
ACTOR = f"kvckpt_verl_test_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def ledger_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """verl's module-scoped ``tq_init`` (line 38), on loopback Ray, plus one ledger for the module."""
    with transferqueue("kvckpt-verl-rb", ACTOR):
        path = str(tmp_path_factory.mktemp("verl_rb") / "ledger.kv")
        _make_rb(path)  # installs the mirror before the first test writes anything
        yield path


@pytest.fixture
def partition_id(ledger_path: str) -> Iterator[str]:
    """verl's per-test partition (line 45); afterwards the ledger must agree with TransferQueue."""
    pid = f"test-{uuid.uuid4().hex}"
    yield pid
    _assert_ledger_agrees(pid)
    _clear_partition(pid)
    mirror = active()
    listing = RAW["kv_list"]() or {}
    ray.get(mirror.actor.retain.remote(mirror.token, {p: list(v) for p, v in listing.items()}))


def _make_rb(path: str, *, trainer_mode: str = "sync", max_off_policy_threshold: int = 8,
             max_off_policy_strategy: str = "drop", refill_fn: Any = None, **kwargs: Any) -> Any:
    """verl's ``_make_rb`` (line 51): the same keywords, the kvckpt classes, the ledger in ``sampler_kwargs``."""
    cls = KvckptReplayBuffer if trainer_mode == "sync" else KvckptReplayBufferAsync
    return cls(trainer_mode=trainer_mode, trainer_config={}, max_off_policy_threshold=max_off_policy_threshold,
               max_off_policy_strategy=max_off_policy_strategy,
               sampler_kwargs={"kvckpt": {"path": path, "actor_name": ACTOR}}, poll_interval=POLL,
               refill_fn=refill_fn, **kwargs)


def _uid() -> str:
    return uuid.uuid4().hex


def _group(partition_id: str, status: str, *, sessions: int = 1, global_steps: int = 0) -> tuple[str, list[str]]:
    """verl's ``RolloutProducer.run`` (line 162) for one prompt: each session's trajectory, then the status."""
    uid, keys = _uid(), []
    for session in range(sessions):
        key = f"{uid}_{session}_0"
        tq.kv_put(key=key, partition_id=partition_id, fields={"input_ids": torch.tensor([1, 2, 3])},
                  tag={"is_prompt": False, "seq_len": 3, "global_steps": global_steps})
        keys.append(key)
    tq.kv_put(key=uid, partition_id=partition_id,
              tag={"is_prompt": True, "status": status, "global_steps": global_steps})
    return uid, keys


def _set_status(partition_id: str, uid: str, status: str, global_steps: int = 0) -> None:
    """verl's ``_set_prompt_status`` (line 127)."""
    tq.kv_put(key=uid, partition_id=partition_id, tag={"is_prompt": True, "status": status,
                                                        "global_steps": global_steps})


def _clear_partition(partition_id: str) -> None:
    """verl's ``_clear_partition`` (line 264)."""
    keys = list(tq.kv_list(partition_id=partition_id).get(partition_id, {}))
    if keys:
        tq.kv_clear(keys=keys, partition_id=partition_id)


def _uids(keys: list[str]) -> set[str]:
    return {k.split("_")[0] for k in keys}


def _listed(partition_id: str) -> dict[str, dict]:
    return tq.kv_list(partition_id=partition_id).get(partition_id, {})


def _assert_ledger_agrees(partition_id: str) -> None:
    """The addition: every key TransferQueue lists is in the ledger with the same tag, and nothing else is
    (a sampled prompt is there as a consumed mark)."""
    snap = ray.get(active().actor.snapshot.remote())
    listed = _listed(partition_id)
    held = snap["items"].get(partition_id, {})
    assert set(held) == set(listed)
    for key, tag in listed.items():
        assert held[key]["tags"] == tag, key


class _Refiller:
    """verl's ``FakeRefiller`` (line 82): writes ``n`` finished groups synchronously, records the calls."""

    def __init__(self, partition_id: str, global_steps: int) -> None:
        self.partition_id, self.global_steps = partition_id, global_steps
        self.calls: list[int] = []
        self.produced: list[str] = []

    def __call__(self, n: int) -> int:
        self.calls.append(n)
        self.produced += [_group(self.partition_id, "finished", global_steps=self.global_steps)[0] for _ in range(n)]
        return n


class _Background(threading.Thread):
    """verl's ``SampleConsumer`` / ``WaitConsumer`` (lines 192, 225): a blocking call in a thread."""

    def __init__(self, fn: Any, **kwargs: Any) -> None:
        super().__init__(daemon=True)
        self.fn, self.kwargs, self.result, self.error = fn, kwargs, None, None

    def run(self) -> None:
        try:
            self.result = self.fn(**self.kwargs)
        except Exception as exc:  # surfaced by value()
            self.error = exc

    def value(self, timeout: float = 10.0) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "the blocking call did not return"
        if self.error is not None:
            raise self.error
        return self.result


# -- __init__ validation ------------------------------------------------------------------------
def test_init_rejects_non_positive_threshold(ledger_path: str) -> None:
    """verl line 278."""
    with pytest.raises(AssertionError, match="max off policy threshold"):
        _make_rb(ledger_path, max_off_policy_threshold=0)


def test_init_rejects_unknown_strategy(ledger_path: str) -> None:
    """verl line 284."""
    with pytest.raises(AssertionError, match="max off policy strategy"):
        _make_rb(ledger_path, max_off_policy_strategy="bogus")


def test_init_rejects_dapo_without_refill_fn(ledger_path: str) -> None:
    """verl line 712."""
    with pytest.raises(ValueError, match="requires refill_fn"):
        _make_rb(ledger_path, filter_groups_metric="acc", refill_fn=None)


# -- metadata sync ------------------------------------------------------------------------------
def test_sync_metadata_classifies_keys(partition_id: str, ledger_path: str) -> None:
    """verl line 304."""
    pending, _ = _group(partition_id, "pending", sessions=0)
    running, r_keys = _group(partition_id, "running")
    finished, f_keys = _group(partition_id, "finished", sessions=2)
    failure, x_keys = _group(partition_id, "failure")
    rb = _make_rb(ledger_path)
    rb._sync_metadata_from_transfer_queue()
    assert rb.pending_keys[partition_id] == {pending}
    assert rb.running_keys[partition_id] == {running}
    assert rb.finished_keys[partition_id] == {finished}
    assert rb.failure_keys[partition_id] == {failure}
    assert set(rb.partitions[partition_id]) == {*r_keys, *f_keys, *x_keys}
    assert all(t == {"is_prompt": False, "seq_len": 3, "global_steps": 0} for t in rb.partitions[partition_id].values())


def test_sync_metadata_unknown_status_raises(partition_id: str, ledger_path: str) -> None:
    """verl line 330."""
    _group(partition_id, "bogus", sessions=0)
    rb = _make_rb(ledger_path)
    try:
        with pytest.raises(ValueError, match="Unknown status"):
            rb._sync_metadata_from_transfer_queue()
    finally:
        _clear_partition(partition_id)


# -- sample --------------------------------------------------------------------------------------
def test_sample_returns_finished_and_failure_trajectories(partition_id: str, ledger_path: str) -> None:
    """verl line 373; sync mode keeps nothing across a restart, so the sampled prompts leave the ledger too."""
    finished, f_keys = _group(partition_id, "finished", sessions=2)
    failure, x_keys = _group(partition_id, "failure")
    running, _ = _group(partition_id, "running")
    rb = _make_rb(ledger_path)
    batch, _ = rb.sample(global_steps=0, partition_id=partition_id, batch_size=2)
    assert batch.partition_id == partition_id and set(batch.keys) == {*f_keys, *x_keys}
    assert len(batch.tags) == len(batch.keys)
    remaining = _listed(partition_id)
    assert finished not in remaining and failure not in remaining and running in remaining
    assert partition_id not in ray.get(rb.ledger.snapshot.remote())["consumed"]


def test_sample_prioritizes_smallest_global_steps(partition_id: str, ledger_path: str) -> None:
    """verl line 429."""
    newest, _ = _group(partition_id, "finished", global_steps=5)
    oldest, _ = _group(partition_id, "finished", global_steps=1)
    middle, _ = _group(partition_id, "finished", global_steps=2)
    rb = _make_rb(ledger_path)
    batch, _ = rb.sample(global_steps=0, partition_id=partition_id, batch_size=2)
    assert _uids(batch.keys) == {oldest, middle}
    assert newest in _listed(partition_id)


def test_sample_blocks_until_enough_then_unblocks(partition_id: str, ledger_path: str) -> None:
    """verl line 453."""
    _group(partition_id, "finished")
    rb = _make_rb(ledger_path)
    consumer = _Background(rb.sample, global_steps=0, partition_id=partition_id, batch_size=2)
    consumer.start()
    time.sleep(POLL * 5)
    assert consumer.is_alive()
    _group(partition_id, "finished")
    batch, _ = consumer.value()
    assert len(batch.keys) == 2


def test_sync_grpo_step_returns_complete_groups(partition_id: str, ledger_path: str) -> None:
    """verl line 478."""
    groups = [_group(partition_id, "finished", sessions=4) for _ in range(3)]
    rb = _make_rb(ledger_path)
    batch, _ = rb.sample(global_steps=0, partition_id=partition_id, batch_size=3)
    assert set(batch.keys) == {k for _, keys in groups for k in keys} and len(batch.keys) == 12


def test_async_overproduction_drains_in_batches_without_duplicates(partition_id: str, ledger_path: str) -> None:
    """verl line 502."""
    uids = {_group(partition_id, "finished", sessions=2)[0] for _ in range(5)}
    rb = _make_rb(ledger_path)
    seen: set[str] = set()
    for size in (2, 2, 1):
        batch, _ = rb.sample(global_steps=0, partition_id=partition_id, batch_size=size)
        got = _uids(batch.keys)
        assert len(got) == size and len(batch.keys) == 2 * size and not got & seen
        seen |= got
        rb._sync_metadata_from_transfer_queue()
    assert seen == uids


# -- off-policy: drop and wait ------------------------------------------------------------------
def test_drop_refills_stale_groups_and_reports_metrics(partition_id: str, ledger_path: str) -> None:
    """verl line 551; the dropped group is gone from the ledger too (the partition check)."""
    stale, stale_keys = _group(partition_id, "finished", global_steps=0)
    boundary, _ = _group(partition_id, "finished", global_steps=4)
    fresh, _ = _group(partition_id, "finished", global_steps=5)
    inflight, _ = _group(partition_id, "running", global_steps=0)
    refiller = _Refiller(partition_id, 5)
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", max_off_policy_threshold=2, refill_fn=refiller)
    batch, metrics = rb.sample(global_steps=5, partition_id=partition_id, batch_size=3)
    got = _uids(batch.keys)
    assert len(got) == 3 and stale not in got and inflight not in got and {boundary, fresh} <= got
    assert len(got & set(refiller.produced)) == 1 and refiller.calls == [1]
    assert stale not in _listed(partition_id) and stale_keys[0] not in _listed(partition_id)
    assert metrics["validation/off_policy/evicted_samples"] == 1
    for stat in ("mean", "max", "min"):
        assert metrics[f"validation/off_policy/evicted_samples_staleness/{stat}"] == 6


def test_wait_blocks_until_stale_inflight_finishes(partition_id: str, ledger_path: str) -> None:
    """verl line 640."""
    for _ in range(2):
        _group(partition_id, "finished", global_steps=5)
    stale, _ = _group(partition_id, "running", global_steps=0)
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", max_off_policy_strategy="wait",
                  max_off_policy_threshold=2)
    consumer = _Background(rb.sample, global_steps=5, partition_id=partition_id, batch_size=2)
    consumer.start()
    time.sleep(POLL * 5)
    assert consumer.is_alive()
    _set_status(partition_id, stale, "finished")
    batch, _ = consumer.value()
    assert len(_uids(batch.keys)) == 2


def test_wait_keeps_stale_terminal_trajectories(partition_id: str, ledger_path: str) -> None:
    """verl line 670; async mode with no checkpoint yet: the sampled prompt leaves the ledger, unmarked (a restart
    would train from scratch, so no mark is kept)."""
    uid, keys = _group(partition_id, "finished", global_steps=0)
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", max_off_policy_strategy="wait",
                  max_off_policy_threshold=2)
    batch, metrics = rb.sample(global_steps=100, partition_id=partition_id, batch_size=1)
    assert set(batch.keys) == set(keys) and metrics == {}
    snapshot = ray.get(rb.ledger.snapshot.remote())
    assert partition_id not in snapshot["consumed"] and uid not in snapshot["items"].get(partition_id, {})


def test_async_failure_refills_exact_missing_count(partition_id: str, ledger_path: str) -> None:
    """verl line 785."""
    finished, _ = _group(partition_id, "finished")
    failure, _ = _group(partition_id, "failure")
    refiller = _Refiller(partition_id, 1)
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", refill_fn=refiller)
    batch, metrics = rb.sample(global_steps=1, partition_id=partition_id, batch_size=2)
    assert failure not in _uids(batch.keys) and finished in _uids(batch.keys)
    assert refiller.calls == [1] and metrics["validation/rollout_failure/evicted_samples"] == 1


# -- the separate-async trainer's calls ---------------------------------------------------------
def test_get_sampleable_count_excludes_stale_groups_without_consuming(partition_id: str, ledger_path: str) -> None:
    """verl line 1179."""
    fresh, _ = _group(partition_id, "finished", global_steps=5)
    stale, _ = _group(partition_id, "finished", global_steps=0)
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", max_off_policy_threshold=1)
    assert rb.get_sampleable_count(global_steps=5, partition_id=partition_id) == 1
    assert {fresh, stale} <= set(_listed(partition_id))


def test_wait_for_sampleable_blocks_below_the_target(partition_id: str, ledger_path: str) -> None:
    """verl line 1212."""
    _group(partition_id, "finished")
    pending, _ = _group(partition_id, "running")
    rb = _make_rb(ledger_path, trainer_mode="colocate_async")
    waiter = _Background(rb.wait_for_sampleable, global_steps=0, partition_id=partition_id, target_count=2)
    waiter.start()
    time.sleep(POLL * 5)
    assert waiter.is_alive()
    _set_status(partition_id, pending, "finished")
    assert waiter.value()[1] == {}


def test_wait_for_sampleable_replaces_groups_sample_would_have_evicted(partition_id: str, ledger_path: str) -> None:
    """verl line 1233."""
    _group(partition_id, "finished", global_steps=0)
    refiller = _Refiller(partition_id, 5)
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", max_off_policy_threshold=1, refill_fn=refiller)
    _, metrics = rb.wait_for_sampleable(global_steps=5, partition_id=partition_id, target_count=1)
    assert refiller.calls == [1] and metrics["validation/off_policy/evicted_samples"] == 1
    batch, _ = rb.sample(global_steps=5, partition_id=partition_id, batch_size=1)
    assert _uids(batch.keys) == {refiller.produced[0]}
