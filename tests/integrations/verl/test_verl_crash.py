"""A verl-shaped async run SIGKILLed between two checkpoints, restarted in a fresh process.

Phase A (``tests/_verl_run.py A``: verl's trainer-base code paths, the kvckpt buffer selected by
``custom_sampler``, stand-in agent-loop workers on a loopback Ray) trains steps 1-3 with a
checkpoint after step 2, leaves four prompts generating and is killed with its whole process group
(trainer, Ray, TransferQueue, workers, ledger actor) once every other prompt finished. Phase B
restarts through verl's ``_load_checkpoint`` + ``_reissue_inflight_prompts`` and trains five steps.

Asserted: every trajectory finished before the kill that the step-2 checkpoint's weights had not
trained on (the finished-but-untrained groups, and step 3's groups, whose training the kill lost)
is trained in B exactly once and never generated again; each in-flight prompt is re-issued once;
the dataloader resumes after the last prompt A dispatched (none is dispatched twice); a write from
a phase-A worker is refused, and so are run A's ``tq.save_checkpoint``, ``tq.load_checkpoint`` and
the ledger's ``resume`` made with run A's token (nothing changes: ledger, TransferQueue, the
checkpoint directories). The same kill against verl's own buffer (TransferQueue's own
checkpoint of step 2, restored in B before the kvckpt resume) is measured beside it.

The window tests kill run A inside verl's ``_save_checkpoint`` of step 4 (``_verl_run.py``'s
``KVCKPT_VERL_KILL``: before the ledger's checkpoint, after it, after verl's tracker; the process group
SIGKILLs itself at that hook), or restart it with ``trainer.resume_mode=disable``, and assert that on the
restarted timeline every dispatched prompt is in the loaded weights or held again, never both, and that
no prompt is trained twice. One case runs in CI; the rest are marked ``slow`` (about 1.5 min each here).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from _paths import TESTS

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

pytestmark = pytest.mark.verl
RUN = TESTS / "_verl_run.py"


def _lines(work: Path, name: str) -> list[list[str]]:
    path = work / name
    return [ln.split() for ln in path.read_text().splitlines()] if path.exists() else []


def _phase(work: Path, phase: str, *, until_ready: bool, env: dict[str, str] | None = None) -> None:
    """Run one phase in a fresh process group; ``until_ready``: SIGKILL the group once run A logs ``READY``.
    A phase that SIGKILLs its own group (a window test's kill point) must have logged ``KILL``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(work / f"phase_{phase}.out", "w") as out:
        proc = subprocess.Popen([sys.executable, str(RUN), phase, str(work)], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    deadline = time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if until_ready and ["READY"] in _lines(work, "run_A.log"):
                os.killpg(proc.pid, signal.SIGKILL)  # the whole job: trainer, Ray, TransferQueue, workers, ledger
                proc.wait()
                return
            time.sleep(0.2)
        if proc.poll() == -signal.SIGKILL and any(ln[0] == "KILL" for ln in _lines(work, "run_A.log")):
            return
        assert proc.poll() == 0, (work / f"phase_{phase}.out").read_text()[-6000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_kill_between_checkpoints_reuses_every_finished_trajectory(tmp_path: Path) -> None:
    _phase(tmp_path, "A", until_ready=True)
    _phase(tmp_path, "B", until_ready=False)
    result = json.loads((tmp_path / "result.json").read_text())

    gen_a = [ln for ln in _lines(tmp_path, "gen_A.log") if ln[0] == "T"]
    finished_a = {key for _, key, _ in gen_a}
    trained_a = {int(ln[1]): set(ln[2:]) for ln in _lines(tmp_path, "trained_A.log")}
    covered = trained_a[1] | trained_a[2]  # the step-2 checkpoint's weights trained on these
    needed = finished_a - covered  # finished before the kill, not in the checkpoint's weights
    trained_b = [key for ln in _lines(tmp_path, "trained_B.log") for key in ln[2:]]
    gen_b = _lines(tmp_path, "gen_B.log")
    regenerated_b = {key for kind, key, _ in gen_b if kind == "T"} & finished_a

    # kvckpt: every needed trajectory trained once in B, none generated again.
    assert needed and needed <= set(trained_b), sorted(needed - set(trained_b))
    assert [k for k, n in Counter(trained_b).items() if n > 1] == []
    assert regenerated_b == set()
    assert not covered & set(trained_b)  # nothing the checkpoint covers is trained twice
    # each in-flight prompt (index % 3 == 2 in A) re-issued exactly once and generated once in B
    indexes_a = {int(ln[2]) for ln in _lines(tmp_path, "gen_A.log")} | {2, 5, 8, 11}
    finished_b = Counter(int(idx) for kind, _, idx in gen_b if kind == "F")
    assert result["reissued"] == 4
    assert {i: n for i, n in finished_b.items() if i in indexes_a} == {2: 1, 5: 1, 8: 1, 11: 1}
    # the dataloader resumes after A's last dispatch (index 11): no prompt is dispatched in both runs
    fresh_b = {i for i in finished_b if i not in indexes_a}
    assert fresh_b and min(fresh_b) == 12 and all(n == 1 for n in finished_b.values())
    # the late write of a phase-A worker is refused and changes nothing
    assert "refused" in (result["refused"]["error"] or ""), result["refused"]
    assert result["refused"]["victim_status"] != "failure" and result["refused"]["ledger_status"] != "failure"
    # run A's checkpoint, load and resume calls, made with its token after B opened its run: refused, no trace
    assert result["stale"] == {"save_checkpoint": "refused", "load_checkpoint": "refused", "resume": "refused",
                               "unchanged": True}

    own_reused = needed & set(result["own"]["trajectories"])
    print(json.dumps({"finished_before_kill": len(finished_a), "needed_after_restart": len(needed),
                      "kvckpt_reused": len(needed), "kvckpt_regenerated": 0,
                      "verl_own_reused": len(own_reused), "verl_own_regenerated": len(needed - own_reused),
                      "reissued_prompts": result["reissued"]}))
    assert len(needed - own_reused) > 0  # verl's own buffer loses what finished after its checkpoint


def _indexes(work: Path) -> dict[str, int]:
    """Trajectory key -> dataset index, from both runs' generation logs."""
    logs = [*_lines(work, "gen_A.log"), *_lines(work, "gen_B.log")]
    return {key: int(idx) for kind, key, idx in logs if kind == "T"}


def _window(work: Path, point: str, resume: str, *, first: bool = False) -> dict:
    """Run A to ``point`` of its step-4 ``_save_checkpoint`` (SIGKILLed there; ``first``: no step-2 checkpoint
    before it), restart it as B with ``resume_mode=resume``; check what every restarted timeline must hold and
    return the measured figures."""
    env = {"KVCKPT_VERL_KILL": point, "KVCKPT_VERL_RESUME": resume, "KVCKPT_VERL_FIRST": "1" if first else "0"}
    _phase(work, "A", until_ready=False, env=env)
    assert ["KILL", point] in _lines(work, "run_A.log")
    _phase(work, "B", until_ready=False, env=env)
    result = json.loads((work / "result.json").read_text())
    held, index = result["window"], _indexes(work)
    resumed = result["resumed_from"]
    trained_a = {int(ln[1]): [index[k] for k in ln[2:]] for ln in _lines(work, "trained_A.log")}
    kept = Counter(i for step, idx in trained_a.items() if step <= resumed for i in idx)  # in the loaded weights
    trained_b = Counter(index[k] for ln in _lines(work, "trained_B.log") for k in ln[2:])
    prompts = {int(i): status for i, status in held["prompts"].items()}

    # nothing lost: every dispatched prompt is in the loaded weights or held again (finished or in flight) ...
    assert set(kept) | set(prompts) == set(range(held["next_index"])), (sorted(kept), prompts, held)
    # ... and nothing doubled: none is both, none is trained twice on the restarted timeline
    assert not set(kept) & set(prompts)
    assert all(n == SESSIONS for n in (kept + trained_b).values()), (kept, trained_b)
    assert result["reissued"] == sum(s in ("pending", "running") for s in prompts.values())  # each in flight once
    assert held["late_write"] == "refused"
    consumed_after = {i for step, idx in trained_a.items() if step > resumed for i in idx}
    return {"resumed_from": resumed, "next_index": held["next_index"], "reissued": result["reissued"],
            "held_finished": sum(s == "finished" for s in prompts.values()),
            "consumed_after_resume_point": len(consumed_after),
            "of_those_finished_again": len({i for i in consumed_after if prompts.get(i) == "finished"}),
            "of_those_reissued": len({i for i in consumed_after if prompts.get(i) in ("pending", "running")}),
            "of_those_from_the_dataloader": len({i for i in consumed_after if i not in prompts}),
            "ledger_checkpoint_step": held["ledger"]}


SESSIONS = 2  # tests/_verl_run.py's rollout.n


_SLOW = pytest.mark.slow  # each case is a killed run and its restart (about 1.5 min here); CI runs the first


@pytest.mark.parametrize(("point", "first", "resumed"), [
    ("after_ledger", True, 0),
    pytest.param("after_ledger", False, 2, marks=_SLOW),
    pytest.param("before_ledger", False, 2, marks=_SLOW),
    pytest.param("after_tracker", False, 4, marks=_SLOW),
])
def test_a_kill_inside_save_checkpoint_trains_every_prompt_once(tmp_path: Path, point: str, first: bool,
                                                                resumed: int) -> None:
    """Window 1: verl's ``_save_checkpoint`` of step 4 is SIGKILLed before the ledger's checkpoint, after it (which
    purged the consumed marks step 4 covers) but before verl's tracker, or after the tracker; with a step-2
    checkpoint before it, or (``first``) none. The restart resumes from the tracker's step (none: from scratch); on
    that timeline every prompt dispatched so far is in the loaded weights or held again (finished, in flight, or
    ahead of the restored dataloader), never both, and the five steps trained after the restart train no prompt
    twice. A run-A worker's late write is refused."""
    figures = _window(tmp_path, point, "auto", first=first)
    print(json.dumps({"kill": point, "first_checkpoint": first, **figures}))
    assert figures["resumed_from"] == resumed
    # what the lost weights had trained on is not lost with them: back finished, re-issued, or fetched again
    assert figures["consumed_after_resume_point"] == 2 * (4 - resumed)  # two groups a step
    if resumed == 0:  # verl trains from scratch: the ledger started over and keeps nothing of run A
        assert figures["next_index"] == 0 and figures["ledger_checkpoint_step"] is None


@_SLOW
def test_resume_mode_disable_starts_over_and_fences_the_old_run(tmp_path: Path) -> None:
    """Window 2: ``trainer.resume_mode=disable`` over a ledger with checkpoints (steps 2 and 4) and groups in it:
    verl's ``_load_checkpoint`` returns at once (step 0, initial weights, the dataloader from its start, no
    ``tq.load_checkpoint``). The ledger starts a new run that fences the old one and keeps nothing (no group, no
    cursor, no checkpoint record): the restart dispatches from index 0 and trains no trajectory of run A."""
    figures = _window(tmp_path, "after_tracker", "disable")
    print(json.dumps({"kill": "after_tracker", "resume_mode": "disable", **figures}))
    assert figures["resumed_from"] == 0 and figures["next_index"] == 0 and figures["reissued"] == 0
    assert figures["ledger_checkpoint_step"] is None
    generated_a = {key for kind, key, _ in _lines(tmp_path, "gen_A.log") if kind == "T"}
    assert not generated_a & {k for ln in _lines(tmp_path, "trained_B.log") for k in ln[2:]}
