"""The kill campaign covers the verl ledger: its side workload (kvckpt.integrations.verl.campaign) drives every kind
of ledger call beside the buffer's workload, in child processes (forked from a fork server that never opened a store)
SIGKILLed at random moments, and after each kill the parent finds the file holding exactly what was acknowledged
(``python -m kvckpt.testing.campaigns.campaign --kills 500 --side kvckpt.integrations.verl.campaign`` is the soak).
The second test shows the checker fails when the file differs from the acknowledged state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

from kvckpt.integrations.verl import campaign
from kvckpt.integrations.verl.ledger import VerlLedger

from kvckpt.testing.campaigns.kill import run_crash_campaign
from kvckpt.testing.campaigns.workload import OpLog, read_log

pytestmark = pytest.mark.verl


def test_kills_keep_every_acknowledged_ledger_call(tmp_path: Path) -> None:
    result = run_crash_campaign(16, seed=4, directory=str(tmp_path), chain=8, sides=[campaign.__name__])
    print(result.summary())  # the counts docs/reliability.md quotes (pytest -s)
    assert result.violations == []
    # every ledger call kind, acknowledged and checked after a kill: on every timeline, since a chain's first child
    # to say it is ready acknowledged each kind before it did (the side's cover, the next test)
    kinds = result.operation_kinds
    assert min(kinds.get(k, 0) for k in campaign.KINDS) > 0, kinds


_START = """
import json, sys
from kvckpt.integrations.verl import campaign
campaign.start_writer = lambda *args, **kwargs: None  # no writer thread: the log holds what start() did itself
class Log:
    ops = []
    def append(self, **op):
        self.ops.append(op["op"])
campaign.start(sys.argv[1], Log(), 5)
print(json.dumps(Log.ops))
"""


def test_a_runs_first_child_acknowledges_every_kind_before_its_start_returns(tmp_path: Path) -> None:
    """A campaign waits for a child's readiness (after every side's ``start``) before it draws the moment of the
    kill, so the kill campaign's coverage holds whatever the machine's speed: a run's first ``start`` makes and
    acknowledges every kind of ledger call before it returns, and marks the run covered; the next child's does
    not cover again (its restart and its calls run on the writer's thread, where a kill can land anywhere)."""
    def child() -> list[str]:
        """The ops one child's ``start`` logged (a fresh interpreter: its own ledger environment)."""
        out = subprocess.run([sys.executable, "-c", _START, str(tmp_path)], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    os.makedirs(tmp_path / "ckpt")
    first, second = child(), child()
    assert set(campaign.KINDS) <= set(first), first
    assert first[:4] == ["lstart", "lrun", "lintent", "lresume"]  # the restart comes first, as verl's does
    assert (tmp_path / campaign.COVERED).is_file()
    assert second == ["lstart"]


def _drive_ledger(run: Path) -> tuple[str, list[dict]]:
    """60 ledger calls of the campaign's writer (seed 7) in ``run``; returns the run token and the log."""
    os.makedirs(run / "ckpt")
    log = OpLog(str(run / "ops.jsonl"))
    writer = campaign.LedgerWriter(str(run), log, seed=7)
    writer.restart()
    for _ in range(60):
        writer.step()
    writer.ledger.close()
    ops = read_log(str(run / "ops.jsonl"))
    assert {op["op"] for op in ops} >= {"lcursor", "lprog", "lput", "lckpt"}
    return writer.token, ops


def _found(run: Path, ops: list[dict]) -> list[str]:
    out: list[str] = []
    campaign.check(str(run), ops, str(run), out.append)
    return out


def test_the_ledger_check_catches_a_file_that_differs_from_the_acknowledged_state(tmp_path: Path) -> None:
    token, ops = _drive_ledger(tmp_path)

    def found(ops: list[dict]) -> list[str]:
        return _found(tmp_path, ops)

    assert found(ops) == []
    # a write nobody acknowledged (the run token is the current one): the acknowledged state loses a prompt
    ledger = VerlLedger(str(tmp_path / campaign.LEDGER_FILE))
    try:
        items = ledger.snapshot()["items"][campaign.PARTITION]
        victim = sorted(items)[0]
        ledger.clear(token, campaign.PARTITION, [victim])  # the acknowledged state lost it
    finally:
        ledger.close()
    lost = found(ops)
    assert len(lost) == 1 and "holds what was not acknowledged" in lost[0] and victim in lost[0], lost


def test_the_ledger_check_catches_a_missing_acknowledged_checkpoint(tmp_path: Path) -> None:
    # what a checkpoint renamed without a directory fsync leaves after a power cut: the newest name is gone
    _, ops = _drive_ledger(tmp_path)
    assert _found(tmp_path, ops) == []
    newest = [op["path"] for op in ops if op["op"] == "lckpt"][-1]
    os.unlink(tmp_path / "ckpt" / newest)
    assert _found(tmp_path, ops) == [f"acknowledged verl checkpoint {newest} is missing"]


def test_between_power_cuts_the_verl_side_drops_a_ledger_no_child_acknowledged_opening(tmp_path: Path) -> None:
    """The side's ``tidy`` (what the power-cut campaign runs between two cuts): a ledger whose creation no child
    acknowledged (no ``lstart``) holds no promise and goes, with its lock file; one a child opened stays."""
    assert campaign.SIDE.tidy is campaign.tidy
    ledger = tmp_path / campaign.LEDGER_FILE
    lock = tmp_path / (campaign.LEDGER_FILE + "-lock")
    for path in (ledger, lock):
        path.write_bytes(b"")  # a cut inside the creation: a 0-byte file no open accepts
    campaign.tidy(str(tmp_path), [{"op": "commit"}])
    assert not ledger.exists() and not lock.exists()
    ledger.write_bytes(b"")
    campaign.tidy(str(tmp_path), [{"op": "commit"}, {"op": "lstart"}])
    assert ledger.exists()
