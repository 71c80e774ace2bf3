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
            ray.get(primary.commit_group.remote(inflight[0], rows(3)))
        with pytest.raises(NotStandby):
            ray.get(standby.apply_log.remote([]))
        info = ray.get(standby.info.remote())
        assert info["role"] == "primary" and info["epoch"] == 2
        close(primary)
        # the client's next call fails on the old primary, finds the promoted one and resends there:
        # a replay of an acknowledged commit is answered as landed, the old lease is fenced
        again = client.commit(done[0], rows(0))
        stale = client.commit(inflight[1], rows(4))
        assert again.result().replayed
        with pytest.raises(AbandonedTimeline):
            stale.result()
        assert client.actor is not primary
        fresh = [client.commit(x, rows(3 + i)) for i, x in enumerate(plan["leases"])]
    assert all(f.result().ready for f in fresh)
    assert len(ray.get(standby.groups.remote(["ready"]))) == 6
    close(standby)
