"""A rollout fleet streaming token progress through the buffer actor on a real multi-node Ray
cluster (loopback), and what each death costs: a rollout node, the store actor's process, the
owner's node (docs/ray.md, "A fleet that streams progress").

One cluster serves the module: the head node (resource ``head``) holds the coordinator and, in
the first two tests, the store actor; the node ``rollout_b`` runs the producers that survive.
Each test adds the node it kills. What recovers runs in processes other than the ones that died:
new producer actors on the surviving node, the restarted store actor (a new process on the same
file), a store actor on another node restoring the checkpoint; the driver plays the trainer (its
redispatch) and checks. "Mid-generation" is a step the test chooses (the producers pause at the
coordinator), never a sleep; where a message is in flight at the kill, the assertions hold for
both outcomes (it landed whole, or not at all).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

kray = pytest.importorskip("kvckpt.integrations.ray")  # before ray: loopback
ray = pytest.importorskip("ray")

import _fleet  # noqa: E402
from _fleet import (  # noqa: E402
    COMMON,
    GROUP_SIZE,
    Coordinator,
    Producer,
    expected_tokens,
    fleet_config,
    kill_node,
    loopback_cluster,
)

from kvckpt import AbandonedTimeline, verify_path  # noqa: E402

pytestmark = pytest.mark.ray

INTERVAL, STEPS = 4, 5  # tokens per engine step (the progress interval), steps per completion
TOTAL = INTERVAL * STEPS
@pytest.fixture(scope="module")
def cluster():
    """Head (store actor, coordinator) and ``rollout_b`` (surviving producers), on loopback."""
    with loopback_cluster("kvckpt-fleet", {"rollout_b": 8}) as made:
        yield made


def on(resource: str) -> dict:
    return {"resources": {resource: 1}}


def seqs(leases: list[dict]) -> list[str]:
    return [f"{x['group_id']}#{i}" for x in leases for i in range(GROUP_SIZE)]


def durable(actor, leases: list[dict]) -> dict[str, int]:
    """Each sequence's durable prefix length, its tokens checked against the generation model."""
    out = {}
    for x in leases:
        found = kray.progress_from_dict(ray.get(actor.progress.remote(x["group_id"])))
        for i in range(GROUP_SIZE):
            tokens = found[i].tokens.numpy() if i in found else []
            assert (tokens == expected_tokens(x["group_id"], i, 0, len(tokens))).all()
            out[f"{x['group_id']}#{i}"] = len(tokens)
    return out


def assert_committed_exactly(actor, leases: list[dict]) -> None:
    """Every group is ready with the full completions, token for token, and no progress is left."""
    gids = [x["group_id"] for x in leases]
    batch = kray.batch_from_dict(ray.get(actor.read_batch.remote(gids, layout="list")))
    for gid, index, row in zip(batch.group_ids, batch.row_indices, batch.rows, strict=True):
        assert row["input_ids"].tolist() == expected_tokens(gid, index, 0, TOTAL).tolist()
    assert sorted(set(batch.group_ids)) == sorted(gids) and len(batch.rows) == GROUP_SIZE * len(gids)
    assert all(ray.get(actor.progress.remote(g)) == {} for g in gids)


def test_a_rollout_node_killed_mid_stream_loses_at_most_one_interval(cluster, tmp_path):
    victim = cluster.add_node(**COMMON, num_cpus=1, resources={"rollout_a": 8})
    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), fleet_config(), name="node-kill",
                                    resources={"head": 1})
    coordinator = Coordinator.options(**on("head")).remote()
    producers = [Producer.options(**on("rollout_a")).remote(actor, coordinator, INTERVAL, STEPS) for _ in range(2)]
    zombie, survivor = (Producer.options(**on("rollout_b")).remote(actor, coordinator, INTERVAL, STEPS)
                        for _ in range(2))
    assert ray.get([p.node_id.remote() for p in producers]) == [victim.node_id] * 2
    # the leases record the holder their producers give: the node, what dies with it
    node_a, node_b = ray.get([producers[0].holder.remote(), survivor.holder.remote()])
    assert (node_a, ray.get(producers[1].holder.remote())) == (f"node:{victim.node_id}",) * 2
    leases = ray.get(actor.admit.remote(list(range(4)), holder=node_a))
    paused, in_flight = leases[:2], leases[2:]
    # step 3 of 5: one engine has generated 3 of its 4 tokens (not yet due), the other has sent step 3
    streams = [producers[0].stream.remote(paused, 3, extra=3),
               producers[1].stream.remote(in_flight, 3, sent="in_flight")]
    ray.get(coordinator.wait_paused.remote(2))
    killed = kill_node(cluster, victim)
    assert len(killed) >= 2
    for stream in streams:  # in flight at the kill: a RayActorError (docs/ray.md); which of its two kinds
        # depends on whether this driver learns of the death (the raylet reporting its own exit, or the cluster's
        # verdict) before it sees the connection drop, a race Ray leaves open: both are what Ray documents
        with pytest.raises(ray.exceptions.RayActorError) as failed:
            ray.get(stream, timeout=120)
        assert isinstance(failed.value, (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError)), \
            repr(failed.value)
    later = _fleet.later_call_error(producers[0], ray.exceptions.ActorUnavailableError)
    assert isinstance(later, ray.exceptions.ActorDiedError), repr(later)  # once the node is declared dead
    state = ray.get(coordinator.state.remote())
    acked, generated = state["acked"], state["generated"]

    # every acknowledged chunk is durable; only the message in flight at the kill may add one more
    held = durable(actor, leases)
    assert {s: held[s] for s in seqs(paused)} == {s: acked[s] for s in seqs(paused)} == dict.fromkeys(seqs(paused), 12)
    for s in seqs(in_flight):
        assert held[s] >= acked[s] >= 12 and held[s] in (12, 16) and generated[s] == 16
    assert all(generated[s] - held[s] <= INTERVAL for s in held)

    # the trainer asks the store what the dead node held (one read) and redispatches it, each once, to a
    # surviving node (one call, one transaction)
    assert ray.get(actor.leases_held_by.remote(node_a)) == leases
    fresh = ray.get(actor.redispatch_held_by.remote(node_a, to=node_b))
    assert [(x["group_id"], x["attempt"], x["holder"]) for x in fresh] == [(x["group_id"], 1, node_b) for x in leases]
    assert ray.get(actor.leases_held_by.remote(node_a)) == [] and ray.get(actor.leases_held_by.remote(node_b)) == fresh
    # a producer of the dead node comes back (a healed partition) and writes after the redispatch: its
    # new chunks are refused; the chunk whose first try landed while its acknowledgement died with the
    # node is answered as the first try was (exactly-once resend), and nothing is written either way
    answers = ray.get(zombie.zombie.remote(list(state["leases"].values()), acked))
    assert answers == {s: f"landed {held[s]}" if held[s] > acked[s] else "StaleAttempt" for s in held}
    assert sum(a == "StaleAttempt" for a in answers.values()) >= 4  # the paused engine's 4 sequences
    assert durable(actor, leases) == held

    # producers on the surviving node resume from the durable prefixes and commit
    starts = ray.get(survivor.resume.remote(fresh))
    assert starts == held  # resumed exactly from the durable prefix
    resumed, regenerated = sum(held.values()), sum(generated[s] - held[s] for s in held)
    assert resumed >= 8 * 12 and regenerated <= 8 * INTERVAL
    assert_committed_exactly(actor, fresh)
    stats = ray.get(actor.stats.remote())
    assert (stats["committed"], stats["ledger_size"]) == (4, 0)
    ray.get(actor.close.remote())
    ray.kill(actor)
    assert verify_path(str(tmp_path / "live.kv"), deep=True).problems == []


def test_the_store_actor_killed_mid_stream_loses_nothing_acknowledged_and_applies_nothing_twice(cluster, tmp_path):
    path = str(tmp_path / "live.kv")
    actor = kray.start_buffer_actor(path, fleet_config(), name="actor-kill", resources={"head": 1}, max_restarts=1)
    coordinator = Coordinator.options(**on("head")).remote()
    leases = ray.get(actor.admit.remote(list(range(4))))
    producers = [Producer.options(**on("rollout_b")).remote(actor, coordinator, INTERVAL, STEPS) for _ in range(2)]
    # step 2 of 5: one engine's message landed but its acknowledgement is lost, the other's is not sent yet
    streams = [producers[0].stream.remote(leases[:2], 2, sent="ack_lost"),
               producers[1].stream.remote(leases[2:], 2, extra=1)]
    ray.get(coordinator.wait_paused.remote(2))
    before = durable(actor, leases)
    assert before == {**dict.fromkeys(seqs(leases[:2]), 12), **dict.fromkeys(seqs(leases[2:]), 8)}
    assert ray.get(coordinator.state.remote())["acked"] == dict.fromkeys(seqs(leases), 8)
    first = ray.get(actor.info.remote())
    os.kill(first["pid"], signal.SIGKILL)
    ray.get(coordinator.release.remote())
    assert ray.get(streams) == [1, 1]  # each engine resent one step, under the recovery plan's lease
    again = kray.wait_for_actor(actor, 120)
    assert (again["restarted"], again["pid"] != first["pid"]) == (True, True)
    plan = ray.get(actor.recovery_plan.remote())
    assert sorted((x["group_id"], x["attempt"]) for x in plan["leases"]) == sorted((x["group_id"], 1) for x in leases)
    with pytest.raises(AbandonedTimeline):  # a lease from before the restart writes nothing
        ray.get(actor.record_progress.remote(leases[0], 0, TOTAL, [1], [-0.5], 0))

    # every acknowledged chunk is there exactly once: one chunk record per step, every token in place
    acked = ray.get(coordinator.state.remote())["acked"]
    assert durable(actor, leases) == acked == dict.fromkeys(seqs(leases), TOTAL)
    inspected = json.loads(subprocess.run([sys.executable, "-m", "kvckpt.tools.cli", "inspect", "--json", path],
                                          capture_output=True, text=True, timeout=120, check=True).stdout)
    assert inspected["progress"] == {"samples": 8, "chunks": 8 * STEPS, "tokens": 8 * TOTAL}

    assert all(ray.get([p.commit.remote() for p in producers])[0])
    assert_committed_exactly(actor, [{"group_id": x["group_id"]} for x in leases])
    ray.get(actor.close.remote())
    ray.kill(actor)
    assert verify_path(path, deep=True).problems == []


def test_the_owners_node_dies_and_another_node_restores_what_inspect_counted(cluster, tmp_path):
    owner = cluster.add_node(**COMMON, num_cpus=1, resources={"owner_a": 1})
    node_a, shared = tmp_path / "node_a", tmp_path / "shared"
    node_a.mkdir()
    shared.mkdir()
    actor = kray.start_buffer_actor(str(node_a / "live.kv"), fleet_config(), name="owner-a", node_id=owner.node_id,
                                    max_restarts=1)
    coordinator = Coordinator.options(**on("head")).remote()
    leases = ray.get(actor.admit.remote(list(range(5))))
    done, streaming, late = leases[:2], leases[2:4], leases[4:]
    first, second = (Producer.options(**on("rollout_b")).remote(actor, coordinator, INTERVAL, STEPS)
                     for _ in range(2))
    ray.get(first.stream.remote(done))
    assert ray.get(first.commit.remote()) == [True, True]
    stream = second.stream.remote(streaming, 2)  # pauses with 2 steps of 5 acknowledged
    ray.get(coordinator.wait_paused.remote(1))
    ckpt = str(shared / "step1.kvckpt")  # checkpoints go to storage that outlives the owner's node
    ray.get(actor.checkpoint.remote(ckpt, {"step": 1}))
    # after the checkpoint: the paused engine finishes its progress, another group is committed
    ray.get(coordinator.release.remote())
    ray.get(stream)
    ray.get(first.stream.remote(late))
    assert ray.get(first.commit.remote()) == [True]
    acked_groups = len(done) + len(late)
    acked_tokens = sum(ray.get(coordinator.state.remote())["acked"][s] for s in seqs(streaming))
    assert acked_tokens == 4 * TOTAL

    kill_node(cluster, owner)
    # a rollout worker's commits to the dead owner fail in their futures; the owner is never restarted
    # elsewhere (it is pinned to its node)
    refused = ray.get(second.commit.remote())
    assert len(refused) == 2 and all(isinstance(e, ray.exceptions.RayActorError) for e in refused)
    with pytest.raises(ray.exceptions.ActorUnschedulableError):
        kray.wait_for_actor(actor, 120)
    shutil.rmtree(node_a)  # its disk is gone with it

    out = subprocess.run([sys.executable, "-m", "kvckpt.tools.cli", "inspect", "--json", ckpt],
                         capture_output=True, text=True, timeout=120, check=True)
    inspected = json.loads(out.stdout)
    kept_groups, kept_tokens = inspected["counts"]["groups"], inspected["progress"]["tokens"]
    assert (kept_groups, inspected["counts"]["inflight"], kept_tokens) == (2, 3, 4 * 2 * INTERVAL)

    # a new owner on another node restores the checkpoint into its own directory
    node_b = tmp_path / "node_b"
    node_b.mkdir()
    restored = kray.start_buffer_actor(str(node_b / "live.kv"), fleet_config(), name="owner-b",
                                       node_id=cluster.head_node.node_id)
    plan = ray.get(restored.restore.remote(ckpt))
    assert ray.get(restored.info.remote())["node_id"] != owner.node_id
    stats = ray.get(restored.stats.remote())
    assert (stats["committed"], plan["progress_tokens"]) == (kept_groups, kept_tokens)
    lost_groups, lost_tokens = acked_groups - kept_groups, acked_tokens - kept_tokens
    assert (lost_groups, lost_tokens) == (1, 4 * 3 * INTERVAL)  # exactly what inspect said was missing
    assert sorted(x["group_id"] for x in plan["leases"]) == sorted(x["group_id"] for x in streaming + late)

    # the trainer's next move: the rollout workers (their node survived) take the plan's leases from
    # the new owner and resume from the prefixes kept
    ray.get([p.connect.remote(restored) for p in (first, second)])
    replies = ray.get([first.resume.remote(plan["leases"][:2]), second.resume.remote(plan["leases"][2:])])
    starts = {k: v for reply in replies for k, v in reply.items()}
    assert sorted(starts.values()) == [0, 0] + [2 * INTERVAL] * 4
    assert_committed_exactly(restored, leases)
    ray.get(restored.close.remote())
    ray.kill(restored)
    assert verify_path(str(node_b / "live.kv"), deep=True).problems == []
