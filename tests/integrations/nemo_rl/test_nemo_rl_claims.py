"""The NeMo-RL calls docs/integrations.md says run unchanged, or are refused and why: one test each.

Each test names the line of NeMo-RL's own unit test (main ``7ea279ab``,
``tests/unit/single_controller/test_sampler_interface.py`` = SIF, ``test_tq_replay_buffer.py`` =
TQRB) whose call it makes, written as NeMo-RL writes it, against a real store.
"""

from __future__ import annotations

from typing import Any

import pytest
from _nemo_rl import N_GENS, SAMPLERS, add_group, run, stamp
from kvckpt.integrations.nemo_rl import (
    InOrderSampler,
    KvckptSampler,
    ReadyFirstSampler,
    WeightFifoSampler,
    WindowedSampler,
)

from kvckpt.errors import BadArgument

GATED = ["in_order", "weight_fifo", "ready_first"]


@pytest.mark.parametrize(("name", "build"), [
    ("windowed", lambda buf: WindowedSampler(buf, max_staleness_versions=1)),
    ("ready_first", lambda buf: ReadyFirstSampler(buf, max_staleness_versions=1)),
    ("weight_fifo", lambda buf: WeightFifoSampler(buf, max_staleness_versions=1)),
    ("in_order", lambda buf: InOrderSampler(buf, max_lookahead_versions=1))])
def test_a_sampler_is_built_directly_as_nemo_rl_builds_it(make: Any, name: str, build: Any) -> None:
    """SIF l.98-101: ``InOrderSampler(buffer, max_lookahead_versions=1)`` and its three siblings."""
    buf = make(SAMPLERS[name])
    sampler = build(buf)
    assert isinstance(sampler, KvckptSampler) and sampler.config() == buf.core.sampler.config()
    assert run(sampler.admit(trainer_version_fn=lambda: 0)) == (0 if name == "in_order" else None)


def test_a_directly_built_sampler_must_be_the_stores(make: Any) -> None:
    """The store keeps the sampler it was created with: another class or window is refused, naming both."""
    buf = make(SAMPLERS["in_order"])
    with pytest.raises(BadArgument, match=r"configured with sampler .*in_order.*not a WindowedSampler"):
        WindowedSampler(buf, max_staleness_versions=1)
    with pytest.raises(BadArgument, match=r"configured with sampler .*'max_lookahead_versions': 1.*asks for .*: 3"):
        InOrderSampler(buf, max_lookahead_versions=3)
    with pytest.raises(ValueError, match="max_lookahead_versions"):  # NeMo-RL's ValueError for a negative window
        InOrderSampler(buf, max_lookahead_versions=-1)
    assert InOrderSampler(buf).max_lookahead_versions == 1  # a keyword left out is the store's


def test_batch_metadata_sequences_are_lists(make: Any) -> None:
    """SIF l.342 (``meta.sample_ids == ["old_g0", ...]``) with a directly built ``ReadyFirstSampler``, and
    TQRB l.259 (``meta.tags == [{"weight_version": 3}] * _N_GENS``): lists, as ``KVBatchMeta``'s."""
    buf = make(SAMPLERS["ready_first"])
    s = ReadyFirstSampler(buf, max_staleness_versions=1)
    run(s.admit(trainer_version_fn=lambda: 0))
    gids = [add_group(buf, w).group_ids[0] for w in (1, 3, 2, 4)]
    committed = buf.meta_list[0]
    assert committed.tags == [{"weight_version": 1}] * N_GENS and committed.sequence_lengths == [3] * N_GENS
    meta, n = run(s.select(current_train_weight=3, min_prompt_groups=3, max_prompt_groups=3))
    assert n == 3
    assert meta.sample_ids == [f"{gid}_g{i}" for gid in gids[:3] for i in range(N_GENS)]
    assert meta.group_ids == gids[:3] and meta.fields == list(buf.core.schema.fields)
    assert buf.start_weight_list == [4]


def test_reserve_without_admit_runs_unchanged_under_windowed(make: Any) -> None:
    """TQRB l.212-224 (``buf.reserve(weight_version=3)``, nothing admitted), under ``windowed``
    (which never gates): an unready placeholder, as NeMo-RL's."""
    buf = make(SAMPLERS["windowed"])
    group_id = buf.reserve(weight_version=3)
    assert isinstance(group_id, str) and group_id
    assert (buf.size(), buf.start_weight_list, buf.end_weight_list) == (1, [3], [-1])
    assert (buf.ready_list, buf.meta_list) == ([False], [None])


@pytest.mark.parametrize("name", GATED)
def test_reserve_without_admit_is_refused_under_a_gated_sampler_saying_why(make: Any, name: str) -> None:
    """TQRB l.212 under a gated sampler: refused (a deviation), nothing written, the message says
    why (the gate and the ledger) and what to call; after ``sampler.admit`` the same call works."""
    buf = make(SAMPLERS[name])
    with pytest.raises(BadArgument, match=rf"no admission is stamped for target_step None: await sampler\.admit "
                                          rf"first .* Under {name} the store's gate admits batches and its ledger"):
        buf.reserve(weight_version=3)
    assert buf.size() == 0 and buf.core.ledger() == []
    sampler = {"in_order": InOrderSampler, "weight_fifo": WeightFifoSampler, "ready_first": ReadyFirstSampler}[name]
    target = run(sampler(buf).admit(trainer_version_fn=lambda: 0))
    buf.reserve(weight_version=3, target_step=target)
    assert (buf.size(), buf.start_weight_list, buf.ready_list, buf.target_step_list) == (1, [3], [False], [target])


def test_a_stamp_no_admission_made_is_refused_under_in_order(make: Any) -> None:
    """TQRB l.450 (``_add_group(buf, weight=0, target_step=6)``, nothing admitted) under ``in_order``:
    refused, naming the double stamp it would cause; stamped by admissions first, it runs (as
    ``tests/integrations/nemo_rl/test_nemo_rl_surface.py::TestTargetSteps`` does for every promote case)."""
    buf = make(SAMPLERS["in_order"])
    with pytest.raises(BadArgument, match=r"no admission is stamped for target_step 6.*stamped again when the cursor"):
        add_group(buf, 0, target_step=6)
    assert buf.size() == 0 and buf.core.ledger() == []
    s = InOrderSampler(buf, max_lookahead_versions=1)
    stamp(buf, s, 6)
    add_group(buf, 0, target_step=6)
    stamp(buf, s, 7)
    add_group(buf, 0, target_step=7)
    assert buf.promote_ready_group(to_target_step=5) == 7 and buf.target_step_list == [6, 5]


@pytest.mark.parametrize("name", ["windowed", "weight_fifo", "ready_first"])
def test_a_stamp_under_a_sampler_that_stamps_none_is_refused_not_dropped(make: Any, name: str) -> None:
    """TQRB l.450's ``target_step=6`` where the store records no stamps: refused (it used to be
    dropped silently under ``windowed``, so ``count_for_target_step(6)`` read 0)."""
    buf = make(SAMPLERS[name])
    if name != "windowed":
        run(create(buf, name).admit(trainer_version_fn=lambda: 0))
    with pytest.raises(BadArgument, match=rf"target_step=6, but {name} stamps no admission with a step"):
        buf.reserve(weight_version=0, target_step=6)
    assert buf.size() == 0 and buf.count_for_target_step(6) == 0


def create(buf: Any, name: str) -> KvckptSampler:
    """The sampler ``name`` built directly (SIF l.98-101's form)."""
    return {"windowed": WindowedSampler, "weight_fifo": WeightFifoSampler, "ready_first": ReadyFirstSampler,
            "in_order": InOrderSampler}[name](buf)

