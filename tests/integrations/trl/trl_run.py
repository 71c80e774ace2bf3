"""One AsyncGRPOTrainer run on CPU, in its own process (the TRL crash tests start it twice).

    python tests/integrations/trl/trl_run.py CONFIG_JSON

CONFIG_JSON: ``mode`` ("kvckpt" or "default"), ``workdir``, ``model``, ``max_steps``,
``save_steps``, ``kill_at`` (SIGKILL this process at the end of that step, with a prompt in flight;
0: never), ``kill_in_save`` (SIGKILL it inside TRL's own save of that step's checkpoint, after the
model and before the optimizer state, with a prompt in flight: the checkpoint directory is left
unusable and kvckpt's file was never written; 0: never),
``kill_after_resume`` (SIGKILL it right after the store was opened at train begin), ``resume``
(a checkpoint directory or null), ``log`` (a JSON-lines file the run appends its events to, each
fsynced: the steps' trained groups, the store as train begin left it, and, for "default", every
generated position).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trl_cpu import default_like_worker, install_cpu_stand_ins


class WatchedLock:
    """The worker's ``engine_lock``, recording whether another thread is blocked on it: the kill
    point's condition (a worker blocked there holds admitted leases it cannot generate)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.blocked = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self.blocked.set()
        try:
            return self._lock.acquire(True, timeout)
        finally:
            self.blocked.clear()

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> WatchedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    install_cpu_stand_ins()
    import numpy as np
    import torch
    from kvckpt.integrations.trl import KvckptRolloutWorker
    from kvckpt.integrations.vllm import AdditionTask
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    task = AdditionTask()
    from datasets import Dataset

    dataset = Dataset.from_list([{"prompt": task.prompt(i), "answer": task.answer(i)} for i in range(task.size)])
    log_fh = open(cfg["log"], "a")  # noqa: SIM115 - appended to until the process ends or is killed

    def log(event):
        log_fh.write(json.dumps({"run": cfg["run"], **event}) + "\n")
        log_fh.flush()
        os.fsync(log_fh.fileno())

    def reward(completions, answer, **_):
        return [1.0 if c.strip() == a else 0.1 * (a in c) for c, a in zip(completions, answer, strict=True)]

    args = AsyncGRPOConfig(
        output_dir=os.path.join(cfg["workdir"], "out"), max_steps=cfg["max_steps"], save_steps=cfg["save_steps"],
        save_strategy="steps", per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=2,
        max_completion_length=3, token_budget=0, use_cpu=True, bf16=False, report_to=[], logging_steps=1,
        max_staleness=cfg.get("max_staleness", 1), learning_rate=1e-3, seed=0, save_only_model=False,
        dataloader_num_workers=0)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])

    class Probe(TrainerCallback):
        """Logs what each step trained; at ``kill_at`` holds the engine until a prompt is in flight, then
        SIGKILLs this process (so the kill always finds committed, ready and in-flight work: the
        dataloader has read the next step's groups, still ready in the store, before a step ends)."""

        def on_train_begin(self, args, state, control, **kwargs):
            if cfg["mode"] != "kvckpt":
                return
            buf = worker.buffer
            log({"begin": state.global_step, "plan": worker.callback.plan.report() if worker.callback.plan else None,
                 "ready": [[g.prompt_idx, g.start_weight, g.lineage_fork, g.lineage_weight]
                           for g in buf.groups(["ready"])],
                 "ledger": [[e.prompt_idx, e.start_weight, e.lineage_fork] for e in buf.ledger()]})
            if cfg.get("kill_after_resume"):
                os.kill(os.getpid(), signal.SIGKILL)

        def on_step_end(self, args, state, control, **kwargs):
            if cfg["mode"] == "kvckpt":
                trained = [g.prompt_idx for g in worker.buffer.groups(["consumed"])
                           if g.consumed_step == state.global_step - 1]
                log({"step": state.global_step, "trained": sorted(trained), "evicted": worker.rollout_buffer.evicted})
            else:
                log({"step": state.global_step, "trained_ids": sorted(trainer._trained_groups),
                     "start": worker._loop_kwargs["dataset_start_index"]})
            if cfg["mode"] == "kvckpt" and cfg["run"] == 1 and state.global_step == 2:
                # Let generation fill the store's capacity once, so some groups wait past
                # max_staleness whatever the machine's speed (the stale-drop path always runs).
                while worker.buffer.admissible():
                    worker.buffer.wait_for_change(0.1)
            if state.global_step != cfg["kill_at"]:
                return
            if cfg["mode"] == "kvckpt":
                hold_a_prompt_in_flight()
            os.kill(os.getpid(), signal.SIGKILL)

    def hold_a_prompt_in_flight():
        """Hold the engine until a prompt is in flight. While the engine is held, a prompt admitted
        now, or held by a worker blocked on the engine, cannot be generated or committed before the
        kill. (Waiting for a new admission alone hung when the worker had admitted its leases just
        before and was blocked on the engine: nothing new could be admitted.)"""
        worker.engine_lock.acquire()
        before = {e.group_id for e in worker.buffer.ledger()}
        engine_waited_on = worker.engine_lock.blocked
        while not ({e.group_id for e in worker.buffer.ledger()} - before or engine_waited_on.is_set()):
            worker.buffer.wait_for_change(0.1)

    def kill_inside_trl_save(save):
        """TRL's ``_save_optimizer_and_scheduler``, which at ``kill_in_save`` dies before writing."""
        def wrapped(output_dir):
            if trainer.state.global_step == cfg.get("kill_in_save"):
                hold_a_prompt_in_flight()
                log({"killed_in_save": trainer.state.global_step,
                     "ready": [[g.prompt_idx, g.start_weight] for g in worker.buffer.groups(["ready"])],
                     "ledger": [[e.prompt_idx, e.start_weight] for e in worker.buffer.ledger()]})
                os.kill(os.getpid(), signal.SIGKILL)
            return save(output_dir)
        return wrapped

    if cfg["mode"] == "kvckpt":
        worker = KvckptRolloutWorker(os.path.join(cfg["workdir"], "buffer.kv"), cfg["model"], dataset, [reward], args,
                                     backend="transformers", capacity=8, retain_consumed=True)
        worker.engine_lock = WatchedLock()
        extra = {"rollout_worker": worker, "weight_transfer": worker.weight_transfer}
        callbacks = [worker.callback, Probe()]
    else:
        from kvckpt.integrations.vllm import create_backend

        engine = create_backend("transformers", cfg["model"], seed=0)

        def generate_group(position, group_id, version):
            row = dataset[position % len(dataset)]
            ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            (samples,) = engine.generate([ids], [2], 3, 1.0)
            rewards = np.array(reward([s.text for s in samples], [row["answer"]] * 2))
            adv = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
            return [RolloutSample(prompt=row["prompt"], completion=s.text,
                                  input_ids=np.array(list(s.prompt_ids) + list(s.completion_ids), dtype=np.int64),
                                  completion_mask=np.array([0] * len(s.prompt_ids) + [1] * len(s.completion_ids)),
                                  old_log_probs=np.array([0.0] * len(s.prompt_ids) + list(s.logprobs),
                                                         dtype=np.float32),
                                  advantage=float(a), model_version=version, group_id=group_id,
                                  metrics={"reward": float(r)}) for s, r, a in zip(samples, rewards, adv, strict=True)]

        worker = default_like_worker(generate_group, len(dataset), log)

        class NoTransfer:
            def init_weight_transfer(self): pass
            def pause(self): pass
            def send_weights(self, iterator):
                engine.load_weights([(n, t.detach().clone()) for n, t in iterator])
            def resume(self): pass
            def destroy(self): pass

        extra = {"rollout_worker": worker, "weight_transfer": NoTransfer()}
        callbacks = [Probe()]
    torch.manual_seed(0)
    trainer = AsyncGRPOTrainer(model=cfg["model"], reward_funcs=[reward], args=args, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=callbacks, **extra)
    if cfg.get("kill_in_save"):
        trainer._save_optimizer_and_scheduler = kill_inside_trl_save(trainer._save_optimizer_and_scheduler)
    trainer.train(resume_from_checkpoint=cfg.get("resume"))
    if cfg["mode"] == "kvckpt":
        log({"done": True, "plan": worker.callback.plan.report() if worker.callback.plan else None})
        worker.close()
    else:
        log({"done": True})


if __name__ == "__main__":
    main()
