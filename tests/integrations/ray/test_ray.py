"""The buffer as a Ray actor: concurrent producers, restarts after SIGKILL and ray.kill, fencing,
a simulated two-node cluster, and stores that stay ordinary kvckpt files.

One loopback-only Ray instance serves the module (``ray_local``); the two-node test shuts it
down and runs its own ``ray.cluster_utils.Cluster``. Every failure test asserts the exact
partition of the work: each commit either was acknowledged (and its group is in the store once)
or was refused as stale (and its prompt is in the ledger with a bumped attempt), nothing else.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from _buffers import SCHEMA, make_group

# Imported before ray, so Ray's loopback setting is read with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0.
kray = pytest.importorskip("kvckpt.integrations.ray")
ray = pytest.importorskip("ray")

from kvckpt import (  # noqa: E402
    AbandonedTimeline,
    BadArgument,
    CorruptRecord,
    ForeignLease,
    SchemaMismatch,
    StaleAttempt,
    read_stamp,
    verify_path,
)

pytestmark = pytest.mark.ray

CONFIG = {"group_size": 2, "schema": SCHEMA, "sampler": "ready_first", "max_buffered_rollouts": 256,
          "groups_per_step": 4}
#: The module's Ray (``ray_local``, tests/conftest.py).
RAY_LOCAL = {"num_cpus": 4, "object_store_memory": 256 << 20, "namespace": "kvckpt-test"}


@ray.remote(num_cpus=0)
class Producer:
    """A rollout worker stand-in: commits the rows it is handed through a BufferClient."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def commit(self, work: list[tuple[dict, Any]], retry_first: int = 0) -> list[tuple[str, bool]]:
        """Commit every group (batches of 3, 2 calls in flight), then commit the first
        ``retry_first`` again, as a producer does after a lost acknowledgement."""
        with kray.BufferClient(self.buffer, batch_groups=3, max_in_flight=2) as client:
            futures = [client.commit(lease, rows) for lease, rows in work]
        with kray.BufferClient(self.buffer, batch_groups=3, max_in_flight=2) as client:
            futures += [client.commit(lease, rows) for lease, rows in work[:retry_first]]
        return [(f.result().group_id, f.result().replayed) for f in futures]


def rows(seed: int) -> list[dict[str, Any]]:
    return kray.to_wire(make_group(2, seed))


def seed_of(group_id: str) -> int:
    return int(group_id.rsplit("p", 1)[1])


def outcome(sent: list[tuple[str, Future]]) -> tuple[dict[str, bool], set[str]]:
    """Acknowledged group ids (-> replayed) and group ids refused as stale; nothing else allowed."""
    acked: dict[str, bool] = {}
    stale: set[str] = set()
    for group_id, future in sent:
        error = future.exception()
        if error is None:
            assert (future.result().group_id, future.result().ready) == (group_id, True)
            acked[group_id] = future.result().replayed
        else:
            assert isinstance(error, StaleAttempt), repr(error)
            stale.add(group_id)
    return acked, stale


def assert_partition(actor: Any, committed: set[str], stale: set[str]) -> None:
    """Exactly the ``committed`` groups are stored, once each; exactly the ``stale`` prompts are
    in flight, under a bumped attempt and without partial rows; the store verifies deep."""
    ids = [g["group_id"] for g in ray.get(actor.groups.remote())]
    assert sorted(ids) == sorted(committed)
    ledger = ray.get(actor.ledger.remote())
    assert {e["group_id"]: (e["attempt"], tuple(e["siblings"])) for e in ledger} == {g: (1, ()) for g in stale}
    stats = ray.get(actor.stats.remote())
    assert (stats["committed"], stats["ledger_size"]) == (len(committed), len(stale))
    assert ray.get(actor.verify.remote(deep=True))["problems"] == []


# -- safety by default -------------------------------------------------------------------------------
def test_local_ray_is_loopback_only_without_dashboard(ray_local):
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
    assert ray.get_runtime_context().namespace == "kvckpt-test"
    assert ray.cluster_resources()["object_store_memory"] == 256 << 20


def test_producers_encode_at_the_edge_and_the_actor_only_checks(ray_local, tmp_path):
    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), CONFIG, name="edge")
    leases = ray.get(actor.admit.remote(list(range(4))))
    bad = make_group(2, 9)
    bad[1] = {k: v for k, v in bad[1].items() if k != "total_reward"}
    with kray.BufferClient(actor, batch_groups=2) as edge:  # encode_at_edge is the default
        refused = edge.commit(leases[0], bad)
        assert isinstance(refused.exception(timeout=0), SchemaMismatch)  # refused here, nothing was sent
        futures = [edge.commit(lease, make_group(2, seed_of(lease["group_id"]))) for lease in leases[:3]]
    with kray.BufferClient(actor, encode_at_edge=False) as plain:  # the owner encodes: the same bytes land
        futures.append(plain.commit(leases[3], rows(seed_of(leases[3]["group_id"]))))
    assert [f.result().ready for f in futures] == [True] * 4
    with kray.BufferClient(actor) as again:  # an identical re-commit from the edge is an idempotent replay
        replay = again.commit(leases[1], make_group(2, seed_of(leases[1]["group_id"])))
    assert replay.result().replayed
    stats = ray.get(actor.stats.remote())  # 4 calls (2 + 1 edge, 1 plain, 1 replay) carried 5 commits
    assert (stats["actor_commit_calls"], stats["actor_commit_call_commits"], stats["commit_transitions"]) == (4, 5, 5)
    assert 1 <= stats["commit_transactions"] <= 4 and 1 <= stats["actor_commit_calls_most_running"] <= 4
    assert verify_path(str(tmp_path / "live.kv"), deep=True).ok
    ray.kill(actor)


def test_a_rollout_worker_commits_one_engine_call_in_one_actor_call(ray_local, tmp_path):
    from kvckpt.integrations.vllm import DEFAULT_SCHEMA, RolloutWorker, ensure_tiny_model

    from kvckpt import Lease

    worker = RolloutWorker(ensure_tiny_model(str(tmp_path / "model")), max_tokens=3, seed=1)
    config = {"group_size": 2, "schema": DEFAULT_SCHEMA, "sampler": "ready_first", "max_buffered_rollouts": 8}
    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), config, name="rollout")
    leases = [Lease.from_dict(d) for d in ray.get(actor.admit.remote([1, 2, 3]))]
    assert [r.ready for r in worker.run(actor, leases)] == [True] * 3
    stats = ray.get(actor.stats.remote())  # three groups, one call, one durable transaction
    assert (stats["actor_commit_calls"], stats["actor_commit_call_commits"], stats["commit_transactions"]) == (1, 3, 1)
    assert verify_path(str(tmp_path / "live.kv"), deep=True).ok
    ray.kill(actor)


def test_a_streaming_worker_records_progress_through_the_actor_and_resumes_from_it(ray_local, tmp_path):
    """Progress every token, through the actor (one step message per engine step, over its progress channel);
    the group is then redispatched and a second worker resumes its samples from their prefixes."""
    from kvckpt.integrations.vllm import DEFAULT_SCHEMA, RolloutWorker, ensure_tiny_model

    from kvckpt import Lease

    model = ensure_tiny_model(str(tmp_path / "model"))
    config = {"group_size": 2, "schema": DEFAULT_SCHEMA, "sampler": "ready_first", "max_buffered_rollouts": 8}
    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), config, name="streaming")
    [lease] = [Lease.from_dict(d) for d in ray.get(actor.admit.remote([1]))]
    client = kray.BufferClient(actor)
    tokens = [7, 8]
    for i in range(2):  # an earlier attempt's durable prefix (it then died)
        assert client.record_progress(lease, i, start=0, tokens=tokens, logprobs=[-0.5, -0.5], weight_version=0) == 2
    again = Lease.from_dict(ray.get(actor.redispatch.remote(lease.group_id)))
    worker = RolloutWorker(model, max_tokens=4, temperature=0.0, progress_every_tokens=1,
                           backend_options={"step_tokens": 1})
    [result] = worker.run(actor, [again])
    assert result.ready and worker.progress_stats["tokens_resumed"] == 4
    assert worker.progress_stats["appends"] >= 1 and worker.progress_stats["append_calls"] >= 1
    # the shipped worker's step messages went over the actor's direct progress channel, not one call each
    assert ray.get(actor.stats.remote())["actor_channel_messages"] == worker.progress_stats["append_calls"]
    rows = kray.batch_from_dict(ray.get(actor.read_batch.remote([again.group_id], layout="list"))).rows
    assert all(r["input_ids"][r["token_mask"] == 1][:2].tolist() == tokens for r in rows)
    assert client.progress(again) == {} and verify_path(str(tmp_path / "live.kv"), deep=True).ok
    ray.kill(actor)


def test_one_engine_steps_progress_is_one_actor_call_and_one_transaction(ray_local, tmp_path):
    from kvckpt import FutureVersion

    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), CONFIG, name="progress")
    leases = ray.get(actor.admit.remote([0, 1]))
    client = kray.BufferClient(actor, encode_at_edge=False)
    before = ray.get(actor.stats.remote())["commit_transactions"]
    step = [{"lease": lease, "index": i, "start": 0, "tokens": torch.tensor([7, i]), "logprobs": [-0.5, -0.25],
             "weight_version": 0} for lease in leases for i in range(2)]
    step.append({**step[0], "start": 2, "weight_version": 5})
    results = client.record_progress_many(step)
    assert results[:4] == [2, 2, 2, 2] and isinstance(results[4], FutureVersion)
    assert ray.get(actor.stats.remote())["commit_transactions"] == before + 1
    assert client.record_progress(leases[0], 1, start=2, tokens=[9], logprobs=[-1.0], weight_version=0) == 3
    got = client.progress(leases[0])
    assert got[1].tokens.tolist() == [7, 1, 9] and got[1].versions.tolist() == [0, 0, 0]
    assert got[0].logprobs.dtype == torch.float32 and verify_path(str(tmp_path / "live.kv"), deep=True).ok
    ray.kill(actor)


def test_corrupt_record_crosses_a_process_boundary(ray_local):
    """Regression: CorruptRecord's two-argument __init__ made it fail to unpickle in the caller."""
    assert pickle.loads(pickle.dumps(CorruptRecord("rows/g_0", "bad checksum"))).key == "rows/g_0"

    @ray.remote(num_cpus=0)
    def fail() -> None:
        raise CorruptRecord("rows/g_0", "bad checksum")

    with pytest.raises(CorruptRecord) as info:
        ray.get(fail.remote())
    assert (info.value.key, info.value.reason) == ("rows/g_0", "bad checksum")


# -- producers and trainer through the actor ---------------------------------------------------------
def test_concurrent_producer_actors_land_every_group_once(ray_local, tmp_path):
    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), CONFIG, name="concurrent")
    leases = ray.get(actor.admit.remote(list(range(30)), b"dl-30"))
    producers = [Producer.remote(actor) for _ in range(3)]
    shares = [[(lease, rows(seed_of(lease["group_id"]))) for lease in leases[i::3]] for i in range(3)]
    replies = ray.get([p.commit.remote(share, retry_first=4) for p, share in zip(producers, shares, strict=True)])

    for share, reply in zip(shares, replies, strict=True):
        gids = [lease["group_id"] for lease, _ in share]
        assert reply == [(g, False) for g in gids] + [(g, True) for g in gids[:4]]  # retries were replays
    assert_partition(actor, {lease["group_id"] for lease in leases}, set())

    # the trainer's side: select, read, finish the step under the selection's session
    selection = ray.get(actor.select.remote(4, 4))
    assert [g["group_id"] for g in selection["groups"]] == [f"a0-p{i}" for i in range(4)]
    batch = kray.batch_from_dict(ray.get(actor.read_batch.remote(selection)))
    expected = [make_group(2, i) for i in range(4)]
    assert batch.lengths.tolist() == [4, 5] * 4
    assert batch.tensors["input_ids"][1, :5].tolist() == expected[0][1]["input_ids"].tolist()
    assert batch.tensors["total_reward"].tolist() == [r["total_reward"].item() for g in expected for r in g]
    assert ray.get(actor.finish_step.remote(session=selection["session"])) == 1
    assert ray.get(actor.recovery_plan.remote()) is None  # this actor created its store
    ray.kill(actor)


def test_actor_checkpoints_are_ordinary_checkpoint_files(ray_local, tmp_path):
    """A checkpoint the actor writes opens with read_stamp/verify_path and restores in a fresh
    process, where the trainer's next select returns the groups committed before it."""
    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), CONFIG, name="ckpt")
    leases = ray.get(actor.admit.remote(list(range(6)), b"dl-6"))
    second = kray.start_buffer_actor(str(tmp_path / "live.kv"), CONFIG, name="ckpt-second", max_restarts=0)
    with pytest.raises(ray.exceptions.ActorDiedError, match="StoreLocked"):  # one writer per store
        ray.get(second.info.remote())
    with kray.BufferClient(actor, batch_groups=4) as client:
        for lease in leases[:4]:
            client.commit(lease, rows(seed_of(lease["group_id"])))
        refused = client.commit(leases[5], rows(5)[:1])  # one row of two: refused in its own slot
    assert isinstance(refused.exception(), SchemaMismatch)
    ckpt = str(tmp_path / "step0.kvckpt")
    started = ray.get(actor.checkpoint.remote(ckpt, {"step": 0, "seed": 7}, wait=False))
    assert list(started) == ["checkpoint_id"]
    finished = ray.get(actor.checkpoint_status.remote(started["checkpoint_id"], wait=True))
    assert (finished["done"], finished["result"]["path"], finished["result"]["trainer_version"]) == (True, ckpt, 0)
    with pytest.raises(BadArgument, match="unknown checkpoint id"):  # reported once, then forgotten
        ray.get(actor.checkpoint_status.remote(started["checkpoint_id"]))
    stamp = read_stamp(ckpt)
    assert (stamp["checkpoint_id"], stamp["trainer_state"]) == (started["checkpoint_id"], {"step": 0, "seed": 7})
    assert verify_path(ckpt, deep=True).problems == []

    # the actor restores its own live store from the file: a commit made after it is undone
    session = ray.get(actor.info.remote())["session"]
    with kray.BufferClient(actor, batch_groups=2) as client:  # one call, two single-row transactions
        halves = [client.commit_sample(leases[4], i, row) for i, row in enumerate(rows(4))]
    assert sorted((f.result().ready, f.result().rows_written) for f in halves) == [(False, 1), (True, 1)]
    plan = kray.plan_from_dict(ray.get(actor.restore.remote(ckpt)))
    assert [(x.group_id, x.attempt) for x in plan.leases] == [("a0-p4", 1), ("a0-p5", 1)]
    assert (plan.checkpoint_id, plan.trainer_state) == (started["checkpoint_id"], {"step": 0, "seed": 7})
    assert ray.get(actor.info.remote())["session"] != session
    assert [g["group_id"] for g in ray.get(actor.groups.remote())] == [f"a0-p{i}" for i in range(4)]
    ray.get(actor.close.remote())
    ray.kill(actor)

    code = textwrap.dedent(f"""
        from kvckpt import restore
        buf, plan = restore({ckpt!r}, {str(tmp_path / "restored.kv")!r})
        print(sorted(l.group_id for l in plan.leases), plan.dataloader_state, buf.select(1, 8).group_ids)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['a0-p4', 'a0-p5'] b'dl-6' ['a0-p0', 'a0-p1', 'a0-p2', 'a0-p3']"


# -- faults ------------------------------------------------------------------------------------------
def test_sigkill_mid_stream_keeps_acknowledged_groups_once_and_fences_stale_leases(ray_local, tmp_path):
    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), CONFIG, name="sigkill", max_restarts=1)
    leases = ray.get(actor.admit.remote(list(range(40))))
    first = ray.get(actor.info.remote())
    client = kray.BufferClient(actor, batch_groups=2, max_in_flight=4, restart_timeout=120)
    sent = [(lease["group_id"], client.commit(lease, rows(seed_of(lease["group_id"])))) for lease in leases[:16]]
    os.kill(first["pid"], signal.SIGKILL)  # up to 4 calls in flight, some landed, some not
    sent += [(lease["group_id"], client.commit(lease, rows(seed_of(lease["group_id"])))) for lease in leases[16:]]
    client.flush()

    acked, stale = outcome(sent)
    assert set(acked) | stale == {lease["group_id"] for lease in leases}
    assert not set(acked) & stale
    assert "a0-p39" in stale  # sent after the kill: the restart's recovery fenced its lease
    second = ray.get(actor.info.remote())
    assert (second["restarted"], second["pid"] != first["pid"]) == (True, True)
    assert_partition(actor, set(acked), stale)

    plan = kray.plan_from_dict(ray.get(actor.recovery_plan.remote()))
    assert {(x.group_id, x.attempt) for x in plan.leases} == {(g, 1) for g in stale}
    # every acknowledged group had landed before the kill (replays: landed, acknowledgement lost)
    assert plan.groups_complete_restored == len(acked)
    # a producer still holding a pre-restart lease is refused; the redispatched lease commits
    old = next(lease for lease in leases if lease["group_id"] in stale)
    with pytest.raises(StaleAttempt):
        ray.get(actor.commit_group.remote(old, rows(seed_of(old["group_id"]))))
    with kray.BufferClient(actor, batch_groups=8) as client:
        redone = [client.commit(lease, rows(seed_of(lease.group_id))) for lease in plan.leases]
    assert all(f.result().ready and not f.result().replayed for f in redone)
    assert_partition(actor, {lease["group_id"] for lease in leases}, set())
    ray.kill(actor)


def test_ray_kill_restart_fences_leases_and_voids_the_open_selection(ray_local, tmp_path):
    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), CONFIG, name="raykill", max_restarts=1)
    leases = ray.get(actor.admit.remote(list(range(8))))
    with kray.BufferClient(actor, batch_groups=4) as client:
        for lease in leases[:6]:
            client.commit(lease, rows(seed_of(lease["group_id"])))
    selection = ray.get(actor.select.remote(4, 4))
    first = ray.get(actor.info.remote())
    ray.kill(actor, no_restart=False)
    while kray.wait_for_actor(actor, timeout=120)["pid"] == first["pid"]:  # the kill is asynchronous
        pass

    plan = ray.get(actor.recovery_plan.remote())
    assert (plan["groups_returned_to_ready"], plan["groups_complete_restored"]) == (4, 6)
    assert [(x["group_id"], x["attempt"]) for x in plan["leases"]] == [("a0-p6", 1), ("a0-p7", 1)]
    with pytest.raises(StaleAttempt, match="restarted"):  # the step's claims were undone: no empty step
        ray.get(actor.finish_step.remote(session=selection["session"]))
    with pytest.raises(AbandonedTimeline):  # the restart's recovery started a new timeline
        ray.get(actor.commit_group.remote(leases[6], rows(6)))
    old_wire = {k: v for k, v in plan["leases"][0].items() if k not in ("store_id", "timeline")}
    with pytest.raises(ForeignLease, match="no store id"):  # a lease of an older kvckpt on the wire
        ray.get(actor.commit_group.remote(old_wire, rows(6)))
    with kray.BufferClient(actor, batch_groups=2) as client:
        refused = [client.commit(lease, rows(6)) for lease in (old_wire, leases[6])]
    assert [type(f.exception()) for f in refused] == [ForeignLease, AbandonedTimeline]
    again = ray.get(actor.select.remote(4, 4))
    assert [g["group_id"] for g in again["groups"]] == [g["group_id"] for g in selection["groups"]]
    assert ray.get(actor.finish_step.remote(session=again["session"])) == 1
    assert [g["group_id"] for g in ray.get(actor.groups.remote(["ready"]))] == ["a0-p4", "a0-p5"]

    # split admission and an explicit redispatch go through the actor as single transactions too
    admission = ray.get(actor.advance_dispatch.remote(b"dl-next", timeout=0))
    [joined] = ray.get(actor.admit.remote([8], admission=admission))
    fresh = ray.get(actor.redispatch.remote(joined["group_id"], start_weight=1))
    assert (joined["group_id"], joined["attempt"], fresh["attempt"], fresh["start_weight"]) == ("a1-s8", 0, 1, 1)
    with pytest.raises(StaleAttempt):
        ray.get(actor.commit_group.remote(joined, rows(8)))
    assert ray.get(actor.commit_group.remote(fresh, rows(8)))["ready"]
    assert_partition(actor, {f"a0-p{i}" for i in range(6)} | {"a1-s8"}, {"a0-p6", "a0-p7"})
    ray.kill(actor)


# -- two nodes ---------------------------------------------------------------------------------------
@pytest.fixture
def two_nodes(ray_teardown):
    """A simulated two-node cluster on loopback: the head holds the store ("buffer_node"), the
    second node runs producers ("producer_node")."""
    from ray.cluster_utils import Cluster

    ray.shutdown()
    kray.keep_ray_on_loopback()
    common = {"node_ip_address": "127.0.0.1", "include_dashboard": False, "object_store_memory": 128 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**common, "num_cpus": 1,
                                                            "resources": {"buffer_node": 1}})
    worker = cluster.add_node(**common, num_cpus=2, resources={"producer_node": 2})
    try:
        yield cluster, worker
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_two_node_cluster_buffer_pinned_producers_remote_driver_reconnects(two_nodes, tmp_path):
    cluster, worker = two_nodes
    namespace = "kvckpt-cluster"
    ray.init(address=cluster.address, namespace=namespace)
    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), CONFIG, name="pinned", detached=True,
                                    resources={"buffer_node": 1})
    leases = ray.get(actor.admit.remote(list(range(12))))
    producers = [Producer.options(resources={"producer_node": 1}).remote(actor) for _ in range(2)]
    shares = [[(lease, rows(seed_of(lease["group_id"]))) for lease in leases[i::2]] for i in range(2)]
    replies = ray.get([p.commit.remote(share) for p, share in zip(producers, shares, strict=True)])

    assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1", "127.0.0.1"]
    assert ray.get(actor.info.remote())["node_id"] == cluster.head_node.node_id
    assert ray.get([p.node_id.remote() for p in producers]) == [worker.node_id] * 2
    assert sorted(g for reply in replies for g, replayed in reply if not replayed) == sorted(
        lease["group_id"] for lease in leases)

    ray.shutdown()  # the driver goes away; the detached actor stays
    ray.init(address=cluster.address, namespace=namespace)
    found = ray.get_actor("pinned", namespace=namespace)
    stats = ray.get(found.stats.remote())
    assert (stats["committed"], stats["ready"], stats["ledger_size"]) == (12, 12, 0)
    ray.get(found.close.remote())
    ray.kill(found)
    assert verify_path(str(tmp_path / "live.kv"), deep=True).problems == []
