"""One AsyncGRPOTrainer run through kvckpt's worker on TRL's vLLM-server path, held mid-generation for a SIGTERM.

    python tests/integrations/trl/trl_server_drain_run.py CONFIG_JSON

CONFIG_JSON: ``workdir``, ``model``, ``server`` (the vLLM server's base URL), ``every`` (progress interval,
tokens), ``max_tokens`` (``max_completion_length``), ``log`` (a JSON-lines file, each event fsynced).

The trainer, the worker and the weight-transfer stand-in are tests/integrations/trl/trl_server_run.py's; the worker
keeps its defaults, so its SIGTERM drain (``drain_seconds``) is the shipped one. One probe: the stream reader of
the first batch holds, inside the engine step's ``on_step`` once the recorder took that step's tokens, at the first
step where a sample is past its first interval and holds an unrecorded tail short of an interval (:data:`TAIL`
tokens past one, and short of ``max_tokens``). While it holds, the reader takes no token, so what each sequence
generated is fixed; it logs ``{"held": [...], "holder": ...}`` (each sequence's group, row index and tokens
generated) and waits for the test's SIGTERM, whose drain (on the main thread) must make every tail durable. The
drain's summary line goes to stderr (the progress logger at INFO, a harness setting only).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trl_cpu import ServerWeightTransferOnCPU, install_cpu_stand_ins, make_room, server_run

#: The unrecorded tail the held sample holds (tokens past its last interval; ``every`` is 8 in the test).
TAIL = 5


def main() -> None:
    cfg = json.loads(sys.argv[1])
    install_cpu_stand_ins()
    from kvckpt.integrations.trl import KvckptRolloutWorker
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    said = logging.getLogger("kvckpt.integrations.common.progress")
    said.setLevel(logging.INFO)
    said.addHandler(logging.StreamHandler(sys.stderr))

    dataset, reward, log, args = server_run(cfg, 3, 1)
    transfer = ServerWeightTransferOnCPU(cfg["server"], {})
    worker = KvckptRolloutWorker(os.path.join(cfg["workdir"], "buffer.kv"), cfg["model"], dataset, [reward], args,
                                 backend="server", weight_transfer=transfer, capacity=8, retain_consumed=True,
                                 progress_every_tokens=cfg["every"])
    stream, every, held = worker.backend.stream, cfg["every"], threading.Event()

    def holding(recorder, on_step):
        def step(deltas):
            stop = on_step(deltas)
            states = recorder.states
            if not held.is_set() and any(every < s.generated < cfg["max_tokens"] and s.generated % every == TAIL
                                         for s in states):
                held.set()
                log({"held": [{"group": s.lease.group_id, "index": s.index, "generated": s.generated}
                              for s in states], "holder": worker.holder})
                threading.Event().wait()  # the reader takes nothing more; SIGTERM's drain ends the process
            return stop
        return step

    def held_stream(seqs, max_tokens, temperature, on_step=None, step_tokens=None):
        if on_step is not None:
            on_step = holding(on_step.__self__, on_step)
        return stream(seqs, max_tokens, temperature, on_step, step_tokens)

    worker.backend.stream = held_stream
    trainer = AsyncGRPOTrainer(model=cfg["model"], reward_funcs=[reward], args=args, train_dataset=dataset,
                               processing_class=AutoTokenizer.from_pretrained(cfg["model"]), rollout_worker=worker,
                               weight_transfer=worker.weight_transfer, callbacks=[worker.callback])
    trainer.train()
    while True:  # a run that ended before the hold: make room until the held batch comes (the test's hang guard)
        make_room(worker.buffer)
        worker.check_health(0)
        worker.buffer.wait_for_change(0.1)


if __name__ == "__main__":
    main()
