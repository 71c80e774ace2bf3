"""The direct progress channel (issue 45): producers' step messages into the buffer actor's process
over one TCP connection each, not one Ray actor call each.

An async Ray actor call costs its owner 0.5-0.75 ms of CPU before the method does any work, so one
call per engine step cannot keep the owner under half a core at the fleet's rate. The channel costs
the owner a socket read plus kvckpt's own work per message. It is offered by the actor
(:meth:`BufferActor.progress_channel <kvckpt.integrations.ray.actor.BufferActor.progress_channel>`)
only where a write needs no replication (docs/ray.md, "The direct progress channel").

The wire, every integer little-endian, no pickle:

* a frame is a 12-byte header (``<IQ``: body length, sequence number) and the body;
* the client's first frame is the hello: its body is the incarnation's token (sequence number 0).
  A wrong token (compared in constant time) closes the connection; nothing is written;
* each later client frame's body is one :class:`~kvckpt.ProgressMessage`'s bytes, its sequence number
  the client's;
* each server frame answers one client frame, same sequence number, in the order they came: the
  per-sequence results (:func:`encode_reply`; errors by class name and message, rebuilt by
  :func:`kvckpt.errors.error_from_wire`), or one error for the message as a whole
  (:class:`~kvckpt.MalformedMessage`; :class:`~kvckpt.errors.ChannelError` for a frame past
  ``max_frame``, after which the server closes the connection).

:class:`ChannelServer` is one thread (``selectors``): each round it reads what every connection sent,
records all complete frames of the round in ONE :meth:`kvckpt.ReplayBuffer.record_progress_steps`
(one durable transaction), then writes the replies; memory is bounded per connection (one frame
below ``max_frame``, one read, :data:`MAX_OUTBOX` of replies) and in connections. A producer's side
is :class:`~kvckpt.integrations.ray.channel_link.ChannelLink`: frames in order, up to
``max_in_flight`` unanswered, and after a broken connection a fresh ask of the actor (a Ray call,
which waits for a restart) and a resend of every unanswered frame in order; a step message's resend
is answered as its first try was (:mod:`kvckpt.transitions.progress_step`), so each message lands
exactly once.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvckpt.errors import ChannelError, KvckptError, error_from_wire, error_to_wire

_LOG = logging.getLogger(__name__)
#: A frame's header: body length, sequence number.
HEADER = struct.Struct("<IQ")
#: The longest frame body the server accepts (a step message of 8 sequences of 2 KB is about 17 KB).
MAX_FRAME_BYTES = 64 << 20
#: The longest hello body (the token is 32 characters).
MAX_HELLO_BYTES = 64
#: Bytes one read of one connection takes per round.
READ_BYTES = 256 << 10
#: Reply bytes the server holds for a connection that does not read them; past it the connection is closed.
MAX_OUTBOX = 4 << 20
#: Connections the server holds at once; one more is closed at once.
MAX_CONNECTIONS = 1024
_RESULTS, _ERROR = 0, 1
_INT, _ERR = struct.Struct("<Bq"), struct.Struct("<BHI")


# -- replies ---------------------------------------------------------------------------------------
def encode_reply(result: Sequence[int | BaseException] | BaseException) -> bytes:
    """One message's answer as bytes: a list of per-sequence ends or errors, or one error."""
    if isinstance(result, BaseException):
        return bytes([_ERROR]) + _error(result)
    parts = [bytes([_RESULTS]), struct.pack("<I", len(result))]
    for one in result:
        parts.append(_error(one) if isinstance(one, BaseException) else _INT.pack(0, int(one)))
    return b"".join(parts)


def _error(exc: BaseException) -> bytes:
    name, message = (s.encode() for s in error_to_wire(exc))
    return _ERR.pack(1, len(name), len(message)) + name + message


def decode_reply(body: bytes) -> list[int | KvckptError] | KvckptError:
    """The answer :func:`encode_reply` encoded, errors rebuilt as their kvckpt classes.

    Raises:
        ChannelError: the bytes are not a reply (truncated, an unknown tag, bytes left over).
    """
    try:
        view = memoryview(body)
        if view[0] == _ERROR:
            exc, end = _read_error(view, 1)
            out: list[int | KvckptError] | KvckptError = exc
        else:
            [count], end, out = struct.unpack_from("<I", view, 1), 5, []
            for _ in range(count):
                if view[end] == 0:
                    out.append(_INT.unpack_from(view, end)[1])
                    end += _INT.size
                else:
                    exc, end = _read_error(view, end)
                    out.append(exc)
        if end != len(view):
            raise ValueError(f"{len(view) - end} bytes left over")
        return out
    except (IndexError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ChannelError(f"the progress channel's reply is malformed ({exc}); the server is not kvckpt's "
                           "or the bytes were damaged") from None


def _read_error(view: memoryview, at: int) -> tuple[KvckptError, int]:
    tag, n_name, n_message = _ERR.unpack_from(view, at)
    if tag != 1:
        raise ValueError(f"unknown tag {tag}")
    at += _ERR.size
    name, message = bytes(view[at:at + n_name]).decode(), bytes(view[at + n_name:at + n_name + n_message]).decode()
    if at + n_name + n_message > len(view):
        raise ValueError("truncated error")
    return error_from_wire(name, message), at + n_name + n_message


# -- the server (in the actor's process) -----------------------------------------------------------
@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    hello: bool = False  # the token was shown
    closing: bool = False  # refused: flush the outbox, then close
    events: int = selectors.EVENT_READ


class ChannelServer:
    """The channel's one server thread in the buffer actor's process (see the module docstring).

    Args:
        record: records step messages in one durable transaction and returns per message its
            per-sequence results or the error that refused it whole
            (:meth:`kvckpt.ReplayBuffer.record_progress_steps`).
        host: the address to listen on (the node's IP as Ray knows it; loopback in tests).
        max_frame: the longest message accepted, in bytes. Defaults to :data:`MAX_FRAME_BYTES`.

    Attributes:
        token: this server's secret (a new one per server: per actor incarnation, restore, promotion).
        rounds, messages: record calls made and the messages they carried.
    """

    def __init__(self, record: Callable[[list[bytes]], list[Any]], host: str, *,
                 max_frame: int = MAX_FRAME_BYTES) -> None:
        self._record, self.max_frame = record, max_frame
        self.token = secrets.token_hex(16)
        self.rounds = self.messages = 0
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listener")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: set[_Conn] = set()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="kvckpt-progress-channel", daemon=True)
        self._thread.start()

    def info(self) -> dict[str, Any]:
        """What a client needs to connect: ``host``, ``port``, ``token``, ``max_frame``."""
        return {"host": self.host, "port": self.port, "token": self.token, "max_frame": self.max_frame}

    def close(self) -> None:
        """Stop: the round running finishes (its transaction and replies), then every connection and
        the listener are closed; frames not yet recorded are dropped unanswered (their clients resend).
        Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._wake_w.send(b"x")
        self._thread.join()
        for conn in list(self._conns):
            self._drop(conn)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    @property
    def alive(self) -> bool:
        """Whether the server thread still serves (not closed, not stopped by a bug)."""
        return not self._closing and self._thread.is_alive()

    def _serve(self) -> None:
        try:
            self._rounds()
        except Exception:  # a bug: logged; every connection closes, the actor starts a new server when asked
            _LOG.exception("the progress channel's server stopped")
            for conn in list(self._conns):
                self._drop(conn)

    def _rounds(self) -> None:
        while not self._closing:
            frames: list[tuple[_Conn, int, bytes]] = []
            refused: list[tuple[_Conn, int, KvckptError]] = []
            for key, mask in self._sel.select():
                if key.data == "listener":
                    self._accept()
                elif key.data == "wake":
                    self._wake_r.recv(64)
                else:
                    if mask & selectors.EVENT_READ:
                        self._read(key.data, frames, refused)
                    if mask & selectors.EVENT_WRITE and key.data in self._conns:
                        self._flush(key.data)
            if frames and not self._closing:
                self._round(frames)
            for conn, seq, exc in refused:  # after the answers to the frames before the refused one
                self._refuse(conn, seq, exc)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            if len(self._conns) >= MAX_CONNECTIONS:
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn, frames: list[tuple[_Conn, int, bytes]],
              refused: list[tuple[_Conn, int, KvckptError]]) -> None:
        """Take what ``conn`` sent; append its complete message frames to ``frames``, and a frame past
        the limit to ``refused`` (nothing more is read from ``conn``)."""
        try:
            data = conn.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        inbox = conn.inbox
        inbox += data
        at = 0
        while len(inbox) - at >= HEADER.size:
            length, seq = HEADER.unpack_from(inbox, at)
            limit = self.max_frame if conn.hello else MAX_HELLO_BYTES
            if length > limit:
                if not conn.hello:  # not a client of this incarnation: nothing is answered
                    self._drop(conn)
                    return
                refused.append((conn, seq, ChannelError(
                    f"a progress channel frame of {length} bytes is longer than the channel's limit of {limit} "
                    "bytes; the connection is closed, nothing of the frame was written")))
                conn.inbox.clear()  # refused at this round's end (closing: read no more)
                return
            if len(inbox) - at < HEADER.size + length:
                break
            body = bytes(inbox[at + HEADER.size:at + HEADER.size + length])
            at += HEADER.size + length
            if conn.hello:
                frames.append((conn, seq, body))
            elif hmac.compare_digest(body, self.token.encode()):
                conn.hello = True
            else:  # a wrong token (a stale incarnation's, or none): closed, nothing written
                self._drop(conn)
                return
        del inbox[:at]

    def _round(self, frames: list[tuple[_Conn, int, bytes]]) -> None:
        """All complete frames of this round in one record call, then each one's reply."""
        try:
            results = self._record([body for _, _, body in frames])
        except Exception as exc:  # the store as a whole (closed, disk full): every message of the round
            results = [exc] * len(frames)
        self.rounds += 1
        self.messages += len(frames)
        for (conn, seq, _), result in zip(frames, results, strict=True):
            if conn in self._conns:
                reply = encode_reply(result)
                conn.outbox += HEADER.pack(len(reply), seq) + reply
        for conn in {conn for conn, _, _ in frames}:
            if conn in self._conns:
                self._flush(conn)

    def _refuse(self, conn: _Conn, seq: int, exc: KvckptError) -> None:
        """Answer ``seq`` with ``exc``, read nothing more from ``conn`` and close it once the answer is out."""
        if conn not in self._conns:
            return
        reply = encode_reply(exc)
        conn.outbox += HEADER.pack(len(reply), seq) + reply
        conn.closing = True
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbox) if conn.outbox else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(conn)
            return
        del conn.outbox[:sent]
        if len(conn.outbox) > MAX_OUTBOX or (conn.closing and not conn.outbox):
            self._drop(conn)  # a client that does not read its replies, or a refused one answered
            return
        events = (0 if conn.closing else selectors.EVENT_READ) | (selectors.EVENT_WRITE if conn.outbox else 0)
        if events != conn.events:
            self._sel.modify(conn.sock, events, conn)
            conn.events = events

    def _drop(self, conn: _Conn) -> None:
        if conn in self._conns:
            self._conns.discard(conn)
            self._sel.unregister(conn.sock)
            conn.sock.close()
