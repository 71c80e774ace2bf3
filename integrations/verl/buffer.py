"""verl's V1 replay buffers over the kvckpt verl ledger: ``KvckptReplayBuffer`` (sync) and
``KvckptReplayBufferAsync`` (colocate_async / separate_async).

Each builds an instance of verl's own class (``verl.trainer.ppo.v1.replay_buffer.ReplayBuffer`` or
``ReplayBufferAsync``, not a subclass: ``type(buffer)`` is verl's class), so every public call, return
type and sampling decision is verl's. What they add is where the state lives (:func:`attach`).
``trainer.v1.sampler.custom_sampler`` names them as verl names a class: verl calls what it loads with
the constructor's arguments. Building one

1. starts (or finds) the ledger actor for ``sampler_kwargs.kvckpt.path`` and opens a new run in
   it, which fences every process of the previous run;
2. installs the mirror in this process and publishes it to every process that joins
   TransferQueue afterwards (verl's agent-loop workers), so each TransferQueue put or clear of
   verl's is one ledger transaction first;
3. async modes, once the ledger has a checkpoint and verl's trainer will load one: refills
   TransferQueue from the live ledger (every trajectory finished before a crash, every in-flight
   prompt, which ``_reissue_inflight_prompts`` then re-issues once), and restores the trainer's
   dataloader position of the last dispatch on the trainer's first ``kv_list``. Sync mode, an
   async run with no checkpoint yet, and a trainer that will load none keep nothing across a
   restart, as verl's trainer (sync saves no buffer state; with no ``global_step_N`` found through
   ``latest_checkpointed_iteration.txt``, or with ``trainer.resume_mode=disable``, verl trains from
   scratch): the ledger is pruned to what TransferQueue holds (after a restart, nothing) and
   forgets its last checkpoint, so a later ``tq.load_checkpoint`` of any older checkpoint copies
   that file in. Whether the trainer will load one is decided as verl's ``_load_checkpoint``
   decides it, from the trainer's config (the trainer is ``refill_fn``'s owner; a buffer built
   without one resumes the live ledger). This closes the window between the ledger's checkpoint
   of step N and verl's tracker: a restart then resumes from the previous ``global_step_M`` (its
   file is copied in) or, with none, from scratch.

Through ``custom_sampler`` verl's ``_build_replay_buffer`` hands a custom sampler its six contract arguments only;
built that way by a verl trainer, the buffer computes DAPO's metric, ``sync_refill_failed_groups`` and (sync class)
the batch sizes and ``max_inflight_gen_batches`` from that trainer's config as verl does for its own classes
(:func:`builtin_arguments`), so these settings work as with verl's buffer instead of being dropped.

In async modes, once the ledger has a checkpoint, a group the trainer samples, or that sampling
evicts (stale, DAPO-filtered, failed, surplus), is marked consumed by that step, not deleted: a crash
before a checkpoint covers the step gives it back, since the weights that trained on it (or that it
was judged stale against) are lost too. The marks are dropped by the checkpoint that covers them
(``tq.save_checkpoint``), so the ledger holds at most the groups taken since the last one. Before
the first checkpoint such a group is deleted: a restart then starts from scratch and needs none.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import ray
from kvckpt.integrations.verl.config import LedgerSettings
from kvckpt.integrations.verl.ledger import ledger_actor
from kvckpt.integrations.verl.mirror import NAMESPACE, RAW, Mirror, MirrorRef, install, publish
from omegaconf import DictConfig
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path


def _ledger_backed(cls: type[ReplayBuffer], trainer_mode: str, trainer_config: DictConfig,
                   max_off_policy_threshold: int | None, max_off_policy_strategy: str,
                   sampler_kwargs: DictConfig, **kwargs: Any) -> ReplayBuffer:
    """verl's ``cls`` built with verl's arguments (plus :func:`builtin_arguments` where a verl trainer built it
    through ``custom_sampler``), then :func:`attach`'d to the ledger."""
    trainer = getattr(kwargs.get("refill_fn"), "__self__", None)
    if _is_verl_trainer(trainer) and not BUILTIN_ONLY & kwargs.keys():
        kwargs.update(builtin_arguments(trainer, sync=cls is ReplayBuffer))
    buffer = cls(trainer_mode, trainer_config, max_off_policy_threshold, max_off_policy_strategy, sampler_kwargs,
                 **kwargs)
    return attach(buffer, sampler_kwargs)


def attach(buffer: ReplayBuffer, sampler_kwargs: DictConfig | dict | None) -> ReplayBuffer:
    """Put verl's ``buffer`` (an instance of verl's own class, which stays its class) on the ledger
    ``sampler_kwargs.kvckpt`` names: steps 1-3 of the module docstring, then its ``sample`` (and
    ``ReplayBufferAsync.wait_for_sampleable``) take groups under the training step (:func:`_taking`).
    Sets ``buffer.ledger`` (the actor), ``buffer.run``, ``buffer.mirror`` and ``buffer.restored`` (the
    keys refilled from the live ledger). Returns ``buffer``."""
    settings = LedgerSettings.from_sampler_kwargs(sampler_kwargs)
    if settings.progress_every_tokens and importlib.util.find_spec("vllm") is not None:
        from kvckpt.integrations.verl import server

        server.install()  # before verl starts its vLLM replicas (server.py says why at import)
    buffer.ledger = ledger_actor(settings.path, settings.actor_name, NAMESPACE)
    run = ray.get(buffer.ledger.open_run.remote())
    buffer.run = run["run"]
    trainer = getattr(buffer.refill_fn, "__self__", None)
    buffer.mirror = install(Mirror(settings.actor_name, run["token"], cursor=lambda: _dataloader_state(trainer),
                                   restore_cursor=lambda state: _restore_dataloader(trainer, state)))
    publish(MirrorRef(settings.actor_name, run["token"]))
    if (buffer.trainer_mode == "sync" or ray.get(buffer.ledger.info.remote())["checkpoint_step"] is None
            or not _trainer_loads_a_checkpoint(trainer)):
        listing = RAW["kv_list"]() or {}
        ray.get(buffer.ledger.retain.remote(run["token"], {p: list(items) for p, items in listing.items()}))
        buffer.restored = 0
    else:
        buffer.restored = buffer.mirror.refill(ray.get(buffer.ledger.resume.remote(run["token"])))
    # token progress is kept only for the prompts _reissue_inflight_prompts will dispatch again
    ray.get(buffer.ledger.settle_progress.remote(run["token"], _inflight_prompts(RAW["kv_list"]() or {})))
    for name in ("sample", "wait_for_sampleable"):
        if hasattr(buffer, name):
            setattr(buffer, name, _taking(buffer, getattr(buffer, name)))
    return buffer


def _taking(buffer: ReplayBuffer, method: Callable[..., Any]) -> Callable[..., Any]:
    """verl's bound ``method`` (``sample`` or ``wait_for_sampleable``, whose first two arguments are the training
    step and the partition), run with this thread's ``kv_clear`` marking groups consumed by that step (async
    training partition only, once the ledger has a checkpoint): every group it takes out of the buffer, sampled
    or evicted (stale, DAPO-filtered, failed, surplus), is marked instead of deleted, and a restart or a load of
    a checkpoint before that step gives it back as it was, judged again by verl's buffer against the trainer
    version resumed. Sync mode and validation delete them: nothing of theirs is restored after a restart.

    The training partition's step is also the ledger's trainer step first (``VerlLedger.trainer_step``: verl's
    ``global_steps`` is its weights' version, sent to the rollout servers after this step trains), so token
    progress of a later version is refused as the replay buffer refuses it."""

    @functools.wraps(method)
    def take(global_steps: int, partition_id: str, *args: Any, **kwargs: Any) -> Any:
        step = None if partition_id == "val" or buffer.trainer_mode == "sync" else global_steps
        if step is not None:
            ray.get(buffer.ledger.trainer_step.remote(buffer.mirror.token, int(step)))
        with buffer.mirror.consuming(step):
            return method(global_steps, partition_id, *args, **kwargs)

    return take


#: What verl's ``_build_replay_buffer`` hands its built-in classes and never a custom sampler.
BUILTIN_ONLY = frozenset({"filter_groups_metric", "sync_refill_failed_groups", "train_batch_size", "gen_batch_size",
                          "max_inflight_gen_batches"})


def _is_verl_trainer(owner: Any) -> bool:
    """Whether ``owner`` is a verl V1 ``PPOTrainer``, without importing verl's trainer (tens of seconds) where no
    trainer exists: a trainer's module is imported before the trainer is."""
    trainer_base = sys.modules.get("verl.trainer.ppo.v1.trainer_base")
    return trainer_base is not None and isinstance(owner, trainer_base.PPOTrainer)


def builtin_arguments(trainer: Any, *, sync: bool) -> dict[str, Any]:
    """The :data:`BUILTIN_ONLY` arguments verl 0.9.1's ``_build_replay_buffer`` (``trainer_base.py`` lines 165-183)
    computes from the trainer's config for its own ``ReplayBuffer`` (``sync``) or ``ReplayBufferAsync``, computed as
    it computes them: DAPO's metric through the trainer's own ``_resolve_filter_groups_metric`` (its checks and its
    ``max_num_gen_batches`` warning included), ``trainer.v1.sampler.sync_refill_failed_groups``, and for the sync
    class the batch sizes and ``algorithm.filter_groups.max_inflight_gen_batches``. verl hands a custom sampler none
    of them, so the kvckpt buffer reads them itself: DAPO filtering, failed-group refill and the in-flight bound then
    behave as with verl's buffer (each eviction, refill and dispatch one ledger transaction, as any other call)."""
    config = trainer.config
    metric = trainer._resolve_filter_groups_metric()
    refill_failed = bool(config.trainer.v1.sampler.get("sync_refill_failed_groups", False))
    arguments: dict[str, Any] = {"filter_groups_metric": metric, "sync_refill_failed_groups": refill_failed}
    if sync:
        train_batch_size = config.data.train_batch_size
        arguments.update(
            train_batch_size=train_batch_size,
            gen_batch_size=1 if metric is not None or refill_failed
            else (config.data.get("gen_batch_size", None) or train_batch_size),
            max_inflight_gen_batches=config.algorithm.filter_groups.get("max_inflight_gen_batches", 1)
            if metric is not None else 1)
    return arguments


def _trainer_loads_a_checkpoint(trainer: Any) -> bool:
    """Whether verl's ``_load_checkpoint`` will call ``tq.load_checkpoint``, decided as it decides (its step 1 and
    step 5: ``resume_mode``, the tracker file through verl's own ``find_latest_ckpt_path``, the folder's
    ``transfer_queue``). Without a verl trainer (a buffer built by hand) it cannot tell and answers yes."""
    config = getattr(trainer, "config", None)
    if config is None or "trainer" not in config:
        return True
    settings = config.trainer
    mode = settings.get("resume_mode", "auto")
    if mode == "disable":
        return False
    if mode == "auto" and settings.get("default_local_dir") is not None:
        folder = find_latest_ckpt_path(os.path.abspath(settings.default_local_dir))
    elif mode == "resume_path" and settings.get("resume_from_path") is not None:
        folder = os.path.abspath(str(settings.resume_from_path))
    else:
        return True  # verl fails on an unknown mode or a missing folder before it loads anything
    return folder is not None and os.path.exists(os.path.join(folder, "transfer_queue"))


def _inflight_prompts(listing: dict[str, dict[str, dict]]) -> list[str]:
    """The prompt uids ``_reissue_inflight_prompts`` re-issues (its own filter: ``is_prompt``, pending or running)."""
    return [key for key, tag in listing.get("train", {}).items()
            if tag.get("is_prompt", False) and tag.get("status") in ("pending", "running")]


def _dataloader_state(trainer: Any) -> Any:
    loader = getattr(trainer, "train_dataloader", None)
    return None if loader is None or not hasattr(loader, "state_dict") else loader.state_dict()


def _restore_dataloader(trainer: Any, state: Any) -> None:
    loader = getattr(trainer, "train_dataloader", None)
    if loader is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(state)
        trainer.train_dataloader_it = None  # the next fetch starts a fresh iterator from that state


def KvckptReplayBuffer(trainer_mode: str, trainer_config: DictConfig, max_off_policy_threshold: int | None,
                       max_off_policy_strategy: str, sampler_kwargs: DictConfig, **kwargs: Any) -> ReplayBuffer:
    """verl's sync ``ReplayBuffer`` with its state in a kvckpt ledger (``trainer_mode: sync``): an instance of
    verl's own class, built with verl's constructor arguments, then :func:`attach`'d.

    ``sampler_kwargs.kvckpt`` configures the ledger (:class:`~.config.LedgerSettings`).
    """
    return _ledger_backed(ReplayBuffer, trainer_mode, trainer_config, max_off_policy_threshold,
                          max_off_policy_strategy, sampler_kwargs, **kwargs)


def KvckptReplayBufferAsync(trainer_mode: str, trainer_config: DictConfig, max_off_policy_threshold: int | None,
                            max_off_policy_strategy: str, sampler_kwargs: DictConfig,
                            **kwargs: Any) -> ReplayBufferAsync:
    """verl's ``ReplayBufferAsync`` with its state in a kvckpt ledger (``colocate_async`` / ``separate_async``): an
    instance of verl's own class, built with verl's constructor arguments, then :func:`attach`'d.

    ``sampler_kwargs.kvckpt`` configures the ledger (:class:`~.config.LedgerSettings`).
    """
    return _ledger_backed(ReplayBufferAsync, trainer_mode, trainer_config,  # type: ignore[return-value]
                          max_off_policy_threshold, max_off_policy_strategy, sampler_kwargs, **kwargs)
