"""Support of tests/integrations/ray/test_ray_fleet.py: a rollout fleet that streams token progress through the
buffer actor on a real multi-node Ray cluster (loopback), and the means to kill its parts.

* :func:`expected_tokens` is the generation model: the token at position ``p`` of sample ``i``
  of a group is a fixed function of ``(group, i, p)``, so any attempt on any node produces the
  same completion and a test can check every stored token.
* :func:`send_step` is the ONE place a producer sends an engine step's progress: one columnar
  step message (``BufferClient.record_progress_step``), as a fleet streams it.
* :class:`Coordinator` (on the head node) collects what producers acknowledged and generated,
  and holds them at a chosen step until the driver releases them: "mid-generation" is a point
  the test chooses, never a sleep.
* :class:`Producer` streams, resumes from a durable prefix, commits, and replays a dead
  producer's writes (the zombie of a healed partition); :func:`kill_node` SIGKILLs a node's
  raylet and every process under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kvckpt.integrations.ray as kray  # before ray: loopback
import numpy as np
import ray

from kvckpt import StaleAttempt

#: The schema of the fleet's rows: the whole ``input_ids`` is the completion (no ``token_mask``).
SCHEMA = {"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"),
          "total_reward": ("float32", "row")}
GROUP_SIZE = 2


def fleet_config(capacity: int = 64) -> dict[str, Any]:
    """The buffer config of the fleet tests (groups of :data:`GROUP_SIZE`)."""
    return {"group_size": GROUP_SIZE, "schema": SCHEMA, "sampler": "ready_first", "max_buffered_rollouts": capacity}


def expected_tokens(group_id: str, index: int, start: int, count: int) -> np.ndarray:
    """Tokens ``start .. start+count-1`` of sample ``index`` of ``group_id`` (the same on every attempt)."""
    base = zlib.crc32(f"{group_id}#{index}".encode())
    return (base + 7919 * np.arange(start, start + count, dtype=np.int64)) % 50_000


def logprobs_of(tokens: np.ndarray) -> np.ndarray:
    """The logprob the model gives each token (a fixed function of the token)."""
    return -((tokens % 97).astype(np.float32) / 100)


def send_step(client: kray.BufferClient, items: Sequence[Mapping[str, Any]]) -> list[int | BaseException]:
    """Send one engine step's progress chunks in one columnar message; each item's durable length or error.

    The only call through which the fleet tests stream progress (see the module doc)."""
    future = client.record_progress_step(items)
    client.flush()
    return future.result()


def kill_node(cluster: Any, node: Any) -> list[int]:
    """SIGKILL a ``ray.cluster_utils.Cluster`` node: its raylet and every process under it
    (workers, actors), as a machine that loses power would. Returns the pids killed besides the
    node's own processes, after each is gone."""
    from ray._private import ray_constants

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    doomed, todo = [], list(children.get(raylet, []))
    while todo:
        pid = todo.pop()
        doomed.append(pid)
        todo += children.get(pid, [])
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    cluster.remove_node(node, allow_graceful=False)
    deadline = time.monotonic() + 60
    while any(_state(pid) not in ("Z", "gone") for pid in doomed):  # SIGKILL is delivered asynchronously
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of the killed node outlived SIGKILL: {doomed}")
        time.sleep(0.01)
    return doomed


def later_call_error(actor: Any, transient: type[BaseException], deadline_s: float = 120) -> BaseException:
    """The error a new call to ``actor`` (on a killed node) raises once it is not ``transient``:
    calls made before the cluster declares the node dead raise ``transient`` (each is answered at
    once, so this polls the cluster's verdict, never a sleep's length)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            ray.get(actor.node_id.remote(), timeout=deadline_s)
        except transient:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
        except Exception as exc:  # the caller asserts which
            return exc
        else:
            raise AssertionError("a call to an actor of the killed node was answered")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@ray.remote(num_cpus=0)
class Coordinator:
    """What producers report (per sequence: acknowledged and generated tokens, the leases they
    hold) and a barrier: :meth:`pause` returns once the driver calls :meth:`release`."""

    def __init__(self) -> None:
        self.acked: dict[str, int] = {}
        self.generated: dict[str, int] = {}
        self.leases: dict[str, dict[str, Any]] = {}
        self.paused = 0
        self._arrived = asyncio.Condition()
        self._go = asyncio.Event()

    async def report(self, acked: Mapping[str, int], generated: Mapping[str, int],
                     leases: Sequence[Mapping[str, Any]] = ()) -> None:
        self.acked.update(acked)
        self.generated.update(generated)
        self.leases.update({lease["group_id"]: dict(lease) for lease in leases})

    async def pause(self) -> None:
        async with self._arrived:
            self.paused += 1
            self._arrived.notify_all()
        await self._go.wait()

    async def wait_paused(self, count: int) -> None:
        async with self._arrived:
            await self._arrived.wait_for(lambda: self.paused >= count)

    async def release(self) -> None:
        self._go.set()

    async def state(self) -> dict[str, Any]:
        return {"acked": self.acked, "generated": self.generated, "leases": self.leases}


def _seq(group_id: str, index: int) -> str:
    return f"{group_id}#{index}"


@ray.remote(num_cpus=0)
class Producer:
    """A rollout engine: its sequences are the samples of its leases; each engine step generates
    ``interval`` tokens of every sequence and sends them in one :func:`send_step`."""

    def __init__(self, buffer: Any, coordinator: Any, interval: int, steps: int) -> None:
        self.buffer, self.coordinator = buffer, coordinator
        self.interval, self.steps = interval, steps
        self.client = kray.BufferClient(buffer, restart_timeout=120)
        self.leases: dict[str, dict[str, Any]] = {}
        self.resends = 0

    def connect(self, buffer: Any) -> None:
        """Send to another store actor from now on (a new owner after the old one's node died)."""
        self.buffer, self.client = buffer, kray.BufferClient(buffer, restart_timeout=120)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def holder(self) -> str:
        """The lease holder name this producer gives (its node's: what dies with the node)."""
        return kray.holder_name()

    def _items(self, step: int, starts: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
        items = []
        for gid, lease in self.leases.items():
            for i in range(GROUP_SIZE):
                start = step * self.interval if starts is None else starts[_seq(gid, i)]
                count = min(self.interval, self.steps * self.interval - start)
                if count <= 0:
                    continue
                tokens = expected_tokens(gid, i, start, count)
                items.append({"lease": lease, "index": i, "start": start, "tokens": tokens,
                              "logprobs": logprobs_of(tokens), "weight_version": 0})
        return items

    def _ack(self, items: list[dict[str, Any]], results: list[Any]) -> None:
        """Report acknowledged lengths; raise the first refusal."""
        for result in results:
            if isinstance(result, BaseException):
                raise result
        acked = {_seq(it["lease"]["group_id"], it["index"]): r for it, r in zip(items, results, strict=True)}
        ray.get(self.coordinator.report.remote(acked, acked))

    def _step(self, step: int) -> None:
        """One engine step; after the store actor restarted (the call died, or its lease was fenced),
        take the recovery plan's lease and resend the same chunks (a landed one is a no-op)."""
        items = self._items(step)
        try:
            self._ack(items, send_step(self.client, items))
        except (ray.exceptions.RayActorError, StaleAttempt):
            kray.wait_for_actor(self.buffer, 120)
            plan = ray.get(self.buffer.recovery_plan.remote())
            self.leases.update({x["group_id"]: x for x in plan["leases"] if x["group_id"] in self.leases})
            self.resends += 1
            items = self._items(step)
            self._ack(items, send_step(self.client, items))

    def stream(self, leases: Sequence[Mapping[str, Any]], pause_at: int | None = None, *, extra: int = 0,
               sent: str | None = None) -> int:
        """Stream every step of ``leases``. At step ``pause_at``, pause at the coordinator until
        released, having generated ``extra`` tokens of the step (not yet due: nothing sent), or the
        whole step and sent it: its message still in flight (``sent="in_flight"``), or landed with
        its acknowledgement lost on the way back (``sent="ack_lost"``: sent again after the pause).
        Returns the resends made after a refusal or the store actor's death."""
        self.leases = {x["group_id"]: dict(x) for x in leases}
        ray.get(self.coordinator.report.remote({}, {}, list(self.leases.values())))
        for step in range(self.steps):
            if step != pause_at:
                self._step(step)
                continue
            seqs = [_seq(g, i) for g in self.leases for i in range(GROUP_SIZE)]
            done = step * self.interval
            ray.get(self.coordinator.report.remote({}, {s: done + (self.interval if sent else extra) for s in seqs}))
            if sent == "ack_lost":
                send_step(self.client, self._items(step))  # durable now; the producer never learns it
            with ThreadPoolExecutor(1) as pool:
                flight = pool.submit(self._step, step) if sent == "in_flight" else None
                ray.get(self.coordinator.pause.remote())
                if flight is not None:
                    flight.result()
                else:
                    self._step(step)
        return self.resends

    def zombie(self, leases: Sequence[Mapping[str, Any]], acked: Mapping[str, int]) -> dict[str, str]:
        """A producer of a dead node back from a partition: it still holds ``leases`` and sends the
        next chunk of every sequence after what it saw acknowledged. Returns, per sequence, the
        refusal's class name, or ``"landed N"`` where the store answered with a durable end ``N``
        (a resend of a chunk whose first try landed: the same answer, nothing written)."""
        self.leases = {x["group_id"]: dict(x) for x in leases}
        items = self._items(0, starts=acked)
        return {_seq(it["lease"]["group_id"], it["index"]): type(r).__name__ if isinstance(r, BaseException)
                else f"landed {r}" for it, r in zip(items, send_step(self.client, items), strict=True)}

    def resume(self, leases: Sequence[Mapping[str, Any]]) -> dict[str, int]:
        """A new attempt on a surviving node: read each sample's durable prefix, check it, generate
        the rest from there, stream it and commit the group. Returns, per sequence, where it started."""
        self.leases = {x["group_id"]: dict(x) for x in leases}
        starts = {}
        for gid in self.leases:
            found = self.client.progress(gid)
            for i in range(GROUP_SIZE):
                prefix = found[i].tokens.numpy() if i in found else np.zeros(0, np.int64)
                assert (prefix == expected_tokens(gid, i, 0, len(prefix))).all(), f"{gid}#{i}: a wrong prefix"
                starts[_seq(gid, i)] = len(prefix)
        current = dict(starts)
        while items := self._items(0, starts=current):
            self._ack(items, send_step(self.client, items))
            current.update({_seq(it["lease"]["group_id"], it["index"]): it["start"] + len(it["tokens"])
                            for it in items})
        self.commit()
        return starts

    def commit(self) -> list[bool | BaseException]:
        """Commit every group of the producer's leases (the full completions) through the
        producer's client; per group, whether it is ready, or the error its future holds."""
        total = self.steps * self.interval
        futures = []
        for gid, lease in self.leases.items():
            rows = []
            for i in range(GROUP_SIZE):
                tokens = expected_tokens(gid, i, 0, total)
                rows.append({"input_ids": tokens, "generation_logprobs": logprobs_of(tokens),
                             "total_reward": np.float32(i)})
            futures.append(self.client.commit(lease, rows))
        self.client.flush()
        return [f.exception() or f.result().ready for f in futures]
