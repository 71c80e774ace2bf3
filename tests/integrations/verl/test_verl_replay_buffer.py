"""verl's V1 replay-buffer tests, ported onto the kvckpt buffer (``KvckptReplayBuffer[Async]``): all 44.

Source: verl's ``tests/trainer/ppo/v1/test_replay_buffer_on_cpu.py`` (verl-project/verl at
1dda039b9; its V1 ``replay_buffer.py`` differs from the 0.9.1 wheel's only by the wheel's
``max_off_policy_threshold=None`` and canonical-reward DAPO additions, so every test applies to
0.9.1). Each test names the verl test and line it ports, in verl's order. The calls are verl's: the
buffer is built with verl's constructor keywords and defaults (``_make_rb``, verl line 51),
prompts and trajectories are written with ``tq.kv_put`` exactly as verl's ``RolloutProducer``
(line 152) writes them (DAPO rewards in ``extra_fields.reward_extra_info``), and the buffer is
driven through ``sample``, ``get_sampleable_count``, ``wait_for_sampleable`` and the private
helpers verl's tests call, with verl's arguments, against a real TransferQueue on a loopback Ray
with 8 logical CPUs (3 hang ``tq.init`` on a 2-core machine). The file is long because it is one
port of one verl file, test for test, sharing one Ray and TransferQueue per module.

One deviation in every test: ``sampler_kwargs`` carries the ledger section (``{"kvckpt": {...}}``)
where verl's pass ``{}``; and a call that must return gets :data:`HANG` seconds (verl: 2 to 10). Two tests
differ further, each saying how in its docstring:
``test_clear_groups_updates_active_snapshot`` (verl's recording ``kv_clear`` swallows the call,
here it forwards to the mirrored one) and ``test_accumulate_eviction_metrics_merges_filtered_reward_counts``
(verl's pure function, then the same merge through the kvckpt buffer's ``sample``). One addition
in every test: after the scenario, the ledger holds exactly what TransferQueue lists (tags compared
key by key; sampled prompts as consumed marks). Runs in ``.venv-verl``
(``scripts/peer_envs/verl.txt``); skipped where verl is not installed.
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
from verl.trainer.ppo.v1.replay_buffer import DAPO_FILTERED_REWARD_COUNTS_KEY, _accumulate_eviction_metrics

pytestmark = pytest.mark.verl

POLL = 0.05  # verl's POLL_INTERVAL (line 35)
#: How long a call that must return may take before the test calls it hung. verl waits 10 s (2 s and 5 s in
#: two tests); a buffer that wrongly blocks never returns, so any bound finds it, and this one leaves room
#: for a 2-core machine under load (every put is a ledger transaction here). Not a timing threshold.
HANG = 60.0
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
    _settle(pid)


@pytest.fixture
def val(ledger_path: str) -> Iterator[str]:
    """verl's validation tests' fixed partition ``"val"`` (lines 728, 752), settled as ``partition_id``."""
    yield "val"
    _settle("val")


def _settle(partition_id: str) -> None:
    """The ledger agrees with TransferQueue; then both forget the partition (the module shares one ledger)."""
    _assert_ledger_agrees(partition_id)
    _clear_partition(partition_id)
    mirror = active()
    listing = RAW["kv_list"]() or {}
    ray.get(mirror.actor.retain.remote(mirror.token, {p: list(v) for p, v in listing.items()}))


def _make_rb(path: str, *, max_off_policy_threshold: int = 8, max_off_policy_strategy: str = "drop",
             poll_interval: float = POLL, refill_fn: Any = None, trainer_mode: str = "sync",
             filter_groups_metric: str | None = None, train_batch_size: int = 2, gen_batch_size: int = 1,
             max_inflight_gen_batches: int = 1, sync_refill_failed_groups: bool = False) -> Any:
    """verl's ``_make_rb`` (line 51): its keywords and defaults, the kvckpt classes, the ledger in
    ``sampler_kwargs``."""
    cls = KvckptReplayBuffer if trainer_mode == "sync" else KvckptReplayBufferAsync
    return cls(trainer_mode=trainer_mode, trainer_config={}, max_off_policy_threshold=max_off_policy_threshold,
               max_off_policy_strategy=max_off_policy_strategy,
               sampler_kwargs={"kvckpt": {"path": path, "actor_name": ACTOR}}, poll_interval=poll_interval,
               refill_fn=refill_fn, filter_groups_metric=filter_groups_metric, train_batch_size=train_batch_size,
               gen_batch_size=gen_batch_size, max_inflight_gen_batches=max_inflight_gen_batches,
               sync_refill_failed_groups=sync_refill_failed_groups)


def _uid() -> str:
    return uuid.uuid4().hex


def _group(partition_id: str, status: str, *, sessions: int = 1, global_steps: int = 0,
           rewards: list[float] | None = None) -> tuple[str, list[str]]:
    """verl's ``RolloutProducer.run`` (line 162) for one ``PromptSpec``: each session's trajectory (with its
    reward in ``extra_fields.reward_extra_info["acc"]`` when ``rewards`` is given), then the prompt's status."""
    uid, keys = _uid(), []
    for session in range(sessions):
        key = f"{uid}_{session}_0"
        fields: dict[str, Any] = {"input_ids": torch.tensor([1, 2, 3])}
        if rewards is not None:
            fields["extra_fields"] = {"reward_extra_info": {"acc": float(rewards[session])}}
        tq.kv_put(key=key, partition_id=partition_id, fields=fields,
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
    """verl's ``_clear_partition`` (line 262)."""
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

    def __init__(self, partition_id: str, global_steps: int, sessions: int = 1,
                 rewards: list[float] | None = None) -> None:
        self.partition_id, self.global_steps = partition_id, global_steps
        self.sessions, self.rewards = sessions, rewards
        self.calls: list[int] = []
        self.produced: list[str] = []

    def __call__(self, n: int) -> int:
        self.calls.append(n)
        self.produced += [_group(self.partition_id, "finished", sessions=self.sessions, global_steps=self.global_steps,
                                 rewards=self.rewards)[0] for _ in range(n)]
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

    def value(self, timeout: float = HANG) -> Any:
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


def test_init_rejects_non_positive_sync_dapo_inflight_limit(ledger_path: str) -> None:
    """verl line 290."""
    with pytest.raises(ValueError, match="max_inflight_gen_batches"):
        _make_rb(ledger_path, refill_fn=lambda _n: None, filter_groups_metric="acc", max_inflight_gen_batches=0)


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


def test_clear_groups_updates_active_snapshot(partition_id: str, ledger_path: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """verl line 344. Differs: verl's two groups exist only in the buffer's snapshot (partition ``"p"``,
    uids ``"drop"``/``"keep"``) and its recording ``kv_clear`` swallows the call, which would bypass the
    ledger; here they are real groups in the test's partition and the recording ``kv_clear`` forwards
    to the mirrored one. verl's assertions unchanged, plus: the dropped group is gone from TransferQueue
    and (the partition check) from the ledger, in the one clear verl makes."""
    rb = _make_rb(ledger_path)
    pid = partition_id
    dropped_uid, (dropped_trajectory,) = _group(pid, "finished")
    kept_uid, (kept_trajectory,) = _group(pid, "finished")
    rb.partitions[pid] = {dropped_trajectory: {}, kept_trajectory: {}}
    for status_keys in (rb.pending_keys, rb.running_keys, rb.finished_keys, rb.failure_keys):
        status_keys[pid] |= {dropped_uid, kept_uid}
    rb.prompt_global_steps[pid] = {dropped_uid: 1, kept_uid: 2}
    rb._dapo_classification_cache[pid] = {dropped_uid: 0.0, kept_uid: None}

    cleared: list[set[str]] = []
    mirrored = tq.kv_clear

    def recording(*, keys: list[str], partition_id: str) -> Any:
        cleared.append(set(keys))
        return mirrored(keys=keys, partition_id=partition_id)

    monkeypatch.setattr(tq, "kv_clear", recording)
    rb._clear_groups(pid, {dropped_uid})

    assert cleared == [{dropped_uid, dropped_trajectory}]
    assert rb.partitions[pid] == {kept_trajectory: {}}
    for status_keys in (rb.pending_keys, rb.running_keys, rb.finished_keys, rb.failure_keys):
        assert status_keys[pid] == {kept_uid}
    assert rb.prompt_global_steps[pid] == {kept_uid: 2}
    assert rb._dapo_classification_cache[pid] == {kept_uid: None}
    assert set(_listed(pid)) == {kept_uid, kept_trajectory}


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


def test_sync_failure_without_trajectories_uses_padding_path_by_default(partition_id: str, ledger_path: str) -> None:
    """verl line 402."""
    finished, _ = _group(partition_id, "finished")
    _group(partition_id, "failure", sessions=0)
    rb = _make_rb(ledger_path)
    batch, metrics = rb.sample(global_steps=0, partition_id=partition_id, batch_size=2)
    assert _uids(batch.keys) == {finished} and metrics == {}


def test_sync_all_empty_failures_raise_without_refill(partition_id: str, ledger_path: str) -> None:
    """verl line 417: refused before anything is cleared, so both failures stay, in the ledger too."""
    failures = [_group(partition_id, "failure", sessions=0)[0] for _ in range(2)]
    rb = _make_rb(ledger_path)
    with pytest.raises(RuntimeError, match="sync_refill_failed_groups"):
        rb.sample(global_steps=0, partition_id=partition_id, batch_size=2)
    assert set(_listed(partition_id)) == set(failures)


def test_sample_prioritizes_smallest_global_steps(partition_id: str, ledger_path: str) -> None:
    """verl line 429."""
    newest, _ = _group(partition_id, "finished", global_steps=5)
    oldest, _ = _group(partition_id, "finished", global_steps=1)
    middle, _ = _group(partition_id, "finished", global_steps=2)
    rb = _make_rb(ledger_path)
    batch, _ = rb.sample(global_steps=0, partition_id=partition_id, batch_size=2)
    assert _uids(batch.keys) == {oldest, middle}
    remaining = _listed(partition_id)
    assert oldest not in remaining and middle not in remaining and newest in remaining


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
    per_uid: dict[str, int] = {}
    for key in batch.keys:
        per_uid[key.split("_")[0]] = per_uid.get(key.split("_")[0], 0) + 1
    assert set(per_uid.values()) == {4}


def test_async_overproduction_drains_in_batches_without_duplicates(partition_id: str, ledger_path: str) -> None:
    """verl line 502."""
    uids = {_group(partition_id, "finished", sessions=2)[0] for _ in range(5)}
    rb = _make_rb(ledger_path)
    seen: set[str] = set()
    collected: list[str] = []
    for size in (2, 2, 1):
        batch, _ = rb.sample(global_steps=0, partition_id=partition_id, batch_size=size)
        got = _uids(batch.keys)
        assert len(got) == size and len(batch.keys) == 2 * size and not got & seen
        seen |= got
        collected += batch.keys
        rb._sync_metadata_from_transfer_queue()
    assert seen == uids and len(collected) == 10 == len(set(collected))


# -- off-policy: drop ---------------------------------------------------------------------------
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


def test_drop_uses_one_snapshot_per_poll_iteration(partition_id: str, ledger_path: str) -> None:
    """verl line 599 (the drop race): a stale running prompt that finishes during the first refill is
    dropped on the next snapshot; its status flip, made from inside ``sample``, is a ledger transaction too."""
    stale_finished, _ = _group(partition_id, "finished", global_steps=0)
    stale_running, _ = _group(partition_id, "running", global_steps=0)
    refiller = _Refiller(partition_id, 5)

    def finish_during_first_refill(num_prompts: int) -> int:
        if not refiller.calls:
            _set_status(partition_id, stale_running, "finished", global_steps=0)
        return refiller(num_prompts)

    rb = _make_rb(ledger_path, trainer_mode="colocate_async", max_off_policy_strategy="drop",
                  max_off_policy_threshold=1, refill_fn=finish_during_first_refill)
    batch, metrics = rb.sample(global_steps=5, partition_id=partition_id, batch_size=1)
    got = _uids(batch.keys)
    assert len(got) == 1 and not got & {stale_finished, stale_running} and got <= set(refiller.produced)
    assert refiller.calls == [1, 1]
    assert metrics["validation/off_policy/evicted_samples"] == 2


# -- off-policy: wait ---------------------------------------------------------------------------
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


def test_wait_does_not_block_when_inflight_is_fresh(partition_id: str, ledger_path: str) -> None:
    """verl line 688."""
    finished = {_group(partition_id, "finished", global_steps=3)[0] for _ in range(2)}
    _group(partition_id, "running", global_steps=3)
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", max_off_policy_strategy="wait",
                  max_off_policy_threshold=4)
    batch, metrics = rb.sample(global_steps=3, partition_id=partition_id, batch_size=2)
    assert _uids(batch.keys) == finished and metrics == {}


# -- the mode matrix: stale drop, DAPO, rollout failure -----------------------------------------
def test_init_rejects_dapo_without_refill_fn(ledger_path: str) -> None:
    """verl line 712."""
    with pytest.raises(ValueError, match="requires refill_fn"):
        _make_rb(ledger_path, filter_groups_metric="acc", refill_fn=None)


def test_init_rejects_sync_failure_refill_without_refill_fn(ledger_path: str) -> None:
    """verl line 717."""
    with pytest.raises(ValueError, match="requires refill_fn"):
        _make_rb(ledger_path, sync_refill_failed_groups=True, refill_fn=None)


def test_init_rejects_batched_sync_failure_refill(ledger_path: str) -> None:
    """verl line 722."""
    with pytest.raises(ValueError, match="requires gen_batch_size=1"):
        _make_rb(ledger_path, sync_refill_failed_groups=True, refill_fn=lambda _n: None, gen_batch_size=2)


def test_validation_never_drops_terminal_groups(val: str, ledger_path: str) -> None:
    """verl line 727; validation samples are deleted, not marked consumed, in async mode too."""
    _clear_partition(val)
    stale_dapo, _ = _group(val, "finished", sessions=2, global_steps=0, rewards=[1.0, 1.0])
    stale_failure, _ = _group(val, "failure", global_steps=0)
    refiller = _Refiller(val, 5, sessions=2, rewards=[0.0, 1.0])
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", max_off_policy_strategy="drop",
                  max_off_policy_threshold=1, refill_fn=refiller, filter_groups_metric="acc")
    batch, metrics = rb.sample(global_steps=5, partition_id=val, batch_size=2)
    assert _uids(batch.keys) == {stale_dapo, stale_failure}
    assert refiller.calls == [] and metrics == {}
    assert val not in ray.get(rb.ledger.snapshot.remote())["consumed"]


def test_validation_ignores_sync_failure_refill(val: str, ledger_path: str) -> None:
    """verl line 751."""
    _clear_partition(val)
    finished, _ = _group(val, "finished")
    _group(val, "failure", sessions=0)
    refiller = _Refiller(val, 1)
    rb = _make_rb(ledger_path, sync_refill_failed_groups=True, refill_fn=refiller)
    batch, metrics = rb.sample(global_steps=1, partition_id=val, batch_size=2)
    assert _uids(batch.keys) == {finished}
    assert refiller.calls == [] and metrics == {}


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_sync_ignores_off_policy_strategy(partition_id: str, ledger_path: str, strategy: str) -> None:
    """verl line 770."""
    stale, _ = _group(partition_id, "finished", global_steps=0)
    fresh, _ = _group(partition_id, "finished", global_steps=5)
    rb = _make_rb(ledger_path, max_off_policy_strategy=strategy, max_off_policy_threshold=1)
    batch, metrics = rb.sample(global_steps=5, partition_id=partition_id, batch_size=2)
    assert _uids(batch.keys) == {stale, fresh} and metrics == {}


def test_async_failure_refills_exact_missing_count(partition_id: str, ledger_path: str) -> None:
    """verl line 785."""
    finished, _ = _group(partition_id, "finished")
    failure, _ = _group(partition_id, "failure")
    refiller = _Refiller(partition_id, 1)
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", refill_fn=refiller)
    batch, metrics = rb.sample(global_steps=1, partition_id=partition_id, batch_size=2)
    assert failure not in _uids(batch.keys) and finished in _uids(batch.keys)
    assert refiller.calls == [1] and metrics["validation/rollout_failure/evicted_samples"] == 1


def test_sync_failure_refill_replaces_empty_failed_groups(partition_id: str, ledger_path: str) -> None:
    """verl line 803."""
    finished, _ = _group(partition_id, "finished")
    failure, _ = _group(partition_id, "failure", sessions=0)
    refiller = _Refiller(partition_id, 1)
    rb = _make_rb(ledger_path, sync_refill_failed_groups=True, refill_fn=refiller)
    batch, metrics = rb.sample(global_steps=1, partition_id=partition_id, batch_size=2)
    got = _uids(batch.keys)
    assert len(got) == 2 and finished in got and failure not in got
    assert refiller.calls == [1] and metrics["validation/rollout_failure/evicted_samples"] == 1


def test_sync_failure_refill_replaces_multiple_empty_failed_groups(partition_id: str, ledger_path: str) -> None:
    """verl line 823."""
    for _ in range(3):
        _group(partition_id, "failure", sessions=0)
    refiller = _Refiller(partition_id, 1)
    rb = _make_rb(ledger_path, sync_refill_failed_groups=True, refill_fn=refiller, train_batch_size=3)
    batch, metrics = rb.sample(global_steps=1, partition_id=partition_id, batch_size=3)
    assert _uids(batch.keys) == set(refiller.produced)
    assert refiller.calls == [3] and metrics["validation/rollout_failure/evicted_samples"] == 3


def test_sync_failure_refill_keeps_materializable_failed_groups(partition_id: str, ledger_path: str) -> None:
    """verl line 839."""
    finished, _ = _group(partition_id, "finished")
    failure, _ = _group(partition_id, "failure", sessions=1)
    refiller = _Refiller(partition_id, 1)
    rb = _make_rb(ledger_path, sync_refill_failed_groups=True, refill_fn=refiller)
    batch, metrics = rb.sample(global_steps=1, partition_id=partition_id, batch_size=2)
    assert _uids(batch.keys) == {finished, failure}
    assert refiller.calls == [] and metrics == {}


def test_sync_failure_refill_does_not_drain_unrelated_inflight(partition_id: str, ledger_path: str) -> None:
    """verl line 856 (verl gives ``sample`` 2 s, here :data:`HANG`: a buffer that drained the running prompt
    would block until the ``finally`` finishes it, however long the bound)."""
    finished, _ = _group(partition_id, "finished")
    _group(partition_id, "failure", sessions=0)
    running, _ = _group(partition_id, "running", sessions=0)
    refiller = _Refiller(partition_id, 1)
    rb = _make_rb(ledger_path, sync_refill_failed_groups=True, refill_fn=refiller)
    consumer = _Background(rb.sample, global_steps=1, partition_id=partition_id, batch_size=1)
    try:
        consumer.start()
        batch, metrics = consumer.value()
        assert _uids(batch.keys) == {finished}
        assert refiller.calls == [] and metrics["validation/rollout_failure/evicted_samples"] == 1
        assert running in _listed(partition_id)
    finally:
        if consumer.is_alive():
            _set_status(partition_id, running, "finished", global_steps=1)
            consumer.join(timeout=HANG)


def test_async_dapo_refills_exact_missing_count(partition_id: str, ledger_path: str) -> None:
    """verl line 882; the filtered group leaves the ledger with TransferQueue (the partition check)."""
    all_same, _ = _group(partition_id, "finished", sessions=2, rewards=[1.0, 1.0])
    mixed, _ = _group(partition_id, "finished", sessions=2, rewards=[0.0, 1.0])
    refiller = _Refiller(partition_id, 1, sessions=2, rewards=[0.0, 1.0])
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", refill_fn=refiller, filter_groups_metric="acc")
    batch, metrics = rb.sample(global_steps=1, partition_id=partition_id, batch_size=2)
    got = _uids(batch.keys)
    assert all_same not in got and mixed in got
    assert refiller.calls == [1] and metrics["validation/filter_groups/evicted_samples"] == 1


def test_dapo_classification_cache_fetches_only_new_finished_groups(partition_id: str, ledger_path: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """verl line 904 (``kv_batch_get`` is TransferQueue's own: the mirror does not replace reads)."""
    first_filtered, first_keys = _group(partition_id, "finished", sessions=2, rewards=[1.0, 1.0])
    _, mixed_keys = _group(partition_id, "finished", sessions=2, rewards=[0.0, 1.0])
    requested: list[set[str]] = []
    original = tq.kv_batch_get

    def recording_kv_batch_get(*args: Any, **kwargs: Any) -> Any:
        requested.append(set(kwargs["keys"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(tq, "kv_batch_get", recording_kv_batch_get)
    rb = _make_rb(ledger_path, filter_groups_metric="acc", refill_fn=lambda _n: None)
    rb._sync_metadata_from_transfer_queue()
    first = rb._dapo_filtered_keys(partition_id)
    assert first[0] == {first_filtered} and dict(first[1]) == {1.0: 1}
    assert rb._dapo_filtered_keys(partition_id) == first

    second_filtered, second_keys = _group(partition_id, "finished", sessions=2, rewards=[0.0, 0.0])
    rb._sync_metadata_from_transfer_queue()
    filtered, counts = rb._dapo_filtered_keys(partition_id)
    assert filtered == {first_filtered, second_filtered} and dict(counts) == {0.0: 1, 1.0: 1}
    assert requested == [{*first_keys, *mixed_keys}, set(second_keys)]


def test_terminal_eviction_reasons_has_no_cross_call_hidden_state(partition_id: str, ledger_path: str) -> None:
    """verl line 940; both evicted groups leave the ledger in ``_evict_terminal_groups``' one clear."""
    _group(partition_id, "finished", sessions=2, rewards=[0.0, 0.0])
    _group(partition_id, "finished", sessions=2, rewards=[1.0, 1.0])
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", filter_groups_metric="acc", refill_fn=lambda _n: None)
    rb._sync_metadata_from_transfer_queue()
    train_reasons = rb._terminal_eviction_reasons(global_steps=0, partition_id=partition_id)
    rb._terminal_eviction_reasons(global_steps=0, partition_id="val")
    _evicted, _stale, dapo_count, metrics = rb._evict_terminal_groups(
        global_steps=0, partition_id=partition_id, eviction_reasons=train_reasons)
    assert dapo_count == 2 and metrics[DAPO_FILTERED_REWARD_COUNTS_KEY] == {0.0: 1, 1.0: 1}
    assert _listed(partition_id) == {}


def test_accumulate_eviction_metrics_merges_filtered_reward_counts(partition_id: str, ledger_path: str) -> None:
    """verl line 963: verl's module function, called as verl calls it (the kvckpt buffer's ``sample`` calls
    it unchanged). Differs: then the same figures through the kvckpt buffer, where the merge happens,
    across three poll iterations of one ``sample`` (4 groups filtered, then 2: {0.0: 3, 1.0: 1} + {0.0: 2})."""
    acc: dict = {}
    _accumulate_eviction_metrics(
        acc, {DAPO_FILTERED_REWARD_COUNTS_KEY: {0.0: 3, 1.0: 1}, "training/filter_groups/evicted_samples": 4},
        stale_count=0)
    _accumulate_eviction_metrics(
        acc, {DAPO_FILTERED_REWARD_COUNTS_KEY: {0.0: 2}, "training/filter_groups/evicted_samples": 2}, stale_count=0)
    assert acc[DAPO_FILTERED_REWARD_COUNTS_KEY] == {0.0: 5, 1.0: 1}
    assert acc["training/filter_groups/evicted_samples"] == 6

    for rewards in ([0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]):
        _group(partition_id, "finished", sessions=2, rewards=rewards)
    calls: list[int] = []

    def refill(n: int) -> int:  # first 2 more all-zero groups and 2 mixed, then only mixed ones
        rewards = [[0.0, 0.0]] * 2 + [[0.0, 1.0]] * (n - 2) if not calls else [[0.0, 1.0]] * n
        calls.append(n)
        for r in rewards:
            _group(partition_id, "finished", sessions=2, rewards=r)
        return n

    rb = _make_rb(ledger_path, trainer_mode="colocate_async", refill_fn=refill, filter_groups_metric="acc")
    _batch, metrics = rb.sample(global_steps=1, partition_id=partition_id, batch_size=2)
    assert calls == [4, 2]
    assert metrics[DAPO_FILTERED_REWARD_COUNTS_KEY] == {0.0: 5, 1.0: 1}
    assert metrics["validation/filter_groups/evicted_samples"] == 6


def test_dapo_reports_filtered_reward_value_breakdown(partition_id: str, ledger_path: str) -> None:
    """verl line 986."""
    for rewards in ([0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]):
        _group(partition_id, "finished", sessions=2, rewards=rewards)
    refiller = _Refiller(partition_id, 1, sessions=2, rewards=[0.0, 1.0])
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", refill_fn=refiller, filter_groups_metric="acc")
    _batch, metrics = rb.sample(global_steps=1, partition_id=partition_id, batch_size=1)
    assert metrics["validation/filter_groups/evicted_samples"] == 3
    assert metrics[DAPO_FILTERED_REWARD_COUNTS_KEY] == {0.0: 2, 1.0: 1}


def test_sync_dapo_refills_twice_and_clears_surplus(partition_id: str, ledger_path: str) -> None:
    """verl line 1007; the discarded surplus leaves the ledger with TransferQueue (the partition check)."""
    all_same, _ = _group(partition_id, "finished", sessions=2, rewards=[0.0, 0.0])
    mixed, _ = _group(partition_id, "finished", sessions=2, rewards=[0.0, 1.0])
    refiller = _Refiller(partition_id, 1, sessions=2, rewards=[0.0, 1.0])
    rb = _make_rb(ledger_path, refill_fn=refiller, filter_groups_metric="acc")
    batch, metrics = rb.sample(global_steps=1, partition_id=partition_id, batch_size=2)
    got, refilled = _uids(batch.keys), set(refiller.produced)
    assert all_same not in got and mixed in got
    assert refiller.calls == [2] and len(got & refilled) == 1
    assert metrics["validation/filter_groups/evicted_samples"] == 1
    assert metrics["validation/filter_groups/discarded_surplus_samples"] == 1
    surplus = (refilled - got).pop()
    remaining = _listed(partition_id)
    assert surplus not in remaining and f"{surplus}_0_0" not in remaining and f"{surplus}_1_0" not in remaining


def test_sync_dapo_and_failure_refill_credits_are_combined(partition_id: str, ledger_path: str) -> None:
    """verl line 1035."""
    all_same, _ = _group(partition_id, "finished", sessions=2, rewards=[0.0, 0.0])
    empty_failure, _ = _group(partition_id, "failure", sessions=0)
    mixed, _ = _group(partition_id, "finished", sessions=2, rewards=[0.0, 1.0])
    refiller = _Refiller(partition_id, 1, sessions=2, rewards=[0.0, 1.0])
    rb = _make_rb(ledger_path, refill_fn=refiller, filter_groups_metric="acc", sync_refill_failed_groups=True,
                  train_batch_size=3)
    batch, metrics = rb.sample(global_steps=1, partition_id=partition_id, batch_size=3)
    got = _uids(batch.keys)
    assert len(got) == 3 and mixed in got and all_same not in got and empty_failure not in got
    assert refiller.calls == [3]
    assert metrics["validation/filter_groups/evicted_samples"] == 1
    assert metrics["validation/rollout_failure/evicted_samples"] == 1
    assert metrics["validation/filter_groups/discarded_surplus_samples"] == 1


def test_sync_dapo_does_not_refill_when_filtered_surplus_leaves_a_full_batch(partition_id: str,
                                                                           ledger_path: str) -> None:
    """verl line 1064."""
    _group(partition_id, "finished", sessions=2, rewards=[0.0, 0.0])
    mixed = {_group(partition_id, "finished", sessions=2, rewards=[0.0, 1.0])[0] for _ in range(2)}
    refiller = _Refiller(partition_id, 1, sessions=2, rewards=[0.0, 1.0])
    rb = _make_rb(ledger_path, refill_fn=refiller, filter_groups_metric="acc", train_batch_size=3)
    batch, metrics = rb.sample(global_steps=1, partition_id=partition_id, batch_size=2)
    assert _uids(batch.keys) == mixed
    assert refiller.calls == [] and metrics["validation/filter_groups/evicted_samples"] == 1


def test_sync_dapo_streams_refill_credit_with_bounded_inflight(partition_id: str, ledger_path: str) -> None:
    """verl line 1085 (verl waits up to 5 s for the two refill calls, here :data:`HANG`: once both are made no
    third can follow, since the credit is spent, and the slow group keeps ``sample`` blocked until it finishes)."""
    all_same, _ = _group(partition_id, "finished", sessions=2, rewards=[0.0, 0.0])
    slow_valid, _ = _group(partition_id, "running", sessions=2, rewards=[0.0, 1.0])
    refiller = _Refiller(partition_id, 1, sessions=2, rewards=[0.0, 1.0])
    rb = _make_rb(ledger_path, refill_fn=refiller, filter_groups_metric="acc", train_batch_size=2, gen_batch_size=1,
                  max_inflight_gen_batches=1)
    consumer = _Background(rb.sample, global_steps=1, partition_id=partition_id, batch_size=2)
    consumer.start()
    deadline = time.time() + HANG
    while len(refiller.calls) < 2 and consumer.is_alive() and time.time() < deadline:
        time.sleep(POLL)
    assert refiller.calls == [1, 1] and consumer.is_alive()

    _set_status(partition_id, slow_valid, "finished", global_steps=0)
    batch, metrics = consumer.value()
    assert len(_uids(batch.keys)) == 2 and all_same not in _uids(batch.keys)
    assert metrics["validation/filter_groups/evicted_samples"] == 1
    assert metrics["validation/filter_groups/discarded_surplus_samples"] == 1


def test_sync_dapo_discards_unsent_credit_when_batch_fills(partition_id: str, ledger_path: str) -> None:
    """verl line 1122."""
    all_same, _ = _group(partition_id, "finished", sessions=2, rewards=[0.0, 0.0])
    slow_valid, _ = _group(partition_id, "running", sessions=2, rewards=[0.0, 1.0])
    refiller = _Refiller(partition_id, 1, sessions=2, rewards=[0.0, 1.0])

    def refill_and_finish_original(num_prompts: int) -> int:
        result = refiller(num_prompts)
        _set_status(partition_id, slow_valid, "finished", global_steps=0)
        return result

    rb = _make_rb(ledger_path, refill_fn=refill_and_finish_original, filter_groups_metric="acc", train_batch_size=2,
                  gen_batch_size=1, max_inflight_gen_batches=1)
    batch, metrics = rb.sample(global_steps=1, partition_id=partition_id, batch_size=2)
    assert len(_uids(batch.keys)) == 2 and all_same not in _uids(batch.keys)
    assert refiller.calls == [1] and metrics["validation/filter_groups/evicted_samples"] == 1
    assert "validation/filter_groups/discarded_surplus_samples" not in metrics


def test_overlapping_async_eviction_reasons_refill_once(partition_id: str, ledger_path: str) -> None:
    """verl line 1153."""
    _group(partition_id, "finished", sessions=2, global_steps=0, rewards=[1.0, 1.0])
    refiller = _Refiller(partition_id, 5, sessions=2, rewards=[0.0, 1.0])
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", max_off_policy_strategy="drop",
                  max_off_policy_threshold=1, refill_fn=refiller, filter_groups_metric="acc")
    _, metrics = rb.sample(global_steps=5, partition_id=partition_id, batch_size=1)
    assert refiller.calls == [1]
    assert metrics["validation/off_policy/evicted_samples"] == 1
    assert metrics["validation/filter_groups/evicted_samples"] == 1


# -- wait_for_sampleable: the separate-async trainer's calls ------------------------------------
def test_get_sampleable_count_excludes_stale_groups_without_consuming(partition_id: str, ledger_path: str) -> None:
    """verl line 1179."""
    fresh, _ = _group(partition_id, "finished", global_steps=5)
    stale, _ = _group(partition_id, "finished", global_steps=0)
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", max_off_policy_threshold=1)
    assert rb.get_sampleable_count(global_steps=5, partition_id=partition_id) == 1
    assert {fresh, stale} <= set(_listed(partition_id))


def test_wait_for_sampleable_leaves_the_groups_for_sample(partition_id: str, ledger_path: str) -> None:
    """verl line 1196; waiting changes nothing in the ledger either (the two groups become consumed marks
    only when ``sample`` takes them)."""
    uids = {_group(partition_id, "finished")[0] for _ in range(2)}
    rb = _make_rb(ledger_path, trainer_mode="colocate_async")
    _, metrics = rb.wait_for_sampleable(global_steps=0, partition_id=partition_id, target_count=2)
    assert metrics == {}
    assert partition_id not in ray.get(rb.ledger.snapshot.remote())["consumed"]
    batch, _ = rb.sample(global_steps=0, partition_id=partition_id, batch_size=2)
    assert _uids(batch.keys) == uids


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


# -- kvckpt's own: the trainer's step reaches the ledger ----------------------------------------
def test_an_async_sample_reports_the_trainers_step_to_the_ledger_first(partition_id: str, val: str,
                                                                      ledger_path: str) -> None:
    """kvckpt: verl's training-partition ``sample`` (async modes) first records its ``global_steps`` as the ledger's
    trainer step (``VerlLedger.trainer_step``: token progress of a later weight version is refused
    ``FutureVersion``); a validation sample reports nothing."""
    _group(partition_id, "finished", global_steps=3)
    _group(val, "finished", global_steps=3)
    rb = _make_rb(ledger_path, trainer_mode="colocate_async", max_off_policy_threshold=8)
    assert ray.get(rb.ledger.info.remote())["trainer_step"] is None
    rb.sample(global_steps=9, partition_id=val, batch_size=1)
    assert ray.get(rb.ledger.info.remote())["trainer_step"] is None
    rb.sample(global_steps=5, partition_id=partition_id, batch_size=1)
    assert ray.get(rb.ledger.info.remote())["trainer_step"] == 5
