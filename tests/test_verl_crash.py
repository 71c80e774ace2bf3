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

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

pytestmark = pytest.mark.verl
RUN = Path(__file__).with_name("_verl_run.py")


def _lines(work: Path, name: str) -> list[list[str]]:
    path = work / name
    return [ln.split() for ln in path.read_text().splitlines()] if path.exists() else []


def _phase(work: Path, phase: str, *, until_ready: bool) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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
