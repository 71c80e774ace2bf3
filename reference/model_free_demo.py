"""The model-free demo (``kvckpt demo --no-model``): a real producer/consumer run, SIGKILLed
mid-step, recovered; the reference-trainer demo (:mod:`kvckpt.reference.demo`) without a
model, in seconds. It shows, on a small but real run, what kvckpt is for:

1. **Run.** A child process owns a buffer store. A dispatcher thread admits dataloader batches,
   generator threads "roll out" each prompt ``n`` times (numpy rows shaped like GRPO rollouts:
   prompt + response token ids, per-token logprobs, a response mask, a reward; some commit
   sibling by sibling, some whole groups), and the trainer loop selects a batch, reads it, takes
   a step, finishes it and, every few steps, saves its "model" and a kvckpt checkpoint.
2. **Crash.** Mid-step, with groups claimed, groups buffered and rollouts in flight (some with
   finished siblings), the child is SIGKILLed.
3. **Recover** in this process, from the live store (default: nothing generated is lost) or from
   the latest checkpoint file, and report what was restored, redispatched and reused, the
   generation work a checkpoint-only recovery loses, and the time to the first batch.
4. **Finish** the run (redispatched leases first, then the rest of the dataset) and **check**
   that every prompt was trained exactly once (or deliberately discarded by the sampler's
   staleness rule) and that the final store verifies.

The "model" is the list of prompts each step trained on, saved atomically with every
checkpoint: exactly what a real trainer's weights would have absorbed. Consumption after the
last model checkpoint is lost with the model; recovery makes those groups ready again.

It reads the stores with the model demo's readers (:func:`~kvckpt.reference.report.store_view`,
``work_after_checkpoint``, ``audit``) and reports in its shape, so one
:func:`~kvckpt.reference.report.render` prints both; :func:`run_demo` is its whole interface.

Why this module is long (about 520 lines): the model-free run is a small trainer of its own (a
dispatcher, generator threads and a training loop over one buffer, :class:`_Run`, about 160 lines)
beside the crash-and-recover driver; both are the demo and nothing else uses them.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from kvckpt.reference.report import audit, store_view, work_after_checkpoint

from kvckpt import (
    BufferConfig,
    Lease,
    Prompt,
    ReplayBuffer,
    create_sampler,
    read_stamp,
    restore,
    verify_path,
    write_durably,
)
from kvckpt.errors import BadArgument, GateTimeout, KvckptError, LeaseError

SAMPLERS = ("in_order", "weight_fifo", "windowed", "ready_first")
RECOVERY_MODES = ("live", "checkpoint")
LIVE_FILE = "live.kv"
CRASH_EVENT = "crash-point"
VOCAB = 32_000
TASKS = ("math", "code", "chat")
SCHEMA = {"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"),
          "token_mask": ("bool", "token"), "total_reward": ("float32", "row")}


@dataclass
class DemoConfig:
    """The run's shape. :meth:`preset` gives the two sizes the command line offers."""

    prompts: int
    groups_per_step: int
    group_size: int
    workers: int
    sample_seconds: float
    step_seconds: float
    response_tokens: tuple[int, int]
    checkpoint_every: int
    crash_step: int
    sampler: dict[str, Any]
    window: int = 2
    deadline_seconds: float = 120.0

    @classmethod
    def preset(cls, fast: bool, sampler: str) -> DemoConfig:
        """``fast``: 48 prompts, about 15 s; otherwise 192 prompts, under a minute."""
        if sampler not in SAMPLERS:
            raise BadArgument(f"unknown sampler {sampler!r}; choose from {', '.join(SAMPLERS)}")
        key = "max_lookahead_versions" if sampler == "in_order" else "max_staleness_versions"
        config = {"name": sampler, key: 2}
        if fast:
            return cls(prompts=48, groups_per_step=4, group_size=4, workers=3, sample_seconds=0.05,
                       step_seconds=0.1, response_tokens=(16, 128), checkpoint_every=2, crash_step=7,
                       sampler=config, deadline_seconds=60.0)
        return cls(prompts=192, groups_per_step=8, group_size=4, workers=4, sample_seconds=0.06,
                   step_seconds=0.2, response_tokens=(64, 1024), checkpoint_every=4, crash_step=14,
                   sampler=config)

    @property
    def capacity(self) -> int:
        """``max_buffered_rollouts``: what the sampler needs not to deadlock."""
        return create_sampler(self.sampler).required_buffer_capacity(self.groups_per_step)


# -- rollouts ------------------------------------------------------------------------------------
def make_row(prompt_idx: int, index: int, attempt: int, response_tokens: tuple[int, int]) -> dict[str, np.ndarray]:
    """One completion of a prompt, shaped like a GRPO rollout row.

    The prompt tokens depend only on ``prompt_idx`` (siblings share them); the response, its
    logprobs and the reward on ``(prompt_idx, index, attempt)``.
    """
    prompt = np.random.default_rng(prompt_idx).integers(0, VOCAB, 24 + prompt_idx % 41)
    rng = np.random.default_rng((prompt_idx, index, attempt))
    response = rng.integers(0, VOCAB, int(rng.integers(*response_tokens)))
    logprobs = np.concatenate([np.zeros(len(prompt), np.float32),
                               -rng.exponential(0.6, len(response)).astype(np.float32)])
    mask = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(response), bool)])
    return {"input_ids": np.concatenate([prompt, response]).astype(np.int64), "generation_logprobs": logprobs,
            "token_mask": mask, "total_reward": np.float32(rng.random() < 0.4)}


def _write_json(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` atomically: temporary name, fsync, rename, fsync the directory."""
    write_durably(path, json.dumps(doc).encode())


class _Run:
    """Dispatcher, generator threads and the trainer loop over one open buffer."""

    def __init__(self, buf: ReplayBuffer, cfg: DemoConfig, out: str, next_prompt: int,
                 model: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> None:
        self.buf, self.cfg, self.out, self.model, self.emit = buf, cfg, out, model, emit
        self.next_prompt = next_prompt
        self.leases: queue.Queue[Lease] = queue.Queue()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.handle: Any = None
        self.deadline = float("inf")

    # producers
    def start(self, redispatch: list[Lease]) -> None:
        for lease in redispatch:
            self.leases.put(lease)
        self.threads = [threading.Thread(target=self._guard, args=(self._dispatch,), daemon=True)]
        self.threads += [threading.Thread(target=self._guard, args=(self._generate,), daemon=True)
                         for _ in range(self.cfg.workers)]
        for thread in self.threads:
            thread.start()

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            self.errors.append(exc)
            self.stop.set()

    def _dispatch(self) -> None:
        gps = self.cfg.groups_per_step
        while not self.stop.is_set() and self.next_prompt < self.cfg.prompts:
            first = self.next_prompt
            batch = [Prompt(i, TASKS[i % len(TASKS)]) for i in range(first, min(first + gps, self.cfg.prompts))]
            state = json.dumps({"cursor": first + len(batch)}).encode()
            try:
                leases = self.buf.admit(batch, dataloader_state=state, timeout=0.2)
            except GateTimeout:
                continue
            self.next_prompt = first + len(batch)
            for lease in leases:
                self.leases.put(lease)

    def _generate(self) -> None:
        while not self.stop.is_set():
            try:
                lease = self.leases.get(timeout=0.05)
            except queue.Empty:
                continue
            todo = list(lease.missing) or list(range(lease.group_size))
            rows = {}
            try:
                for index in todo:
                    time.sleep(self.cfg.sample_seconds)
                    row = make_row(lease.prompt_idx, index, lease.attempt, self.cfg.response_tokens)
                    if lease.prompt_idx % 2:  # a streaming worker: each sibling lands as it finishes
                        self.buf.commit_sample(lease, index, row)
                    else:
                        rows[index] = row
                if rows:
                    self.buf.commit_group(lease, rows)
            except LeaseError:
                pass  # aborted as stale by the sampler meanwhile: the store already accounts for it

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()
        if self.handle is not None:
            self.handle.wait()

    # trainer
    def _check(self) -> None:
        if self.errors:
            raise self.errors[0]
        if time.monotonic() > self.deadline:
            raise KvckptError(f"the demo did not finish training within {self.cfg.deadline_seconds:.0f} s "
                              f"(trainer at step {self.buf.trainer_version}); is the machine overloaded?")

    def select(self) -> Any:
        """Block until a batch can be claimed for the current step (or nothing is left)."""
        gps = self.cfg.groups_per_step
        patient_until = time.monotonic() + 1.0
        while True:
            self._check()
            stats = self.buf.stats()
            left = self.cfg.prompts - len(self.model["trained"]) - stats["evicted"] - stats["aborted"]
            if left <= 0:
                return None
            want = min(gps, left)
            selection = self.buf.select(want, gps)
            if not selection and self.cfg.sampler["name"] != "in_order" and time.monotonic() > patient_until:
                selection = self.buf.select(1, gps)  # a staleness sampler may never fill the batch
            if selection:
                return selection
            self.buf.wait_for_change(0.05)

    def train_step(self, selection: Any, first_batch: Callable[[], None] | None = None) -> float:
        """Read the batch, compute a GRPO-style loss and spend the step's time."""
        batch = self.buf.read_batch(selection)
        if first_batch is not None:
            first_batch()
        rewards = batch.tensors["total_reward"].view(-1, self.cfg.group_size)
        advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
        mask = batch.tensors["token_mask"].float()
        per_row = (batch.tensors["generation_logprobs"] * mask).sum(1) / mask.sum(1).clamp(min=1)
        loss = float(-(advantages.reshape(-1) * per_row).mean())
        step = selection.step
        self.model["trained"].extend([step, g.prompt_idx, g.group_id] for g in selection.groups)
        self.model["loss"].append(round(loss, 6))
        time.sleep(self.cfg.step_seconds)
        return loss

    def finish_step(self) -> int:
        version = self.buf.finish_step()
        self.buf.evict()
        self.buf.abort_stale_inflight()
        if version % self.cfg.checkpoint_every == 0:
            if self.handle is not None:
                self.handle.wait()
            model_path = os.path.join(self.out, "model", f"step_{version:04d}.json")
            _write_json(model_path, {**self.model, "step": version})
            ckpt = os.path.join(self.out, "ckpt", f"step_{version:04d}.kvckpt")
            self.handle = self.buf.checkpoint(ckpt, {"step": version, "model": model_path})
            self.emit({"event": "checkpoint", "step": version})
        return version

    def train(self, crash_step: int | None = None, first_batch: Callable[[], None] | None = None) -> None:
        """Train until every prompt is trained or discarded; at ``crash_step`` announce the crash point
        mid-step and keep "computing" until killed."""
        self.deadline = time.monotonic() + self.cfg.deadline_seconds
        while True:
            selection = self.select()
            if selection is None:
                return
            self.train_step(selection, first_batch)
            first_batch = None
            if crash_step is not None and selection.step >= crash_step:
                self._announce_crash(selection.step)
            self.emit({"event": "step", "step": selection.step, "groups": len(selection)})
            self.finish_step()

    def _announce_crash(self, step: int) -> None:
        """Wait (mid-step) until groups are buffered and rollouts in flight with finished siblings."""
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            self._check()
            state = self.buf.state()
            partial = any(e.siblings for e in self.buf.ledger())
            if state["ready"] and state["inflight"] and partial:
                break
            self.buf.wait_for_change(0.02)
        self.emit({"event": CRASH_EVENT, "step": step})
        threading.Event().wait()  # "computing" until the SIGKILL (or the parent's death, see _child)


# -- the child process ---------------------------------------------------------------------------
def _child(out: str, cfg: DemoConfig) -> None:
    """Create the store and run until the parent kills this process."""
    def emit(event: dict[str, Any]) -> None:
        print(json.dumps(event), flush=True)

    parent = os.getppid()

    def orphaned() -> None:  # never outlive the parent, even if it dies without killing this process
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()

    buf = ReplayBuffer.create(os.path.join(out, LIVE_FILE), BufferConfig(
        group_size=cfg.group_size, schema=SCHEMA, sampler=cfg.sampler, max_buffered_rollouts=cfg.capacity,
        groups_per_step=cfg.groups_per_step))
    run = _Run(buf, cfg, out, 0, {"trained": [], "loss": []}, emit)
    run.start([])
    run.train(crash_step=cfg.crash_step)
    emit({"event": "finished"})  # only if the crash point was never reached
    run.close()
    buf.close()


def _run_child(out: str, cfg: DemoConfig, log: Callable[[str], None]) -> dict[str, Any]:
    """Start the child, follow its events, SIGKILL it at the crash point; return what it reported."""
    args = json.dumps({"out": out, "config": asdict(cfg)})
    stderr_path = os.path.join(out, "child.stderr")
    with open(stderr_path, "w") as stderr:
        child = subprocess.Popen([sys.executable, "-m", "kvckpt.reference.model_free_demo", args],
                                 stdout=subprocess.PIPE, stderr=stderr, text=True)
    seen: dict[str, Any] = {"pid": child.pid, "steps": 0, "checkpoints": []}
    log(f"run       child pid {child.pid}: {cfg.workers} generator threads, trainer, checkpoint every "
        f"{cfg.checkpoint_every} steps")
    killer = threading.Timer(cfg.deadline_seconds, child.kill)
    killer.start()
    try:
        for line in child.stdout:
            event = json.loads(line)
            if event["event"] == "step":
                seen["steps"] = event["step"] + 1
            elif event["event"] == "checkpoint":
                seen["checkpoints"].append(event["step"])
            elif event["event"] == CRASH_EVENT:
                time.sleep(0.01)  # let the generators get into their next commits
                os.kill(child.pid, signal.SIGKILL)
                seen["killed_mid_step"] = event["step"]
                break
    finally:
        killer.cancel()
        child.kill()
        child.wait()
        child.stdout.close()
    with open(stderr_path) as f:
        tail = f.read()[-2000:]
    if "killed_mid_step" not in seen:
        raise KvckptError(f"the demo's child process ended before its crash point (exit {child.returncode}): "
                          f"{tail.strip() or 'no output'}")
    if not tail:
        os.unlink(stderr_path)
    log(f"crash     SIGKILL mid-step {seen['killed_mid_step']} (checkpoints at steps "
        f"{', '.join(map(str, seen['checkpoints'])) or 'none'})")
    return seen


# -- analysis of the crashed store (with the model demo's readers: one account of a store) -------
def _next_prompt(dataloader_state: bytes | None) -> int:
    return json.loads(dataloader_state)["cursor"] if dataloader_state else 0


def _at_kill(view: dict[str, Any]) -> dict[str, Any]:
    """The crashed store's work in progress, with the rollouts that had finished siblings."""
    st = view["state"]
    return {"claimed": st["claimed"], "ready": st["ready"], "inflight": st["inflight"],
            "partial": sum(1 for e in view["ledger"] if e.siblings)}


def _sibling_rows_after(live: dict[str, Any], ckpt: dict[str, Any] | None) -> int:
    """Sibling rows of in-flight rollouts committed after the checkpoint."""
    old = {e.group_id: set(e.siblings) for e in ckpt["ledger"]} if ckpt else {}
    return sum(len(set(e.siblings) - old.get(e.group_id, set())) for e in live["ledger"])


def _load_model(path: str | None) -> dict[str, Any]:
    """A saved "model" (the prompts each step trained on), or a fresh one."""
    if path is None:
        return {"trained": [], "loss": [], "step": 0}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _latest(pattern: str) -> str | None:
    files = sorted(glob.glob(pattern))
    return files[-1] if files else None


# -- the parent ----------------------------------------------------------------------------------
def run_demo(out: str | None = None, *, fast: bool = False, sampler: str = "in_order", recovery: str = "live",
             log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run, crash, recover, finish and check (see the module docstring); return the report.

    Args:
        out: directory for the store, checkpoints and model files (created; must not hold an
            earlier run). Defaults to a temporary directory, removed afterwards.
        fast: the small preset (about 15 s) instead of the full one (under a minute). Defaults to False.
        sampler: one of :data:`SAMPLERS`. Defaults to ``"in_order"``.
        recovery: ``"live"`` (recover the crashed live store) or ``"checkpoint"`` (restore the
            latest checkpoint file). Defaults to ``"live"``.
        log: called with one line per phase as the demo goes.

    Returns:
        The report (JSON-able); ``report["ok"]`` says whether every prompt was trained exactly once
        (or discarded by the sampler) and the final store verified.

    Raises:
        BadArgument: unknown sampler or recovery mode, or ``out`` holds an earlier run.
        KvckptError: the run did not complete (the message says where it stopped).
    """
    if recovery not in RECOVERY_MODES:
        raise BadArgument(f"unknown recovery mode {recovery!r}; choose from {', '.join(RECOVERY_MODES)}")
    cfg = DemoConfig.preset(fast, sampler)
    keep = out is not None
    if out is None:
        out = tempfile.mkdtemp(prefix="kvckpt-demo-")
    elif os.path.exists(os.path.join(out, LIVE_FILE)):
        raise BadArgument(f"{out!r} already holds a demo run; choose an empty or new directory")
    out = os.path.abspath(out)
    for sub in ("model", "ckpt"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    source = "live store" if recovery == "live" else "latest checkpoint file"
    log(f"demo      {sampler} sampler, {cfg.prompts} prompts x {cfg.group_size} completions, "
        f"{cfg.groups_per_step} prompts per step, recovery from the {source}")
    ok = False
    try:
        report = _demo(out, cfg, recovery, log)
        ok = report["ok"]
        report["out"] = out if keep else None
        return report
    finally:
        if not keep and ok:
            shutil.rmtree(out, ignore_errors=True)
        elif not keep:
            log(f"files     kept for inspection in {out}")


def _demo(out: str, cfg: DemoConfig, mode: str, log: Callable[[str], None]) -> dict[str, Any]:
    # A trainer restarting after a crash has torch loaded before it touches the buffer: import it
    # while the child runs, so the time to the first batch measures kvckpt, not an import.
    preload = threading.Thread(target=__import__, args=("torch",), daemon=True)
    preload.start()
    child = _run_child(out, cfg, log)
    preload.join()
    live = os.path.join(out, LIVE_FILE)
    ckpt = _latest(os.path.join(out, "ckpt", "*.kvckpt"))
    at_kill, ckpt_view = store_view(live), store_view(ckpt) if ckpt else None
    work = work_after_checkpoint(at_kill, ckpt_view)
    work["sibling_rows"] = _sibling_rows_after(at_kill, ckpt_view)
    work["rows"] += work["sibling_rows"]

    t0 = time.perf_counter()
    if mode == "live":
        model = _load_model(_latest(os.path.join(out, "model", "step_*.json")))
        buf = ReplayBuffer.open(live)
        plan = buf.recover(model["step"])
    else:
        if ckpt is None:
            raise KvckptError("no complete checkpoint was written before the crash; nothing to restore")
        model = _load_model(read_stamp(ckpt)["trainer_state"]["model"])
        buf, plan = restore(ckpt, live, overwrite=True)
    t_recovered = time.perf_counter()
    first: dict[str, float] = {}
    next_prompt = _next_prompt(plan.dataloader_state)
    run = _Run(buf, cfg, out, next_prompt, {"trained": list(model["trained"]), "loss": list(model["loss"])},
               lambda e: None)
    redispatched = [{"prompt_idx": lease.prompt_idx, "group_id": lease.group_id, "reused": sorted(
        set(range(lease.group_size)) - set(lease.missing))} for lease in plan.leases]
    lost = work if mode == "checkpoint" else {"groups": 0, "rows": 0, "raw_bytes": 0}
    recovery = {
        "mode": mode, "resume_step": plan.resume_version, "checkpoint": os.path.basename(ckpt) if ckpt else None,
        "groups_complete_restored": plan.groups_complete_restored,
        "groups_returned_to_ready": plan.groups_returned_to_ready,
        "prompts_redispatched": redispatched, "siblings_reused": plan.siblings_reused,
        "siblings_rerun": plan.siblings_rerun,
        "work_after_checkpoint": {k: work[k] for k in ("groups", "rows", "sibling_rows", "raw_bytes",
                                                       "prompts_admitted")},
        "work_lost": {k: lost[k] for k in ("groups", "rows", "raw_bytes")},
        "groups_after_checkpoint_recommitted": len(set(work["group_ids"]) & {x["group_id"] for x in redispatched}),
        "recover_seconds": t_recovered - t0}
    log(f"recover   {mode}: resume at step {plan.resume_version}; ready groups: {plan.groups_complete_restored}; "
        f"prompts to redispatch: {len(plan.leases)}")
    try:
        run.start(plan.leases)
        run.train(first_batch=lambda: first.setdefault("t", time.perf_counter()))
    finally:
        run.close()
        buf.close()
    recovery["time_to_first_batch_seconds"] = first["t"] - t0 if first else None
    final = verify_path(live, deep=True)
    check = audit(live)
    trained_by_step = check.pop("trained_by_step")
    check["model_agrees"] = trained_by_step == _by_model_step(run.model["trained"])  # the "model" and the store
    check.update(verify_ok=final.ok, verify_problems=[str(p) for p in final.problems[:10]])
    steps_after = len(run.model["loss"]) - len(model["loss"])
    log(f"finish    {steps_after} more steps trained, to step {plan.resume_version + steps_after}")
    ok = final.ok and not check["lost"] and not check["doubled"] and check["model_agrees"]
    return {"ok": ok, "backend": "model-free", "sampler": cfg.sampler["name"], "config": asdict(cfg),
            "learning_curve": None, "learning": None,
            "run": {"child_pid": child["pid"], "steps": len(run.model["loss"]), "groups_per_step": cfg.groups_per_step,
                    "group_size": cfg.group_size, "killed_mid_step": child["killed_mid_step"],
                    "checkpoints": child["checkpoints"], "checkpoint_step": plan.resume_version,
                    "at_kill": _at_kill(at_kill)},
            "recovery": recovery, "finish": {"steps_trained": steps_after,
                                             "final_step": plan.resume_version + steps_after},
            "check": check}


def _by_model_step(trained: list[list[Any]]) -> dict[int, list[int]]:
    """The prompts the saved "model" trained on, by step (as :func:`audit`'s ``trained_by_step``)."""
    steps: dict[int, list[int]] = {}
    for step, prompt, _ in trained:
        steps.setdefault(step, []).append(prompt)
    return {k: sorted(v) for k, v in sorted(steps.items())}


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    _cfg = _spec["config"]
    _cfg["response_tokens"] = tuple(_cfg["response_tokens"])
    _child(_spec["out"], DemoConfig(**_cfg))
