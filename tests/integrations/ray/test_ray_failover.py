"""The owner's node and disk die mid-stream, and the standby on another node takes over (issue 44,
stage 5; docs/replication.md, "On Ray"; docs/ray.md, the failure table).

A real multi-node Ray cluster on loopback: the head (the driver plays the trainer), ``standby_b``
(the standby actor, automatic promotion on), ``rollout_c`` (a producer streaming progress step
messages and committing groups through a :class:`BufferClient` that names the standby as its
failover), and per test the owner's node ``owner_a`` (the primary actor, pinned). The test SIGKILLs
the owner's node once the producer has a chosen number of groups acknowledged (the producer keeps
streaming: whatever is in flight at the kill lands whole or not at all), deletes its directory,
and checks, per acknowledgement level:

* ``remote_durable`` and ``remote_apply``: every acknowledged commit is ready on the promoted standby and every
  acknowledged progress prefix is durable there; the recovery plan redispatches exactly the prompts
  not committed there, once each; the producer's client found the new primary by itself and its
  in-flight call was answered exactly once; the producer resumes the plan's leases from their
  prefixes and every group ends committed once, token for token;
* ``async``: the acknowledged commits missing on the promoted standby are at most the records the
  standby had not applied at the kill (the primary's lag, read from its dead file), the standby
  held at least what the primary last reported acknowledged; then the same resumption.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

kray = pytest.importorskip("kvckpt.integrations.ray")  # before ray: loopback
ray = pytest.importorskip("ray")

from _fleet import (  # noqa: E402
    COMMON,
    GROUP_SIZE,
    expected_tokens,
    fleet_config,
    kill_node,
    logprobs_of,
    loopback_cluster,
)

from kvckpt import AbandonedTimeline, verify_path  # noqa: E402
from kvckpt.durability.safe_open import open_readonly  # noqa: E402
from kvckpt.storage.replog import describe  # noqa: E402

pytestmark = pytest.mark.ray

INTERVAL, STEPS = 4, 3  # tokens per engine step, steps per completion
TOTAL = INTERVAL * STEPS
PROMPTS, KILL_AFTER = 10, 3  # prompts admitted; acknowledged commits before the owner's node is killed
@pytest.fixture(scope="module")
def cluster():
    """Head, ``standby_b`` and ``rollout_c`` on loopback (a dead node declared so after 3 missed
    health checks 1 s apart)."""
    with loopback_cluster("kvckpt-failover", {"standby_b": 4, "rollout_c": 4}, sys.modules[__name__]) as made:
        yield made


def node_of(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def _seq(group_id: str, index: int) -> str:
    return f"{group_id}#{index}"


@ray.remote(num_cpus=0, max_concurrency=4)
class Streamer:
    """A rollout engine on ``rollout_c``: per lease, streams every engine step's progress of its
    samples as one step message, then commits the group; one operation in flight at a time. Its
    client names the standby as failover. Records what was acknowledged and what was refused."""

    def __init__(self, primary: Any, standby_name: str) -> None:
        self.client = kray.BufferClient(primary, batch_groups=1, max_in_flight=1, failover=[standby_name],
                                        restart_timeout=120)
        self.committed: list[str] = []
        self.progress: dict[str, int] = {}
        self.fenced: list[str] = []
        self.replayed: list[str] = []
        self.acked_at: list[float] = []
        self._cond = threading.Condition()

    def _items(self, lease: Mapping[str, Any], starts: Mapping[str, int]) -> list[dict[str, Any]]:
        items = []
        for i in range(GROUP_SIZE):
            start = starts[_seq(lease["group_id"], i)]
            count = min(INTERVAL, TOTAL - start)
            if count > 0:
                tokens = expected_tokens(lease["group_id"], i, start, count)
                items.append({"lease": dict(lease), "index": i, "start": start, "tokens": tokens,
                              "logprobs": logprobs_of(tokens), "weight_version": 0})
        return items

    def _one(self, lease: Mapping[str, Any], starts: dict[str, int]) -> None:
        gid = lease["group_id"]
        try:
            while items := self._items(lease, starts):
                results = self.client.record_progress_step(items).result()
                for item, result in zip(items, results, strict=True):
                    if isinstance(result, BaseException):
                        raise result
                    starts[_seq(gid, item["index"])] = result
                    with self._cond:
                        self.progress[_seq(gid, item["index"])] = result
            rows = []
            for i in range(GROUP_SIZE):
                tokens = expected_tokens(gid, i, 0, TOTAL)
                rows.append({"input_ids": tokens, "generation_logprobs": logprobs_of(tokens),
                             "total_reward": float(i)})
            result = self.client.commit(lease, rows).result()
        except AbandonedTimeline:
            with self._cond:
                self.fenced.append(gid)
            return
        with self._cond:
            self.committed.append(gid)
            self.acked_at.append(time.time())
            if result.replayed:
                self.replayed.append(gid)
            self._cond.notify_all()

    def run(self, leases: Sequence[Mapping[str, Any]]) -> None:
        for lease in leases:
            self._one(lease, {_seq(lease["group_id"], i): 0 for i in range(GROUP_SIZE)})

    def resume(self, leases: Sequence[Mapping[str, Any]]) -> dict[str, int]:
        """New attempts under the plan's leases: start each sample from its durable prefix (checked
        token for token) on the client's primary. Returns where each sample started."""
        starts = {}
        for lease in leases:
            found = self.client.progress(lease["group_id"])
            mine = {}
            for i in range(GROUP_SIZE):
                prefix = found[i].tokens.numpy() if i in found else []
                assert (prefix == expected_tokens(lease["group_id"], i, 0, len(prefix))).all()
                mine[_seq(lease["group_id"], i)] = len(prefix)
            starts.update(mine)
            self._one(lease, mine)
        return starts

    def wait_committed(self, count: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: len(self.committed) >= count)

    def state(self) -> dict[str, Any]:
        with self._cond:
            return {"committed": list(self.committed), "progress": dict(self.progress), "fenced": list(self.fenced),
                    "replayed": list(self.replayed), "acked_at": list(self.acked_at), "epoch": self.client.epoch}


def lose_the_owner(cluster, tmp_path, ack: str) -> dict[str, Any]:
    """Start the pair and the producer, kill the owner's node mid-stream, delete its directory;
    what the test checks."""
    owner = cluster.add_node(**COMMON, num_cpus=1, resources={"owner_a": 1})
    node_a, node_b = tmp_path / "node_a", tmp_path / "node_b"
    node_a.mkdir()
    node_b.mkdir()
    name = f"standby-{ack}"
    standby = kray.start_standby_actor(str(node_b / "standby.kv"), name=name, node_id=node_of("standby_b"),
                                       auto_promote=True)
    primary = kray.start_buffer_actor(str(node_a / "live.kv"), fleet_config(), name=f"primary-{ack}",
                                      node_id=owner.node_id, max_restarts=0,
                                      replication={"standby": name, "ack": ack})
    leases = ray.get(primary.admit.remote(list(range(PROMPTS))))
    streamer = Streamer.options(resources={"rollout_c": 1}).remote(primary, name)
    running = streamer.run.remote(leases)
    ray.get(streamer.wait_committed.remote(KILL_AFTER))
    reported = ray.get(primary.replica_status.remote())  # the primary's last word on its lag
    killed_at = time.time()
    kill_node(cluster, owner)
    while any(n["NodeID"] == owner.node_id and n["Alive"] for n in ray.nodes()):
        time.sleep(0.05)
    declared_at = time.time()  # Ray's verdict: the node is dead (what automatic promotion waits for)
    with open_readonly(str(node_a / "live.kv")) as dead:  # what the dead primary had written
        last_at_kill = dead.read(describe)["last"]
    shutil.rmtree(node_a)  # its disk is gone with it
    ray.get(running)  # the producer went on: its client found the promoted standby
    info = ray.get(standby.info.remote())
    assert info["role"] == "primary" and info["epoch"] == 2 and info["node_id"] != owner.node_id
    return {"standby": standby, "streamer": streamer, "leases": leases, "reported": reported,
            "last_at_kill": last_at_kill, "killed_at": killed_at, "declared_at": declared_at, "info": info,
            "state": ray.get(streamer.state.remote()), "plan": ray.get(standby.recovery_plan.remote())}


def timing(run: dict[str, Any]) -> str:
    """Seconds from the kill to Ray declaring the node dead (as the driver saw it) and to the
    automatic promotion (reported, never asserted)."""
    return (f"kill to node declared dead {run['declared_at'] - run['killed_at']:.2f} s, to promotion "
            f"{run['info']['promoted_at'] - run['killed_at']:.2f} s")


def finish(run: dict[str, Any]) -> None:
    """The producer resumes exactly the plan's leases from their prefixes; every group ends
    committed once, token for token, and the promoted store verifies."""
    standby, plan, leases = run["standby"], run["plan"], run["leases"]
    ready = {g["group_id"] for g in ray.get(standby.groups.remote(["ready"]))}
    planned = [x["group_id"] for x in plan["leases"]]
    assert len(planned) == len(set(planned))  # each once
    assert sorted(planned) == sorted({x["group_id"] for x in leases} - ready)  # exactly the uncommitted
    # the producer learned each as fenced, but for acknowledged commits the standby never got (async)
    lost = {g for g in run["state"]["committed"] if g not in ready}
    assert set(planned) == set(run["state"]["fenced"]) | lost and not set(run["state"]["fenced"]) & lost
    starts = ray.get(run["streamer"].resume.remote(plan["leases"]))
    assert all(0 <= s <= TOTAL for s in starts.values())
    batch = kray.batch_from_dict(ray.get(standby.read_batch.remote([x["group_id"] for x in leases],
                                                                   layout="list")))
    assert sorted(set(batch.group_ids)) == sorted(x["group_id"] for x in leases)
    assert len(batch.rows) == GROUP_SIZE * PROMPTS
    for gid, index, row in zip(batch.group_ids, batch.row_indices, batch.rows, strict=True):
        assert row["input_ids"].tolist() == expected_tokens(gid, index, 0, TOTAL).tolist()
    path = ray.get(standby.info.remote())["path"]
    ray.get(standby.close.remote())
    ray.kill(standby)
    assert verify_path(path, deep=True).problems == []


@pytest.mark.parametrize("ack", ["remote_durable", "remote_apply"])
def test_remote_durable_loses_nothing_acknowledged_when_the_owners_node_and_disk_die(cluster, tmp_path, ack):
    """Both remote levels: the standby's process outlives the owner's node, so what it applied is there whether
    or not it was fsynced (``remote_durable`` adds a power cut of the standby's machine)."""
    run = lose_the_owner(cluster, tmp_path, ack)
    state, standby = run["state"], run["standby"]
    ready = {g["group_id"] for g in ray.get(standby.groups.remote(["ready"]))}
    before_kill = [g for g, t in zip(state["committed"], state["acked_at"], strict=True) if t < run["killed_at"]]
    assert len(before_kill) >= KILL_AFTER and set(before_kill) <= ready  # every acknowledged commit
    # every acknowledged progress prefix of a prompt still in flight is durable on the promoted standby
    for x in run["plan"]["leases"]:
        found = kray.progress_from_dict(ray.get(standby.progress.remote(x["group_id"])))
        for i in range(GROUP_SIZE):
            acked = state["progress"].get(_seq(x["group_id"], i), 0)
            assert (len(found[i].tokens) if i in found else 0) >= acked
    # the standby had applied every record the dead primary wrote that a producer was answered for
    assert run["info"]["promoted_from"] >= run["reported"]["acked"]
    print(f"\n{ack}: {timing(run)}; records written never acknowledged "
          f"{run['last_at_kill'] - run['info']['promoted_from']}")
    finish(run)


def test_async_loses_at_most_the_lag_when_the_owners_node_and_disk_die(cluster, tmp_path):
    run = lose_the_owner(cluster, tmp_path, "async")
    state, standby = run["state"], run["standby"]
    ready = {g["group_id"] for g in ray.get(standby.groups.remote(["ready"]))}
    before_kill = [g for g, t in zip(state["committed"], state["acked_at"], strict=True) if t < run["killed_at"]]
    lost = [g for g in before_kill if g not in ready]
    lag_at_kill = run["last_at_kill"] - run["info"]["promoted_from"]
    # one producer, one operation at a time: each acknowledged commit is its own record, so the lost
    # commits are among the records the standby had not applied at the kill
    assert len(lost) <= lag_at_kill
    assert run["info"]["promoted_from"] >= run["reported"]["acked"]  # the reported lag was no smaller than the truth
    assert run["reported"]["ack"] == "async" and run["reported"]["lag_s"] >= 0
    print(f"\nasync: lag at the kill {lag_at_kill} records, lost acknowledged commits {len(lost)}; {timing(run)}")
    finish(run)
