"""The ZeroMQ boundary between the actor's token stream and the reward scorer.

Owns: msgpack framing of the wire messages (``engine.wire``, re-exported here; msgspec
Structs in one tagged union, never pickle), :func:`validate_endpoint` (local only:
``ipc://`` or loopback ``tcp://``), PUSH :class:`Sender` / PULL :class:`Receiver` and
their asyncio twins (sndhwm for back-pressure; frames over ``max_frame_bytes`` refused by
the sender and, via ``zmq.MAXMSGSIZE``, by the receiver; malformed frames counted, never
raised). Sockets close with linger 0; every side is a (sync and async) context manager.

A frame over the receiver's limit never reaches Python: libzmq drops the connection it came
on (with anything queued behind it; a connecting sender reconnects). The receiver counts
dropped connections in ``stats.disconnects``; its peer's own size check is the clear error.

Leaves out: what is scored and when (the reward feeder), message content semantics beyond
shape (indices, step numbers), authentication (local endpoints only).
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .errors import EngineConfigError, EngineError
from .wire import (  # re-exported: the channel's vocabulary
    MESSAGE_TYPES, Heartbeat, Message, Reorderer, ScoreError, ScoreResult, Shutdown, TokenChunk)

__all__ = [
    "MESSAGE_TYPES", "AsyncReceiver", "AsyncSender", "ChannelFullError", "ChannelStats",
    "FrameTooLargeError", "Heartbeat", "Message", "Receiver", "Reorderer", "ScoreError", "ScoreResult",
    "Sender", "Shutdown", "TokenChunk", "validate_endpoint",
]

DEFAULT_MAX_FRAME_BYTES = 1 << 20


class ChannelFullError(EngineError):
    """The peer is not draining the channel (send high-water mark reached)."""


class FrameTooLargeError(EngineError):
    """A message encodes to more bytes than the channel's ``max_frame_bytes``."""


_LOOPBACK_TCP = re.compile(r"tcp://(127\.0\.0\.1|localhost|\[::1\]):(\*|[0-9]{1,5})")
_IPC_PATH_MAX = 107  # sun_path is 108 bytes with its terminating NUL


def validate_endpoint(endpoint: Any, field: str = "channel endpoint") -> str:
    """``endpoint`` if it is ``ipc://<path>`` or ``tcp://{127.0.0.1|localhost|[::1]}:<port>``
    (port ``*``: any free one, bind only); else a one-line :class:`EngineConfigError`."""
    ep = endpoint if isinstance(endpoint, str) else ""
    if ep.startswith("ipc://") and len(ep) > len("ipc://"):
        if len(ep[6:].encode()) > _IPC_PATH_MAX:
            raise EngineConfigError(f"{field}: ipc path of {endpoint!r} is longer than "
                              f"{_IPC_PATH_MAX} bytes; use a shorter path")
        return ep
    m = _LOOPBACK_TCP.fullmatch(ep)
    if m and (m[2] == "*" or 1 <= int(m[2]) <= 65535):
        return ep
    raise EngineConfigError(f"{field}: {endpoint!r} is not a local endpoint; use ipc://<path> or "
                      "tcp://127.0.0.1:<port> (or localhost, [::1]); the channel never "
                      "listens beyond this machine")


def _open(ctx: zmq.Context, kind: int, endpoint: str, bind: bool, opts: dict[int, int]):
    endpoint = validate_endpoint(endpoint)
    if not bind and endpoint.endswith(":*"):
        raise EngineConfigError(f"channel endpoint: {endpoint!r}: port '*' can only bind; "
                          "a connecting side needs the bound port")
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if "[::1]" in endpoint or "localhost" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    for opt, value in opts.items():
        sock.setsockopt(opt, value)
    try:
        (sock.bind if bind else sock.connect)(endpoint)
    except zmq.ZMQError as exc:
        sock.close(0)
        verb = "bind" if bind else "connect"
        raise EngineConfigError(f"channel endpoint: cannot {verb} {endpoint!r}: {exc}") from None
    return sock


@dataclasses.dataclass
class ChannelStats:
    """What a receiver refused or lost; reported in step metrics."""

    received: int = 0
    malformed: int = 0  # frames that are not exactly one valid message
    disconnects: int = 0  # peer connections dropped, incl. for a frame over max_frame_bytes
    last_error: str | None = None


class _Endpoint:
    """The socket, its context (owned unless given) and, for receivers, a monitor."""

    def __init__(self, kind, endpoint, bind, opts, context, context_cls, monitor):
        self.own_ctx = context is None
        self.ctx = context if context is not None else context_cls()
        try:
            self.sock = _open(self.ctx, kind, endpoint, bind, opts)
        except EngineError:
            if self.own_ctx:
                self.ctx.term()
            raise
        self.monitor = None
        if monitor:
            addr = f"inproc://colocate-channel-monitor-{uuid.uuid4().hex}"
            self.sock.monitor(addr, zmq.EVENT_DISCONNECTED)
            self.monitor = zmq.Socket(self.ctx, zmq.PAIR)  # plain socket, polled non-blocking
            self.monitor.connect(addr)

    @property
    def address(self) -> str:
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def disconnects(self) -> int:
        count = 0
        while self.monitor is not None:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            count += event["event"] == zmq.EVENT_DISCONNECTED
        return count

    def close(self) -> None:
        if self.sock.closed:
            return
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(0)
        if self.own_ctx:
            self.ctx.term()


def _frame(encoder: msgspec.msgpack.Encoder, msg: Message, limit: int) -> bytes:
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"channel: cannot send {type(msg).__name__}; expected one of "
                        f"{[t.__name__ for t in MESSAGE_TYPES]}")
    data = encoder.encode(msg)
    if len(data) > limit:
        raise FrameTooLargeError(f"channel: {type(msg).__name__} encodes to {len(data)} "
                                 f"bytes > max_frame_bytes {limit}; send smaller chunks")
    return data


def _full(endpoint: str, hwm: int, timeout_s: float) -> ChannelFullError:
    return ChannelFullError(f"channel to {endpoint}: not drained within {timeout_s} s "
                            f"(sndhwm={hwm} messages queued); the scorer is not keeping up")


def _accept(decoder: msgspec.msgpack.Decoder, frames: list[bytes], stats: ChannelStats):
    """The message in ``frames``, or None (counted) when they are not one valid message."""
    try:
        if len(frames) != 1:
            raise msgspec.DecodeError(f"expected 1 frame, got {len(frames)}")
        msg = decoder.decode(frames[0])
    except msgspec.DecodeError as exc:  # ValidationError included
        stats.malformed += 1
        stats.last_error = str(exc)[:200]
        return None
    stats.received += 1
    return msg


def _ms_left(deadline: float | None) -> int | None:
    return None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))


class _Side:
    """What both ends share: the endpoint, close, sync and async context managers."""

    _end: _Endpoint

    @property
    def endpoint(self) -> str:
        """The bound or connected address (a ``*`` port resolved)."""
        return self._end.address

    def close(self) -> None:
        self._end.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class _PushSide(_Side):
    _context_cls: type = zmq.Context

    def __init__(self, endpoint: str, *, bind: bool = False, sndhwm: int = 1000,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, context=None):
        self.sndhwm, self.max_frame_bytes, self.sent = sndhwm, max_frame_bytes, 0
        self._enc = msgspec.msgpack.Encoder()
        self._end = _Endpoint(zmq.PUSH, endpoint, bind, {zmq.SNDHWM: sndhwm}, context,
                              self._context_cls, monitor=False)


class _PullSide(_Side):
    _context_cls: type = zmq.Context

    def __init__(self, endpoint: str, *, bind: bool = True, rcvhwm: int = 1000,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, context=None):
        self.max_frame_bytes, self.stats = max_frame_bytes, ChannelStats()
        self._dec = msgspec.msgpack.Decoder(Message)
        opts = {zmq.RCVHWM: rcvhwm, zmq.MAXMSGSIZE: max_frame_bytes}
        self._end = _Endpoint(zmq.PULL, endpoint, bind, opts, context, self._context_cls,
                              monitor=True)


class Sender(_PushSide):
    """PUSH side (connects by default). ``send(msg, timeout_s)``: None blocks while the
    peer is full; a number waits at most that long (0: not at all), then raises
    :class:`ChannelFullError`."""

    def send(self, msg: Message, timeout_s: float | None = None) -> None:
        data = _frame(self._enc, msg, self.max_frame_bytes)
        sock = self._end.sock
        if timeout_s is None:
            sock.send(data)
        elif not sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
            raise _full(self.endpoint, self.sndhwm, timeout_s)
        else:
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.Again:  # filled again between the poll and the send
                raise _full(self.endpoint, self.sndhwm, timeout_s) from None
        self.sent += 1


class AsyncSender(_PushSide):
    """:class:`Sender` on ``zmq.asyncio``: ``await send(msg, timeout_s)``."""

    _context_cls = zmq.asyncio.Context

    async def send(self, msg: Message, timeout_s: float | None = None) -> None:
        data = _frame(self._enc, msg, self.max_frame_bytes)
        wait = None if timeout_s is None else int(timeout_s * 1000)
        if not await self._end.sock.poll(wait, zmq.POLLOUT):
            raise _full(self.endpoint, self.sndhwm, timeout_s)
        await self._end.sock.send(data)
        self.sent += 1


class Receiver(_PullSide):
    """PULL side (binds by default). ``recv(timeout_s)`` returns the next valid message,
    or None when none came in time (None: wait forever); refused frames are counted in
    ``stats``, never raised."""

    def recv(self, timeout_s: float | None = None) -> Message | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sock = self._end.sock
        try:
            while sock.poll(_ms_left(deadline), zmq.POLLIN):
                msg = _accept(self._dec, sock.recv_multipart(zmq.NOBLOCK), self.stats)
                if msg is not None:
                    return msg
            return None
        finally:
            self.stats.disconnects += self._end.disconnects()


class AsyncReceiver(_PullSide):
    """:class:`Receiver` on ``zmq.asyncio``: ``await recv(timeout_s)``."""

    _context_cls = zmq.asyncio.Context

    async def recv(self, timeout_s: float | None = None) -> Message | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sock = self._end.sock
        try:
            while await sock.poll(_ms_left(deadline), zmq.POLLIN):
                msg = _accept(self._dec, await sock.recv_multipart(), self.stats)
                if msg is not None:
                    return msg
            return None
        finally:
            self.stats.disconnects += self._end.disconnects()
