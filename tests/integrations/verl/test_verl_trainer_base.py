"""verl's V1 trainer-base tests, ported onto the kvckpt buffer selected by ``custom_sampler``.

Source (verl-project/verl at 1dda039b9): ``tests/trainer/ppo/v1/test_trainer_base_on_cpu.py``, 7 tests;
each port names the verl test and line. verl's tests build ``_StubTrainer`` (line 23) with
``__new__`` and the config of ``_trainer_with_filter_groups`` (line 36), then call the trainer's own
``_build_replay_buffer`` / ``_init_dataloader``; so do these, with one change to that config: the
sampler is the kvckpt class for the mode, behind ``custom_sampler`` (``pkg://`` path, the real class,
no ``load_extern_type`` patch), and ``sampler_kwargs`` carries the ledger section. Every build
constructs the real buffer on a real TransferQueue and Ray on loopback (the ledger actor, a new run,
the mirror).

Six of verl's seven tests check what ``_build_replay_buffer`` hands verl's *built-in* classes
(``ReplayBuffer`` / ``ReplayBufferAsync``: the DAPO metric, ``train_batch_size``, ``gen_batch_size``,
``max_inflight_gen_batches``, ``sync_refill_failed_groups``, the ``max_num_gen_batches`` warning). A
custom sampler gets none of them (verl 0.9.1 ``trainer_base.py`` lines 163-165: "custom
implementations own their filtering semantics"), so the kvckpt class computes them from its trainer's
config as verl does (``buffer.builtin_arguments``), and each port asserts verl's values under verl's
configuration.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from unittest.mock import patch

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

import ray
from _verl_support import StubTrainer, transferqueue
from kvckpt.integrations.verl import KvckptReplayBuffer
from omegaconf import OmegaConf
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

pytestmark = pytest.mark.verl
ACTOR = f"kvckpt_verl_trainer_base_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def ledger_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One loopback Ray with TransferQueue for the module, and the ledger file every build opens."""
    with transferqueue("kvckpt-verl-trainer-base", ACTOR):
        yield str(tmp_path_factory.mktemp("verl_trainer_base") / "ledger.kv")


def _trainer_with_filter_groups(ledger_path: str, filter_groups: dict, trainer_mode: str = "sync") -> StubTrainer:
    """verl's ``_trainer_with_filter_groups`` (line 36), the kvckpt class for ``trainer_mode`` selected."""
    name = "KvckptReplayBuffer" if trainer_mode == "sync" else "KvckptReplayBufferAsync"
    trainer = StubTrainer.__new__(StubTrainer)
    trainer.trainer_mode = trainer_mode
    trainer.config = OmegaConf.create({
        "algorithm": {"filter_groups": filter_groups},
        "data": {"train_batch_size": 64, "gen_batch_size": 8},
        "reward": {"reward_model": {"enable": False, "enable_resource_pool": False}},
        "trainer": {"v1": {trainer_mode: {}, "sampler": {
            "custom_sampler": {"path": "pkg://kvckpt.integrations.verl", "name": name},
            "max_off_policy_threshold": 1, "max_off_policy_strategy": "drop",
            "sampler_kwargs": {"kvckpt": {"path": ledger_path, "actor_name": ACTOR}}}}},
    })
    return trainer


def test_kvckpt_sampler_class_follows_trainer_mode(ledger_path: str) -> None:
    """verl ``test_builtin_sampler_class_follows_trainer_mode`` (line 60): verl's own sync class for ``sync``, its
    async class for both async modes (the kvckpt buffer is an instance of verl's class, not a subclass), each on
    a new run of the one ledger; the async ones get DAPO's metric from
    the trainer's config as verl's built-ins do, and the batch sizes stay ``None`` as verl's async ones."""
    sync_trainer = _trainer_with_filter_groups(ledger_path, {"enable": False}, trainer_mode="sync")
    sync_sampler = sync_trainer._build_replay_buffer()
    async_samplers = [
        _trainer_with_filter_groups(ledger_path, {"enable": True, "metric": "acc"}, trainer_mode=mode)
        ._build_replay_buffer() for mode in ("colocate_async", "separate_async")]

    assert type(sync_sampler) is ReplayBuffer
    assert all(type(sampler) is ReplayBufferAsync for sampler in async_samplers)
    assert all(sampler.filter_groups_metric == "acc" for sampler in async_samplers)
    assert all(sampler.train_batch_size is None for sampler in async_samplers)
    assert all(sampler.gen_batch_size is None for sampler in async_samplers)
    assert [s.run for s in (sync_sampler, *async_samplers)] == [sync_sampler.run + i for i in range(3)]


def test_the_kvckpt_sampler_runs_verls_filter_groups_validation(ledger_path: str) -> None:
    """verl ``test_custom_sampler_skips_builtin_filter_groups_validation`` (line 74) shows verl handing a custom
    sampler the six contract arguments only; the kvckpt class then runs verl's own validation itself (so a
    DAPO config verl refuses is refused here too, before any ledger run opens), and a buffer built without a
    verl trainer (``refill_fn`` a plain function) keeps ``ReplayBuffer``'s defaults, as verl's would; arguments
    the caller passes (as verl passes its built-ins) are taken as given."""
    trainer = _trainer_with_filter_groups(ledger_path, {"enable": True, "metric": "acc"})
    with patch.object(trainer, "_resolve_filter_groups_metric", return_value="acc") as resolve_filter_groups_metric:
        sampler = trainer._build_replay_buffer()
    resolve_filter_groups_metric.assert_called_once_with()
    assert type(sampler) is ReplayBuffer and sampler.refill_fn == trainer._add_prompts_to_generate

    runs = ray.get(sampler.ledger.info.remote())["run"]
    no_metric = _trainer_with_filter_groups(ledger_path, {"enable": True})
    with pytest.raises(ValueError, match=r"algorithm\.filter_groups\.metric must be set"):
        no_metric._build_replay_buffer()
    assert ray.get(sampler.ledger.info.remote())["run"] == runs

    by_hand = KvckptReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=1,
                                 max_off_policy_strategy="drop", refill_fn=lambda n: n,
                                 sampler_kwargs=trainer.config.trainer.v1.sampler.sampler_kwargs)
    assert by_hand.filter_groups_metric is None and by_hand.train_batch_size is None
    assert by_hand.gen_batch_size is None and by_hand.max_inflight_gen_batches == 1
    assert by_hand.sync_refill_failed_groups is False
    explicit = KvckptReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=1,
                                  max_off_policy_strategy="drop", refill_fn=trainer._add_prompts_to_generate,
                                  sampler_kwargs=trainer.config.trainer.v1.sampler.sampler_kwargs,
                                  filter_groups_metric=None)
    assert explicit.filter_groups_metric is None and explicit.train_batch_size is None  # the caller's arguments win


def test_filter_groups_reach_the_kvckpt_sampler_as_verls(ledger_path: str) -> None:
    """verl ``test_builtin_filter_groups_uses_default_inflight_limit`` (line 93): ``"acc"``, 64, 1, 1, as verl's
    sync built-in gets them."""
    trainer = _trainer_with_filter_groups(ledger_path, {"enable": True, "metric": "acc"})

    sampler = trainer._build_replay_buffer()

    assert sampler.filter_groups_metric == "acc"
    assert sampler.train_batch_size == 64
    assert sampler.gen_batch_size == 1
    assert sampler.max_inflight_gen_batches == 1


def test_configured_inflight_limit_reaches_the_kvckpt_sampler(ledger_path: str) -> None:
    """verl ``test_builtin_filter_groups_forwards_configured_inflight_limit`` (line 104): 3."""
    trainer = _trainer_with_filter_groups(ledger_path, {"enable": True, "metric": "acc", "max_inflight_gen_batches": 3})

    sampler = trainer._build_replay_buffer()

    assert sampler.max_inflight_gen_batches == 3


def test_sync_failure_refill_reaches_the_kvckpt_sampler(ledger_path: str) -> None:
    """verl ``test_builtin_sync_failure_refill_forces_single_prompt_generation`` (line 112):
    ``sync_refill_failed_groups=True`` and ``gen_batch_size=1``; with neither set, verl's ``gen_batch_size``."""
    trainer = _trainer_with_filter_groups(ledger_path, {"enable": False})
    trainer.config.trainer.v1.sampler.sync_refill_failed_groups = True

    sampler = trainer._build_replay_buffer()

    assert sampler.sync_refill_failed_groups is True
    assert sampler.gen_batch_size == 1
    plain = _trainer_with_filter_groups(ledger_path, {"enable": False})._build_replay_buffer()
    assert (plain.sync_refill_failed_groups, plain.gen_batch_size, plain.train_batch_size) == (False, 8, 64)


def test_sync_failure_refill_overrides_dataloader_generation_batch_size(ledger_path: str) -> None:
    """verl line 122, as verl makes it (the same patches of verl's dataset, sampler and dataloader), with the
    kvckpt class selected: the trainer still fetches one prompt per dataloader batch, though the kvckpt sampler
    does not refill failed groups (line 112's port)."""
    trainer = _trainer_with_filter_groups(ledger_path, {"enable": False})
    trainer.config.trainer.v1.sampler.sync_refill_failed_groups = True
    trainer.config.data.update({"train_files": [], "val_files": [], "train_max_samples": -1, "val_max_samples": -1,
                                "dataloader_num_workers": 0, "val_batch_size": 1, "validation_shuffle": False})
    trainer.config.trainer.total_epochs = 1
    trainer.config.trainer.total_training_steps = None
    trainer.parameter_sync_step = 1
    trainer.tokenizer = None
    trainer.processor = None

    with (
        patch("verl.trainer.ppo.v1.trainer_base.create_rl_dataset", side_effect=[[{}, {}], [{}]]),
        patch("verl.trainer.ppo.v1.trainer_base.create_rl_sampler", return_value=None),
        patch("verl.trainer.ppo.v1.trainer_base.StatefulDataLoader") as dataloader,
        patch("verl.trainer.ppo.v1.trainer_base.logger.warning") as warning,
    ):
        trainer._init_dataloader()

    assert trainer.config.data.gen_batch_size == 1
    assert dataloader.call_args_list[0].kwargs["batch_size"] == 1
    warning.assert_any_call("data.gen_batch_size=8 is overridden to 1.")


def test_total_generation_limit_is_warned_about_for_the_kvckpt_sampler(ledger_path: str) -> None:
    """verl ``test_builtin_filter_groups_warns_when_total_generation_limit_is_configured`` (line 155): verl's
    warning, once, that ``max_num_gen_batches`` is ignored; and the buffer is built."""
    trainer = _trainer_with_filter_groups(ledger_path, {"enable": True, "metric": "acc", "max_num_gen_batches": 10})

    with patch("verl.trainer.ppo.v1.trainer_base.logger.warning") as warning:
        sampler = trainer._build_replay_buffer()

    warning.assert_called_once_with(
        "algorithm.filter_groups.max_num_gen_batches=%s is ignored by the built-in V1 ReplayBuffer; "
        "use max_inflight_gen_batches to bound concurrent Sync DAPO generation.", 10)
    assert type(sampler) is ReplayBuffer
    assert ray.get(sampler.ledger.info.remote())["run"] == sampler.run
