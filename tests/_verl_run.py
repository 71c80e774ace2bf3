"""A verl-shaped async run in one process, for tests/integrations/verl/test_verl_crash.py:
``python _verl_run.py A|B WORKDIR``.

The trainer is verl's ``PPOTrainer`` (its own ``_build_replay_buffer``, ``_next_train_batch``,
``_submit_batch_to_rollout``, ``_add_async_warmup_batches``, ``_save_checkpoint``,
``_load_checkpoint`` and ``_reissue_inflight_prompts``), built as verl's own trainer-base test builds
it (``__new__`` plus a config), selecting the kvckpt buffer through ``custom_sampler``. Only what
needs a GPU is a stand-in: the actor worker group (its checkpoint calls write nothing) and the
agent-loop workers, Ray actors that join TransferQueue with ``tq.init()`` and write each prompt's
``running`` tag, its trajectories and its ``finished`` tag with the calls verl's ``AgentLoopWorkerTQ``
makes. Every acknowledged trajectory is appended to a log (fsync'd), the test's ground truth.

Phase A trains steps 1-3, checkpoints after step 2 (and saves TransferQueue's own checkpoint of the
same moment beside it, what verl's built-in buffer would restore), leaves every prompt with
``index % 3 == 2`` generating forever, waits until every other prompt finished, writes ``READY`` and
sleeps until the test SIGKILLs its process group. Phase B resumes: first what verl's own buffer
gets back from TransferQueue's checkpoint, then verl's resume path with the kvckpt buffer, run A's
checkpoint, load and resume calls with run A's token, a late write from a phase-A worker, and five
training steps; it writes ``result.json``.

With ``KVCKPT_VERL_KILL`` set (``before_ledger``, ``after_ledger`` or ``after_tracker``: a point of verl's
``_save_checkpoint``), phase A trains steps 1-4, checkpoints after step 2 and, once every prompt that
does not hang finished, saves the step-4 checkpoint and SIGKILLs its own process group at that point
(before ``tq.save_checkpoint``, after it, after ``latest_checkpointed_iteration.txt``). Phase B then runs
verl's resume path with ``trainer.resume_mode`` from ``KVCKPT_VERL_RESUME`` (default ``auto``) and
trains five steps; it writes ``result.json`` (what was re-issued and restored, the step it resumed from).
``KVCKPT_VERL_FIRST=1`` skips the step-2 checkpoint: the killed one is the run's first.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

WORK = sys.argv[2] if len(sys.argv) > 2 else "."
PHASE = sys.argv[1] if len(sys.argv) > 1 else "A"
ACTOR = "kvckpt_verl_crash"
SESSIONS, BATCH, WARMUP = 2, 2, 3  # rollout.n, train_batch_size (= gen_batch_size), warmup batches
KILL = os.environ.get("KVCKPT_VERL_KILL")  # a kill point of _save_checkpoint (the window tests)
FIRST = os.environ.get("KVCKPT_VERL_FIRST") == "1"  # no step-2 checkpoint: step 4's is the first
RESUME = os.environ.get("KVCKPT_VERL_RESUME", "auto")


def log(name: str, line: str) -> None:
    """Append one line durably (the test's ground truth)."""
    fd = os.open(os.path.join(WORK, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def lines(name: str) -> list[list[str]]:
    path = os.path.join(WORK, name)
    return [ln.split() for ln in open(path).read().splitlines()] if os.path.exists(path) else []


def main() -> None:
    from kvckpt.integrations.ray import init_local_ray

    init_local_ray(num_cpus=8, object_store_memory=256 << 20, namespace="kvckpt-verl-crash", address="local")
    import ray
    import torch
    import transfer_queue as tq
    from _verl_support import StubTrainer
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.utils.dataset.rl_dataset import collate_fn

    tq.init()
    gen_log = f"gen_{PHASE}.log"
    hang = PHASE == "A"

    @ray.remote(num_cpus=0)
    class StandInWorker:
        """verl's AgentLoopWorkerTQ write sequence, with a canned generation instead of an LLM server."""

        def __init__(self) -> None:
            import transfer_queue as wtq

            wtq.init()  # joins: the kvckpt MirrorRef in TransferQueue's config installs the mirror here
            self.tq, self.tasks = wtq, set()

        async def generate_sequences(self, batch: TensorDict) -> None:
            uids = batch.get("uid")
            uids = uids.tolist() if hasattr(uids, "tolist") else list(uids)
            for uid, index in zip(uids, batch["index"].tolist(), strict=True):
                task = asyncio.create_task(self._run(str(uid), int(index), int(batch["global_steps"])))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

        async def _run(self, uid: str, index: int, steps: int) -> None:
            await self.tq.async_kv_put(key=uid, partition_id="train", tag={"status": "running"})
            if hang and index % 3 == 2:
                await asyncio.sleep(3600)
            for session in range(SESSIONS):
                key = f"{uid}_{session}_0"
                fields = TensorDict({"input_ids": torch.tensor([[index, session, 7]])}, batch_size=[1])
                await self.tq.async_kv_batch_put(keys=[key], partition_id="train", fields=fields,
                                                 tags=[{"status": "success", "seq_len": 3, "global_steps": steps}])
                log(gen_log, f"T {key} {index}")
            await self.tq.async_kv_put(key=uid, partition_id="train", tag={"status": "finished"})
            log(gen_log, f"F {uid} {index}")

    class StandInManager:
        """verl's AgentLoopManagerTQ.generate_sequences: chunk the batch over the workers, wait for dispatch."""

        def __init__(self) -> None:
            self.workers = [StandInWorker.remote() for _ in range(2)]

        def generate_sequences(self, prompts: TensorDict) -> None:
            chunks = prompts.chunk(len(self.workers))
            ray.get([w.generate_sequences.remote(c) for w, c in zip(self.workers, chunks, strict=False)])

    class StandInWorkerGroup:
        def save_checkpoint(self, *args: object, **kwargs: object) -> None:
            pass

        def load_checkpoint(self, *args: object, **kwargs: object) -> None:
            pass

    class Callback:
        def on_save(self, **kwargs: object) -> None:
            pass

    trainer = StubTrainer.__new__(StubTrainer)
    trainer.trainer_mode = "colocate_async"
    trainer.config = OmegaConf.create({
        "algorithm": {"filter_groups": {"enable": False}},
        "data": {"train_batch_size": BATCH, "gen_batch_size": BATCH},
        "skip": {"rollout_tq": {"enable": False}},
        "actor_rollout_ref": {"actor": {"checkpoint": {}}},
        "trainer": {
            "default_local_dir": os.path.join(WORK, "ckpt"), "default_hdfs_dir": None, "resume_mode": RESUME,
            "del_local_ckpt_after_load": False,
            "v1": {"trainer_mode": "colocate_async", "colocate_async": {}, "sampler": {
                "custom_sampler": {"path": "pkg://kvckpt.integrations.verl", "name": "KvckptReplayBufferAsync"},
                "max_off_policy_threshold": 100, "max_off_policy_strategy": "drop",
                "sampler_kwargs": {"kvckpt": {"path": os.path.join(WORK, "ledger.kv"), "actor_name": ACTOR}}}}},
    })
    trainer.use_critic = False
    trainer.actor_rollout_wg = StandInWorkerGroup()
    trainer.checkpoint_callback = Callback()
    trainer._restored_tq_prompt_count = 0
    dataset = [{"raw_prompt": f"question {i}", "index": torch.tensor(i)} for i in range(64)]
    trainer.train_dataloader = StatefulDataLoader(dataset, batch_size=BATCH, shuffle=False, collate_fn=collate_fn)
    trainer.train_dataloader_it = None

    own = None
    if PHASE == "B" and not KILL:  # what verl's built-in buffer gets back: TransferQueue's own checkpoint of step 2
        own_dir = os.path.join(WORK, "own_tq_checkpoint")
        tq.load_checkpoint(own_dir)
        listed = tq.kv_list("train").get("train", {})
        own = {"trajectories": sorted(k for k, t in listed.items() if not t.get("is_prompt")),
               "inflight": sorted(k for k, t in listed.items()
                                  if t.get("is_prompt") and t.get("status") in ("pending", "running"))}
        tq.kv_clear(keys=list(listed), partition_id="train")

    trainer.replay_buffer = trainer._build_replay_buffer()  # verl's custom_sampler path
    from kvckpt.integrations.verl.mirror import RAW, Mirror, active

    trainer._load_checkpoint()
    stale = stale_calls() if PHASE == "B" and not KILL else None
    resumed_from, restored = trainer.global_steps, trainer.replay_buffer.restored
    window = None
    if PHASE == "B" and KILL:  # what the restart holds before the re-issue: index -> prompt status
        # the mirrored kv_list, as _reissue_inflight_prompts' first call: it restores the dataloader position
        listed = {k: t for k, t in tq.kv_list("train").get("train", {}).items() if t.get("is_prompt")}
        indexes = tq.kv_batch_get(keys=list(listed), partition_id="train")["index"].tolist() if listed else []
        window = {"prompts": {str(i): listed[k]["status"] for k, i in zip(listed, indexes, strict=True)},
                "next_index": trainer.train_dataloader.state_dict()["_num_yielded"] * BATCH,
                "ledger": ray.get(active().actor.info.remote())["checkpoint_step"]}
        token_a = next(ln[1] for ln in lines("run_A.log") if ln[0] == "token")
        from kvckpt.integrations.verl import StaleRun

        try:  # a late write of a run-A worker
            Mirror(ACTOR, token_a).kv_put(key="late", partition_id="train", tag={"status": "finished"})
            window["late_write"] = "accepted"
        except StaleRun:
            window["late_write"] = "refused"
    trainer.global_steps += 1
    trainer.agent_loop_manager = StandInManager()
    reissued = trainer._reissue_inflight_prompts()
    log(f"run_{PHASE}.log", f"token {active().token} reissued {reissued} step {trainer.global_steps}")

    refused = None
    if PHASE == "B" and not KILL:  # a rollout worker of run A writes late, with run A's token
        token_a = next(ln[1] for ln in lines("run_A.log") if ln[0] == "token")
        victim = sorted(own["inflight"])[0] if own["inflight"] else None
        from kvckpt.integrations.verl import StaleRun

        try:
            Mirror(ACTOR, token_a).kv_put(key=victim, partition_id="train", tag={"status": "failure"})
        except StaleRun as exc:  # Ray re-raises the actor's error as a subclass of it
            refused = str(exc).splitlines()[-1]
        listed = RAW["kv_list"](partition_id="train").get("train", {})
        held = ray.get(active().actor.snapshot.remote())["items"]["train"].get(victim, {}).get("tags", {})
        refused = {"error": refused, "victim_status": listed.get(victim, {}).get("status"),
                   "ledger_status": held.get("status")}
    elif PHASE == "A":
        trainer._add_async_warmup_batches(WARMUP)

    last = 4 if KILL else 3
    steps = range(1, last + 1) if PHASE == "A" else range(trainer.global_steps, trainer.global_steps + 5)
    for step in steps:
        trainer.global_steps = step
        trainer._add_prompts_to_generate(BATCH)
        batch, _ = trainer.replay_buffer.sample(global_steps=step, partition_id="train", batch_size=BATCH)
        log(f"trained_{PHASE}.log", f"S {step} " + " ".join(sorted(batch.keys)))
        tq.kv_clear(keys=batch.keys, partition_id="train")  # fit's step 7
        if PHASE == "A" and step == 2 and not FIRST:
            trainer._save_checkpoint()
            if not KILL:
                RAW["save_checkpoint"](os.path.join(WORK, "own_tq_checkpoint"), metadata={"global_steps": step})

    if PHASE == "A":
        dispatched = (WARMUP + last) * BATCH
        while len([ln for ln in lines(gen_log) if ln[0] == "F"]) < dispatched - dispatched // 3:
            time.sleep(0.2)
        if KILL:
            kill_in_save_checkpoint(trainer, KILL)
        log("run_A.log", "READY")
        time.sleep(3600)
    with open(os.path.join(WORK, "result.json"), "w") as f:
        json.dump({"own": own, "refused": refused, "reissued": reissued, "stale": stale, "restored": restored,
                   "resumed_from": resumed_from, "window": window}, f)
    ray.get(active().actor.close.remote())


def kill_in_save_checkpoint(trainer: object, point: str) -> None:
    """Run verl's ``_save_checkpoint`` of the current step and SIGKILL this process group (the trainer, Ray,
    TransferQueue, the workers, the ledger actor) at ``point``: before the ledger's checkpoint
    (``tq.save_checkpoint``), after it, or after verl's tracker file (``checkpoint_callback.on_save``)."""
    import signal

    import transfer_queue as tq

    def kill(*args: object, **kwargs: object) -> None:
        log("run_A.log", f"KILL {point}")
        os.killpg(0, signal.SIGKILL)

    saved = tq.save_checkpoint
    if point == "before_ledger":
        tq.save_checkpoint = kill
    elif point == "after_ledger":
        tq.save_checkpoint = lambda *args, **kwargs: (saved(*args, **kwargs), kill())
    else:
        trainer.checkpoint_callback.on_save = kill
    trainer._save_checkpoint()
    raise AssertionError(f"_save_checkpoint returned past the kill point {point}")


def stale_calls() -> dict[str, object]:
    """Phase B, before any worker of B runs: run A's trainer calls ``tq.save_checkpoint``, ``tq.load_checkpoint``
    and the ledger's ``resume`` with run A's token. Returns each outcome and whether anything changed (the
    ledger, TransferQueue, the step-2 checkpoint directory; the step-9 directory must not appear)."""
    import hashlib
    from pathlib import Path

    import ray
    from kvckpt.integrations.verl import StaleRun
    from kvckpt.integrations.verl.mirror import RAW, Mirror, active

    token_a = next(ln[1] for ln in lines("run_A.log") if ln[0] == "token")
    step2 = os.path.join(WORK, "ckpt", "global_step_2", "transfer_queue")
    step9 = os.path.join(WORK, "ckpt", "global_step_9")

    def state() -> object:  # nothing else writes now: the ledger file's bytes are its state
        files = [Path(WORK, "ledger.kv"), *sorted(Path(step2).iterdir())]
        return [{str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files},
                ray.get(active().actor.info.remote()), RAW["kv_list"](partition_id="train"), os.path.exists(step9)]

    before, outcomes, old = state(), {}, Mirror(ACTOR, token_a)
    calls = {"save_checkpoint": lambda: old.save_checkpoint(os.path.join(step9, "transfer_queue"),
                                                            metadata={"global_steps": 9}),
             "load_checkpoint": lambda: old.load_checkpoint(step2),
             "resume": lambda: ray.get(old.actor.resume.remote(token_a, 2))}
    for name, call in calls.items():
        try:
            call()
            outcomes[name] = "accepted"
        except StaleRun:
            outcomes[name] = "refused"
    return {**outcomes, "unchanged": state() == before}


if __name__ == "__main__":
    main()
