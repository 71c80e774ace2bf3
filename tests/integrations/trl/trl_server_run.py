"""One AsyncGRPOTrainer run through kvckpt's worker on TRL's vLLM-server path, in its own process.

    python tests/integrations/trl/trl_server_run.py CONFIG_JSON

CONFIG_JSON: ``workdir``, ``model``, ``server`` (the vLLM server's base URL), ``max_steps``,
``save_steps``, ``every`` (progress interval, tokens), ``max_tokens`` (``max_completion_length``),
``kill_after_step`` (SIGKILL this process mid-generation after that step: in the first batch after
the step where a sample has durable tokens and tokens generated since its last record, the
generation thread waits until the step's checkpoint is complete (TRL's ``trainer_state.json`` and
kvckpt's file both written; the batch's states cannot change meanwhile), then dies; the trainer
waits once that checkpoint is saved, so the run cannot end first; 0: never), ``resume``
(a checkpoint directory or null), ``kill_in_save`` (SIGKILL this process inside TRL's own save of
that step's checkpoint, after the model and before the optimizer state, so ``checkpoint-N/`` is left
partial, with a prompt in flight, on the worker's defaults (no ``after_step``): the probe holds the
engine until the batch in flight ended, lets the next batch's first progress flush through and holds
its second, like a disk that stalls, and kills once the reader must wait for that flush before it
takes more of a sequence, logging every sequence's tokens taken and durable under the recorder's
lock; 0: never), ``reload`` (``{sync number: model directory}``: that weight sync really changes the
server's weights, tests/integrations/trl/trl_cpu.py), ``sync_mid_stream_at`` (at the end of that step,
before TRL's weight sync, the probe holds the stream reader of a batch dispatched on the weights the
sync replaces, at the first engine step where one of its samples (the held sample) has a chunk of
those weights durable and at least an interval of its budget left, and has not ended: the sync lands
while it is mid-stream, every token it takes after the sync is the new weights', and a chunk of them
falls due before it can end, whatever the timing (a batch that never offers such a step is let go and
the next one held); once the server resumed it lets the reader go, and it SIGKILLs the process once
the held sample's own chunk of the new weights is durable (on the flusher, before the batch can end),
logging the ledger; the held sample's group committed first ends the run with status 3 instead;
0: never),
``log`` (a JSON-lines file, each event fsynced: the sequences in
flight at the kill, the recovery plan, the worker's progress counters at the end).

Greedy (``top_k=1``: TRL's loss divides by the temperature, so ``temperature=0`` is refused, and vLLM
raises a temperature under 0.01 to 0.01) and ``learning_rate=0``: the CPU stand-in for TRL's NCCL weight transfer
(tests/integrations/trl/trl_cpu.py) sends no weights, so the server's startup weights are the trainer's exactly.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trl_cpu import ServerWeightTransferOnCPU, install_cpu_stand_ins, make_room, server_run


def main() -> None:
    cfg = json.loads(sys.argv[1])
    install_cpu_stand_ins()
    from kvckpt.integrations.trl import BUFFER_FILE, KvckptRolloutWorker
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from kvckpt.storage.progress_message import decode_message

    dataset, reward, log, args = server_run(cfg, cfg["max_steps"], cfg["save_steps"])

    def kill_mid_generation(states):
        """SIGKILL once ``kill_after_step``'s checkpoint is complete and a sample of the batch in
        flight has a durable prefix and tokens after it, logging every sequence of the batch first."""
        if not cfg.get("kill_after_step") or trainer.state.global_step < cfg["kill_after_step"]:
            return
        if not any(0 < s.durable < s.generated for s in states):
            return
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{cfg['kill_after_step']}")
        while not all(os.path.isfile(os.path.join(checkpoint, name)) for name in ("trainer_state.json", BUFFER_FILE)):
            time.sleep(0.05)  # the trainer saves it without waiting for this batch (its groups are ready)
        log({"killed": trainer.state.global_step,
             "in_flight": [{"group": s.lease.group_id, "prompt_idx": s.lease.prompt_idx, "index": s.index,
                            "attempt": s.lease.attempt, "generated": s.generated, "durable": s.durable}
                           for s in states]})
        os.kill(os.getpid(), signal.SIGKILL)

    class HoldAfterTheCheckpoint(TrainerCallback):
        """Once ``kill_after_step``'s checkpoint is saved, the trainer waits for the kill: a run that
        trained on from ready groups could otherwise end (exit 0) before the generation thread saw a
        sample with a durable prefix and tokens after it. While it waits, it makes room in a full
        store, so the worker admits and generates again, and its hook kills this process."""

        def on_save(self, args, state, control, **kwargs):
            if cfg.get("kill_after_step") and state.global_step == cfg["kill_after_step"]:
                while True:  # until the generation thread's hook kills this process
                    make_room(worker.buffer)
                    worker.check_health(0)
                    worker.buffer.wait_for_change(0.1)

    recorders = []  # the recorder of every batch the worker streamed (the probes read the last)
    armed = []  # (held, go) of a reader hold the next batch takes (hold_a_reader_mid_stream)

    def stall_the_next_batch(buf):
        """Let the next batch's first progress flush (one step message) land and hold its second until the
        process dies, like a disk that stalls."""
        record, passed, held = buf.record_progress_step, [], threading.Event()

        def stalling(message):
            if len(passed) == 1:
                held.set()
                threading.Event().wait()  # never set: the held flush never lands
            passed.append(message)
            return record(message)

        worker.engine_lock.acquire()  # the batch in flight ends; the next one starts behind the stalled disk
        count = len(recorders)
        buf.record_progress_step = stalling
        worker.engine_lock.release()
        while not (held.is_set() and len(recorders) > count):
            make_room(buf)
            worker.check_health(0)
            time.sleep(0.02)
        return recorders[-1]

    def hold_a_reader_mid_stream(buf, landed, dispatched):
        """Hold the stream reader of the next batch dispatched on the weights of step ``dispatched`` at its
        first engine step where a sample (the held one) has a durable chunk, at least ``every`` tokens of
        its budget left and no end of sequence yet, until ``go`` is set: the tokens it took so far are those
        weights', and after a sync every token it takes is the new weights', a chunk of them due before it
        can end. ``landed(sent, results)`` is called (on the flusher) with every progress flush's decoded
        message and its answers once the store answered it. Returns the held batch's recorder, ``go`` and
        the held sample's ``(group id, row index)``."""
        record, held, go = buf.record_progress_step, threading.Event(), threading.Event()
        chosen = []

        def recording(message):
            results = record(message)
            landed(decode_message(buf.schema, message), results)
            return results

        def mid_stream(states, last):
            """The position of the sample to hold in the batch (``states``; ``last``: each sample's last
            token so far), or None: this step offers none."""
            if any(s.lease.start_weight != dispatched for s in states):
                return None
            for i, s in enumerate(states):
                if (s.durable > 0 and s.generated <= cfg["max_tokens"] - cfg["every"]
                        and last.get(i) != worker.tokenizer.eos_token_id):
                    return i
            return None

        buf.record_progress_step = recording
        armed.append((mid_stream, held, go, chosen))
        while not held.is_set():
            make_room(buf)
            worker.check_health(0)
            time.sleep(0.02)
        return recorders[-1], go, chosen[0]

    def holding(recorder, on_step):
        """``on_step``, holding the reader as :func:`hold_a_reader_mid_stream` asked (if it did)."""
        if not armed:
            return on_step
        last: dict[int, int] = {}  # each sample's last token so far

        def step(deltas):
            stop = on_step(deltas)
            for i, ids, *_ in deltas:
                if ids:
                    last[i] = ids[-1]
            if armed:
                mid_stream, held, go, chosen = armed[0]
                i = mid_stream(recorder.states, last)
                if i is not None:
                    armed.pop()
                    state = recorder.states[i]
                    chosen.append((state.lease.group_id, state.index))
                    held.set()
                    go.wait()
            return stop
        return step

    class SyncMidStream(TrainerCallback):
        """At ``sync_mid_stream_at``'s step end (before TRL's sync): a sample is held mid-stream; a
        thread lets it go once the server resumed and kills once new weights' tokens are durable."""

        def on_step_end(self, args, state, control, **kwargs):
            step = cfg.get("sync_mid_stream_at")
            if step != state.global_step:
                return
            buf = worker.buffer
            sample = []  # the held sample's (group id, row index), once held

            def landed(sent, results):  # on the flusher: the held sample's first chunk of the new weights is durable
                for j, result in enumerate(results):
                    lease = sent.leases[int(sent.lease_of[j])]
                    versions = (sent.versions[j:j + 1] if sent.token_versions is None
                                else sent.token_versions[sent.offsets[j]:sent.offsets[j + 1]])
                    if (sample and (lease["group_id"], int(sent.indices[j])) == sample[0]
                            and step in versions.tolist() and not isinstance(result, BaseException)):
                        log({"killed_after_sync": step, "held": list(sample[0]),
                             "ledger": [[e.group_id, e.prompt_idx, e.start_weight] for e in buf.ledger()]})
                        os.kill(os.getpid(), signal.SIGKILL)

            commit = buf.commit_group

            def committing(lease, *a, **kw):  # the held group ending before the kill: the probe missed its point
                if sample and lease.group_id == sample[0][0]:
                    log({"held_group_committed": list(sample[0])})
                    print(f"the held sample {sample[0]} ended with no chunk of the new weights durable",
                          file=sys.stderr, flush=True)
                    os._exit(3)
                return commit(lease, *a, **kw)

            buf.commit_group = committing
            recorder, go, held = hold_a_reader_mid_stream(buf, landed, step - 1)
            sample.append(held)
            log({"held": {"group": held[0], "index": held[1],
                          "states": [{"index": s.index, "generated": s.generated, "durable": s.durable}
                                     for s in recorder.states]}})

            def after_the_sync():
                while worker.epochs.version != step or worker.epochs.paused:
                    time.sleep(0.02)
                go.set()

            threading.Thread(target=after_the_sync, daemon=True).start()

        def on_save(self, args, state, control, **kwargs):
            if cfg.get("sync_mid_stream_at") == state.global_step:
                while True:  # until the thread kills this process (the run must not end first)
                    make_room(worker.buffer)
                    worker.check_health(0)
                    worker.buffer.wait_for_change(0.1)


    def kill_inside_trl_save(save):
        """TRL's ``_save_optimizer_and_scheduler``, which at ``kill_in_save`` holds a flush and dies (see above)."""
        def wrapped(output_dir):
            if trainer.state.global_step != cfg.get("kill_in_save"):
                return save(output_dir)
            recorder = stall_the_next_batch(worker.buffer)  # the held flush never lands: the process dies
            while True:
                # the reader takes no token and the flusher applies no result meanwhile
                with recorder.recorder._cond:
                    if any(recorder.recorder.held_back(t, 1) for t in recorder.tails):
                        log({"killed_in_save": trainer.state.global_step,
                             "in_flight": [{"group": s.lease.group_id, "prompt_idx": s.lease.prompt_idx,
                                            "index": s.index, "generated": s.generated, "durable": s.durable}
                                           for s in recorder.states]})
                        os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.02)
        return wrapped

    transfer = ServerWeightTransferOnCPU(cfg["server"], {int(k): v for k, v in cfg.get("reload", {}).items()})
    worker = KvckptRolloutWorker(os.path.join(cfg["workdir"], "buffer.kv"), cfg["model"], dataset, [reward], args,
                                 weight_transfer=transfer, capacity=8, retain_consumed=True,
                                 progress_every_tokens=cfg["every"],
                                 after_step=kill_mid_generation if cfg.get("kill_after_step") else None)
    stream = worker.backend.stream

    def recorded_stream(seqs, max_tokens, temperature, on_step=None, step_tokens=None):
        if on_step is not None:
            recorders.append(on_step.__self__)
            on_step = holding(on_step.__self__, on_step)
        return stream(seqs, max_tokens, temperature, on_step, step_tokens)

    worker.backend.stream = recorded_stream
    trainer = AsyncGRPOTrainer(model=cfg["model"], reward_funcs=[reward], args=args, train_dataset=dataset,
                               processing_class=AutoTokenizer.from_pretrained(cfg["model"]), rollout_worker=worker,
                               weight_transfer=worker.weight_transfer,
                               callbacks=[worker.callback, HoldAfterTheCheckpoint(), SyncMidStream()])
    if cfg.get("kill_in_save"):
        trainer._save_optimizer_and_scheduler = kill_inside_trl_save(trainer._save_optimizer_and_scheduler)
    trainer.train(resume_from_checkpoint=cfg.get("resume"))
    plan = worker.callback.plan
    log({"done": trainer.state.global_step, "plan": plan.report() if plan else None,
         "stats": worker.progress_stats})
    worker.close()


if __name__ == "__main__":
    main()
