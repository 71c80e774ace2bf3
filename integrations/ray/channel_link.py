"""A producer's side of the direct progress channel (:mod:`kvckpt.integrations.ray.channel`): one
connection, frames in order, up to ``max_in_flight`` unanswered, and after a broken connection a
fresh ask of the actor and a resend of every unanswered frame in order (exactly once: a step
message's resend is answered as its first try). :class:`~kvckpt.integrations.ray.BufferClient`
uses it with ``channel=True``."""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from kvckpt.integrations.ray.channel import HEADER, MAX_FRAME_BYTES, decode_reply

from kvckpt.errors import ChannelError


class ChannelGone(Exception):
    """The actor no longer offers a channel (``ask`` returned ``None``); ``unanswered`` holds the
    frames not answered, in order, as ``(message, future)``, for the actor-call path to resend."""

    def __init__(self, unanswered: list[tuple[bytes, Future[Any]]]) -> None:
        super().__init__(f"{len(unanswered)} progress messages to resend through actor calls")
        self.unanswered = unanswered


class ChannelLink:
    """One producer's connection to the channel: frames in order, up to ``max_in_flight`` unanswered.

    Args:
        ask: returns the actor's :meth:`~kvckpt.integrations.ray.actor.BufferActor.progress_channel`
            (``None``: not offered); called at the start and after every broken connection, it waits
            for a restarted actor (a Ray call), and raises if the actor is gone for good.
        max_in_flight: frames sent and not yet answered, at most.
        retries: reconnections in a row without an answer in between before every unanswered
            future fails.
        timeout: seconds a reply may take before the connection counts as broken (a resend is
            answered as the first try, so this costs time, never correctness).

    Raises (from the constructor, :meth:`send`, :meth:`reap`, :meth:`drive`, :meth:`flush`):
        ChannelGone: the actor stopped offering the channel; the caller resends what it holds.
    """

    def __init__(self, ask: Callable[[], Mapping[str, Any] | None], *, max_in_flight: int = 4, retries: int = 3,
                 timeout: float = 60.0) -> None:
        self._ask, self.max_in_flight, self.retries, self.timeout = ask, max_in_flight, retries, timeout
        self._unanswered: deque[tuple[int, bytes, Future[Any]]] = deque()
        self._next_seq = 1
        self._sock: socket.socket | None = None
        self.max_frame = MAX_FRAME_BYTES
        self._attempts = 0  # reconnections since the last answer
        self._connect()

    @property
    def outstanding(self) -> int:
        """Frames sent and not yet answered."""
        return len(self._unanswered)

    def holds(self, future: Future[Any]) -> bool:
        """Whether ``future`` is one of this link's unanswered frames."""
        return any(f is future for _, _, f in self._unanswered)

    def send(self, message: bytes, future: Future[Any]) -> None:
        """Send one step message (after reaping the oldest reply while ``max_in_flight`` are out);
        ``future`` gets its answer. A message over the channel's ``max_frame`` fails its future with
        :class:`~kvckpt.errors.ChannelError` at once, unsent."""
        if len(message) > self.max_frame:
            future.set_exception(ChannelError(f"a progress message of {len(message)} bytes is longer than the "
                                              f"channel's limit of {self.max_frame} bytes; nothing was sent"))
            return
        try:
            while len(self._unanswered) >= self.max_in_flight:
                self.reap()
        except ChannelGone as gone:  # this message goes with the unanswered ones, after them
            gone.unanswered.append((message, future))
            raise
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._unanswered.append((seq, message, future))
        try:
            self._write([(seq, message)])
        except OSError as exc:
            self._recover(exc)

    def drive(self, future: Future[Any]) -> None:
        """Reap replies until ``future`` is answered (or failed)."""
        while not future.done() and self._unanswered:
            self.reap()

    def flush(self) -> None:
        """Reap until every frame sent is answered."""
        while self._unanswered:
            self.reap()

    def reap(self) -> None:
        """Read one reply and complete its future (the oldest unanswered frame's)."""
        try:
            length, seq = HEADER.unpack(self._recv(HEADER.size))
            body = self._recv(length)
        except OSError as exc:
            self._recover(exc)
            return
        if not self._unanswered or self._unanswered[0][0] != seq:  # replies come in frame order, or not kvckpt's
            self._recover(ChannelError(f"the progress channel answered frame {seq}, not the oldest unanswered"))
            return
        self._attempts = 0
        _, _, future = self._unanswered.popleft()
        try:
            result = decode_reply(body)
        except ChannelError as exc:
            result = exc
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def close(self) -> None:
        """Close the connection (unanswered frames stay unanswered: :meth:`flush` first)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- internals -------------------------------------------------------------------------------
    def _connect(self) -> None:
        """Ask the actor for its channel and connect; ``ChannelGone`` when it offers none."""
        self.close()
        info = self._ask()
        if info is None:
            raise ChannelGone([(m, f) for _, m, f in self._unanswered])
        self.max_frame = int(info["max_frame"])
        sock = socket.create_connection((info["host"], int(info["port"])), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        token = str(info["token"]).encode()
        sock.sendall(HEADER.pack(len(token), 0) + token)

    def _write(self, frames: list[tuple[int, bytes]]) -> None:
        if self._sock is None:
            raise ConnectionError("the progress channel is not connected")
        self._sock.sendall(b"".join(HEADER.pack(len(m), seq) + m for seq, m in frames))

    def _recv(self, n: int) -> bytes:
        if self._sock is None:
            raise ConnectionError("the progress channel is not connected")
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the buffer actor closed the progress channel")
            buf += chunk
        return bytes(buf)

    def _recover(self, exc: BaseException) -> None:
        """After a broken connection: ask the actor again (waits for a restart), reconnect and resend
        every unanswered frame in order; past ``retries`` reconnections without an answer, fail them."""
        while True:
            self.close()
            if self._attempts >= self.retries:
                self._fail(ChannelError(f"the progress channel broke ({exc!r}) and {self.retries} reconnections "
                                        "brought no answer; the unanswered messages may or may not have landed "
                                        "(resend them: a resend is answered as the first try)"))
                return
            self._attempts += 1
            try:
                self._connect()
                self._write([(seq, m) for seq, m, _ in self._unanswered])
                return
            except ChannelGone:
                raise
            except OSError as again:
                exc = again
            except Exception as gone:  # the actor is gone for good (the ask's Ray error)
                self._fail(gone)
                return

    def _fail(self, exc: BaseException) -> None:
        while self._unanswered:
            self._unanswered.popleft()[2].set_exception(exc)
