"""The kill campaign's side hook (kvckpt.testing.campaigns.sides) refuses a module that defines no side, by name;
the verl ledger's side runs through it in tests/integrations/verl/test_verl_campaign.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvckpt.testing.campaigns.powercut import tidy_image
from kvckpt.testing.campaigns.sides import Side, load_side


def test_a_module_without_a_side_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"'kvckpt\.testing\.campaigns\.harness' defines no SIDE"):
        load_side("kvckpt.testing.campaigns.harness")


def test_a_side_is_what_its_module_defines(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvckpt.testing.campaigns.harness as module

    side = Side(lambda run, log, seed: None, lambda run, ops, scratch, bad: 0)
    monkeypatch.setattr(module, "SIDE", side, raising=False)
    assert load_side("kvckpt.testing.campaigns.harness") is side


def test_between_power_cuts_the_image_is_tidied_by_the_campaign_and_by_each_side(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What no promise covers goes (other runs, interrupted checkpoint copies), and each side's ``tidy``
    gets the current run's directory and its acknowledged operations: here it drops a file no acknowledged
    ``open`` covers, as the verl side drops a ledger whose creation no child acknowledged."""
    import kvckpt.testing.campaigns.harness as module

    seen: list[tuple[str, list[dict[str, Any]]]] = []

    def tidy(run: str, ops: list[dict[str, Any]]) -> None:
        seen.append((run, ops))
        if not any(op["op"] == "open" for op in ops):
            (Path(run) / "side.kv").unlink()

    monkeypatch.setattr(module, "SIDE", Side(lambda run, log, seed: None, lambda run, ops, scratch, bad: 0, tidy),
                        raising=False)
    image = tmp_path / "image"
    for name in ("run-old", "run-now/ckpt"):
        (image / name).mkdir(parents=True)
    for name in ("run-old/buffer.kv", "run-now/buffer.kv", "run-now/side.kv", "run-now/ckpt/c1.kvckpt",
                 "run-now/ckpt/c2.kvckpt.partial"):
        (image / name).write_bytes(b"x")
    tidy_image(str(image), "run-now", [{"op": "commit"}], [module.__name__])
    assert sorted(str(p.relative_to(image)) for p in image.rglob("*") if p.is_file()) == [
        "run-now/buffer.kv", "run-now/ckpt/c1.kvckpt"]
    assert seen == [(str(image / "run-now"), [{"op": "commit"}])]
    (image / "run-now" / "side.kv").write_bytes(b"x")
    tidy_image(str(image), "run-now", [{"op": "open"}], [module.__name__])
    assert (image / "run-now" / "side.kv").exists()  # an acknowledged open: the side keeps its store
