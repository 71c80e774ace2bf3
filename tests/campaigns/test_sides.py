"""The kill campaign's side hook (kvckpt.testing.campaigns.sides) refuses a module that defines no side, by name;
the verl ledger's side runs through it in tests/integrations/verl/test_verl_campaign.py."""

from __future__ import annotations

import pytest

from kvckpt.testing.campaigns.sides import Side, load_side


def test_a_module_without_a_side_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"'kvckpt\.testing\.campaigns\.harness' defines no SIDE"):
        load_side("kvckpt.testing.campaigns.harness")


def test_a_side_is_what_its_module_defines(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvckpt.testing.campaigns.harness as module

    side = Side(lambda run, log, seed: None, lambda run, ops, scratch, bad: 0)
    monkeypatch.setattr(module, "SIDE", side, raising=False)
    assert load_side("kvckpt.testing.campaigns.harness") is side
