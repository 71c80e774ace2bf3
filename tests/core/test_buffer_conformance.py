"""The buffer conformance suite (kvckpt.testing.conformance.buffer) on the surfaces other than
ReplayBuffer itself (tests/core/test_buffer_stateful.py runs that one): the asyncio facade through a
synchronous shim, and the reference trainer's in-memory buffer (which lacks durability by design).
Each surface's missing capabilities are declared with their reason; the Ray actor's run is in
tests/integrations/ray/test_ray_conformance.py. A surface with a bug fails the suite.

CI runs derandomized profiles: the same examples every run.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings

from kvckpt.buffer.surface import TABLE
from kvckpt.testing.conformance.buffer import (
    ASYNC_SURFACE,
    REPLAY_BUFFER_SURFACE,
    BufferSurface,
    run_buffer_conformance,
)
from kvckpt.testing.conformance.scenarios import SCENARIOS, run_operation_scenarios
from kvckpt.testing.fixtures.memory_buffer import MemoryReplayBuffer

SAMPLERS = ["in_order", "weight_fifo", "windowed", "ready_first"]
#: Smaller than the buffer's own profile: the facade adds only its event loop hop to each call.
SMALL = settings(max_examples=20, stateful_step_count=40, deadline=None, database=None, derandomize=True,
                 print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_the_async_facade_conforms(sampler: str) -> None:
    run_buffer_conformance(ASYNC_SURFACE, sampler, SMALL)


MEMORY = settings(max_examples=90, stateful_step_count=40, deadline=None, database=None, derandomize=True,
                  print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

#: The reference trainer's in-memory buffer: what it lacks is the point of the comparison.
MEMORY_SURFACE = BufferSurface(
    "MemoryReplayBuffer", create=lambda path, config: MemoryReplayBuffer(config),
    lacks={"durability": "nothing survives the process: checkpoint and recover raise NotImplementedError",
           "reopen": "an in-memory buffer has no file to open again",
           "store_file": "an in-memory buffer has no file: refusals are held to every public read instead"},
    offers=("memory",))


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_the_in_memory_buffer_conforms(sampler: str) -> None:
    # no file, so quick: three times the ci profile's examples, so the run's draws do not hang on a few examples
    # (a CI run drew no chunk past the weights in 30 examples of in_order, a run of the file alone did)
    run_buffer_conformance(MEMORY_SURFACE, sampler, MEMORY)


def test_the_in_memory_buffer_lacks_durability_as_declared() -> None:
    """The declared lack is real: a memory buffer neither checkpoints nor recovers."""
    from kvckpt import BufferConfig

    buf = MemoryReplayBuffer(BufferConfig(group_size=2, schema={"input_ids": ("int64", "token")}))
    for call in (lambda: buf.checkpoint("/nonexistent/ckpt.kv"), buf.recover):
        with pytest.raises(NotImplementedError):
            call()


class _WeightsFollowTheTrainer(MemoryReplayBuffer):
    """A buffer with one bug: finish_step ignores the rollout weights' version."""

    def finish_step(self, *, weight_version: int | None = None) -> int:
        return super().finish_step()


def test_the_suite_fails_a_surface_with_a_bug() -> None:
    broken = BufferSurface("broken", create=lambda path, config: _WeightsFollowTheTrainer(config),
                           lacks=MEMORY_SURFACE.lacks)
    quick = settings(SMALL, phases=[Phase.generate])  # the failure, unshrunk
    with pytest.raises(AssertionError):
        run_buffer_conformance(broken, "in_order", quick)


def test_an_unknown_capability_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown capabilities"):
        BufferSurface("typo", create=lambda path, config: None, lacks={"durablity": "spelt wrong"})


def test_every_operation_of_the_table_has_a_scenario() -> None:
    assert [row.name for row in TABLE] == list(SCENARIOS)


@pytest.mark.parametrize("surface", [REPLAY_BUFFER_SURFACE, ASYNC_SURFACE, MEMORY_SURFACE], ids=lambda s: s.name)
def test_every_operation_runs_its_scenario_on_every_surface_that_offers_it(surface: BufferSurface) -> None:
    """One explicit scenario per operation (kvckpt.testing.conformance.scenarios); an operation is skipped only where
    the operation table says the surface does not offer it (the Ray actor's run: tests/integrations/ray)."""
    outcome = run_operation_scenarios(surface)
    assert list(outcome) == [row.name for row in TABLE]
    skipped = {op for op, how in outcome.items() if how != "driven"}
    expected = {row.name for row in TABLE if surface.offers and not any(row.on(c).offered for c in surface.offers)}
    assert skipped == expected


def test_a_scenario_fails_a_surface_with_a_bug() -> None:
    broken = BufferSurface("broken", create=lambda path, config: _WeightsFollowTheTrainer(config),
                           lacks=MEMORY_SURFACE.lacks, offers=("memory",))
    with pytest.raises(AssertionError, match="the scenario of finish_step failed"):
        run_operation_scenarios(broken, only=["finish_step"])


@pytest.mark.parametrize("surface", ["ReplayBuffer", "MemoryReplayBuffer"])
def test_a_list_of_the_missing_rows_is_committed_as_those_rows(tmp_path, surface: str) -> None:
    """``commit_group(lease, [row])`` after a sibling landed is row ``lease.missing[0]``, held against that row's
    durable progress (a conformance run found the in-memory buffer numbering the list from row 0)."""
    from kvckpt import BadArgument, BufferConfig, Prompt, ReplayBuffer
    from kvckpt.testing.conformance.buffer import SCHEMA, row_for

    config = BufferConfig(group_size=2, max_buffered_rollouts=4, schema=SCHEMA)
    buf = (ReplayBuffer.create(str(tmp_path / "live.kv"), config) if surface == "ReplayBuffer"
           else MemoryReplayBuffer(config))
    try:
        [lease] = buf.admit([Prompt(prompt_idx=0)], timeout=0)
        gid = lease.group_id
        buf.commit_sample(lease, 0, row_for(gid, 0, 0))
        ours = row_for(gid, 1, 0)
        buf.record_progress(lease, 1, start=0, tokens=ours["input_ids"][:2], logprobs=ours["generation_logprobs"][:2],
                            weight_version=0)
        lease = buf.redispatch(gid)  # attempt 1, row 0 kept: missing == (1,)
        assert lease.missing == (1,)
        with pytest.raises(BadArgument):  # another row's content contradicts row 1's durable prefix
            buf.commit_group(lease, [row_for(gid, 1, 1)])
        assert buf.commit_group(lease, [ours]).ready
        rows = buf.read_batch([gid], layout="list").rows
        assert [r["input_ids"].tolist() for r in rows] == [row_for(gid, i, 0)["input_ids"].tolist() for i in (0, 1)]
    finally:
        buf.close()
