"""Typed ZeroMQ sockets: each owns one msgspec encoder and one decoder for its message union.

The one ZeroMQ wrapper set of the control plane (the tensor plane has `zmq_tensor` and
`ucx_channel`):

- `TypedSocket`: any socket type (PULL for commands and KV ingress, PUB/SUB for load reports,
  ROUTER/DEALER for request/response). `recv_nowait` decodes straight into the union, for poll
  loops that drain their sockets; `recv` waits (in zmq poll, never a sleep) up to a timeout. A
  malformed or unknown message is logged and dropped, and the socket keeps working.
  NOTE: a zmq socket is not thread safe: each one belongs to one thread.
- Tensor messages are `[envelope, frame, frame, ...]`: the envelope is the msgspec header plus
  tensor specs (`tensor_frames`), each frame a tensor's raw bytes, sent zero-copy (pyzmq keeps a
  reference to each buffer until libzmq has sent it).
- `PushPool`: one PUSH socket per destination endpoint, connected on first use, closed (its queue
  with it) when its owner learns the peer is gone (`drop`).
- Every socket of a mesh is a CURVE server (binds) or client (connects) with the mesh's keys
  (`zmq_auth.CurveKeys`): `auth=None` is plain ZeroMQ, for benches and tests of the sockets alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec
import structlog
import zmq

from common.transport.zmq_auth import CurveKeys

if TYPE_CHECKING:
    import torch

    from common.transport.tensor_frames import EnvelopeCodec

log = structlog.get_logger(__name__)

HeaderT = TypeVar("HeaderT")  # the message type a socket carries (tensor_frames' envelopes too)


class TypedSocket(Generic[HeaderT]):
    """A ZeroMQ socket that sends and receives one msgspec union type (optionally + tensors)."""

    def __init__(self, sock: zmq.Socket, message_type: Any) -> None:
        self.sock = sock
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(message_type)
        self._message_type = message_type
        self._codec: EnvelopeCodec[HeaderT] | None = None  # at the first tensor message

    def _tensor_codec(self) -> EnvelopeCodec[HeaderT]:
        """The tensor envelope's codec, made at this socket's first tensor message. Tensors are
        the tensor plane's: the modules that carry them (and torch) are imported then, so that a
        process whose sockets carry messages alone (the Router) never imports torch."""
        if self._codec is None:
            from common.transport.tensor_frames import EnvelopeCodec

            self._codec = EnvelopeCodec(self._message_type)
        return self._codec

    def send(self, msg: HeaderT, prefix: Sequence[bytes] = ()) -> None:
        """Send one message (ROUTER replies put the peer identity in `prefix`)."""
        self.sock.send_multipart([*prefix, self._encoder.encode(msg)])

    def send_tensors(self, header: HeaderT, tensors: Sequence[torch.Tensor]) -> None:
        self.sock.send_multipart(self._tensor_codec().to_frames(header, tensors), copy=False)

    def recv_nowait(self) -> tuple[list[bytes], HeaderT] | None:
        """The next message and its routing prefix, or None if none is queued. Malformed
        messages are logged and dropped."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            try:
                return frames[:-1], self._decoder.decode(frames[-1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("dropped malformed message", socket=self.sock.type, error=str(exc))

    def recv(self, timeout_s: float) -> tuple[list[bytes], HeaderT] | None:
        """The next well-formed message and its routing prefix, waiting up to `timeout_s`
        seconds in zmq poll; None if none came. Malformed messages are logged and dropped."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.sock.poll(left_ms):
                return None
            item = self.recv_nowait()  # None: what woke the poll was dropped
            if item is not None:
                return item

    def recv_tensors_nowait(self) -> tuple[HeaderT, list[torch.Tensor]] | None:
        """The next tensor message (header, tensors), or None. Malformed ones are dropped."""
        codec = self._tensor_codec()
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            try:
                return codec.from_frames(frames)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, RuntimeError) as exc:
                log.warning("dropped malformed tensor message", error=str(exc))

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket; messages not yet sent get `linger_s` seconds to leave (0: dropped)."""
        self.sock.close(linger=int(linger_s * 1000))


class PushPool(Generic[HeaderT]):
    """PUSH sockets to many endpoints, one per endpoint, created on first use.

    Their sends never block: a message that cannot be queued (the peer's queue is at its
    high-water mark, 1000 messages: a peer that died or stopped reading) raises `zmq.Again` at
    once. A caller decides what that peer's loss means; a loop that blocked there would freeze,
    while the heartbeat thread beside it kept saying it was healthy.

    A socket lives until `drop` or `close`: ZeroMQ would keep reconnecting to a peer that is gone
    (every 0.1 s) and hold what was queued for it, so its owner drops it once membership says
    the peer is gone. A peer that comes back at the same endpoint gets a fresh socket.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        message_type: Any,
        on_new: Callable[[zmq.Socket], None] | None = None,
        *,
        auth: CurveKeys | None,
        hwm: int | None = None,
    ) -> None:
        """`on_new(socket)` runs for each new socket before it connects (to monitor it, say).
        `hwm`: each socket's send queue, in messages (ZeroMQ's 1000 by default)."""
        self._hwm = hwm
        self._ctx = ctx
        self._type = message_type
        self._on_new = on_new
        self._auth = auth
        self._sockets: dict[str, TypedSocket[HeaderT]] = {}

    def get(self, endpoint: str) -> TypedSocket[HeaderT]:
        sock = self._sockets.get(endpoint)
        if sock is None:
            raw = self._ctx.socket(zmq.PUSH)
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.SNDTIMEO, 0)
            if self._hwm is not None:
                raw.setsockopt(zmq.SNDHWM, self._hwm)
            if self._auth is not None:
                self._auth.join(raw)
            if self._on_new is not None:
                self._on_new(raw)
            raw.connect(endpoint)
            sock = self._sockets[endpoint] = TypedSocket(raw, self._type)
        return sock

    def endpoints(self) -> set[str]:
        """The endpoints it holds a socket to."""
        return set(self._sockets)

    def drop(self, endpoint: str) -> bool:
        """Close `endpoint`'s socket, if any: what was queued for it is discarded, and it stops
        reconnecting. The next `get(endpoint)` connects a new one. Whether there was one."""
        sock = self._sockets.pop(endpoint, None)
        if sock is not None:
            sock.close()
        return sock is not None

    def close(self, linger_s: float = 0.0) -> None:
        for sock in self._sockets.values():
            sock.close(linger_s)
        self._sockets.clear()


def bind_random(
    ctx: zmq.Context, kind: int, host: str = "127.0.0.1", *, auth: CurveKeys | None
) -> tuple[zmq.Socket, str]:
    """A socket bound to a free TCP port on `host`, and its endpoint string."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if auth is not None:
        auth.serve(sock)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{host}:{port}"


def connect(ctx: zmq.Context, kind: int, endpoint: str, *, auth: CurveKeys | None) -> zmq.Socket:
    """A socket of `kind` connected to `endpoint` (a CURVE client with `auth`), no linger."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if auth is not None:
        auth.join(sock)
    sock.connect(endpoint)
    return sock
