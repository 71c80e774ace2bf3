"""The asyncio facade: same transactions and guarantees as the synchronous buffer, run off the loop.

The central property is that a gated admission waits on the event loop without holding a pool
thread: with a one-thread pool, commits and ``finish_step`` still run while an admission waits,
and a ticker task keeps running on the loop the whole time.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest
from _buffers import SCHEMA, make_group

from kvckpt import BufferConfig, GateTimeout, Prompt, StaleAttempt, UnknownGroup, check, read_stamp, verify_path
from kvckpt.buffer.aio import AsyncReplayBuffer


def config(**kwargs) -> BufferConfig:
    kwargs.setdefault("sampler", {"name": "in_order", "max_lookahead_versions": 1})
    kwargs.setdefault("max_buffered_rollouts", 8)
    return BufferConfig(group_size=2, schema=SCHEMA, groups_per_step=2, **kwargs)


def test_round_trip_through_the_facade(tmp_path):
    async def scenario():
        async with await AsyncReplayBuffer.create(str(tmp_path / "b.kv"), config()) as buf:
            leases = await buf.admit([Prompt(0, group_id="g0"), Prompt(1, group_id="g1")], b"dl-1")
            results = await asyncio.gather(*(buf.commit_group(lease, make_group(2, i))
                                             for i, lease in enumerate(leases)))
            replay = await buf.commit_group(leases[0], make_group(2, 0))
            selection = await buf.select(2, 2)
            batch = await buf.read_batch(selection)
            version = await buf.finish_step()
            return (results, replay, selection.group_ids, batch.lengths.tolist(), version, await buf.stats(),
                    await buf.dataloader_state(), await buf.ledger(), [g.state for g in await buf.groups()])

    results, replay, selected, lengths, version, stats, dl, ledger, states = asyncio.run(scenario())
    assert [(r.group_id, r.ready, r.replayed) for r in results] == [("g0", True, False), ("g1", True, False)]
    assert (replay.ready, replay.replayed, replay.rows_written) == (True, True, 0)
    assert selected == ["g0", "g1"]
    assert lengths == [4, 5, 4, 5]
    assert version == 1
    assert (stats["admitted"], stats["committed"], stats["consumed"], stats["ledger_size"]) == (2, 2, 2, 0)
    assert dl == b"dl-1"
    assert ledger == []
    assert states == ["consumed", "consumed"]


def test_gate_wait_holds_no_thread_and_never_blocks_the_loop(tmp_path):
    """A one-thread pool: if the waiting admission held the thread, the commits, select and
    finish_step that open the gate could never run and the test would time out."""
    async def scenario():
        buf = await AsyncReplayBuffer.create(str(tmp_path / "b.kv"), config(), max_workers=1)
        first = await buf.admit([Prompt(0, group_id="g0"), Prompt(1, group_id="g1")])
        await buf.admit([Prompt(2, group_id="g2"), Prompt(3, group_id="g3")])
        assert not await buf.admissible(2)  # W=1: dispatch_index 1 >= trainer_version 0 + 1
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        ticking = asyncio.create_task(ticker())
        waiting = asyncio.create_task(buf.admit([Prompt(4, group_id="g4"), Prompt(5, group_id="g5")], timeout=60))
        await asyncio.sleep(0.2)
        blocked = not waiting.done()
        ticks_while_blocked = ticks
        for i, lease in enumerate(first):
            await buf.commit_group(lease, make_group(2, i))
        await buf.select(2, 2)
        await buf.finish_step()
        second = await asyncio.wait_for(waiting, 30)
        stop.set()
        await ticking
        state = await buf.state()
        await buf.close()
        return blocked, ticks_while_blocked, [(x.group_id, x.target_step) for x in second], state

    blocked, ticks, second, state = asyncio.run(scenario())
    assert blocked
    assert ticks > 10  # the loop kept running while the admission waited
    assert second == [("g4", 2), ("g5", 2)]
    assert (state["dispatch_index"], state["trainer_version"], state["inflight"]) == (2, 1, 4)


def test_a_waiting_admission_sleeps_until_a_write_lands(tmp_path):
    """A refused try writes nothing, so it wakes no waiter, itself included: with an hour's poll
    interval, the admission tries once while the gate stays closed, then once more per write that
    lands (the commits, select and finish_step that open the gate), never in a loop."""
    tries = 0

    async def scenario():
        nonlocal tries
        buf = await AsyncReplayBuffer.create(str(tmp_path / "b.kv"), config(), poll_interval=3600)
        first = await buf.admit([Prompt(0, group_id="g0"), Prompt(1, group_id="g1")])
        await buf.admit([Prompt(2, group_id="g2"), Prompt(3, group_id="g3")])
        admit = buf.buffer.admit

        def counted(*args, **kwargs):
            nonlocal tries
            tries += 1
            return admit(*args, **kwargs)

        buf.buffer.admit = counted
        waiting = asyncio.create_task(buf.admit([Prompt(4, group_id="g4"), Prompt(5, group_id="g5")], timeout=60))
        for _ in range(50):  # many turns of the loop, and pool round trips, while the gate is closed
            await buf.admissible(2)
        tries_while_closed = tries
        for i, lease in enumerate(first):
            await buf.commit_group(lease, make_group(2, i))
        await buf.select(2, 2)
        await buf.finish_step()
        second = await asyncio.wait_for(waiting, 30)
        await buf.close()
        return tries_while_closed, [x.group_id for x in second]

    tries_while_closed, second = asyncio.run(scenario())
    assert tries_while_closed == 1
    assert 2 <= tries <= 5  # one per gate-changing write at most, the last one admitted
    assert second == ["g4", "g5"]


def test_gate_timeout_writes_nothing(tmp_path):
    async def scenario():
        async with await AsyncReplayBuffer.create(str(tmp_path / "b.kv"), config()) as buf:
            await buf.admit([0, 1])
            await buf.admit([2, 3])
            before = await buf.state()
            with pytest.raises(GateTimeout, match=r"after 0.1s"):
                await buf.admit([4, 5], timeout=0.1)
            return before, await buf.state()

    before, after = asyncio.run(scenario())
    assert after == before
    assert (after["dispatch_index"], after["admissions"], after["inflight"]) == (1, 2, 4)


def test_concurrent_commits_each_land_once(tmp_path):
    async def scenario():
        async with await AsyncReplayBuffer.create(
                str(tmp_path / "b.kv"), config(sampler="ready_first", max_buffered_rollouts=32)) as buf:
            leases = await buf.admit([Prompt(i, group_id=f"g{i:02d}") for i in range(24)])
            # each commit twice at once: one lands, the other is a replay or, if it ran first, lands
            # and makes its twin the replay; never both.
            results = await asyncio.gather(*(buf.commit_group(lease, make_group(2, i % 24))
                                             for i, lease in enumerate(leases + leases)))
            stats = await buf.stats()
            report = buf.buffer.store.read(lambda t: check(t, deep=True))
            return results, stats, report, [g.group_id for g in await buf.groups(["ready"])]

    results, stats, report, ready = asyncio.run(scenario())
    by_group: dict[str, list[bool]] = {}
    for r in results:
        by_group.setdefault(r.group_id, []).append(r.replayed)
    assert {g: sorted(v) for g, v in by_group.items()} == {f"g{i:02d}": [False, True] for i in range(24)}
    assert ready == [f"g{i:02d}" for i in range(24)]
    assert (stats["committed"], stats["ready"], stats["ledger_size"]) == (24, 24, 0)
    assert report.problems == []


def test_stale_lease_is_refused_after_recover(tmp_path):
    async def scenario():
        async with await AsyncReplayBuffer.create(str(tmp_path / "b.kv"), config()) as buf:
            [old, _] = await buf.admit([Prompt(0, group_id="g0"), Prompt(1, group_id="g1")])
            plan = await buf.recover()
            with pytest.raises(StaleAttempt):
                await buf.commit_group(old, make_group(2, 0))
            [new, _] = plan.leases
            result = await buf.commit_group(new, make_group(2, 0))
            return [(x.group_id, x.attempt) for x in plan.leases], result, await buf.group("g0")

    leases, result, group = asyncio.run(scenario())
    assert leases == [("g0", 1), ("g1", 1)]
    assert (result.ready, result.replayed) == (True, False)
    assert (group.state, group.attempt) == ("ready", 1)


def test_split_admission_redispatch_and_named_eviction(tmp_path):
    async def scenario():
        async with await AsyncReplayBuffer.create(str(tmp_path / "b.kv"), config()) as buf:
            admission = await buf.advance_dispatch(b"dl-0")
            [lease] = await buf.admit([Prompt(0, group_id="g0")], admission=admission)
            await buf.admit([Prompt(1, group_id="g1")])  # dispatch_index 1: the gate is closed now
            with pytest.raises(GateTimeout):
                await buf.advance_dispatch(timeout=0.05)
            fresh = await buf.redispatch("g0", start_weight=3)
            with pytest.raises(StaleAttempt):
                await buf.commit_group(lease, make_group(2, 0))
            await buf.commit_group(fresh, make_group(2, 0))
            evicted = await buf.evict(["g0"])
            with pytest.raises(UnknownGroup):
                await buf.redispatch("g0")
            return (admission, lease, fresh, evicted, await buf.group("g0"), await buf.count_for_target_step(1),
                    await buf.promote_ready_group(0))

    admission, lease, fresh, evicted, group, pending_step1, lender = asyncio.run(scenario())
    assert (admission.admission_id, admission.dispatch_index, admission.target_step) == ("a0", 0, 0)
    assert (lease.admission_id, lease.target_step, lease.attempt) == ("a0", 0, 0)
    assert (fresh.attempt, fresh.start_weight) == (1, 3)
    assert evicted == ["g0"]
    assert (group.state, group.rows_stored, group.reason) == ("evicted", False, "discarded by the caller")
    assert (pending_step1, lender) == (1, None)


def test_checkpoint_awaited_then_restored_in_a_fresh_process(tmp_path):
    ckpt, live = str(tmp_path / "step1.kvckpt"), str(tmp_path / "restored.kv")

    async def scenario():
        async with await AsyncReplayBuffer.create(str(tmp_path / "b.kv"), config()) as buf:
            leases = await buf.admit([Prompt(0, group_id="g0"), Prompt(1, group_id="g1")], b"dl-1")
            for i, lease in enumerate(leases):
                await buf.commit_group(lease, make_group(2, i))
            await buf.select(2, 2)
            await buf.finish_step()
            await buf.admit([Prompt(2, group_id="g2"), Prompt(3, group_id="g3")], b"dl-2")
            handle = await buf.checkpoint(ckpt, {"step": 1})
            return await buf.wait_checkpoint(handle)

    result = asyncio.run(scenario())
    assert (result.path, result.trainer_version) == (ckpt, 1)
    assert read_stamp(ckpt)["trainer_state"] == {"step": 1}
    assert verify_path(ckpt).ok
    code = textwrap.dedent(f"""
        from kvckpt import restore
        buf, plan = restore({ckpt!r}, {live!r})
        print([(l.group_id, l.attempt, l.target_step) for l in plan.leases], plan.dataloader_state)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[('g2', 1, 1), ('g3', 1, 1)] b'dl-2'"


def test_close_is_idempotent_and_releases_the_store(tmp_path):
    path = str(tmp_path / "b.kv")

    async def scenario():
        buf = await AsyncReplayBuffer.create(path, config())
        await buf.close()
        await buf.close()
        reopened = await AsyncReplayBuffer.open(path)  # the writer lock was released
        state = await reopened.state()
        await reopened.close()
        return state

    assert asyncio.run(scenario())["admissions"] == 0
