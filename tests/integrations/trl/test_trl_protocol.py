"""The kvckpt TRL worker against TRL's own protocols, called the way TRL 1.16.0's trainer calls them.

Call sites (trl/experimental/async_grpo/async_grpo_trainer.py, TRL 1.16.0): ``RolloutWorkerProtocol``
and ``WeightTransferProtocol`` (lines 115-182); ``_TrainBeginCallback.on_train_begin`` runs
``init_weight_transfer()``, the cold ``_sync_weight()`` and ``rollout_worker.start()`` (226-234);
``_sync_weight_merged`` runs ``pause()``, ``send_weights(self._streaming_iter())``, ``resume()`` and
``update_model_version(self.model_version)`` (1766-1799); ``RolloutQueueDataset.__iter__`` calls
``queue.get(timeout=poll_interval_s)``, on ``queue.Empty`` ``check_health_fn(stale_after_s)``, and
``queue.qsize()`` (351-382); ``log()`` drains ``metrics_queue.get_nowait()`` (1700-1703).
"""

from __future__ import annotations

import importlib.util
import inspect
import queue
import sys
from collections import defaultdict

import pytest
from _paths import ROOT

pytestmark = [pytest.mark.trl,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                 reason="TRL not installed (pip install -e '.[test]' on Python >= 3.11)")]


@pytest.fixture
def setup(tmp_path, model_path):
    from kvckpt.integrations.trl import KvckptRolloutWorker
    from transformers import AutoModelForCausalLM, TrainerControl, TrainerState
    from trl.experimental.async_grpo import AsyncGRPOConfig

    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=2,
                           max_completion_length=3, token_budget=0, use_cpu=True, bf16=False, report_to=[],
                           max_staleness=1)
    dataset = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]

    def reward(completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    worker = KvckptRolloutWorker(str(tmp_path / "buffer.kv"), model_path, dataset, [reward], args,
                                 backend="transformers")
    trainer_model = AutoModelForCausalLM.from_pretrained(model_path)
    yield worker, args, TrainerState(), TrainerControl(), trainer_model
    worker.close()


def test_members_match_trls_protocols(setup):
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutWorkerProtocol, WeightTransferProtocol

    worker = setup[0]
    for proto, obj in ((RolloutWorkerProtocol, worker), (WeightTransferProtocol, worker.weight_transfer)):
        for name, member in vars(proto).items():
            if name.startswith("_") or not callable(member):
                continue
            ours = inspect.signature(getattr(obj, name)).parameters
            theirs = list(inspect.signature(member).parameters)[1:]
            assert list(ours) == theirs, (proto.__name__, name)
    for name in RolloutWorkerProtocol.__annotations__:  # rollout_buffer, metrics_queue
        assert hasattr(worker, name)
    for method in ("get", "qsize"):
        assert callable(getattr(worker.rollout_buffer, method))


def test_driven_as_trls_trainer_drives_it(setup):
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset

    worker, args, state, control, trainer_model = setup
    with pytest.raises(Exception, match="store is not open"):
        worker.start()
    worker.callback.on_train_begin(args, state, control)  # ours runs before TRL's _TrainBeginCallback
    transfer = worker.weight_transfer
    transfer.init_weight_transfer()
    transfer.pause()
    transfer.send_weights((n, p.detach()) for n, p in trainer_model.named_parameters())
    transfer.resume()
    worker.update_model_version(1)
    worker.start()
    dataset = RolloutQueueDataset(rollout_queue=worker.rollout_buffer, model_version_fn=lambda: 1,
                                  check_health_fn=worker.check_health, stale_after_s=args.heartbeat_stale_after_s,
                                  metrics=defaultdict(list), max_staleness=args.max_staleness, poll_interval_s=0.5)
    rows = iter(dataset)
    first, second = next(rows), next(rows)
    assert first["group_id"] == second["group_id"] == 0  # a group's rows are served together
    assert first["completion_mask"].sum() >= 1 and len(first["input_ids"]) == len(first["old_log_probs"])
    assert abs(first["advantage"] + second["advantage"]) < 1e-5 or first["advantage"] == second["advantage"] == 0
    assert worker.rollout_buffer.qsize() >= 0
    with pytest.raises(queue.Empty):
        worker.metrics_queue.get_nowait()
    worker.check_health(args.heartbeat_stale_after_s)
    # A step of 2 rows trained group 0: the callback claims it and closes kvckpt step 0.
    state.global_step = 1
    worker.callback.on_step_end(args, state, control)
    assert worker.buffer.trainer_version == 1
    assert worker.buffer.groups(["consumed"])[0].prompt_idx == 0
    worker.stop()


def test_unknown_weight_names_fail_closed(setup):
    import torch

    from kvckpt.errors import BadArgument

    worker = setup[0]
    with pytest.raises(BadArgument, match="parameters the rollout engine lacks"):
        worker.load_weights([("not.a.param", torch.zeros(1))])


def test_missing_trl_names_the_install(monkeypatch):
    from kvckpt.integrations.common import PeerMissing
    from kvckpt.integrations.trl.peer import rollout_sample_class

    monkeypatch.setitem(sys.modules, "trl.experimental.async_grpo.async_rollout_worker", None)
    with pytest.raises(PeerMissing, match=r"^kvckpt.integrations.trl needs trl\.experimental\.async_grpo\."
                                          r"async_rollout_worker: pip install 'kvckpt\[trl\]'$"):
        rollout_sample_class()


def test_docs_block_trains():
    """docs/integrations.md's TRL block, run as written (with the CPU harness's two stand-ins)."""
    import pathlib
    import re

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from trl_cpu import install_cpu_stand_ins

    install_cpu_stand_ins()
    doc = (ROOT / "docs" / "integrations.md").read_text()
    section = doc[doc.index("## TRL AsyncGRPOTrainer"):]
    section = section[section.index("test_docs_block_trains runs this block"):]  # the in-process block, named there
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(block, "docs/integrations.md (TRL)", "exec"), {"__name__": "docs_trl"})


def test_resume_without_live_store_restores_the_checkpoint_file(setup, tmp_path, model_path):
    from kvckpt.integrations.trl import BUFFER_FILE, KvckptRolloutWorker

    from kvckpt.errors import RecoveryError

    worker, args, state, control, _ = setup
    worker.callback.on_train_begin(args, state, control)
    worker.buffer.finish_step()
    state.global_step = 1
    (tmp_path / "out" / "checkpoint-1").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-1" / "trainer_state.json").write_text("{}")  # TRL's save ends with it
    worker.callback.on_save(args, state, control)
    assert (tmp_path / "out" / "checkpoint-1" / BUFFER_FILE).is_file()
    worker.close()

    again = KvckptRolloutWorker(worker.store_path, model_path, worker.dataset, worker.reward_funcs, args,
                                backend="transformers")
    state.global_step = 0  # a fresh start over a store that has trained: refused, nothing touched
    with pytest.raises(RecoveryError, match="starts from step 0"):
        again.callback.on_train_begin(args, state, control)
    (tmp_path / "buffer.kv").unlink()
    state.global_step = 1  # resume_from_checkpoint=checkpoint-1 with the live store lost
    again.callback.on_train_begin(args, state, control)
    assert again.callback.plan.resume_version == 1 and again.buffer.trainer_version == 1
    again.close()
