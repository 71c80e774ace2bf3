"""Figure 7: a real training loop killed at chosen points, and the acknowledged groups each
recovery mode (the live store, the last checkpoint file) then loses (:func:`measure_crashes`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import data
from benchmarks.measure import Settings, child
from kvckpt import CLAIMED, CONSUMED, READY, BufferConfig, Prompt, ReplayBuffer, read_stamp, restore


def crash_child(directory: str, crash_at: str, steps_per_ckpt: int, gps: int, seed: int) -> None:
    """A small async GRPO loop that SIGKILLs itself at ``crash_at``.

    Producers stay one step ahead: each step commits ``gps`` new groups, then the trainer selects
    ``gps`` and finishes the step; every ``steps_per_ckpt`` steps a checkpoint is written (and
    waited for). Each acknowledged commit is appended to ``acked.txt`` with its generated tokens,
    each completed checkpoint as ``# <file name>``.
    ``crash_at``: ``after-checkpoint`` (right after the second checkpoint completes),
    ``mid-interval`` (half an interval of commits later), ``before-checkpoint`` (the last commit
    before the third checkpoint) or ``during-copy`` (the third checkpoint stamped, its copy running).
    """
    spec = data.RolloutSpec(group_size=8, response_median=400)
    config = BufferConfig(group_size=spec.group_size, schema=data.SCHEMA,
                          sampler={"name": "windowed", "max_staleness_versions": 4},
                          max_buffered_rollouts=(2 * steps_per_ckpt + 4) * gps, groups_per_step=gps)
    rng = np.random.default_rng(seed)
    buf = ReplayBuffer.create(os.path.join(directory, "live.kv"), config)
    interval = steps_per_ckpt * gps
    crash_commit = {"after-checkpoint": 0, "mid-interval": interval // 2, "before-checkpoint": interval}.get(crash_at)
    acked = open(os.path.join(directory, "acked.txt"), "w")  # noqa: SIM115 - must survive until SIGKILL
    since_ckpt, ckpts, prompt = None, 0, 0

    def produce() -> None:
        nonlocal prompt, since_ckpt
        for lease in buf.admit([Prompt(prompt_idx=prompt + j) for j in range(gps)]):
            group = data.make_group(rng, spec)
            buf.commit_group(lease, data.rows_of(group))
            acked.write(f"{lease.group_id} {data.response_tokens(group)}\n")
            acked.flush()
            if since_ckpt is not None:
                since_ckpt += 1
                if ckpts == 2 and since_ckpt == crash_commit:
                    os.kill(os.getpid(), signal.SIGKILL)
        prompt += gps

    produce()
    step = 0
    while True:
        produce()
        buf.read_batch(buf.select(gps, gps))
        buf.finish_step()
        step += 1
        if step % steps_per_ckpt == 0:
            handle = buf.checkpoint(os.path.join(directory, f"step-{step:04d}.kvckpt"), {"step": step})
            if ckpts == 2 and crash_at == "during-copy":
                os.kill(os.getpid(), signal.SIGKILL)
            acked.write(f"# {os.path.basename(handle.wait().path)}\n")
            acked.flush()
            ckpts += 1
            since_ckpt = 0
            if ckpts == 2 and crash_commit == 0:
                os.kill(os.getpid(), signal.SIGKILL)


def count_child(crashed: str) -> None:
    """Runs in a fresh process after the crashes. For each ``[directory, checkpoint file]`` of the
    JSON list ``crashed``: recover both ways (the live store in place; the checkpoint file restored
    to another path) and print, per mode, which groups are committed after recovery (ready,
    claimed, or consumed by a step the resumed model contains) and what the trainer's next
    ``select`` returns. One JSON line per directory."""
    for directory, checkpoint_file in json.loads(crashed):
        stamp = read_stamp(checkpoint_file)
        out = {}
        for mode in ("live", "checkpoint"):
            if mode == "live":
                buf = ReplayBuffer.open(os.path.join(directory, "live.kv"))
                plan = buf.recover(stamp["trainer_version"])
            else:
                buf, plan = restore(checkpoint_file, os.path.join(directory, "restored.kv"))
            with buf:
                out[mode] = {"kept": [g.group_id for g in buf.groups([READY, CLAIMED, CONSUMED])],
                             "redispatch": len(plan.leases), "resume_version": plan.resume_version,
                             "selected": buf.select(1, buf.config.groups_per_step).group_ids}
        print(json.dumps(out), flush=True)


def _crash(directory: str, point: str, settings: Settings) -> dict[str, Any]:
    """Run :func:`crash_child` to its SIGKILL; return what was acknowledged and the last checkpoint."""
    os.makedirs(directory, exist_ok=True)
    proc = child("import sys; from benchmarks.measure_crashes import crash_child; "
                  "crash_child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))",
                  directory, point, str(settings.crash_steps_per_checkpoint), str(settings.crash_groups_per_step),
                  str(settings.seed))
    if proc.returncode != -signal.SIGKILL:
        raise RuntimeError(f"crash child did not die of SIGKILL (rc {proc.returncode}): {proc.stderr[-2000:]}")
    ckpt = sorted(p for p in os.listdir(directory) if p.endswith(".kvckpt"))[-1]
    acked: dict[str, int] = {}
    with open(os.path.join(directory, "acked.txt")) as f:
        for line in f:
            first, second = line.split()
            if first != "#":
                acked[first] = int(second)
            elif second == ckpt:
                covered = len(acked)
    return {"acked": acked, "acked_since_checkpoint": len(acked) - covered, "checkpoint_file": ckpt,
            "partial_files": sum(p.endswith(".partial") for p in os.listdir(directory))}


def measure_crashes(work: str, settings: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    """Figure 7: for each crash point, the acknowledged groups lost by live-store recovery and by
    checkpoint-only recovery (the last complete checkpoint file), counted in a fresh process."""
    dirs = {point: os.path.join(work, f"crash-{point}") for point in settings.crash_points}
    try:
        crashes = {point: _crash(d, point, settings) for point, d in dirs.items()}
        proc = child("import sys; from benchmarks.measure_crashes import count_child; count_child(sys.argv[1])",
                      json.dumps([[d, os.path.join(d, crashes[p]["checkpoint_file"])] for p, d in dirs.items()]))
        if proc.returncode != 0:
            raise RuntimeError(f"recovery after the crash failed: {proc.stderr[-2000:]}")
        lines = proc.stdout.strip().splitlines()[-len(dirs):]
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    out = {}
    for (point, crash), line in zip(crashes.items(), lines, strict=True):
        acked = crash.pop("acked")
        result = {"acked": len(acked), **crash}
        for mode, doc in json.loads(line).items():
            kept = set(doc["kept"])
            lost = [gid for gid in acked if gid not in kept]
            result[mode] = {"lost_groups": len(lost), "lost_tokens": sum(acked[g] for g in lost),
                            "redispatch": doc["redispatch"], "resume_version": doc["resume_version"],
                            "selected": len(doc["selected"])}
        out[point] = result
        log(f"  crash {point}: lost live {result['live']['lost_groups']}, "
            f"checkpoint-only {result['checkpoint']['lost_groups']} of {len(acked)} acked")
    return out
