"""The direct progress channel into the buffer actor (issue 45): a producer's step messages over one
socket, answered exactly as the actor's ``record_progress_steps`` calls answer them.

Real Ray on loopback and a real store: the channel's answers equal the actor calls' for the same kind
of messages (a per-sequence refusal and a malformed message included); a wrong token and an
oversized frame are refused with nothing written; a SIGKILL of the actor with frames unanswered is
followed by a re-ask and a resend (exactly once, rows counted in a fresh process); a replicated
actor offers no channel and the client uses actor calls. The framing and the fallback are also
driven against a :class:`ChannelServer` on a real buffer in this process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from _buffers import until

kray = pytest.importorskip("kvckpt.integrations.ray")
ray = pytest.importorskip("ray")

from kvckpt.integrations.ray.channel import HEADER, ChannelServer, decode_reply, encode_reply  # noqa: E402
from kvckpt.integrations.ray.channel_link import ChannelGone, ChannelLink  # noqa: E402

from kvckpt import (  # noqa: E402
    AbandonedTimeline,
    BufferConfig,
    KvckptError,
    MalformedMessage,
    ProgressGap,
    ReplayBuffer,
    StaleAttempt,
)
from kvckpt.errors import ChannelError, CorruptRecord, UnknownGroup  # noqa: E402
from kvckpt.storage.progress_message import ProgressEncoder  # noqa: E402

pytestmark = pytest.mark.ray

CONFIG = {"group_size": 2, "schema": {"input_ids": ("int64", "token")}, "sampler": "ready_first",
          "max_buffered_rollouts": 64}
#: The module's Ray (``ray_local``, tests/conftest.py).
RAY_LOCAL = {"num_cpus": 2, "object_store_memory": 128 << 20, "namespace": "kvckpt-channel-test", "address": "local"}


def step(encoder: Any, lease: Any, start: int, second: int | None = None) -> bytes:
    """Both samples of one group, 3 tokens each, sample 0 from ``start``, sample 1 from ``second``
    (default ``start``): one engine step's message."""
    second = start if second is None else second
    tokens = np.arange(start, start + 6)
    return encoder.encode([lease, lease], [0, 1], [start, second], tokens, -tokens / 100, [0, 3, 6], versions=0).value


def answers(futures: list[Future[Any]], leases: list[Any]) -> list[Any]:
    """Each future's answer with errors as (class name, message), the leases' group ids named by position."""
    def shown(exc: BaseException) -> tuple[str, str]:
        text = str(exc)
        for n, lease in enumerate(leases):
            text = text.replace(lease["group_id"], f"<group {n}>")
        return type(exc).__name__, text

    out = []
    for future in futures:
        try:
            out.append([shown(r) if isinstance(r, BaseException) else r for r in future.result()])
        except KvckptError as exc:
            out.append(shown(exc))
    return out


def stats(actor: Any) -> dict[str, Any]:
    return ray.get(actor.stats.remote(), timeout=60)


def raw(info: dict[str, Any], token: str) -> socket.socket:
    """A connection to the channel that has shown ``token``."""
    sock = socket.create_connection((info["host"], info["port"]), timeout=60)
    sock.sendall(HEADER.pack(len(token), 0) + token.encode())
    return sock


def read_reply(sock: socket.socket) -> tuple[int, Any] | None:
    """One reply frame (sequence number, decoded answer), or ``None`` at the end of the stream."""
    data = b""
    while len(data) < HEADER.size:
        chunk = sock.recv(HEADER.size - len(data))
        if not chunk:
            return None
        data += chunk
    length, seq = HEADER.unpack(data)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return seq, decode_reply(body)


# -- through Ray -----------------------------------------------------------------------------------
def test_the_channel_answers_as_the_actor_calls_do(ray_local, tmp_path):
    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), CONFIG, name="same")
    leases = ray.get(actor.admit.remote(list(range(8))))
    encoder = ProgressEncoder.from_config(ray.get(actor.info.remote())["config"])

    def messages(ls: list[Any]) -> list[bytes]:
        return [step(encoder, ls[0], 0), step(encoder, ls[1], 0),
                step(encoder, ls[2], 5),  # a gap in both sequences
                b"not a message",  # MalformedMessage, the message as a whole
                step(encoder, ls[0], 3),  # continues the first
                step(encoder, ls[3], 0, 4)]  # sample 0 lands, sample 1 is refused alone

    with kray.BufferClient(actor, channel=True) as over_channel:
        assert over_channel.channel
        by_channel = [over_channel.record_progress_step(m) for m in messages(leases[:4])]
    with kray.BufferClient(actor) as over_calls:
        assert not over_calls.channel
        by_calls = [over_calls.record_progress_step(m) for m in messages(leases[4:])]
    got = answers(by_channel, leases[:4])
    assert got == answers(by_calls, leases[4:])
    assert got[0] == got[1] == [3, 3] and got[4] == [6, 6] and got[5][0] == 3
    assert [r[0] for r in got[2]] == ["ProgressGap"] * 2 and got[5][1][0] == "ProgressGap"
    assert got[3][0] == "MalformedMessage"
    with pytest.raises(MalformedMessage, match="bad magic"):
        by_channel[3].result()
    with pytest.raises(ProgressGap):
        raise by_channel[2].result()[0]
    counters = stats(actor)
    assert (counters["actor_channel_messages"], counters["actor_step_messages"]) == (6, 6)
    for lease_a, lease_b in zip(leases[:4], leases[4:], strict=True):  # the same prefixes stored both ways
        a, b = (kray.progress_from_dict(ray.get(actor.progress.remote(x["group_id"]))) for x in (lease_a, lease_b))
        assert {i: p.tokens.tolist() for i, p in a.items()} == {i: p.tokens.tolist() for i, p in b.items()}
    ray.get(actor.close.remote())
    ray.kill(actor)


def channel_actor(tmp_path: Any, name: str) -> tuple[Any, Any, ProgressEncoder, dict[str, Any]]:
    """A fresh actor with one prompt admitted: ``(actor, lease, encoder, its progress_channel())``."""
    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), CONFIG, name=name)
    [lease] = ray.get(actor.admit.remote([0]))
    encoder = ProgressEncoder.from_config(ray.get(actor.info.remote())["config"])
    return actor, lease, encoder, ray.get(actor.progress_channel.remote())


def test_a_wrong_token_is_closed_and_writes_nothing(ray_local, tmp_path):
    actor, lease, encoder, info = channel_actor(tmp_path, "token")
    message = step(encoder, lease, 0)
    wrong = "0" * len(info["token"]) if info["token"] != "0" * len(info["token"]) else "1" * len(info["token"])
    with raw(info, wrong) as sock:
        sock.sendall(HEADER.pack(len(message), 1) + message)
        assert read_reply(sock) is None  # closed, no answer
    assert stats(actor)["actor_channel_messages"] == 0
    assert ray.get(actor.progress.remote(lease["group_id"])) == {}
    with raw(info, info["token"]) as sock:  # the same frame with the token is recorded
        sock.sendall(HEADER.pack(len(message), 1) + message)
        assert read_reply(sock) == (1, [3, 3])
    ray.kill(actor)


def test_a_frame_past_the_limit_is_refused_and_its_connection_closed(ray_local, tmp_path):
    actor, lease, encoder, info = channel_actor(tmp_path, "oversized")
    with raw(info, info["token"]) as sock:
        good = step(encoder, lease, 0)
        sock.sendall(HEADER.pack(len(good), 1) + good + HEADER.pack(info["max_frame"] + 1, 2) + b"x" * 64)
        assert read_reply(sock) == (1, [3, 3])  # the frame before it is answered
        seq, refusal = read_reply(sock)
        assert seq == 2 and isinstance(refusal, ChannelError)
        assert f"longer than the channel's limit of {info['max_frame']} bytes" in str(refusal)
        assert read_reply(sock) is None
    assert stats(actor)["actor_channel_messages"] == 1
    # the client never sends one: refused at the edge, unsent
    client = kray.BufferClient(actor, channel=True)
    client._link.max_frame = 16
    with pytest.raises(ChannelError, match="nothing was sent"):
        client.record_progress_step(step(encoder, lease, 3)).result()
    ray.kill(actor)


def test_a_channel_future_completes_when_waited_on_and_record_progress_many_goes_over_the_channel(ray_local,
                                                                                                  tmp_path):
    actor, lease, encoder, _ = channel_actor(tmp_path, "drive")
    client = kray.BufferClient(actor, channel=True, max_in_flight=4)
    future = client.record_progress_step(step(encoder, lease, 0))
    assert future.result(timeout=60) == [3, 3]  # no flush: waiting reaps its reply (a hang fails the deadline)
    items = [{"lease": lease, "index": i, "start": 3, "tokens": [7, 8], "logprobs": [0.0, 0.0], "weight_version": 0}
             for i in range(2)]
    assert client.record_progress_many(items) == [5, 5]
    counters = stats(actor)
    assert (counters["actor_channel_messages"], counters["actor_step_messages"]) == (2, 0)
    client.close()
    ray.kill(actor)


COUNT = """
import json, sys
from kvckpt import ReplayBuffer
buffer = ReplayBuffer.open(sys.argv[1], readonly=True)
print(json.dumps({g: {i: p.tokens.tolist() for i, p in buffer.progress(g).items()} for g in sys.argv[2:]}))
"""


def test_a_killed_owner_with_frames_unanswered_gets_them_again_exactly_once(ray_local, tmp_path):
    path = str(tmp_path / "live.kv")
    actor = kray.start_buffer_actor(path, CONFIG, name="kill", max_restarts=1)
    leases = ray.get(actor.admit.remote(list(range(4))))
    first = ray.get(actor.info.remote())
    client = kray.BufferClient(actor, channel=True, max_in_flight=4, restart_timeout=120)
    encoder = client.progress_encoder()
    messages = [step(encoder, lease, 0) for lease in leases]
    acked = [client.record_progress_step(m) for m in messages[:2]]
    assert [f.result() for f in acked] == [[3, 3], [3, 3]]  # acknowledged before the kill
    os.kill(first["pid"], signal.SIGSTOP)  # the owner reads nothing more
    unanswered = [client.record_progress_step(m) for m in messages[2:]]  # sent, never read by this incarnation
    os.kill(first["pid"], signal.SIGKILL)
    client.flush()  # the broken connection: ask the restarted actor, resend both
    assert ray.get(actor.info.remote())["pid"] != first["pid"]
    resent = [f.result() for f in unanswered]
    assert all(isinstance(r, AbandonedTimeline) for results in resent for r in results), resent  # never landed
    assert stats(actor)["actor_channel_messages"] == 2  # the resends came over the new incarnation's channel

    # a frame that landed and whose answer was lost is resent and answered as its first try
    [fresh] = ray.get(actor.admit.remote([4]))
    landed = client.record_progress_step(step(encoder, fresh, 0))
    until(lambda: stats(actor)["actor_channel_messages"] == 3, "the frame was never recorded")
    client._link.close()  # the connection breaks with the answer unread
    assert landed.result() == [3, 3]
    assert stats(actor)["actor_channel_messages"] == 4  # recorded twice, stored once (counted below)

    # every message again, on a new connection: the first answers, sequence by sequence
    with kray.BufferClient(actor, channel=True) as again:
        repeat = [again.record_progress_step(m) for m in [*messages, step(encoder, fresh, 0)]]
    assert [r.result() for r in repeat[:2]] == [[3, 3], [3, 3]] and repeat[4].result() == [3, 3]
    assert all(isinstance(r, StaleAttempt) for f in repeat[2:4] for r in f.result())
    ray.get(actor.close.remote())
    ray.kill(actor)

    gids = [lease["group_id"] for lease in [*leases, fresh]]
    out = subprocess.run([sys.executable, "-c", COUNT, path, *gids], check=True, capture_output=True, text=True)
    stored = json.loads(out.stdout)
    want = {"0": [0, 1, 2], "1": [3, 4, 5]}
    assert [stored[g] for g in gids] == [want, want, {}, {}, want]  # acknowledged once, nothing doubled


def test_a_replicated_actor_offers_no_channel_and_the_client_uses_actor_calls(ray_local, tmp_path):
    standby = kray.start_standby_actor(str(tmp_path / "standby.kv"), name="fallback-standby")
    primary = kray.start_buffer_actor(str(tmp_path / "primary.kv"), CONFIG, name="fallback",
                                      replication={"standby": "fallback-standby"})
    [lease] = ray.get(primary.admit.remote([0]), timeout=60)
    assert ray.get(primary.progress_channel.remote()) is None
    assert ray.get(standby.progress_channel.remote()) is None
    with kray.BufferClient(primary, channel=True) as client:
        assert not client.channel
        future = client.record_progress_step(step(client.progress_encoder(), lease, 0))
    assert future.result() == [3, 3]
    counters = stats(primary)
    assert (counters["actor_step_messages"], counters["actor_channel_messages"]) == (1, 0)
    ray.get(primary.close.remote())
    ray.get(standby.close.remote())
    for actor in (primary, standby):
        ray.kill(actor)


def test_a_promoted_standby_without_a_successor_offers_a_channel(ray_local, tmp_path):
    standby = kray.start_standby_actor(str(tmp_path / "standby.kv"), name="promoted-standby")
    primary = kray.start_buffer_actor(str(tmp_path / "primary.kv"), CONFIG, name="promoted",
                                      replication={"standby": "promoted-standby"})
    [lease] = ray.get(primary.admit.remote([0]), timeout=60)  # answered once the standby applied it
    assert ray.get(standby.progress_channel.remote()) is None  # a standby: none
    ray.get(standby.promote.remote(), timeout=60)
    with kray.BufferClient(standby, channel=True) as client:  # a primary that ships nowhere: offered
        assert client.channel
        future = client.record_progress_step(step(client.progress_encoder(), lease, 0))
    assert isinstance(future.result()[0], StaleAttempt)  # the promotion's recovery fenced the lease
    assert stats(standby)["actor_channel_messages"] == 1
    for actor in (primary, standby):
        ray.kill(actor)


def test_a_restore_closes_the_channel_and_the_next_has_a_new_token(ray_local, tmp_path):
    actor = kray.start_buffer_actor(str(tmp_path / "live.kv"), CONFIG, name="restore")
    [lease] = ray.get(actor.admit.remote([0]))
    encoder = ProgressEncoder.from_config(ray.get(actor.info.remote())["config"])
    ray.get(actor.checkpoint.remote(str(tmp_path / "ckpt.kv")))
    before = ray.get(actor.progress_channel.remote())
    old = raw(before, before["token"])
    ray.get(actor.restore.remote(str(tmp_path / "ckpt.kv")))
    message = step(encoder, lease, 0)
    try:
        old.sendall(HEADER.pack(len(message), 1) + message)
        assert read_reply(old) is None  # the old connection is closed: nothing answered
    except ConnectionError:
        pass
    old.close()
    after = ray.get(actor.progress_channel.remote())
    assert after["token"] != before["token"]
    assert stats(actor)["actor_channel_messages"] == 0
    assert ray.get(actor.progress.remote(lease["group_id"])) == {}
    ray.kill(actor)


# -- the framing and the fallback, on a real buffer in this process ---------------------------------
@pytest.fixture
def served(tmp_path):
    buffer = ReplayBuffer.create(str(tmp_path / "local.kv"), BufferConfig.from_dict(CONFIG))
    server = ChannelServer(buffer.record_progress_steps, "127.0.0.1")
    yield buffer, server
    server.close()
    buffer.close()


def test_every_kvckpt_error_crosses_the_reply_wire_as_its_own_class():
    sent = [3, ProgressGap("a gap"), UnknownGroup("no such group"), CorruptRecord("k", "bad"), 7]
    back = decode_reply(encode_reply(sent))
    assert [type(r) for r in back] == [type(r) for r in sent] and [str(r) for r in back] == [str(r) for r in sent]
    whole = decode_reply(encode_reply(MalformedMessage("bad magic")))
    assert type(whole) is MalformedMessage and str(whole) == "bad magic"
    foreign = decode_reply(encode_reply(RuntimeError("boom")))
    assert type(foreign) is KvckptError and str(foreign) == "RuntimeError: boom"
    with pytest.raises(ChannelError, match="malformed"):
        decode_reply(encode_reply([1, 2])[:-1])


def test_one_round_records_every_connections_frames_in_one_call(served):
    buffer, server = served
    leases = buffer.admit([0, 1])
    encoder = buffer.progress_encoder()
    one, two = raw(server.info(), server.token), raw(server.info(), server.token)
    with one, two:
        calls = []
        record = server._record
        server._record = lambda messages: calls.append(len(messages)) or record(messages)
        payload = [step(encoder, leases[0], 0), step(encoder, leases[0], 3)]
        one.sendall(b"".join(HEADER.pack(len(m), n) + m for n, m in enumerate(payload, 1)))
        assert [read_reply(one), read_reply(one)] == [(1, [3, 3]), (2, [6, 6])]
        two.sendall(HEADER.pack(len(payload[0]), 9) + payload[0])  # a resend from another connection
        assert read_reply(two) == (9, [3, 3])
    assert calls == [2, 1] and (server.messages, server.rounds) == (3, 2)  # one sendall's two frames: one round


def test_a_link_whose_actor_stops_offering_the_channel_hands_back_what_is_unanswered(served):
    buffer, server = served
    [lease] = buffer.admit([0])
    encoder = buffer.progress_encoder()
    offers = [server.info()]
    link = ChannelLink(lambda: offers.pop() if offers else None, max_in_flight=4, retries=2, timeout=60)
    answered: Future[Any] = Future()
    link.send(step(encoder, lease, 0), answered)
    link.flush()
    assert answered.result() == [3, 3]
    server.close()  # the actor replaced (a failover to a replicated primary): no channel offered
    message, left = step(encoder, lease, 3), Future()
    with pytest.raises(ChannelGone) as gone:
        link.send(message, left)
        link.flush()
    assert [(m, f) for m, f in gone.value.unanswered] == [(message, left)] and not left.done()
    assert buffer.record_progress_step(message) == [6, 6]  # what the caller then resends lands
