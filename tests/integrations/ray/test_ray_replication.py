"""The standby actor on one loopback Ray (issue 44, stage 5; docs/replication.md, "On Ray"): the
primary actor ships its log to it at each acknowledgement level, a new standby catches up from a
snapshot while producers write, a promotion fences the old primary, and :class:`BufferClient`
finds the promoted standby and resends exactly once. The node-loss tests on a multi-node cluster
are in ``test_ray_failover.py``."""

from __future__ import annotations

import time
from typing import Any

import pytest
from _buffers import SCHEMA, make_group

kray = pytest.importorskip("kvckpt.integrations.ray")  # before ray: loopback
ray = pytest.importorskip("ray")

from kvckpt import AbandonedTimeline, BadArgument  # noqa: E402
from kvckpt.durability.replication import compare_replicas  # noqa: E402
from kvckpt.errors import NotPrimary, NotStandby  # noqa: E402

pytestmark = pytest.mark.ray

CONFIG = {"group_size": 2, "schema": SCHEMA, "sampler": "ready_first", "max_buffered_rollouts": 256}
RAY_LOCAL = {"num_cpus": 4, "object_store_memory": 256 << 20, "namespace": "kvckpt-replication"}


def rows(seed: int) -> list[dict[str, Any]]:
    return kray.to_wire(make_group(2, seed))


def pair(tmp_path, name: str, ack: str, **standby: Any) -> tuple[Any, Any]:
    """A standby actor and a primary actor replicating to it at ``ack``."""
    standby_actor = kray.start_standby_actor(str(tmp_path / "standby.kv"), name=f"{name}-standby", **standby)
    primary = kray.start_buffer_actor(str(tmp_path / "primary.kv"), CONFIG, name=name,
                                      replication={"standby": f"{name}-standby", "ack": ack})
    return primary, standby_actor


def close(*actors: Any) -> None:
    for actor in actors:
        ray.get(actor.close.remote())
        ray.kill(actor)


def test_the_config_names_a_level():
    with pytest.raises(BadArgument, match="acknowledgement level"):
        kray.ReplicationConfig("s", ack="remote")
    assert kray.LEVELS == ("async", "remote_apply", "remote_durable")


@pytest.mark.parametrize("ack", ["remote_apply", "remote_durable"])
def test_a_remote_level_acknowledges_only_what_the_standby_applied(ray_local, tmp_path, ack):
    primary, standby = pair(tmp_path, f"remote-{ack}", ack)
    leases = ray.get(primary.admit.remote(list(range(12))))
    with kray.BufferClient(primary, batch_groups=3, max_in_flight=2) as client:
        for i, lease in enumerate(leases):
            result = client.commit(lease, rows(i)).result()
            assert result.ready
            # acknowledged: the standby holds it already (every record up to the primary's last)
            assert ray.get(standby.replica_status.remote())["applied"] >= \
                ray.get(primary.replica_status.remote())["acked"]
    status = ray.get(primary.replica_status.remote())
    assert status["last"] == ray.get(standby.replica_status.remote())["applied"] == status["acked"]
    assert status["snapshots"] == 1 and status["batches"] >= 1 and status["lag_records"] == 0
    assert compare_replicas(str(tmp_path / "primary.kv"), str(tmp_path / "standby.kv"))["equal"]
    close(primary, standby)


def test_async_measures_the_lag_and_the_standby_follows(ray_local, tmp_path):
    primary, standby = pair(tmp_path, "async", "async")
    leases = ray.get(primary.admit.remote(list(range(6))))
    with kray.BufferClient(primary, batch_groups=2, max_in_flight=2) as client:
        futures = [client.commit(lease, rows(i)) for i, lease in enumerate(leases)]
    assert all(f.result().ready for f in futures)
    status = ray.get(primary.replica_status.remote())
    assert status["ack"] == "async" and {"lag_records", "lag_s", "connected"} <= set(status)
    deadline = time.monotonic() + 60
    while ray.get(standby.replica_status.remote()) is None or \
            ray.get(standby.replica_status.remote())["applied"] < status["last"]:
        assert time.monotonic() < deadline, "the standby never caught up"
        time.sleep(0.05)
    assert compare_replicas(str(tmp_path / "primary.kv"), str(tmp_path / "standby.kv"))["equal"]
    close(primary, standby)


def test_promotion_fences_the_old_primary_and_the_client_fails_over(ray_local, tmp_path):
    primary, standby = pair(tmp_path, "promote", "remote_durable")
    leases = ray.get(primary.admit.remote(list(range(6))))
    done, inflight = leases[:3], leases[3:]
    with kray.BufferClient(primary, batch_groups=3, max_in_flight=1, failover=["promote-standby"],
                           restart_timeout=30) as client:
        assert all(f.result().ready for f in [client.commit(x, rows(i)) for i, x in enumerate(done)])
        with pytest.raises(NotPrimary):
            ray.get(standby.select.remote())  # a standby serves nothing
        plan = ray.get(standby.promote.remote())
        # exactly the in-flight leases are redispatched; every acknowledged commit is there
        assert sorted(x["group_id"] for x in plan["leases"]) == sorted(x["group_id"] for x in inflight)
        assert sorted(g["group_id"] for g in ray.get(standby.groups.remote(["ready"]))) == \
            sorted(x["group_id"] for x in done)
        # the old primary can no longer acknowledge anything: its standby refuses it as replaced
        with pytest.raises(NotPrimary):
            ray.get(primary.commit_group.remote(inflight[0], rows(3)), timeout=60)
        with pytest.raises(NotStandby):
            ray.get(standby.apply_log.remote([]), timeout=60)
        info = ray.get(standby.info.remote())
        assert info["role"] == "primary" and info["epoch"] == 2
        # the client's next call is refused by the fenced old primary (NotPrimary); the client finds
        # the promoted one and resends there: a replay of an acknowledged commit is answered as
        # landed, the old lease is fenced
        again = client.commit(done[0], rows(0))
        stale = client.commit(inflight[1], rows(4))
        assert again.result().replayed
        with pytest.raises(AbandonedTimeline):
            stale.result()
        assert client.actor is not primary and client.epoch == 2
        fresh = [client.commit(x, rows(3 + i)) for i, x in enumerate(plan["leases"])]
    assert all(f.result().ready for f in fresh)
    assert len(ray.get(standby.groups.remote(["ready"]))) == 6
    close(primary)
    # the old primary revived on its old file (a new process, the same replication config): it
    # acknowledges nothing, its standby (now the primary) refuses it
    revived = kray.start_buffer_actor(str(tmp_path / "primary.kv"), CONFIG, name="promote-revived",
                                      replication={"standby": "promote-standby", "ack": "remote_durable"})
    with pytest.raises(NotPrimary):
        ray.get(revived.admit.remote([99]), timeout=120)
    close(revived, standby)


@ray.remote(num_cpus=0)
class HeldStandby:
    """A standby stand-in answering as a real one would (the primary's store tag, epoch 1, what it
    applied), whose applies wait while it is held; or one that refuses as a promoted standby does."""

    def __init__(self, tag: str, refuse: bool = False) -> None:
        import asyncio

        self.tag, self.refuse, self.applied, self.calls = tag, refuse, 0, 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def watch_primary(self, node_id: str) -> None:
        pass

    async def replica_status(self) -> dict[str, Any]:
        return {"role": "standby", "epoch": 1, "applied": self.applied, "store_tag": self.tag}

    async def apply_log(self, records: list[bytes]) -> int:
        from kvckpt.storage.replog import decode_record

        self.calls += 1
        if self.refuse:
            raise NotStandby("promoted: it applies no shipped log")
        await self.gate.wait()
        self.applied = max([self.applied] + [decode_record(r).seq for r in records])
        return self.applied

    async def hold(self, held: bool) -> None:
        if held:
            self.gate.clear()
        else:
            self.gate.set()

    async def count(self) -> int:
        return self.calls


def held_pair(tmp_path, name: str, ack: str, **standby: Any) -> tuple[Any, Any]:
    """A primary replicating at ``ack`` to a :class:`HeldStandby`."""
    primary = kray.start_buffer_actor(str(tmp_path / "primary.kv"), CONFIG, name=name,
                                      replication={"standby": f"{name}-held", "ack": ack, "max_lag_s": 0.5})
    tag = ray.get(primary.replica_status.remote())["store_tag"]  # a read: the shipper has not started
    return primary, HeldStandby.options(name=f"{name}-held").remote(tag, **standby)


def not_answered(ref: Any) -> bool:
    """Whether the call is still unanswered after a while (the outcome it must not have)."""
    ready, _ = ray.wait([ref], timeout=2)
    return not ready


@pytest.mark.parametrize("ack", ["remote_apply", "remote_durable"])
def test_a_remote_level_answers_only_after_the_standby_applied(ray_local, tmp_path, ack):
    primary, held = held_pair(tmp_path, f"held-{ack}", ack)
    [lease] = ray.get(primary.admit.remote([0]), timeout=60)
    calls = ray.get(held.count.remote())
    ray.get(held.hold.remote(True))
    commit = primary.commit_group.remote(lease, rows(0))
    deadline = time.monotonic() + 60
    while ray.get(held.count.remote()) == calls:  # the commit's record reached the standby
        assert time.monotonic() < deadline, "the primary shipped nothing after the commit"
        time.sleep(0.01)
    assert not_answered(commit)  # durable on the primary, but its standby has not applied it
    ray.get(held.hold.remote(False))
    assert ray.get(commit, timeout=60)["ready"]
    close(primary)


def test_async_holds_writes_while_the_connected_standby_lags_past_the_bound(ray_local, tmp_path):
    primary, held = held_pair(tmp_path, "held-async", "async")
    first, second = ray.get(primary.admit.remote([0, 1]), timeout=60)
    deadline = time.monotonic() + 60
    while ray.get(primary.replica_status.remote())["lag_records"]:  # the standby caught up (its snapshot, the
        assert time.monotonic() < deadline                          # admission): only the held commit can lag
        time.sleep(0.05)
    ray.get(held.hold.remote(True))
    assert ray.get(primary.commit_group.remote(first, rows(0)), timeout=60)["ready"]  # async: answered at once
    deadline = time.monotonic() + 60
    while (status := ray.get(primary.replica_status.remote()))["lag_s"] <= 0.5:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert status["lag_records"] >= 1 and status["connected"]
    commit = primary.commit_group.remote(second, rows(1))
    assert not_answered(commit)  # held back: the lag is past max_lag_s
    ray.get(held.hold.remote(False))
    assert ray.get(commit, timeout=60)["ready"]
    close(primary)


@pytest.mark.parametrize("ack", ["async", "remote_durable"])
def test_a_standby_that_was_promoted_fences_the_primary(ray_local, tmp_path, ack):
    primary, _held = held_pair(tmp_path, f"fenced-{ack}", ack, refuse=True)
    admitted = primary.admit.remote([0])
    if ack == "remote_durable":  # never acknowledged: the standby refused it
        with pytest.raises(NotPrimary):
            ray.get(admitted, timeout=60)
    else:  # acknowledged before the shipper heard; nothing after
        ray.get(admitted, timeout=60)
        deadline = time.monotonic() + 60
        while not ray.get(primary.replica_status.remote())["fenced"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(NotPrimary):
            ray.get(primary.admit.remote([1]), timeout=60)
    close(primary)


def test_a_replaced_standby_and_a_restored_primary_each_start_from_a_snapshot(ray_local, tmp_path):
    primary, standby = pair(tmp_path, "replaced", "remote_durable")
    leases = ray.get(primary.admit.remote(list(range(8))), timeout=60)
    for i in range(3):
        ray.get(primary.commit_group.remote(leases[i], rows(i)), timeout=60)
    ckpt = str(tmp_path / "step.kvckpt")
    ray.get(primary.checkpoint.remote(ckpt), timeout=60)
    for i in range(3, 6):
        ray.get(primary.commit_group.remote(leases[i], rows(i)), timeout=60)
    # the standby's node is gone: a new standby under the same name, on an empty directory
    ray.kill(standby)
    while True:  # its name is free once Ray has recorded the death (else the start would return the dead one)
        try:
            ray.get_actor("replaced-standby")
        except ValueError:
            break
        time.sleep(0.05)
    fresh = kray.start_standby_actor(str(tmp_path / "standby2.kv"), name="replaced-standby")
    ray.get(primary.commit_group.remote(leases[6], rows(6)), timeout=120)
    assert compare_replicas(str(tmp_path / "primary.kv"), str(tmp_path / "standby2.kv"))["equal"]
    # a restore rewinds the primary's history: its standby must not take the restored log as a
    # continuation of what it applied (it would skip it as resends): it is copied a snapshot again
    plan = ray.get(primary.restore.remote(ckpt), timeout=120)
    ray.get(primary.commit_group.remote(plan["leases"][0], rows(7)), timeout=120)
    assert compare_replicas(str(tmp_path / "primary.kv"), str(tmp_path / "standby2.kv"))["equal"]
    assert ray.get(primary.replica_status.remote())["snapshots"] == 1  # this shipper's (after the restore)
    close(primary, fresh)
