"""Selecting the kvckpt backend by configuration: the entry point's config building (no NeMo-RL
needed), its refusal without NeMo-RL, and the swap's mechanics against a stand-in of the three
NeMo-RL names it replaces (``setup.TQReplayBuffer``, ``setup.build_data_plane_client``,
``single_controller.create_sampler``), including the hand-over of the buffer to another process
as NeMo-RL ships it to its SingleControllerActor. NeMo-RL itself is not installable here (PyPI's
``nemo-rl`` is a placeholder), so the run of its real launcher is not exercised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from kvckpt.integrations.nemo_rl.entry import build_master_config, main, prepare

from kvckpt.errors import BadArgument

BASE = """\
grpo:
  num_generations_per_prompt: 8
  num_prompts_per_step: 32
async_rl:
  max_buffered_rollouts: 64
  sampler: {name: in_order, max_lookahead_versions: 1}
"""
CHILD = """\
defaults: base.yaml
grpo:
  num_prompts_per_step: 2
async_rl:
  max_buffered_rollouts: 4
  replay_buffer:
    backend: kvckpt
    path: {path}
    schema:
      input_ids: [int64, token]
      input_lengths: [int64, row]
      total_reward: [float32, row]
"""


def write_configs(tmp_path: Path) -> Path:
    (tmp_path / "base.yaml").write_text(BASE)
    child = tmp_path / "kvckpt.yaml"
    child.write_text(CHILD.format(path=tmp_path / "replay.kv"))
    return child


def test_the_master_config_is_built_as_nemo_rls_loader_builds_it(tmp_path: Path) -> None:
    child = write_configs(tmp_path)
    master = build_master_config(str(child), ["grpo.num_generations_per_prompt=2", "+async_rl.extra=1",
                                              "~async_rl.max_buffered_rollouts"])
    assert master["grpo"] == {"num_generations_per_prompt": 2, "num_prompts_per_step": 2}
    assert master["async_rl"]["extra"] == 1 and "max_buffered_rollouts" not in master["async_rl"]
    assert master["async_rl"]["sampler"] == {"name": "in_order", "max_lookahead_versions": 1}
    store, script, argv = prepare(["--config", str(child), "--nemo-rl-script", str(child),
                                   "grpo.num_prompts_per_step=1"])
    assert script == str(child)
    assert (store.path, store.buffer.group_size, store.buffer.groups_per_step) == (str(tmp_path / "replay.kv"), 8, 1)
    assert store.buffer.max_buffered_rollouts == 4 and argv == [str(child), "--config", str(child),
                                                                "grpo.num_prompts_per_step=1"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["notanoverride"], "is not key=value"), (["~grpo.nothing"], "deletes a key the config does not have"),
    (["~async_rl.replay_buffer"], r"no async_rl\.replay_buffer section"),
    (["async_rl.replay_buffer.backend=tq"], "not 'tq'"), (["async_rl.replay_buffer.typo=1"], "unknown config key")])
def test_a_bad_config_is_refused_before_nemo_rl_is_needed(tmp_path: Path, overrides: list[str], message: str) -> None:
    child = write_configs(tmp_path)
    with pytest.raises(BadArgument, match=message):
        prepare(["--config", str(child), *overrides])
    (tmp_path / "loop.yaml").write_text("defaults: loop.yaml\n")
    with pytest.raises(BadArgument, match="inherits from itself"):
        build_master_config(str(tmp_path / "loop.yaml"))


def test_without_nemo_rl_the_entry_point_says_what_to_install(tmp_path: Path, capsys: Any) -> None:
    child = write_configs(tmp_path)
    assert main(["--config", str(child)]) == 2
    err = capsys.readouterr().err
    assert "kvckpt.integrations.nemo_rl (inside NeMo-RL's SingleController) needs nemo_rl" in err
    assert "git clone https://github.com/NVIDIA-NeMo/RL" in err
    assert "placeholder" in err and not (tmp_path / "replay.kv").exists()


# -- the swap against a stand-in of NeMo-RL's three names -------------------------------------------
STAND_IN = {
    "nemo_rl/__init__.py": "",
    "nemo_rl/algorithms/__init__.py": "",
    "nemo_rl/algorithms/single_controller_utils/__init__.py": "",
    "nemo_rl/algorithms/single_controller_utils/setup.py": '''
        class InnerClient:
            """NeMo-RL's TQ client's place: records the rows its trainer workers could read."""
            def __init__(self):
                self.rows = {}
            def put_samples(self, sample_ids, partition_id, fields=None, tags=None):
                for sid in sample_ids:
                    self.rows.setdefault(sid, set()).update(fields.keys())
            def clear_samples(self, sample_ids, partition_id):
                for sid in sample_ids:
                    self.rows.pop(sid, None)
        def build_data_plane_client(cfg, *, bootstrap=True):
            return InnerClient()
        TQReplayBuffer = None  # NeMo-RL's class; the swap replaces the name
        def setup_single_controller():  # what setup.py does with the two names, in its order
            dp_client = build_data_plane_client({"enabled": True}, bootstrap=False)
            return dp_client, TQReplayBuffer(dp_client, partition_id="rollout_data",
                                             pad_value_dict={"token_ids": 0, "input_ids": 0},
                                             require_routed_experts=False)
        ''',
    "nemo_rl/algorithms/single_controller.py": '''
        def create_sampler(buffer, cfg):
            raise AssertionError("NeMo-RL's own create_sampler was handed a kvckpt buffer")
        ''',
    "examples/run_grpo_single_controller.py": '''
        import asyncio, json, pickle, subprocess, sys
        import torch
        from nemo_rl.algorithms import single_controller
        from nemo_rl.algorithms.single_controller_utils import setup
        dp_client, buf = setup.setup_single_controller()
        sampler = single_controller.create_sampler(buf, {"name": "in_order", "max_lookahead_versions": 1})
        sampler.set_dispatch_index(0)
        target = asyncio.run(sampler.admit(trainer_version_fn=lambda: 0))
        rows = {"input_ids": torch.ones((8, 3), dtype=torch.long), "input_lengths": torch.full((8,), 3),
                "total_reward": torch.arange(8.0)}
        for _ in range(2):
            gid = buf.reserve(weight_version=0, target_step=target, prompt_idx=1)
            asyncio.run(buf.commit(gid, rows, start_weight_version=0, end_weight_version=0))
        meta, n = asyncio.run(sampler.select(current_train_weight=0, min_prompt_groups=1, max_prompt_groups=1))
        published = sorted(dp_client.inner.rows[meta.sample_ids[0]])
        handed = pickle.dumps(buf)  # Ray ships the actor args to the SingleControllerActor
        child = subprocess.run([sys.executable, "-c", CHILD], input=handed, capture_output=True)
        assert child.returncode == 0, child.stderr.decode()
        result = {"published": published, "actor": json.loads(child.stdout)}  # it opened: this handle closed
        print(json.dumps(result))
        ''',
}
ACTOR = '''
import asyncio, json, pickle, sys
buf = pickle.loads(sys.stdin.buffer.read())
from nemo_rl.algorithms import single_controller
sampler = single_controller.create_sampler(buf, {"name": "in_order", "max_lookahead_versions": 1})
meta, n = asyncio.run(sampler.select(current_train_weight=0, min_prompt_groups=1, max_prompt_groups=1))
print(json.dumps({"sampler": type(sampler).__name__, "selected": n, "ready_left": len(buf),
                  "inner_bound": buf.dp_client.inner is not None, "published": len(buf.dp_client.inner.rows)}))
'''


def test_the_swap_replaces_nemo_rls_names_and_the_buffer_travels_to_the_actor(tmp_path: Path) -> None:
    root = tmp_path / "stand_in"
    for rel, text in STAND_IN.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    script = root / "examples" / "run_grpo_single_controller.py"
    script.write_text(f"CHILD = {ACTOR!r}\n" + script.read_text())
    child = write_configs(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "kvckpt.integrations.nemo_rl.entry", "--config", str(child),
                           "grpo.num_generations_per_prompt=8"], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"published": ["input_ids", "input_lengths", "total_reward"],
                      "actor": {"sampler": "InOrderSampler", "selected": 1, "ready_left": 0, "inner_bound": True,
                                "published": 16}}  # the driver's published group, then the actor's
