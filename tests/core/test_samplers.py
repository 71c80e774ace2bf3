"""The four samplers (and a custom one) on hand-built buffers, through the real ReplayBuffer API.

Each case is a script of buffer operations followed by the exact groups ``select``, ``evict`` or
``abort_stale_inflight`` must return, in order. Script tokens:

* ``+A@w`` admits group ``A`` generated with weight ``w`` (``+A,B@w``: one admission of two
  prompts, so under ``in_order`` they share a target step);
* ``!A`` commits group ``A`` (all rows); ``xA`` aborts it; ``|`` finishes the training step
  (``trainer_version`` + 1).

The rules are those of replay_semantics.md §B.2/§B.3 and §G.1/§G.4/§G.5.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _buffers import make_group

from kvckpt import (
    BadArgument,
    BufferConfig,
    CapacityError,
    GateTimeout,
    NotSelectable,
    Prompt,
    ReplayBuffer,
    Sampler,
    create_sampler,
    register,
)
from kvckpt.durability.verify import check
from kvckpt.samplers import BufferView, InOrderSampler, ReadyFirstSampler, WeightFifoSampler, WindowedSampler


def run(buf: ReplayBuffer, script: str) -> dict[str, Any]:
    """Play a script (see the module docstring) and return the leases by group id."""
    leases = {}
    for token in script.split():
        if token == "|":
            buf.finish_step()
        elif token[0] == "+":
            names, weight = token[1:].split("@")
            batch = [Prompt(prompt_idx=i, group_id=g) for i, g in enumerate(names.split(","))]
            for lease in buf.admit(batch, weight_version=int(weight), timeout=0):
                leases[lease.group_id] = lease
        elif token[0] == "!":
            assert buf.commit_group(leases[token[1:]], make_group(buf.config.group_size, seed=ord(token[1]))).ready
        elif token[0] == "x":
            buf.abort(token[1:], "test")
        else:
            raise AssertionError(f"bad script token {token!r}")
    assert buf.store.read(check).ok
    return leases


def eligible(buf: ReplayBuffer) -> list[str]:
    """The sampler's eligible list at the current version, read without claiming anything."""
    return buf.store.read(lambda t: list(buf.sampler.eligible(BufferView(t), buf.trainer_version)))


# -- select: (sampler config, script, groups select(1, 99) claims, in order) ------------------------
SELECT_CASES = [
    # in_order: only target_step == trainer_version; the weight window is ignored.
    ("in_order-target-matches-step", {"name": "in_order"}, "+A,B@0 +C@0 !C !B !A", ["A", "B"]),
    ("in_order-next-step-after-finish", {"name": "in_order"}, "+A@0 +C@0 !C !A |", ["C"]),
    ("in_order-ignores-weight", {"name": "in_order"}, "+A@7 !A", ["A"]),
    ("in_order-future-target-waits", {"name": "in_order", "max_lookahead_versions": 2},
     "+A@0 +B@0 +C@0 !B !C", []),
    ("in_order-past-target-not-selectable", {"name": "in_order"}, "+A@0 | !A", []),
    # weight_fifo: w* = oldest in-window weight over ready AND in-flight groups.
    ("weight_fifo-oldest-inflight-blocks-younger", {"name": "weight_fifo"}, "+A@0 | +B@1 !B", []),
    ("weight_fifo-oldest-weight-drained-first", {"name": "weight_fifo"}, "+A@0 | +B@1 !B !A", ["A"]),
    ("weight_fifo-same-weight-dispatch-order", {"name": "weight_fifo"}, "+A@0 +B@0 | +C@1 !C !B !A",
     ["A", "B"]),
    ("weight_fifo-out-of-window-does-not-block", {"name": "weight_fifo"}, "+A@0 | +B@1 | +C@2 !C !B", ["B"]),
    ("weight_fifo-inflight-below-window-ignored", {"name": "weight_fifo"}, "+A@0 | | +C@2 !C", ["C"]),
    ("weight_fifo-no-in-window-slot", {"name": "weight_fifo", "max_staleness_versions": 0},
     "+A@0 !A |", []),
    ("weight_fifo-future-weight-not-selectable", {"name": "weight_fifo"}, "+A@3 !A", []),
    # windowed: ready and max(0, cur-W) <= start_weight <= cur.
    ("windowed-bounds", {"name": "windowed"}, "| | +A@0 +B@1 +C@2 +D@3 !D !C !B !A", ["B", "C"]),
    ("windowed-dispatch-order", {"name": "windowed", "max_staleness_versions": 2},
     "| | +A@2 +B@1 +C@0 +D@2 !D !C !B !A", ["A", "B", "C", "D"]),
    ("windowed-freshest-first", {"name": "windowed", "max_staleness_versions": 2, "sample_freshest_first": True},
     "| | +A@1 +B@0 +C@2 +D@1 +E@2 !A !B !C !D !E", ["C", "E", "A", "D", "B"]),
    ("windowed-freshest-first-bounds", {"name": "windowed", "sample_freshest_first": True},
     "| | +A@0 +B@1 +C@3 +D@2 !A !B !C !D", ["D", "B"]),
    ("windowed-slot-order-G1", {"name": "windowed"}, "+A@0 +B@0 +C@0 !C !A", ["A", "C"]),
    ("windowed-pending-never-selected", {"name": "windowed"}, "+A@0 +B@0 !B", ["B"]),
    # ready_first: ready and start_weight <= cur, no lower bound; dispatch order.
    ("ready_first-no-lower-bound", {"name": "ready_first"}, "+A@0 +B@0 | +C@1 | | !C !B !A", ["A", "B", "C"]),
    ("ready_first-future-weight-waits", {"name": "ready_first"}, "+A@1 +B@0 !A !B", ["B"]),
    ("ready_first-slot-order", {"name": "ready_first", "max_staleness_versions": 2}, "+A@0 +B@0 +C@0 !C !A",
     ["A", "C"]),
]


@pytest.mark.parametrize(("sampler", "script", "expected"), [c[1:] for c in SELECT_CASES],
                         ids=[c[0] for c in SELECT_CASES])
def test_select_claims_exactly_the_eligible_groups_in_order(buffer_factory, sampler, script, expected):
    buf = buffer_factory(sampler, capacity=16)
    run(buf, script)
    assert eligible(buf) == expected
    ready_before = buf.state()["ready"]
    selection = buf.select(1, 99)
    assert selection.group_ids == expected
    assert selection.step == buf.trainer_version
    assert all(g.state == "claimed" and g.claimed_step == selection.step for g in selection.groups)
    assert buf.state()["ready"] == ready_before - len(expected)
    assert not set(buf.select(1, 99).group_ids) & set(expected)  # claimed groups are handed over once
    assert buf.store.read(check).ok


def test_select_takes_at_most_max_and_nothing_below_min(buffer_factory):
    buf = buffer_factory("windowed", capacity=8)
    run(buf, "+A@0 +B@0 +C@0 !A !B !C")
    assert buf.select(4, 5).group_ids == []  # 3 eligible < min 4: nothing claimed
    assert buf.state()["claimed"] == 0
    assert buf.select(2, 2).group_ids == ["A", "B"]
    assert buf.select(1, 1).group_ids == ["C"]
    with pytest.raises(BadArgument):
        buf.select(3, 2)
    with pytest.raises(BadArgument):
        buf.select(0, 2)


def test_selected_rows_stay_readable_until_the_step_finishes(buffer_factory):
    buf = buffer_factory("in_order")
    run(buf, "+A@0 !A")
    selection = buf.select(1, 1)
    assert buf.read_batch(selection).group_ids == ["A", "A"]
    buf.finish_step()
    assert buf.group("A").state == "consumed"


# -- evict: (sampler config, script, groups evict() removes, in index order) -------------------------
EVICT_CASES = [
    ("in_order-past-target", {"name": "in_order"}, "+A,B@0 +C@0 !A !C |", ["A"]),
    ("in_order-pending-never-evicted", {"name": "in_order"}, "+A,B@0 !A | |", ["A"]),
    ("in_order-current-target-kept", {"name": "in_order"}, "+A@0 +B@0 !A !B |", ["A"]),
    ("weight_fifo-below-window", {"name": "weight_fifo"}, "+A@0 +B@0 | +C@1 !A !C |", ["A"]),
    ("weight_fifo-pending-never-evicted", {"name": "weight_fifo"}, "+A@0 +B@0 !B | | |", ["B"]),
    ("windowed-below-window-by-weight", {"name": "windowed"}, "+A@1 +B@0 +C@2 !A !B !C | | |", ["B", "A"]),
    ("windowed-w2", {"name": "windowed", "max_staleness_versions": 2}, "+A@0 +B@1 !A !B | | |", ["A"]),
    ("windowed-nothing-at-zero", {"name": "windowed"}, "+A@0 !A", []),
    ("ready_first-never-evicts", {"name": "ready_first"}, "+A@0 !A | | | | |", []),
]


@pytest.mark.parametrize(("sampler", "script", "expected"), [c[1:] for c in EVICT_CASES],
                         ids=[c[0] for c in EVICT_CASES])
def test_evict_removes_exactly_the_unselectable_ready_groups(buffer_factory, sampler, script, expected):
    buf = buffer_factory(sampler, capacity=16)
    run(buf, script)
    assert buf.evict() == expected
    for gid in expected:
        group = buf.group(gid)
        assert (group.state, group.rows_stored) == ("evicted", False)
        assert group.reason.startswith(f"outside {buf.sampler.name} window")
        with pytest.raises(NotSelectable):
            buf.read_batch([gid])
    assert buf.evict() == []  # idempotent
    assert buf.stats()["evicted"] == len(expected)
    assert not set(expected) & set(eligible(buf))
    assert buf.store.read(check).ok


def test_ready_first_keeps_everything_selectable(buffer_factory):
    buf = buffer_factory({"name": "ready_first", "max_staleness_versions": 0}, capacity=4)
    run(buf, "+A@0 !A | +B@1 !B | | |")
    assert buf.evict() == []
    assert buf.abort_stale_inflight() == []
    assert buf.select(1, 9).group_ids == ["A", "B"]


# -- abort_stale_inflight ---------------------------------------------------------------------------
@pytest.mark.parametrize(("sampler", "script", "expected"), [
    ({"name": "windowed"}, "+A@0 +B@1 +C@0 !C | |", ["A"]),
    ({"name": "windowed", "max_staleness_versions": 2}, "+A@0 +B@1 +C@2 | | | |", ["A", "B"]),
    ({"name": "windowed"}, "+A@0 +B@0", []),
    ({"name": "in_order"}, "+A@0 | +B@1 |", []),
    ({"name": "weight_fifo"}, "+A@0 | +B@1 | |", []),
    ({"name": "ready_first"}, "+A@0 | +B@1 | |", []),
], ids=["windowed-W1", "windowed-W2", "windowed-in-window", "in_order", "weight_fifo", "ready_first"])
def test_abort_stale_inflight(buffer_factory, sampler, script, expected):
    buf = buffer_factory(sampler, capacity=8)
    run(buf, script)
    inflight = [e.group_id for e in buf.ledger()]
    assert buf.abort_stale_inflight() == expected
    assert [e.group_id for e in buf.ledger()] == [g for g in inflight if g not in expected]
    for gid in expected:
        group = buf.group(gid)
        assert (group.state, group.rows_stored) == ("aborted", False)
        assert group.reason == f"stale at version {buf.trainer_version}"
    assert buf.stats()["aborted"] == len(expected)
    assert buf.store.read(check).ok


def test_should_abort_inflight_rule():
    windowed = WindowedSampler(max_staleness_versions=2)
    assert [windowed.should_abort_inflight(w, 5) for w in range(6)] == [True, True, True, False, False, False]
    assert not windowed.should_abort_inflight(0, 2)
    for other in (InOrderSampler(), WeightFifoSampler(), ReadyFirstSampler()):
        assert not any(other.should_abort_inflight(w, 9) for w in range(10))


# -- the admission gate -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["in_order", "weight_fifo", "ready_first"])
@pytest.mark.parametrize("window", [0, 1, 2])
def test_gate_closes_exactly_at_trainer_version_plus_window(buffer_factory, name, window):
    key = "max_lookahead_versions" if name == "in_order" else "max_staleness_versions"
    buf = buffer_factory({"name": name, key: window}, group_size=1, capacity=64)
    admitted = []
    for _ in range(3):
        for _ in range(window + 3):
            st = buf.state()
            closed = st["dispatch_index"] >= st["trainer_version"] + window
            try:
                [lease] = buf.admit([0], timeout=0)
            except GateTimeout as exc:
                assert closed, f"gate refused at {st}"
                assert "gate closed" in str(exc)
                continue
            assert not closed, f"gate admitted at {st}"
            admitted.append((st["trainer_version"], lease.target_step))
        buf.finish_step()
    # W + 1 batches at version 0, then exactly one more per finished step.
    assert [v for v, _ in admitted] == [0] * (window + 1) + [1, 2]
    assert buf.state()["dispatch_index"] == window + 2
    expected_targets = list(range(window + 3)) if name == "in_order" else [None] * (window + 3)
    assert [t for _, t in admitted] == expected_targets


def test_windowed_is_ungated_and_leaves_the_cursor_alone(buffer_factory):
    buf = buffer_factory({"name": "windowed", "max_staleness_versions": 0}, group_size=1, capacity=5)
    for _ in range(5):
        buf.admit([0], timeout=0)
    assert buf.state()["dispatch_index"] == -1
    with pytest.raises(GateTimeout, match="capacity"):  # only capacity stops it
        buf.admit([0], timeout=0)


def test_gate_waits_for_finish_step_from_another_thread(buffer_factory):
    import threading

    buf = buffer_factory({"name": "in_order", "max_lookahead_versions": 0}, group_size=1, capacity=4)
    buf.admit([0], timeout=0)
    timer = threading.Timer(0.1, buf.finish_step)
    timer.start()
    [lease] = buf.admit([1], timeout=30)
    timer.join()
    assert (lease.target_step, buf.trainer_version) == (1, 1)


def test_capacity_blocks_admission_until_select(buffer_factory):
    buf = buffer_factory({"name": "windowed"}, group_size=1, capacity=2)
    leases = buf.admit([0, 1], timeout=0)
    with pytest.raises(GateTimeout, match="capacity"):
        buf.admit([2], timeout=0)
    for lease in leases:
        buf.commit_group(lease, make_group(1, 0))
    with pytest.raises(GateTimeout, match="capacity"):  # ready groups still hold their slots
        buf.admit([2], timeout=0)
    buf.select(1, 1)  # a claimed group releases its slot
    buf.admit([2], timeout=0)
    with pytest.raises(CapacityError):  # a batch larger than the buffer can never fit
        buf.admit([0, 1, 2], timeout=0)


# -- capacity rule at config time ---------------------------------------------------------------------
@pytest.mark.parametrize(("config", "groups_per_step", "needed"), [
    ({"name": "in_order"}, 4, 8),
    ({"name": "in_order", "max_lookahead_versions": 0}, 4, 4),
    ({"name": "in_order", "max_lookahead_versions": 3}, 2, 8),
    ({"name": "weight_fifo", "max_staleness_versions": 2}, 3, 9),
    ({"name": "windowed"}, 5, 10),
    ({"name": "windowed", "max_staleness_versions": 0}, 5, 5),
    ({"name": "ready_first", "max_staleness_versions": 4}, 1, 5),
])
def test_required_buffer_capacity(config, groups_per_step, needed):
    assert create_sampler(config).required_buffer_capacity(groups_per_step) == needed
    kwargs = {"group_size": 2, "schema": {"x": "int64"}, "sampler": config, "groups_per_step": groups_per_step}
    with pytest.raises(CapacityError, match=f"needs for {groups_per_step} groups per step \\({needed} "):
        BufferConfig(max_buffered_rollouts=needed - 1, **kwargs)
    assert BufferConfig(max_buffered_rollouts=needed, **kwargs).max_buffered_rollouts == needed


def test_required_buffer_capacity_refuses_zero_groups():
    with pytest.raises(BadArgument):
        InOrderSampler().required_buffer_capacity(0)


@pytest.mark.parametrize("config", [
    "no_such_sampler", {"name": "in_order", "max_staleness_versions": 1}, {"name": "windowed", "window": 1},
    {"name": "weight_fifo", "max_staleness_versions": -1}, {"name": "ready_first", "max_staleness_versions": True},
    {"max_staleness_versions": 1},
])
def test_bad_sampler_config_is_refused(config):
    with pytest.raises(BadArgument):
        create_sampler(config)


def test_sampler_config_round_trips():
    for config in ({"name": "in_order", "max_lookahead_versions": 3},
                   {"name": "weight_fifo", "max_staleness_versions": 0},
                   {"name": "windowed", "max_staleness_versions": 2, "sample_freshest_first": True},
                   {"name": "ready_first", "max_staleness_versions": 5}):
        assert create_sampler(config).config() == config
        assert create_sampler(create_sampler(config).config()).config() == config
    assert create_sampler("windowed").config() == {"name": "windowed", "max_staleness_versions": 1,
                                                   "sample_freshest_first": False}


# -- a custom sampler ---------------------------------------------------------------------------------
class NewestFirstSampler(Sampler):
    """Test sampler: ready groups newest dispatch first, at most ``limit`` visible; evicts the
    rest once more than ``keep`` are ready."""

    name = "test_newest_first"

    def __init__(self, limit: int = 2, keep: int = 3) -> None:
        self.limit = limit
        self.keep = keep

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "limit": self.limit, "keep": self.keep}

    def eligible(self, view: BufferView, current: int) -> Iterator[str]:
        return iter(list(view.ready_in_order())[::-1][: self.limit])

    def evictable(self, view: BufferView, current: int) -> Iterator[str]:
        return iter(list(view.ready_in_order())[: -self.keep])


def test_custom_sampler_is_registered_persisted_and_reopened(buffer_factory):
    assert register(NewestFirstSampler) is NewestFirstSampler
    config = {"name": "test_newest_first", "limit": 2, "keep": 3}
    buf = buffer_factory(config, capacity=8)
    assert buf.sampler.required_buffer_capacity(3) == 3  # window 0: the base rule
    run(buf, "+A@0 +B@0 | +C@1 +D@1 | +E@2 !A !B !C !D !E")
    path = buf.path
    buf.close()
    with ReplayBuffer.open(path) as reopened:
        assert isinstance(reopened.sampler, NewestFirstSampler)
        assert reopened.config.to_dict()["sampler"] == config
        assert reopened.evict() == ["A", "B"]
        assert reopened.select(1, 9).group_ids == ["E", "D"]
        assert reopened.state()["dispatch_index"] == -1  # no gate_window: ungated


def test_register_refuses_non_samplers():
    with pytest.raises(BadArgument):
        register(dict)
