"""The sampler conformance suite (kvckpt.testing.conformance.samplers): the four built-ins pass it, and each
deliberately broken sampler fails the check that names its bug (so the suite can fail)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvckpt import Sampler, create_sampler, register
from kvckpt.samplers import BufferView
from kvckpt.samplers.base import GatedStalenessSampler
from kvckpt.testing.conformance.samplers import (
    assert_sampler_conforms,
    check_capacity_refuses_deadlock,
    check_config_round_trip,
    check_evict_abort_consistent,
    check_selects_ready_only,
    check_view_read_only,
    run_sampler_conformance,
)

BUILT_INS = [{"name": "in_order", "max_lookahead_versions": 1}, {"name": "in_order", "max_lookahead_versions": 2},
             {"name": "weight_fifo", "max_staleness_versions": 1}, {"name": "windowed", "max_staleness_versions": 2},
             {"name": "windowed", "max_staleness_versions": 1, "sample_freshest_first": True},
             {"name": "ready_first", "max_staleness_versions": 0}, {"name": "ready_first", "max_staleness_versions": 1}]


@pytest.mark.parametrize("config", BUILT_INS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_the_built_in_samplers_conform(tmp_path: Path, config: dict[str, Any]) -> None:
    assert_sampler_conforms(create_sampler(config), str(tmp_path))


class _Fifo(GatedStalenessSampler):
    """A correct custom sampler (weight_fifo's rule written again): the base of the broken ones."""

    name = "conformance-fifo"

    def eligible(self, view: BufferView, current: int) -> Iterator[str]:
        return view.ready_in_weight_range(current - self.window, current)

    def evictable(self, view: BufferView, current: int) -> Iterator[str]:
        return view.ready_below_weight(current - self.window)


@register
class _SelectsInFlight(_Fifo):
    """Bug: offers in-flight (uncommitted) groups for selection."""

    name = "conformance-selects-in-flight"

    def eligible(self, view: BufferView, current: int) -> Iterator[str]:
        yield from super().eligible(view, current)
        yield from view.pending_below_weight(current + 1)


@register
class _EvictsTheWindow(_Fifo):
    """Bug: evicts every ready group, including those still inside its window."""

    name = "conformance-evicts-the-window"

    def evictable(self, view: BufferView, current: int) -> Iterator[str]:
        return view.ready_in_order()


@register
class _AbortsWithoutSaying(_Fifo):
    """Bug: its abort query disagrees with its abort predicate."""

    name = "conformance-aborts-without-saying"

    def should_abort_inflight(self, start_weight: int, current: int) -> bool:
        return start_weight < current - self.window

    def inflight_to_abort(self, view: BufferView, current: int) -> Iterator[str]:
        return iter(())


@register
class _ForgetsItsConfig(_Fifo):
    """Bug: config() drops a constructor key, so a reopened store gets another sampler."""

    name = "conformance-forgets-its-config"

    def config(self) -> dict[str, Any]:
        return {"name": self.name}


@register
class _TooSmall(_Fifo):
    """Bug: claims a capacity below one step's groups suffices (a deadlock)."""

    name = "conformance-too-small"

    def required_buffer_capacity(self, groups_per_step: int) -> int:
        super().required_buffer_capacity(groups_per_step)
        return 1


@register
class _KeepsTheView(_Fifo):
    """Bug: keeps the view it was handed (a handle on a finished transaction)."""

    name = "conformance-keeps-the-view"

    def eligible(self, view: BufferView, current: int) -> Iterator[str]:
        self.last_view = view
        return super().eligible(view, current)


class _Unregistered(_Fifo):
    """Bug: never registered, so a store created with it cannot reopen."""

    name = "conformance-unregistered"


register(_Fifo)


def test_a_correct_custom_sampler_conforms(tmp_path: Path) -> None:
    assert run_sampler_conformance(_Fifo(max_staleness_versions=1), str(tmp_path)) == []


@pytest.mark.parametrize(("broken", "check", "says"), [
    (_SelectsInFlight(1), check_selects_ready_only, "not ready"),
    (_EvictsTheWindow(1), check_evict_abort_consistent, "evictable at version"),
    (_AbortsWithoutSaying(1), check_evict_abort_consistent, "inflight_to_abort yields"),
    (_ForgetsItsConfig(2), check_config_round_trip, "config"),
    (_Unregistered(1), check_config_round_trip, "registered"),
    (_TooSmall(1), check_capacity_refuses_deadlock, "a step's groups do not fit"),
    (_KeepsTheView(1), check_view_read_only, "keeps a handle"),
], ids=lambda x: getattr(x, "name", getattr(x, "__name__", "")))
def test_a_broken_sampler_fails_the_check_that_names_its_bug(tmp_path: Path, broken: Sampler, check: Any,
                                                             says: str) -> None:
    found = check(broken, str(tmp_path))
    assert found and any(says in message for message in found), found
    with pytest.raises(AssertionError, match=check.__name__):
        assert_sampler_conforms(broken, str(tmp_path / "all"))

