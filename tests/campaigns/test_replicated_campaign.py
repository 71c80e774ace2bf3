"""The kill campaign's replicated side (issue 44; :mod:`kvckpt.testing.campaigns.replicated`): a CI slice at
each level, and its checks proven able to fail on a standby that differs from its primary."""

from __future__ import annotations

import os

import pytest

from kvckpt import Standby, ValueStore
from kvckpt.storage import replog
from kvckpt.storage.store import Store
from kvckpt.testing.campaigns import replicated
from kvckpt.testing.campaigns.replicated import (
    ASYNC,
    REMOTE_DURABLE,
    ReplicatedResult,
    check_pair,
    operation,
    run_replicated_campaign,
    setup,
)
from kvckpt.values.records import store_key


@pytest.mark.parametrize(("level", "kills"), [(REMOTE_DURABLE, 8), (ASYNC, 6)])
def test_random_kills_of_the_primary_or_the_standby_keep_every_promise(tmp_path, level, kills):
    result = run_replicated_campaign(kills, level=level, seed=5, directory=str(tmp_path / "run"))
    assert not result.violations, result.violations[:5]
    assert result.kills == kills and result.primary_kills and result.standby_kills
    assert result.promotions == kills and result.caught_up == kills
    assert result.acknowledged > 0, result.summary()
    if level == REMOTE_DURABLE:
        assert result.async_unapplied <= 0  # nothing acknowledged was ever missing on the standby


def write_ops(root: str, seed: int, count: int, acked: int) -> None:
    """Operations ``0 .. count-1`` on the primary (as its child does), the first ``acked`` acknowledged."""
    values = ValueStore(os.path.join(root, replicated.PRIMARY_FILE))
    try:
        for n in range(count):
            values.write(*operation(seed, n))
    finally:
        values.close()
    with open(os.path.join(root, replicated.ACKS_FILE), "w") as f:
        f.write("".join(f"{n}\n" for n in range(acked)))


def apply_to_standby(root: str, upto: int) -> None:
    with Standby(os.path.join(root, replicated.STANDBY_FILE)) as standby:
        records = replicated.primary_records(os.path.join(root, replicated.PRIMARY_FILE), 0, upto)
        standby.apply(records)


def test_the_check_passes_a_standby_behind_at_async_and_fails_it_at_remote_durable(tmp_path):
    setup(str(tmp_path))
    write_ops(str(tmp_path), 1, 6, acked=5)
    apply_to_standby(str(tmp_path), 3)
    findings = []
    result = ReplicatedResult(level=ASYNC)
    check_pair(str(tmp_path), 1, ASYNC, result, findings.append)
    assert findings == [] and result.async_unapplied == 2 and result.caught_up == 1
    # the check caught the standby up: set it back behind, and the same files at remote_durable fail
    (tmp_path / "again").mkdir()
    setup(str(tmp_path / "again"))
    write_ops(str(tmp_path / "again"), 1, 6, acked=5)
    apply_to_standby(str(tmp_path / "again"), 3)
    check_pair(str(tmp_path / "again"), 1, REMOTE_DURABLE, ReplicatedResult(), findings.append)
    assert findings == ["2 operations acknowledged at remote_durable are not on the standby (applied 3)"]


def test_the_check_finds_a_standby_whose_state_is_not_the_primarys_at_its_sequence(tmp_path):
    setup(str(tmp_path))
    write_ops(str(tmp_path), 2, 5, acked=5)
    apply_to_standby(str(tmp_path), 5)
    with Store(str(tmp_path / replicated.STANDBY_FILE)) as store:  # a write no record carried
        key, value = operation(2, 0)[0][0], operation(2, 99)[1][0]
        store.write(lambda txn: replog.bookkeeping(txn).put("rows", store_key(key), value))
    findings = []
    check_pair(str(tmp_path), 2, REMOTE_DURABLE, ReplicatedResult(), findings.append)
    assert findings[0] == "the standby's records are not the primary's state at the standby's applied sequence 5"
    assert any(f.startswith("verify --against after catching up") and "'rows'" in f for f in findings), findings
