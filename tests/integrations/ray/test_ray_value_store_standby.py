"""A value store with a standby on one loopback Ray (issue 44: both store kinds; docs/replication.md, "The
value store on Ray"): :class:`~kvckpt.integrations.ray.values.ReplicatedValueStoreActor`, TransferQueue's
value store with a standby, as a primary and as its standby. The verl ledger's own test, with the primary
killed mid-stream, is ``tests/integrations/verl/test_verl_standby.py`` (``.venv-verl``)."""

from __future__ import annotations

import numpy as np
import pytest

kray = pytest.importorskip("kvckpt.integrations.ray")  # before ray: loopback
ray = pytest.importorskip("ray")

from kvckpt.integrations.ray.values import ReplicatedValueStoreActor  # noqa: E402

from kvckpt import codec  # noqa: E402
from kvckpt.errors import NotPrimary, NotStandby  # noqa: E402

pytestmark = pytest.mark.ray

RAY_LOCAL = {"num_cpus": 4, "object_store_memory": 128 << 20, "namespace": "kvckpt-value-standby"}


def rec(key: str, n: int) -> bytes:
    return codec.encode({"v": np.full(8, n, np.uint8)}, {"k": key, "w": f"w{n}", "t": "bytes"}, 0)


def not_answered(ref) -> bool:
    """Whether the call is still unanswered after a while (the outcome it must not have)."""
    ready, _ = ray.wait([ref], timeout=2)
    return not ready


def test_a_remote_level_put_answers_only_once_the_standby_applied_it(ray_local, tmp_path):
    primary = ReplicatedValueStoreActor.options(name="vs-wait").remote(
        str(tmp_path / "primary.kv"), replication={"standby": "vs-wait-standby", "ack": "remote_durable"})
    assert ray.get(primary.info.remote())["role"] == "primary"  # up; a read starts no shipping
    put = primary.put.remote(["a"], [rec("a", 1)])
    assert not_answered(put)  # durable on the primary, but no standby exists yet to apply it
    standby = ReplicatedValueStoreActor.options(name="vs-wait-standby").remote(str(tmp_path / "standby.kv"),
                                                                             standby=True)
    ray.get(put, timeout=120)
    mine, theirs = ray.get(primary.replica_status.remote()), ray.get(standby.replica_status.remote())
    assert theirs["applied"] >= mine["last"] >= 1 and mine["acked"] >= mine["last"]
    with pytest.raises(NotPrimary):  # a standby serves no data call
        ray.get(standby.get.remote(["a"]))
    for actor in (primary, standby):
        ray.get(actor.close.remote())
        ray.kill(actor)


def test_promotion_keeps_every_acknowledged_put_and_the_revived_old_primary_is_fenced(ray_local, tmp_path):
    config = {"standby": "vs-fence-standby", "ack": "remote_apply"}
    standby = ReplicatedValueStoreActor.options(name="vs-fence-standby").remote(str(tmp_path / "standby.kv"),
                                                                                standby=True)
    primary = ReplicatedValueStoreActor.options(name="vs-fence", max_restarts=0).remote(
        str(tmp_path / "primary.kv"), replication=config)
    keys = [f"k{i}" for i in range(20)]
    for i, key in enumerate(keys):
        ray.get(primary.write.remote([key], [rec(key, i)], [keys[i - 3]] if i % 4 == 3 else []))
    ray.kill(primary, no_restart=True)
    with pytest.raises(NotStandby):  # only a standby applies a log: a primary refuses one
        ray.get(ReplicatedValueStoreActor.options(name="vs-other").remote(str(tmp_path / "o.kv")).apply_log.remote([]))
    status = ray.get(standby.promote.remote())
    assert status["role"] == "primary" and status["epoch"] == 2
    expected = {key: rec(key, i) for i, key in enumerate(keys)}
    for i in range(20):
        if i % 4 == 3:
            expected.pop(keys[i - 3])
    assert ray.get(standby.get.remote(keys)) == [expected.get(k) for k in keys]
    revived = ReplicatedValueStoreActor.options(name="vs-revived").remote(str(tmp_path / "primary.kv"),
                                                                         replication=config)
    with pytest.raises(NotPrimary):
        ray.get(revived.put.remote(["late"], [rec("late", 99)]), timeout=120)
    assert ray.get(standby.get.remote(["late"])) == [None]
    ray.get(standby.put.remote(["after"], [rec("after", 7)]))  # the promoted store takes writes
    assert ray.get(standby.replica_status.remote())["last"] == status["last"] + 1
