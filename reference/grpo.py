"""The reference asynchronous GRPO trainer, with kvckpt as its replay buffer.

Two pumps run at once, as in NeMo-RL's async GRPO:

* **rollout pump** (one thread per worker): redispatch leases left by a recovery first, then
  ``admit`` a dataloader batch (the sampler's gate decides when) -> ``generate`` n completions per
  prompt -> ``commit`` each group under its lease;
* **train pump** (the calling thread): ``evict`` + ``abort_stale_inflight`` -> ``select`` this
  step's groups -> ``read_batch`` -> GRPO loss with importance weights from the stored generation
  logprobs -> optimizer step -> ``finish_step`` -> weight sync to the workers.

Every buffer operation is one durable kvckpt transaction, so the state on disk is always a
consistent cut. Checkpoints go to ``<checkpoint.dir>/step_<N>/``: ``model.pt`` (policy and
optimizer ``state_dict`` via ``torch.save`` — the trainer's own tensors, loaded back with
``weights_only=True``) and ``buffer.kvckpt`` (a kvckpt checkpoint stamped at version N), taken
every ``every_steps`` steps, every ``every_seconds`` seconds and at the end of the run (including
one ended by ``train.time_limit_seconds``).

Resume (``checkpoint.resume: auto``) loads the latest complete ``model.pt`` (step N) and then
either reconciles the *live* store to N (``resume_from: live``, the default: groups generated
after the checkpoint are kept, claims made after it return to ready, in-flight prompts are fenced
and redispatched — no generation lost) or restores ``buffer.kvckpt`` over it (``resume_from:
checkpoint``). The dataloader resumes from the state stored with the last admission, so no
prompt is served twice or skipped.

``replay_buffer.backend: memory`` swaps in :class:`~kvckpt.testing.fixtures.memory_buffer.MemoryReplayBuffer` (same
samplers, nothing durable) for comparison; ``generation.ray: true`` hosts the workers — and the
kvckpt buffer, as a :class:`~kvckpt.integrations.ray.BufferActor` — in Ray actors.

Per-step numbers go to ``metrics_path`` (JSON lines) and, through a
:class:`kvckpt.metrics.MetricsHook` (``metrics=`` or the config's ``metrics`` section: TensorBoard,
W&B), together with the buffer's ``stats()``. Progress is logged on the
``kvckpt.reference.grpo`` logger (no handler installed: configure :mod:`logging` to see it).

Run it: ``python -m kvckpt.reference.grpo CONFIG.yaml`` (``--crash-at POINT[:COUNT]``
SIGKILLs it at a fault point, for recovery tests).

The module is long (about 700 lines) because it is the whole reference trainer in one readable
place: the two pumps, the GRPO loss, checkpoint/resume and the metrics; its config, faults,
memory baseline and demo are separate modules.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from kvckpt.integrations.vllm.worker import DEFAULT_SCHEMA, RolloutWorker
from kvckpt.reference.config import TrainerConfig
from kvckpt.reference.faults import CrashAt, Hooks

from kvckpt import (
    Batch,
    BufferConfig,
    GroupInfo,
    Lease,
    MetricsHook,
    ReplayBuffer,
    Selection,
    durable_replace,
    restore,
    sink_from_config,
)
from kvckpt.errors import BadArgument, GateTimeout
from kvckpt.testing.fixtures.memory_buffer import MemoryReplayBuffer
from kvckpt.testing.fixtures.tiny_model import AdditionTask, TinyModelSpec, ensure_tiny_model

logger = logging.getLogger(__name__)
MODEL_FILE, BUFFER_FILE = "model.pt", "buffer.kvckpt"
#: Buffer operations whose time counts as "time in kvckpt" in the metrics.
BUFFER_OPS = ("admit", "admissible", "commit_group", "commit_sample", "select", "read_batch", "finish_step",
              "evict", "abort_stale_inflight", "checkpoint", "state", "stats", "record_progress_many", "progress")


# -- GRPO maths ------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_ids: Sequence[str], eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: each row's reward minus its group's mean, over the group's std (+ eps).
    A group whose rewards are all equal gets zero advantages (no signal)."""
    index: dict[str, list[int]] = defaultdict(list)
    for row, gid in enumerate(group_ids):
        index[gid].append(row)
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for rows in index.values():
        r = rewards[rows].float()
        adv[rows] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return adv


def grpo_loss(policy: torch.nn.Module, batch: Batch, clip_eps: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped GRPO policy-gradient loss of one padded batch, and its statistics.

    Per completion token: ratio = exp(log pi(token) - generation_logprob), the importance weight
    of the current policy against the weights that generated it (stale by the sampler's lag);
    loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), averaged over each row's
    ``token_mask`` and then over rows (so long wrong answers do not outweigh short right ones).
    """
    t = batch.tensors
    ids, lengths = t["input_ids"], batch.lengths
    attention = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    logits = policy(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = t["token_mask"][:, 1:].float() * t["sample_mask"][:, None]
    ratio = torch.exp(logp - t["generation_logprobs"][:, 1:])
    adv = group_advantages(t["total_reward"], batch.group_ids)[:, None]
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    tokens = mask.sum().clamp(min=1)
    loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    with torch.no_grad():
        stats = {"ratio_mean": float((ratio * mask).sum() / tokens),
                 "ratio_max": float((ratio * mask).max()),
                 "logprob_gap": float(((logp - t["generation_logprobs"][:, 1:]).abs() * mask).sum() / tokens)}
    return loss, stats


def sft_warmup(policy: torch.nn.Module, tokenizer: Any, task: AdditionTask, *, steps: int, lr: float,
               batch_size: int, seed: int) -> list[float]:
    """Supervised steps on correct answers (prompt tokens masked out), so GRPO starts from a
    policy that is sometimes right. Returns the losses."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    losses = []
    policy.train()
    for _ in range(steps):
        pairs = []
        for _ in range(batch_size):
            idx = rng.randrange(task.size)
            prompt = tokenizer(task.prompt(idx), add_special_tokens=False)["input_ids"]
            answer = tokenizer(task.completion(idx), add_special_tokens=False)["input_ids"] + [eos]
            pairs.append((prompt, answer))
        width = max(len(p) + len(a) for p, a in pairs)
        ids = torch.tensor([p + a + [pad] * (width - len(p) - len(a)) for p, a in pairs])
        labels = torch.tensor([[-100] * len(p) + a + [-100] * (width - len(p) - len(a)) for p, a in pairs])
        loss = policy(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    policy.eval()
    return losses


# -- timing ----------------------------------------------------------------------------------------
class OpClock:
    """Seconds spent in buffer operations, per pump (``train``/``rollout``) and per operation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_op: dict[str, float] = defaultdict(float)
        self.by_pump: dict[str, float] = defaultdict(float)

    def add(self, op: str, seconds: float) -> None:
        """Record one call (the pump is the calling thread's role)."""
        pump = "rollout" if threading.current_thread().name.startswith("rollout") else "train"
        with self._lock:
            self.by_op[op] += seconds
            self.by_pump[pump] += seconds

    def pump(self, name: str) -> float:
        """Total seconds of pump ``name`` so far."""
        with self._lock:
            return self.by_pump[name]


class TimedBuffer:
    """A buffer proxy that times the operations in :data:`BUFFER_OPS` on an :class:`OpClock`."""

    def __init__(self, buffer: Any, clock: OpClock) -> None:
        self._buffer, self._clock = buffer, clock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._buffer, name)
        if name not in BUFFER_OPS or not callable(attr):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self._clock.add(name, time.perf_counter() - t0)
        return timed


# -- Ray hosting -----------------------------------------------------------------------------------
class RayBuffer:
    """The trainer's view of a :class:`~kvckpt.integrations.ray.BufferActor`: the replay buffer
    methods the trainer calls, with kvckpt records rebuilt from the actor's dict replies."""

    def __init__(self, actor: Any) -> None:
        import ray

        self._ray, self.actor = ray, actor
        self._session: str | None = None

    def _get(self, ref: Any) -> Any:
        return self._ray.get(ref)

    def recovery_plan(self) -> Any:
        """The plan of the actor's start-up recovery (``None`` for a new store)."""
        from kvckpt.integrations.ray import plan_from_dict

        doc = self._get(self.actor.recovery_plan.remote())
        return None if doc is None else plan_from_dict(doc)

    def restore(self, checkpoint_file: str) -> Any:
        """Replace the live store by a checkpoint file; returns the recovery plan."""
        from kvckpt.integrations.ray import plan_from_dict

        return plan_from_dict(self._get(self.actor.restore.remote(checkpoint_file)))

    def admissible(self, count: int = 1) -> bool:
        """Always True: the actor's admission waits for the gate itself."""
        return True

    def admit(self, prompts: Sequence[Any], dataloader_state: bytes | None = None, *, timeout: float | None = None,
              weight_version: int | None = None, holder: str | None = None) -> list[Lease]:
        """See :meth:`kvckpt.ReplayBuffer.admit`."""
        docs = self._get(self.actor.admit.remote(list(prompts), dataloader_state, timeout=timeout,
                                                 weight_version=weight_version, holder=holder))
        return [Lease.from_dict(d) for d in docs]

    def leases_held_by(self, holder: str) -> list[Lease]:
        """See :meth:`kvckpt.ReplayBuffer.leases_held_by`."""
        return [Lease.from_dict(d) for d in self._get(self.actor.leases_held_by.remote(holder))]

    def select(self, min_groups: int = 1, max_groups: int | None = None) -> Selection:
        """See :meth:`kvckpt.ReplayBuffer.select`; remembers the actor session for ``finish_step``."""
        doc = self._get(self.actor.select.remote(min_groups, max_groups))
        self._session = doc["session"]
        return Selection(doc["step"], tuple(GroupInfo.from_dict(g) for g in doc["groups"]))

    def read_batch(self, groups: Selection | Sequence[str], **kwargs: Any) -> Batch:
        """See :meth:`kvckpt.ReplayBuffer.read_batch`."""
        from kvckpt.integrations.ray import batch_from_dict

        gids = groups.group_ids if isinstance(groups, Selection) else list(groups)
        return batch_from_dict(self._get(self.actor.read_batch.remote(gids, **kwargs)))

    def finish_step(self, *, weight_version: int | None = None) -> int:
        """See :meth:`kvckpt.ReplayBuffer.finish_step` (refused if the actor restarted since select)."""
        return self._get(self.actor.finish_step.remote(weight_version, self._session))

    def evict(self) -> list[str]:
        """See :meth:`kvckpt.ReplayBuffer.evict`."""
        return self._get(self.actor.evict.remote())

    def abort_stale_inflight(self) -> list[str]:
        """See :meth:`kvckpt.ReplayBuffer.abort_stale_inflight`."""
        return self._get(self.actor.abort_stale_inflight.remote())

    def checkpoint(self, dest: str, trainer_state: Mapping[str, Any] | None = None) -> Any:
        """Stamp and copy a checkpoint on the actor's node; returns an object whose ``wait()``
        gives the result dict."""
        ref = self.actor.checkpoint.remote(dest, dict(trainer_state or {}), False, True)
        return _Waitable(lambda: self._get(ref)["result"])

    def state(self) -> dict[str, Any]:
        """See :meth:`kvckpt.ReplayBuffer.state`."""
        return self._get(self.actor.state.remote())

    def stats(self) -> dict[str, Any]:
        """See :meth:`kvckpt.ReplayBuffer.stats`."""
        return self._get(self.actor.stats.remote())

    def groups(self, states: Sequence[str] | None = None) -> list[GroupInfo]:
        """See :meth:`kvckpt.ReplayBuffer.groups`."""
        return [GroupInfo.from_dict(g) for g in self._get(self.actor.groups.remote(states))]

    def wait_for_change(self, timeout: float) -> None:
        """Sleep ``timeout`` (the actor's changes are not signalled to this process)."""
        time.sleep(timeout)

    def close(self) -> None:
        """Close the store and end the actor."""
        with contextlib.suppress(Exception):
            self._get(self.actor.close.remote())
        self._ray.kill(self.actor)


class _Waitable:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def wait(self, timeout: float | None = None) -> Any:
        return self._fn()


class RayWorker:
    """A :class:`~kvckpt.integrations.vllm.worker.RolloutWorker` in a Ray actor, called like the
    in-process one. It commits straight to the buffer actor (rows never pass through the driver).

    Its :attr:`holder` is the name its leases record, as the in-process worker's: by default its actor's
    (:func:`kvckpt.integrations.ray.holder_name` with ``scope="actor"``, given inside the actor: what dies
    with it, so two workers on one node are told apart), and the worker in the actor names itself the same.
    The trainer admits for it with ``holder=worker.holder``, so ``leases_held_by(worker.holder)`` lists what
    it holds and ``redispatch_held_by(worker.holder)`` hands it on after its death."""

    def __init__(self, buffer_actor: Any, holder: str | None = None, **worker_kwargs: Any) -> None:
        import ray

        self._ray = ray
        self.buffer_actor = buffer_actor
        self.actor = ray.remote(RolloutWorker).options(num_cpus=0).remote(holder=holder, **worker_kwargs)
        #: The lease holder name of this worker (``admit(..., holder=worker.holder)``).
        self.holder: str = holder or ray.get(self.actor.__ray_call__.remote(_name_after_its_actor))
        self._version = 0

    @property
    def weight_version(self) -> int:
        """The version last sent with :meth:`load_weights` (Ray runs this caller's calls in order)."""
        return self._version

    def load_weights(self, weights: Any, version: int) -> None:
        """Send new weights (an object ref of a state dict, or the dict)."""
        self._ray.get(self.actor.load_weights.remote(weights, version))
        self._version = int(version)

    def run(self, buffer: Any, leases: Sequence[Lease], before_commit: Any = None) -> list[Any]:
        """Generate and commit in the actor; ``before_commit`` runs here, before the remote call."""
        if before_commit is not None:
            for lease in leases:
                before_commit(lease)
        return self._ray.get(self.actor.run.remote(self.buffer_actor, list(leases)))

    def close(self) -> None:
        """End the actor."""
        self._ray.kill(self.actor)


def _name_after_its_actor(worker: RolloutWorker) -> str:
    """Inside a :class:`RayWorker`'s actor: name the worker after its actor, and return the name."""
    from kvckpt.integrations.ray import holder_name

    worker.holder = holder_name("actor")
    return worker.holder


# -- checkpoints on disk ---------------------------------------------------------------------------
def checkpoint_steps(directory: str) -> list[int]:
    """Steps of the complete checkpoints under ``directory`` (those with a ``model.pt``), ascending."""
    if not os.path.isdir(directory):
        return []
    steps = []
    for name in os.listdir(directory):
        complete = os.path.isfile(os.path.join(directory, name, MODEL_FILE))
        if name.startswith("step_") and name[5:].isdigit() and complete:
            steps.append(int(name[5:]))
    return sorted(steps)


def _atomic_torch_save(obj: Any, path: str) -> None:
    with durable_replace(path) as tmp:
        torch.save(obj, tmp)


# -- the trainer -----------------------------------------------------------------------------------
class GRPOTrainer:
    """An async GRPO run over a kvckpt (or in-memory) replay buffer; see the module docstring.

    Args:
        config: a :class:`~.config.TrainerConfig`, its dict form, or a YAML/JSON path.
        hooks: test-only fault injection (:mod:`.faults`). Defaults to no-op hooks.
        metrics: called after every step with the buffer's ``stats()``, the step and the step's
            record (a :class:`kvckpt.metrics.MetricsHook`, or any callable of that shape).
            Defaults to the hook the config's ``metrics`` section names, if any.

    Examples:
        >>> summary = GRPOTrainer({"output_dir": "runs/demo", "train": {"steps": 20}}).run()  # doctest: +SKIP
        >>> summary["reward_last"] > summary["reward_first"]  # doctest: +SKIP
        True
    """

    def __init__(self, config: TrainerConfig | Mapping[str, Any] | str, *, hooks: Hooks | None = None,
                 metrics: Any = None) -> None:
        self.config = TrainerConfig.from_any(config)
        self.hooks = hooks or Hooks()
        self.metrics = metrics if metrics is not None else _configured_hook(self.config)
        self.task = AdditionTask(self.config.task.max_operand, self.config.seed, self.config.task.repeat)
        self.clock = OpClock()
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._redispatch: list[Lease] = []
        self._dl_lock = threading.Lock()
        self._cursor = 0
        self._rows_committed = 0
        self._groups_committed = 0
        self._count_lock = threading.Lock()
        self._started_ray = False
        self.policy: Any = None
        self.buffer: Any = None
        self.workers: list[Any] = []

    # -- set-up ----------------------------------------------------------------------------------
    def _model_path(self) -> str:
        spec = TinyModelSpec(seed=self.config.seed, max_operand=self.config.task.max_operand)
        return ensure_tiny_model(self.config.model.cache_dir, spec)

    def _setup_policy(self, model_path: str, resume_step: int | None) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(self.config.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.config.train.lr)
        if resume_step is None:
            m = self.config.model
            sft = sft_warmup(self.policy, self.tokenizer, self.task, steps=m.sft_steps, lr=m.sft_lr,
                             batch_size=m.sft_batch, seed=self.config.seed)
            return {"sft_steps": len(sft), "sft_final_loss": sft[-1] if sft else None}
        state = torch.load(os.path.join(self._step_dir(resume_step), MODEL_FILE), weights_only=True)
        self.policy.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._cursor = int(state["dataloader_cursor"])
        return {}

    def _buffer_config(self) -> BufferConfig:
        rb, gen = self.config.replay_buffer, self.config.generation
        return BufferConfig(group_size=gen.group_size, schema=DEFAULT_SCHEMA, sampler=rb.sampler,
                            max_buffered_rollouts=rb.max_buffered_rollouts,
                            groups_per_step=self.config.train.groups_per_step,
                            durable_checkpoints=rb.durable_checkpoints, retain_consumed=rb.retain_consumed)

    def _open_buffer(self, resume_step: int | None) -> Any:
        """Open (creating, recovering or restoring) the buffer; returns the recovery plan or None."""
        rb, ck = self.config.replay_buffer, self.config.checkpoint
        if rb.backend == "memory":
            self.buffer = MemoryReplayBuffer(self._buffer_config())
            return None
        step = resume_step or 0
        ckpt_file = os.path.join(self._step_dir(resume_step), BUFFER_FILE) if resume_step is not None else None
        use_file = ckpt_file is not None and os.path.isfile(ckpt_file) and (
            ck.resume_from == "checkpoint" or not os.path.exists(rb.path))
        if self.config.generation.ray:
            from kvckpt.integrations.ray import start_buffer_actor

            exists = os.path.exists(rb.path)
            if ck.resume == "never" and exists:
                raise BadArgument(f"{rb.path!r} already exists and checkpoint.resume is 'never'")
            actor = start_buffer_actor(rb.path, self._buffer_config().to_dict(),
                                       name=f"kvckpt-buffer-{uuid.uuid4().hex[:8]}", get_if_exists=False,
                                       resume_version=step if exists else None, max_restarts=1)
            self.buffer = RayBuffer(actor)
            return self.buffer.restore(ckpt_file) if use_file else self.buffer.recovery_plan()
        if use_file:
            self.buffer, plan = restore(ckpt_file, rb.path, overwrite=True)
            return plan
        if os.path.exists(rb.path) and ck.resume == "auto":
            self.buffer = ReplayBuffer.open(rb.path)
            return self.buffer.recover(step)
        self.buffer = ReplayBuffer.create(rb.path, self._buffer_config())
        return None

    def _start_workers(self, model_path: str) -> None:
        gen = self.config.generation
        kwargs = {"model_path": model_path, "backend": gen.backend, "task": self.task, "max_tokens": gen.max_tokens,
                  "temperature": gen.temperature, "commit": gen.commit, "backend_options": gen.backend_options,
                  "progress_every_tokens": gen.progress_every_tokens,
                  "progress_every_seconds": gen.progress_every_seconds}
        for i in range(gen.workers):
            seed = self.config.seed * 1000 + i
            if gen.ray:
                self.workers.append(RayWorker(self.buffer.actor, seed=seed, **kwargs))
            else:
                self.workers.append(RolloutWorker(seed=seed, **kwargs))

    def _sync_weights(self, version: int) -> None:
        state = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        if self.config.generation.ray:
            import ray

            state = ray.put(state)
        for worker in self.workers:
            worker.load_weights(state, version)

    # -- pumps -----------------------------------------------------------------------------------
    def _next_leases(self, worker: Any, buffer: Any) -> list[Lease]:
        gps = self.config.train.groups_per_step
        with self._dl_lock:
            if self._redispatch:
                leases, self._redispatch = self._redispatch[:gps], self._redispatch[gps:]
                return leases
            if not buffer.admissible(gps):
                buffer.wait_for_change(0.05)
                return []
            start = self._cursor
            state = json.dumps({"cursor": start + gps}).encode()
            try:
                leases = buffer.admit(list(range(start, start + gps)), dataloader_state=state, timeout=0.25,
                                      weight_version=worker.weight_version, holder=worker.holder)
            except GateTimeout:
                return []
            self._cursor = start + gps
        self.hooks.at("after_admit", leases=leases)
        return leases

    def _rollout_pump(self, worker: Any) -> None:
        buffer = TimedBuffer(self.buffer, self.clock)
        target = buffer if not self.config.generation.ray else None
        try:
            while not self._stop.is_set():
                leases = self._next_leases(worker, buffer)
                if not leases:
                    continue
                t0 = time.perf_counter()
                if target is None:
                    results = worker.run(target, leases, before_commit=self.hooks.before_commit)
                else:
                    results = worker.run(target, leases, before_commit=self.hooks.before_commit,
                                         after_step=self.hooks.after_generation_step)
                if target is None:  # committed by the actor: time the whole remote call
                    self.clock.add("commit_group" if self.config.generation.commit == "group" else "commit_sample",
                                   time.perf_counter() - t0)
                done = [lease for lease, r in zip(leases, results, strict=True) if not isinstance(r, BaseException)]
                with self._count_lock:
                    self._groups_committed += len(done)
                    self._rows_committed += sum(len(lease.missing) for lease in done)
                self.hooks.at("after_commit", leases=leases, results=results)
        except BaseException as exc:
            logger.error("rollout pump %s stopped: %r", threading.current_thread().name, exc)
            self._errors.append(exc)
            self._stop.set()

    def _check_pumps(self) -> None:
        if self._errors:
            raise RuntimeError(f"a rollout pump failed: {self._errors[0]!r}") from self._errors[0]

    def _select(self, buffer: Any) -> Selection:
        gps = self.config.train.groups_per_step
        while True:
            self._check_pumps()
            selection = buffer.select(gps, gps)
            if len(selection):
                return selection
            self.buffer.wait_for_change(0.05)

    # -- checkpoints -----------------------------------------------------------------------------
    def _step_dir(self, step: int) -> str:
        return os.path.join(self.config.checkpoint.dir, f"step_{step}")

    def _checkpoint(self, step: int, buffer: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        directory = self._step_dir(step)
        os.makedirs(directory, exist_ok=True)
        _atomic_torch_save({"model": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                            "step": step, "dataloader_cursor": self._cursor}, os.path.join(directory, MODEL_FILE))
        self.hooks.at("after_model_save", step=step)
        if self.config.replay_buffer.backend == "kvckpt":
            dest = os.path.join(directory, BUFFER_FILE)
            buffer.checkpoint(dest, {"step": step, "model": MODEL_FILE}).wait()
        self.hooks.at("after_checkpoint", step=step)
        for old in checkpoint_steps(self.config.checkpoint.dir)[:-self.config.checkpoint.keep]:
            shutil.rmtree(self._step_dir(old), ignore_errors=True)
        seconds = time.perf_counter() - t0
        logger.info("checkpoint step_%d written in %.2f s (%s)", step, seconds, directory)
        return {"step": step, "seconds": seconds}

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train until ``train.steps`` are finished (or the time limit); returns a summary.

        The summary has the steps done, throughput (``steps_per_second``, ``rollouts_per_second``
        counted in completions), seconds and share of wall time spent in buffer operations per
        pump, mean reward of the first and last steps, the recovery report when resumed, and the
        checkpoints written. Per-step metrics go to ``metrics_path`` as JSON lines.
        """
        cfg = self.config
        torch.set_num_threads(cfg.train.torch_threads)
        os.makedirs(cfg.output_dir, exist_ok=True)
        os.makedirs(cfg.checkpoint.dir, exist_ok=True)
        steps = checkpoint_steps(cfg.checkpoint.dir) if cfg.checkpoint.resume == "auto" else []
        resume_step = steps[-1] if steps else None
        if cfg.generation.ray:
            self._init_ray()
        model_path = self._model_path()
        warmup = self._setup_policy(model_path, resume_step)
        plan = self._open_buffer(resume_step)
        if plan is not None:
            self._redispatch = list(plan.leases)
            if plan.dataloader_state:
                self._cursor = int(json.loads(plan.dataloader_state)["cursor"])
        step = resume_step or 0
        if resume_step is None:
            logger.info("new run in %s: %s", cfg.output_dir, warmup)
        else:
            logger.info("resumed from step_%d (%s): %s", resume_step, cfg.checkpoint.resume_from,
                        plan.report() if plan is not None else "no buffer to recover")
        self._start_workers(model_path)
        self._sync_weights(step)
        summary: dict[str, Any] = {"start_step": step, "resumed_from": resume_step, "warmup": warmup,
                                   "recovery": plan.report() if plan is not None else None, "checkpoints": []}
        pumps = [threading.Thread(target=self._rollout_pump, args=(w,), name=f"rollout-{i}", daemon=True)
                 for i, w in enumerate(self.workers)]
        buffer = TimedBuffer(self.buffer, self.clock)
        rewards: list[float] = []
        t_start = last_ckpt = time.perf_counter()
        try:
            for pump in pumps:
                pump.start()
            with open(cfg.metrics_path, "a") as metrics:
                while step < cfg.train.steps:
                    record = self._train_step(step, buffer)
                    step += 1
                    now = time.perf_counter()
                    ck = cfg.checkpoint
                    if (ck.every_steps and step % ck.every_steps == 0) or (
                            ck.every_seconds is not None and now - last_ckpt >= ck.every_seconds):
                        summary["checkpoints"].append(self._checkpoint(step, buffer))
                        last_ckpt = time.perf_counter()
                    record["elapsed"] = time.perf_counter() - t_start
                    rewards.append(record["reward_mean"])
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                    logger.debug("step %d: %s", record["step"], record)
                    if self.metrics is not None:
                        self.metrics(buffer.stats(), record["step"], record)
                    limit = cfg.train.time_limit_seconds
                    if limit is not None and time.perf_counter() - t_start >= limit:
                        summary["time_limited"] = True
                        break
            wall = time.perf_counter() - t_start
            self._stop.set()
            if cfg.checkpoint.at_end and step not in checkpoint_steps(cfg.checkpoint.dir):
                summary["checkpoints"].append(self._checkpoint(step, buffer))
            summary.update(self._summary(step, wall, rewards))
            logger.info("run ended at step %d after %.1f s", step, wall)
            return summary
        finally:
            self._stop.set()
            for pump in pumps:
                pump.join(timeout=30)
            self._shutdown()

    def _train_step(self, step: int, buffer: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        kv0 = self.clock.pump("train")
        roll0 = self.clock.pump("rollout")
        buffer.evict()
        buffer.abort_stale_inflight()
        t_wait = time.perf_counter()
        selection = self._select(buffer)
        wait = time.perf_counter() - t_wait
        self.hooks.at("after_select", step=step)
        batch = buffer.read_batch(selection)
        t_train = time.perf_counter()
        self.policy.train()
        loss, stats = grpo_loss(self.policy, batch, self.config.train.clip_eps)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.policy.eval()
        train_seconds = time.perf_counter() - t_train
        self.hooks.at("after_optimizer_step", step=step)
        # Sync first: admissions the finished step lets through are then stamped (and generated)
        # with the new weights, one version of lag instead of two.
        self._sync_weights(step + 1)
        buffer.finish_step(weight_version=step + 1)
        self.hooks.at("after_finish_step", step=step)
        rewards = batch.tensors["total_reward"]
        return {"step": step, "reward_mean": float(rewards.mean()), "loss": float(loss.detach()), **stats,
                "groups": len(selection), "rows": len(batch.group_ids),
                "staleness": step - min(g.lineage_weight for g in selection.groups),
                "step_seconds": time.perf_counter() - t0, "wait_seconds": wait, "train_seconds": train_seconds,
                "kvckpt_seconds": self.clock.pump("train") - kv0,
                "rollout_kvckpt_seconds": self.clock.pump("rollout") - roll0}

    def _summary(self, step: int, wall: float, rewards: list[float]) -> dict[str, Any]:
        k = max(1, min(5, len(rewards) // 4))
        train_kv, roll_kv = self.clock.pump("train"), self.clock.pump("rollout")
        return {"steps_done": step, "wall_seconds": wall,
                "steps_per_second": len(rewards) / wall if wall else 0.0,
                "rollouts_per_second": self._rows_committed / wall if wall else 0.0,
                "groups_committed": self._groups_committed, "rows_committed": self._rows_committed,
                "kvckpt_seconds_train": train_kv, "kvckpt_seconds_rollout": roll_kv,
                "kvckpt_share_train": train_kv / wall if wall else 0.0,
                "kvckpt_share_rollout": roll_kv / wall if wall else 0.0,
                "kvckpt_seconds_by_op": dict(self.clock.by_op),
                "progress": self._progress_stats(),
                "reward_first": sum(rewards[:k]) / k if rewards else None,
                "reward_last": sum(rewards[-k:]) / k if rewards else None,
                "metrics_path": self.config.metrics_path}

    def _progress_stats(self) -> dict[str, int]:
        """The in-process workers' token counts (tokens generated, resumed from durable progress,
        appends, append calls), summed."""
        total: dict[str, int] = {}
        for worker in self.workers:
            for key, value in getattr(worker, "progress_stats", {}).items():
                total[key] = total.get(key, 0) + value
        return total

    def _init_ray(self) -> None:
        import ray
        from kvckpt.integrations.ray import init_local_ray

        if not ray.is_initialized():
            init_local_ray(num_cpus=2)
            self._started_ray = True

    def _shutdown(self) -> None:
        for worker in self.workers:
            if hasattr(worker, "close"):
                worker.close()
        if self.buffer is not None:
            self.buffer.close()
        if self._started_ray:
            import ray

            ray.shutdown()


def _configured_hook(config: TrainerConfig) -> MetricsHook | None:
    m = config.metrics
    sink = sink_from_config(m.tensorboard_dir, m.wandb_project)
    return None if sink is None else MetricsHook(sink, every=m.every_steps)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvckpt.reference.grpo CONFIG.yaml [--crash-at POINT[:COUNT]]``: run and
    print the summary (a test crashes the trainer in a fresh process with ``--crash-at``)."""
    import argparse

    parser = argparse.ArgumentParser(description="kvckpt reference async GRPO trainer")
    parser.add_argument("config", help="YAML or JSON trainer config")
    parser.add_argument("--crash-at", help="SIGKILL the process at POINT (the COUNT-th time), e.g. after_finish_step:5")
    args = parser.parse_args(argv)
    hooks = Hooks()
    if args.crash_at:
        point, _, count = args.crash_at.partition(":")
        hooks = CrashAt(point, int(count or 1))
    print(json.dumps(GRPOTrainer(args.config, hooks=hooks).run(), indent=1, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
