"""The power-cut campaign covers the verl ledger: its side workload (kvckpt.integrations.verl.campaign) drives every
kind of ledger call beside the buffer's workload on a FUSE filesystem whose power is cut at random moments (strict
and random cuts), and the image that survives each cut, checked in a fresh process, holds exactly what was
acknowledged (``python -m kvckpt.testing.campaigns.powercut --soak --side kvckpt.integrations.verl.campaign`` is the
soak). The second test shows the side's check fails on that path when the ledger's durability is broken.

The tests need /dev/fuse, root and fusermount3 (``scripts/setup_fuse.sh``); elsewhere they skip saying why.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

from kvckpt.integrations.verl import campaign

from kvckpt.testing.campaigns import powerfs
from kvckpt.testing.campaigns.powercut import run_powercut_campaign

pytestmark = pytest.mark.verl

WHY_NOT = powerfs.unavailable()
needs_fuse = pytest.mark.skipif(WHY_NOT is not None, reason=f"power-cut tests skipped: {WHY_NOT}")
CUTS, SEED, MIN_OPS = 6, 0, 30


@needs_fuse
def test_power_cuts_keep_every_acknowledged_ledger_call() -> None:
    # min_ops: every cut after start-up waits for that many logged operations (the buffer's and the ledger's)
    result = run_powercut_campaign(CUTS, seed=SEED, chain=CUTS, max_delay=0.5, min_ops=MIN_OPS,
                                   sides=[campaign.__name__])
    print(result.summary())  # the counts docs/reliability.md quotes (pytest -s)
    assert result.violations == []
    assert set(result.modes) == {"strict", "random"}, result.modes
    undrawn = [k for k in campaign.KINDS if not result.operation_kinds.get(k)]
    assert not undrawn, f"ledger operation kinds no cut acknowledged: {undrawn} ({result.operation_kinds})"


@needs_fuse
def test_the_ledger_check_catches_an_unsynced_ledger_after_a_power_cut() -> None:
    result = run_powercut_campaign(2, seed=SEED, chain=2, max_delay=0.3, min_ops=MIN_OPS, modes=("strict",),
                                   existing_store=True, sides=["_verl_unsynced_side"])
    ledger = [v for v in result.violations if "verl ledger" in v]
    assert ledger, result.violations
    assert all("verl ledger" in v or "child exited" in v for v in result.violations), result.violations


@needs_fuse
def test_a_ledger_whose_creation_a_cut_interrupted_is_dropped_and_the_next_start_opens_a_new_one() -> None:
    # seed 2: every child recovers or reopens the same run; a later child than the interrupted one opens a ledger
    result = run_powercut_campaign(3, seed=2, chain=3, max_delay=0.3, min_ops=MIN_OPS, modes=("strict",),
                                   existing_store=True, sides=["_verl_interrupted_create_side"])
    assert result.violations == []
    assert result.starts.get("restore", 0) == 0, result.starts
    assert result.operation_kinds.get("lstart", 0) >= 1, result.operation_kinds
