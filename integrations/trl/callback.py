"""The ``TrainerCallback`` that ties a kvckpt store to TRL's steps, checkpoints and resume.

``on_train_begin`` opens the store at the trainer's ``global_step``: a fresh run creates it; a run
resumed from ``checkpoint-N`` (TRL's own ``trainer.train(resume_from_checkpoint=...)``) recovers
the live store at version N — groups trained after step N go back to ready, in-flight prompts are
handed back once, rollouts committed after the checkpoint are kept — or, when the live store is
gone or behind, restores ``checkpoint-N/kvckpt_buffer.kvckpt``. A run that starts at step 0 over
a live store that already trained (a crash before the first save) recovers it at version 0 the
same way, and logs that it did; it refuses only a store of another run or configuration
(:func:`open_store` says how it knows). ``on_step_end`` claims the groups
the step trained and closes the kvckpt step; ``on_save`` writes that file into ``checkpoint-N/``
(so TRL's ``save_total_limit`` rotation removes it with its checkpoint).

A ``checkpoint-N/`` a kill left half written (inside TRL's save, or between it and ``on_save``:
TRL's ``trainer_state.json``, its last file, or kvckpt's file missing) is set aside at train begin:
renamed ``partial-checkpoint-N`` (never deleted), with a warning naming both paths, so neither the
restart's refusal nor TRL's checkpoint discovery ever reads it (:func:`set_aside_partial_checkpoints`).

Why a step's groups are known exactly: with ``token_budget=0`` TRL's ``FixedCountBatcher`` puts
``per_device_train_batch_size * num_processes`` rows in every micro-batch and a step trains
``gradient_accumulation_steps`` micro-batches, in the order the queue served them; the callback
refuses any other set-up at train begin instead of guessing.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from kvckpt.integrations.trl.peer import trainer_callback_class
from kvckpt.integrations.trl.sync import ServerWeightSync

from kvckpt import RecoveryPlan, ReplayBuffer, fsync_dir, restore
from kvckpt.errors import BadArgument, RecoveryError

TrainerCallback = trainer_callback_class()

BUFFER_FILE = "kvckpt_buffer.kvckpt"
#: The files a complete ``checkpoint-N/`` holds last: TRL writes ``trainer_state.json`` after the model and
#: optimizer, and the callback's ``on_save`` writes :data:`BUFFER_FILE` after TRL's save returned.
COMPLETE_MARKERS = ("trainer_state.json", BUFFER_FILE)
#: The prefix a partial ``checkpoint-N`` is renamed with (TRL and transformers look for ``checkpoint-N`` only).
PARTIAL_PREFIX = "partial-"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")

log = logging.getLogger("kvckpt.integrations.trl")


class KvckptCallback(TrainerCallback):
    """Opens, steps, checkpoints and recovers a :class:`KvckptRolloutWorker`'s store.

    Guarantees: after a resume from ``checkpoint-N`` every group is trained exactly once over both
    runs (none trained in steps ``<= N`` is served again; every one served but not trained by step
    ``N`` is served again), no group committed before the crash is generated again, and every prompt
    in flight at the crash is generated once more.

    Attributes:
        plan: the :class:`kvckpt.RecoveryPlan` of the last train begin (``None`` for a fresh store).
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.plan: RecoveryPlan | None = None
        self.samples_per_step = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Check the batching, then open (fresh), recover (live) or restore (file) the store."""
        if not state.is_world_process_zero:
            return
        if args.token_budget != 0:
            raise BadArgument(f"token_budget={args.token_budget}: kvckpt's TRL worker needs token_budget=0 "
                              "(a fixed number of rows per step, so the groups a step trained are known)")
        self.samples_per_step = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                                 * args.world_size)
        if self.samples_per_step % self.worker.num_generations:
            raise BadArgument(f"{self.samples_per_step} rows per step is not a multiple of num_generations="
                              f"{self.worker.num_generations}: a group would be trained across two steps")
        step = int(state.global_step)
        transfer = self.worker.weight_transfer
        if isinstance(transfer, ServerWeightSync):  # it builds TRL's own transfer from them, as TRL would
            transfer.model, transfer.args = kwargs.get("model"), args
        buffer, self.plan = open_store(self.worker, args.output_dir, step)
        set_aside_partial_checkpoints(args.output_dir, keep=step)
        self.worker.clock.pending_step = step
        self.worker.attach(buffer, self.plan.leases if self.plan is not None else ())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Claim the groups this optimizer step trained and close the kvckpt step."""
        if not state.is_world_process_zero:
            return
        self.worker.rollout_buffer.close_step(self.samples_per_step)
        self.worker.clock.pending_step = int(state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write the buffer's checkpoint into TRL's ``checkpoint-N/`` (and wait until it is durable)."""
        if not state.is_world_process_zero:
            return
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", BUFFER_FILE)
        self.worker.buffer.checkpoint(path, {"global_step": int(state.global_step)}, overwrite=True).wait()


def set_aside_partial_checkpoints(output_dir: str, keep: int = 0) -> list[tuple[str, str]]:
    """Rename every partial ``checkpoint-N`` of ``output_dir`` (one missing a file of
    :data:`COMPLETE_MARKERS`: a kill inside TRL's save or before the callback's ``on_save``) to
    ``partial-checkpoint-N`` (``.1``, ``.2``... if taken), logging a warning per directory; its files
    are kept as they are. ``checkpoint-<keep>`` (the one a resumed run starts from) is left alone.

    Returns:
        ``(old path, new path)`` of each directory set aside.
    """
    moved = []
    for path, missing in _checkpoints(output_dir).items():
        if not missing or (keep and path == os.path.join(output_dir, f"checkpoint-{keep}")):
            continue
        name = os.path.basename(path)
        target = os.path.join(output_dir, PARTIAL_PREFIX + name)
        suffix = 0
        while os.path.exists(target):
            suffix += 1
            target = os.path.join(output_dir, f"{PARTIAL_PREFIX}{name}.{suffix}")
        os.rename(path, target)
        fsync_dir(output_dir)
        log.warning("%s is a partial checkpoint (no %s: the run was killed while saving it); set aside as %s, "
                    "its files kept (delete it yourself once you no longer need it)", path, " and no ".join(missing),
                    target)
        moved.append((path, target))
    return moved


def _checkpoints(output_dir: str) -> dict[str, list[str]]:
    """Every ``checkpoint-N`` directory of ``output_dir`` -> the files of :data:`COMPLETE_MARKERS` it lacks."""
    if not os.path.isdir(output_dir):
        return {}
    paths = [os.path.join(output_dir, name) for name in sorted(os.listdir(output_dir)) if _CHECKPOINT.match(name)]
    return {path: [marker for marker in COMPLETE_MARKERS if not os.path.isfile(os.path.join(path, marker))]
            for path in paths if os.path.isdir(path)}


def open_store(worker: Any, output_dir: str, step: int) -> tuple[ReplayBuffer, RecoveryPlan | None]:
    """The worker's store for a run starting at ``step``, and its recovery plan (``None`` if new).

    A run starting at step 0 over a live store that trained (the previous run crashed before its
    first save: the model is the initial one again) recovers the store at version 0: trained
    groups back to ready, committed untrained groups kept, every prompt in flight redispatched
    once; it logs the plan.

    Raises:
        RecoveryError: a run from scratch over a live store of another run or configuration: a
            buffer config other than the worker's (the differing keys are named), a store
            checkpointed at some step (its state's ``durable`` list: the run it belongs to saved,
            so resume from that checkpoint), or an ``output_dir`` holding a complete ``checkpoint-N``
            (likewise; a partial one is set aside by the callback once the store is open). A
            resumed run finding neither a live store at or past ``step`` nor
            ``checkpoint-<step>/kvckpt_buffer.kvckpt``.
    """
    live = worker.store_path
    saved = os.path.join(output_dir, f"checkpoint-{step}", BUFFER_FILE)
    if os.path.exists(live):
        buffer = ReplayBuffer.open(live)
        version = buffer.trainer_version
        if step == 0 and version > 0:
            try:
                _check_same_run(buffer, worker, output_dir)
            except RecoveryError:
                buffer.close()
                raise
            plan = buffer.recover(resume_version=0)
            log.warning("%s: the trainer starts from step 0 and no checkpoint was saved: recovered the live store "
                        "(it had trained %d steps) at version 0: %d groups back to ready, %d ready in all, %d prompts "
                        "redispatched", live, version, plan.groups_returned_to_ready, plan.groups_complete_restored,
                        plan.groups_redispatched)
            return buffer, plan
        if version >= step:
            return buffer, buffer.recover(resume_version=step)
        buffer.close()
        if not os.path.exists(saved):
            raise RecoveryError(f"{live} is at step {version}, behind the resumed step {step}, and {saved} is missing")
        return restore(saved, live)
    if step == 0:
        return ReplayBuffer.create(live, worker.config), None
    if not os.path.exists(saved):
        raise RecoveryError(f"resuming at step {step}: no live store at {live} and no {saved}")
    return restore(saved, live)


def _check_same_run(buffer: ReplayBuffer, worker: Any, output_dir: str) -> None:
    """Refuse a live store that a run from step 0 cannot have left (see :func:`open_store`)."""
    live = worker.store_path
    have, want = buffer.config.to_dict(), worker.config.to_dict()
    differ = sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))
    if differ:
        raise RecoveryError(f"{live} belongs to another configuration: its {', '.join(differ)} differ from this "
                            f"worker's ({', '.join(f'{k}={have.get(k)!r} vs {want.get(k)!r}' for k in differ)})")
    saved = buffer.state()["durable"]
    if saved:
        raise RecoveryError(f"{live} was checkpointed at step(s) {saved} but the trainer starts from step 0: pass "
                            "resume_from_checkpoint (or move the store away to start over)")
    found = [path for path, missing in _checkpoints(output_dir).items() if not missing]  # partial ones are set aside
    if found:
        raise RecoveryError(f"{live} has trained {buffer.trainer_version} steps and {output_dir} holds {found[:3]}, "
                            "but the trainer starts from step 0: pass resume_from_checkpoint (or move both away)")
