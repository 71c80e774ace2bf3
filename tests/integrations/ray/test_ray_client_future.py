"""``BufferClient``'s futures complete when waited on (issue 46): a producer that waits on
``result()`` without ``flush()`` gets its answer, whether its item is still queued (a partial
batch) or already sent, for progress step messages and commits alike, also from another thread.

Each wait is ``result(timeout=...)``: a future nothing drives can never complete, so without the
drive it raises ``TimeoutError`` (never a pass by luck)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

kray = pytest.importorskip("kvckpt.integrations.ray")
ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

CONFIG = {"group_size": 2, "schema": {"input_ids": ("int64", "token")}, "sampler": "ready_first",
          "max_buffered_rollouts": 64}
RAY_LOCAL = {"num_cpus": 2, "object_store_memory": 128 << 20, "namespace": "kvckpt-future-test", "address": "local"}
WAIT = 60  # seconds: far above one call's round trip; only an undriven future reaches it


def step(encoder, lease, seed):
    """Both samples of one group, 3 tokens each from 0: one engine step's message."""
    tokens = np.array([seed, seed + 1, seed + 2, seed + 10, seed + 11, seed + 12])
    return encoder.encode([lease, lease], [0, 1], [0, 0], tokens, -tokens / 100, [0, 3, 6], versions=0)


@pytest.fixture
def actor(ray_local, tmp_path, request):
    handle = kray.start_buffer_actor(str(tmp_path / "live.kv"), CONFIG, name=request.node.name[:40])
    yield handle
    ray.get(handle.close.remote())
    ray.kill(handle)


def test_a_queued_progress_step_completes_when_waited_on_without_flush(actor):
    """batch_steps=4: the first message stays queued in the client; waiting on it sends it."""
    leases = ray.get(actor.admit.remote([0, 1]))
    client = kray.BufferClient(actor, batch_steps=4)
    encoder = client.progress_encoder()
    first = client.record_progress_step(step(encoder, leases[0], 100))
    assert client.outstanding == 1 and not first.done()  # queued, nothing sent yet
    assert first.result(timeout=WAIT) == [3, 3]
    second = client.record_progress_step(step(encoder, leases[1], 200))
    assert second.exception(timeout=WAIT) is None and second.result() == [3, 3]
    assert client.outstanding == 0
    stored = kray.progress_from_dict(ray.get(actor.progress.remote(leases[1]["group_id"])))
    assert stored[1].tokens.tolist() == [210, 211, 212]


def test_sent_steps_and_commits_complete_in_order_when_the_last_is_waited_on(actor):
    """batch_steps=1, max_in_flight=4: three messages in flight; waiting on the last reaps the
    calls ahead of it first (so they are done too), then its own. A commit's future likewise."""
    leases = ray.get(actor.admit.remote([0, 1, 2, 3]))
    client = kray.BufferClient(actor, batch_steps=1, batch_groups=8, max_in_flight=4)
    encoder = client.progress_encoder()
    futures = [client.record_progress_step(step(encoder, lease, 100 * g)) for g, lease in enumerate(leases[:3])]
    assert futures[-1].result(timeout=WAIT) == [3, 3]
    assert all(f.done() for f in futures) and [f.result() for f in futures] == [[3, 3]] * 3
    rows = [{"input_ids": np.arange(4)} for _ in range(2)]
    commit = client.commit(leases[3], rows)  # one of a batch of 8: queued
    assert commit.result(timeout=WAIT).ready


def test_a_future_waited_on_from_another_thread_completes(actor):
    """The producer thread queues; a waiter thread waits on the future: the wait drives the client
    under its lock."""
    [lease] = ray.get(actor.admit.remote([0]))
    client = kray.BufferClient(actor, batch_steps=4)
    future = client.record_progress_step(step(client.progress_encoder(), lease, 7))
    got = []
    waiter = threading.Thread(target=lambda: got.append(future.result(timeout=WAIT)))
    waiter.start()
    waiter.join()
    assert got == [[3, 3]]
