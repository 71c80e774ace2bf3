"""Each acknowledgement level's promise as docs/replication.md ("On Ray") and docs/ray.md state it,
against a real standby actor on one loopback Ray (issue 44), and a promoted standby's own standby:

* ``async``: a write is answered on the primary's own fsync while the standby applies nothing (its
  process is stopped: SIGSTOP); the lag is measured (``lag_s``, ``lag_records``, and every write's
  acknowledgement lag in ``replica_lags()``); once it passes ``max_lag_s`` the next write is held
  before it starts, and the hold is reported (``held_writes``, ``held_s``) until the standby is back;
* ``remote_apply`` and ``remote_durable``: an answered write is in the standby's file, durably: the
  standby's process is SIGKILLed right after the answer and a fresh handle on its file holds it
  (every apply is one fsynced transaction, so the two levels give the same promise; the stand-in
  that holds its applies is in ``test_ray_replication.py``);
* the successor: a standby started with ``replication=`` ships to its own standby once promoted,
  from a snapshot; two failovers in a row lose nothing acknowledged.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest
from _buffers import SCHEMA, make_group, until

kray = pytest.importorskip("kvckpt.integrations.ray")  # before ray: loopback
ray = pytest.importorskip("ray")

from kvckpt import Standby  # noqa: E402
from kvckpt.durability.replication import compare_replicas  # noqa: E402
from kvckpt.errors import StoreLocked  # noqa: E402

pytestmark = pytest.mark.ray

CONFIG = {"group_size": 2, "schema": SCHEMA, "sampler": "ready_first", "max_buffered_rollouts": 256}
RAY_LOCAL = {"num_cpus": 4, "object_store_memory": 256 << 20, "namespace": "kvckpt-replication-levels"}


def rows(seed: int) -> list[dict[str, Any]]:
    return kray.to_wire(make_group(2, seed))


def status(actor: Any) -> dict[str, Any]:
    return ray.get(actor.replica_status.remote(), timeout=60)


def caught_up(primary: Any) -> dict[str, Any]:
    return until(lambda: (s := status(primary))["acked"] is not None and s["lag_records"] == 0 and s,
                 "the standby never caught up")


def released(path: str) -> Standby:
    """A handle on the standby file ``path`` once the killed process's last thread let go of it."""
    def attempt() -> Standby | None:
        try:
            return Standby(path)
        except StoreLocked:
            return None
    return until(attempt, f"{path} stayed locked after its process was killed")


def async_pair(tmp_path, name: str) -> tuple[Any, Any, Any, Any]:
    """A primary at ``async`` (lag bound 0.5 s) shipping to its standby, two prompts admitted and shipped:
    ``(standby, primary, first lease, second lease)``."""
    standby = kray.start_standby_actor(str(tmp_path / "standby.kv"), name=f"{name}-standby")
    primary = kray.start_buffer_actor(str(tmp_path / "primary.kv"), CONFIG, name=name,
                                      replication={"standby": f"{name}-standby", "ack": "async", "max_lag_s": 0.5})
    first, second = ray.get(primary.admit.remote([0, 1]), timeout=60)
    caught_up(primary)
    return standby, primary, first, second


def test_async_answers_at_once_measures_the_lag_and_holds_writes_past_the_bound(ray_local, tmp_path):
    standby, primary, first, second = async_pair(tmp_path, "lag")
    assert status(primary)["connected"] and status(primary)["held_writes"] == 0
    pid = ray.get(standby.info.remote(), timeout=60)["pid"]
    os.kill(pid, signal.SIGSTOP)  # the standby applies nothing until SIGCONT
    try:
        # answered on the primary's own fsync: the standby has not applied it
        assert ray.get(primary.commit_group.remote(first, rows(0)), timeout=60)["ready"]
        lagging = until(lambda: (s := status(primary))["lag_s"] > 0.5 and s, "the lag never passed the bound")
        assert lagging["lag_records"] >= 1 and lagging["connected"] and lagging["max_lag_s"] == 0.5
        commit = primary.commit_group.remote(second, rows(1))
        held = until(lambda: (s := status(primary))["held_writes"] == 1 and s, "the write past the bound was not held")
        assert held["lag_s"] > 0.5
        assert not ray.wait([commit], timeout=0)[0]  # held before it started: nothing of it written
        assert ray.get(primary.group.remote(second["group_id"]), timeout=60) is None  # not committed
    finally:
        os.kill(pid, signal.SIGCONT)
    assert ray.get(commit, timeout=60)["ready"]
    after = status(primary)
    assert after["held_writes"] == 1 and after["held_s"] > 0
    # every write's acknowledgement lag was measured: the first commit's waited past the bound
    lags = ray.get(primary.replica_lags.remote(), timeout=60)
    assert lags and max(lags) > 0.5
    caught_up(primary)
    assert compare_replicas(str(tmp_path / "primary.kv"), str(tmp_path / "standby.kv"))["equal"]
    for actor in (primary, standby):
        ray.get(actor.close.remote())
        ray.kill(actor)


#: Seconds a progress call of a client whose earlier call never comes parks inside the write method.
PARK_S = 20.0


def test_async_holds_the_answer_of_a_write_in_progress_once_the_lag_passes_the_bound(ray_local, tmp_path):
    standby, primary, first, second = async_pair(tmp_path, "answer")
    tokens = np.arange(4, dtype=np.int64)
    message = kray.BufferClient(primary).progress_encoder().encode_items(
        [{"lease": second, "index": 0, "start": 0, "tokens": tokens, "logprobs": -tokens.astype(np.float32) / 10,
          "weight_version": 0}]).value
    pid = ray.get(standby.info.remote(), timeout=60)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        # a write in progress: its client's call 0 never comes, so it parks inside the method (past the
        # check at its start, which the zero lag let through) for PARK_S, then writes
        parked = primary.record_progress_steps.remote([message], "answer-client", 1, 0, PARK_S)
        until(lambda: ray.get(primary.stats.remote(), timeout=60)["actor_step_calls_parked"] == 1, "never parked")
        assert ray.get(primary.commit_group.remote(first, rows(0)), timeout=60)["ready"]
        until(lambda: status(primary)["lag_s"] > 0.5, "the lag never passed the bound")
        assert status(primary)["held_writes"] == 0 and not ray.wait([parked], timeout=0)[0]  # still parked
        # it writes its chunk once the park ends; its answer is held while the lag is past the bound
        until(lambda: status(primary)["held_writes"] == 1, "the answer of the write in progress was not held")
        found = kray.progress_from_dict(ray.get(primary.progress.remote(second["group_id"]), timeout=60))
        assert found[0].tokens.tolist() == tokens.tolist()  # written, durable on the primary
        assert not ray.wait([parked], timeout=0)[0]  # not answered
    finally:
        os.kill(pid, signal.SIGCONT)
    assert ray.get(parked, timeout=60) == [[4]]
    caught_up(primary)
    for actor in (primary, standby):
        ray.get(actor.close.remote())
        ray.kill(actor)


@pytest.mark.parametrize("ack", ["remote_apply", "remote_durable"])
def test_a_remote_level_answer_is_on_the_standbys_disk_when_its_process_dies(ray_local, tmp_path, ack):
    name = f"disk-{ack}"
    standby = kray.start_standby_actor(str(tmp_path / "standby.kv"), name=f"{name}-standby", max_restarts=0)
    primary = kray.start_buffer_actor(str(tmp_path / "primary.kv"), CONFIG, name=name,
                                      replication={"standby": f"{name}-standby", "ack": ack})
    leases = ray.get(primary.admit.remote([0, 1, 2]), timeout=120)
    for i, lease in enumerate(leases):
        assert ray.get(primary.commit_group.remote(lease, rows(i)), timeout=60)["ready"]
    acked = status(primary)["acked"]
    pid = ray.get(standby.info.remote(), timeout=60)["pid"]
    os.kill(pid, signal.SIGKILL)  # no close, nothing flushed after the answers
    with released(str(tmp_path / "standby.kv")) as fresh:  # a fresh handle, this process
        assert fresh.applied >= acked == status(primary)["last"]
    assert compare_replicas(str(tmp_path / "primary.kv"), str(tmp_path / "standby.kv"))["equal"]
    assert status(primary)["ack"] == ack
    ray.kill(primary)


def test_a_promoted_standby_ships_to_its_successor_and_a_second_failover_loses_nothing(ray_local, tmp_path):
    durable = {"ack": "remote_durable"}
    b = kray.start_standby_actor(str(tmp_path / "b.kv"), name="chain-b", max_restarts=0,
                                 replication={"standby": "chain-c", **durable})
    a = kray.start_buffer_actor(str(tmp_path / "a.kv"), CONFIG, name="chain-a", max_restarts=0,
                                replication={"standby": "chain-b", **durable})
    leases = ray.get(a.admit.remote(list(range(9))), timeout=120)
    gids = sorted(x["group_id"] for x in leases)
    with kray.BufferClient(a, batch_groups=1, max_in_flight=1, failover=["chain-b", "chain-c"],
                           restart_timeout=60) as client:
        assert all(client.commit(x, rows(i)).result().ready for i, x in enumerate(leases[:3]))
        ray.kill(a)  # the primary's node and disk are gone
        os.remove(tmp_path / "a.kv")
        plan_b = ray.get(b.promote.remote(), timeout=120)
        assert sorted(x["group_id"] for x in plan_b["leases"]) == sorted(x["group_id"] for x in leases[3:])
        # B ships to its successor, which does not exist yet: at remote_durable its writes wait
        c = kray.start_standby_actor(str(tmp_path / "c.kv"), name="chain-c", max_restarts=0)
        assert all(client.commit(x, rows(3 + i)).result().ready for i, x in enumerate(plan_b["leases"][:3]))
        assert client.epoch == 2
        b_status = status(b)
        assert b_status["snapshots"] == 1 and b_status["acked"] == b_status["last"]  # C caught up from a snapshot
        assert b_status["standby_name"] == "chain-c" and b_status["ack"] == "remote_durable"
        ray.kill(b)  # the promoted primary's node and disk are gone too
        os.remove(tmp_path / "b.kv")
        plan_c = ray.get(c.promote.remote(), timeout=120)
        assert ray.get(c.info.remote(), timeout=60)["epoch"] == 3
        ready = sorted(g["group_id"] for g in ray.get(c.groups.remote(["ready"]), timeout=60))
        acknowledged = sorted([x["group_id"] for x in leases[:3]] + [x["group_id"] for x in plan_b["leases"][:3]])
        assert ready == acknowledged  # every acknowledged commit, of both primaries
        assert sorted(x["group_id"] for x in plan_c["leases"]) == sorted(set(gids) - set(ready))
        assert all(client.commit(x, rows(6 + i)).result().ready for i, x in enumerate(plan_c["leases"]))
        assert client.epoch == 3
    assert sorted(g["group_id"] for g in ray.get(c.groups.remote(["ready"]), timeout=60)) == gids
    ray.get(c.close.remote())
    ray.kill(c)
