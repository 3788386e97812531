"""Typed ZeroMQ sockets for the control plane, one msgspec union type per direction.

| class | zmq type | use |
| --- | --- | --- |
| `CommandRouter` / `CommandDealer` | ROUTER / DEALER | commands and replies (router <-> engines) |
| `StreamPush` / `StreamPull` | PUSH / PULL | token streams (engines -> router) |
| `LoadPublisher` / `LoadSubscriber` | PUB / SUB | load reports (engines -> every router) |

Each socket owns one `msgspec.msgpack.Encoder` and one `Decoder` typed with the union it receives,
built once. `get` blocks in `zmq.Socket.poll` (never a sleep loop) and returns the next message that
decodes; a malformed or unknown message is logged with structlog and dropped, and the socket keeps
working. NOTE: a zmq socket is not thread safe: each wrapper belongs to one thread.

Endpoints are zmq URLs ("tcp://127.0.0.1:5555"); a binding socket given port "*" picks a free port
and reports the real URL in `.endpoint`, which is what gets published through discovery.
"""

from __future__ import annotations

import time
from typing import Any, Generic, TypeVar

import msgspec
import structlog
import zmq

log = structlog.get_logger(__name__)

RecvT = TypeVar("RecvT")


def shared_context() -> zmq.Context[zmq.Socket[bytes]]:
    """The process-wide zmq context (one I/O thread: on 2 vCPUs more threads only add hand-offs)."""
    return zmq.Context.instance()


class MessageSocket(Generic[RecvT]):
    """Base of the typed sockets: one zmq socket, one encoder, one typed decoder."""

    socket_type: int = zmq.PAIR
    binds: bool = False  # default side of the connection for this socket type

    def __init__(self, endpoint: str, recv_type: Any = None, *, bind: bool | None = None,
                 context: zmq.Context[Any] | None = None) -> None:  # fmt: skip
        self.sock = (context or shared_context()).socket(self.socket_type)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._configure()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = None if recv_type is None else msgspec.msgpack.Decoder(recv_type)
        if self.binds if bind is None else bind:
            self.sock.bind(endpoint)
            self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sock.connect(endpoint)
            self.endpoint = endpoint

    def _configure(self) -> None:
        """Socket options set before bind/connect (subclasses override)."""

    def poll(self, timeout: float | None = None) -> bool:
        """True when a message is waiting; blocks up to `timeout` seconds (None: forever)."""
        timeout_ms = None if timeout is None else max(0, int(timeout * 1000))
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def _encode(self, msg: Any) -> bytes:
        return self._encoder.encode(msg)

    def _decode(self, frame: bytes | memoryview) -> RecvT | None:
        """Decode one frame, or log and drop it (None) when it is malformed or unknown."""
        assert self._decoder is not None, "this socket only sends"
        try:
            return self._decoder.decode(frame)  # type: ignore[no-any-return]
        except msgspec.DecodeError as exc:
            log.warning("zmq_message_dropped", socket=type(self).__name__, error=str(exc),
                        nbytes=len(frame))  # fmt: skip
            return None

    def _recv_frames(self, timeout: float | None) -> list[bytes]:
        """Next multipart message; raises TimeoutError after `timeout` seconds."""
        if not self.poll(timeout):
            raise TimeoutError(f"no message on {self.endpoint} within {timeout} s")
        return self.sock.recv_multipart()

    def _get_decoded(self, timeout: float | None) -> tuple[list[bytes], RecvT]:
        """Frames before the payload, and the decoded payload; skips messages that are dropped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            frames = self._recv_frames(left)
            msg = self._decode(frames[-1])
            if msg is not None:
                return frames[:-1], msg

    def close(self, linger: float = 1.0) -> None:
        """Close the socket, giving queued outgoing messages up to `linger` seconds to leave."""
        self.sock.close(linger=int(linger * 1000))


class _Receiver(MessageSocket[RecvT]):
    def get(self, timeout: float | None = None) -> RecvT:
        """The next well-formed message; raises TimeoutError after `timeout` seconds."""
        return self._get_decoded(timeout)[1]

    def get_nowait(self) -> RecvT | None:
        """The next well-formed message if one is already queued, else None."""
        try:
            return self.get(timeout=0)
        except TimeoutError:
            return None


class CommandDealer(_Receiver[RecvT]):
    """DEALER end of a command channel: `put` a command, `get` the replies (connects)."""

    socket_type = zmq.DEALER

    def put(self, msg: Any) -> None:
        self.sock.send(self._encode(msg))


class CommandRouter(MessageSocket[RecvT]):
    """ROUTER end of a command channel: `get` -> (peer identity, command), `put(identity, reply)`.

    Binds by default. `ROUTER_MANDATORY` makes a reply to a vanished peer raise instead of
    vanishing silently.
    """

    socket_type = zmq.ROUTER
    binds = True

    def _configure(self) -> None:
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)

    def get(self, timeout: float | None = None) -> tuple[bytes, RecvT]:
        """The next well-formed command and the identity of the peer that sent it."""
        prefix, msg = self._get_decoded(timeout)
        return prefix[0], msg

    def get_nowait(self) -> tuple[bytes, RecvT] | None:
        try:
            return self.get(timeout=0)
        except TimeoutError:
            return None

    def put(self, identity: bytes, msg: Any) -> None:
        self.sock.send_multipart([identity, self._encode(msg)])


class StreamPush(MessageSocket[Any]):
    """PUSH end of a token stream (connects); send-only."""

    socket_type = zmq.PUSH

    def put(self, msg: Any) -> None:
        self.sock.send(self._encode(msg))


class StreamPull(_Receiver[RecvT]):
    """PULL end of a token stream (binds): fair-queues every pusher."""

    socket_type = zmq.PULL
    binds = True


class LoadPublisher(MessageSocket[Any]):
    """PUB end of load reports (binds); send-only, drops when no subscriber keeps up."""

    socket_type = zmq.PUB
    binds = True

    def put(self, msg: Any) -> None:
        self.sock.send(self._encode(msg))


class LoadSubscriber(_Receiver[RecvT]):
    """SUB end of load reports (connects to one or more publishers; subscribes to everything)."""

    socket_type = zmq.SUB

    def _configure(self) -> None:
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        # Only the latest report matters; a slow router must not queue stale ones.
        self.sock.setsockopt(zmq.RCVHWM, 1000)

    def connect(self, endpoint: str) -> None:
        """Also subscribe to another publisher."""
        self.sock.connect(endpoint)
