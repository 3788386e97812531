"""What reaches the router from the mesh: token streams and load reports, on one IO thread.

`MeshInbox` owns the router's PULL socket (every engine pushes a `TokenBatch` per step, and
`TokenOutput`s for outputs with more, to its `reply_endpoint`) and a SUB socket connected to
every engine's load publisher. Its thread blocks in `zmq.Poller.poll`, restores each request's
token order (`TokenStreamOrderer`: a request's first token comes from its prompt engine, the rest
from its token engine, on different connections), and hands outputs (all that one drain of the
socket made ready, in one call) and load reports to the callbacks it was given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from common.protocol import LoadReport, ServiceReply, TokenBatch, TokenOutput
from common.token_stream import TokenStreamOrderer
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import TypedSocket, bind_random

IO_POLL_MS = 100  # the thread wakes this often to apply subscription changes and notice close


class MeshInbox:
    """The router's receiving sockets and the thread that drains them."""

    def __init__(
        self,
        ctx: zmq.Context,
        host: str,
        on_outputs: Callable[[list[TokenOutput]], None],
        on_load: Callable[[LoadReport], None],
        *,
        auth: CurveKeys,
    ) -> None:
        self.ctx = ctx
        self.on_outputs = on_outputs
        self.on_load = on_load
        self.auth = auth
        pull, self.reply_endpoint = bind_random(ctx, zmq.PULL, host, auth=auth)
        self._replies: TypedSocket[ServiceReply] = TypedSocket(pull, ServiceReply)
        self.orderer = TokenStreamOrderer(expected_only=True)  # the router says what it sent
        # The engines' load endpoints to subscribe to; replaced whole by the membership thread.
        self.load_endpoints: frozenset[str] = frozenset()
        self._closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mesh-inbox", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self._closed.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.auth.join(sub)
        loads: TypedSocket[LoadReport] = TypedSocket(sub, LoadReport)
        connected: set[str] = set()
        poller = zmq.Poller()
        poller.register(self._replies.sock, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        while not self._closed.is_set():
            connected = _resubscribe(sub, connected, self.load_endpoints)
            poller.poll(IO_POLL_MS)
            while (reply := self._replies.recv_nowait()) is not None:
                if isinstance(reply[1], TokenBatch):
                    for out in reply[1].outputs():
                        self.orderer.push(out)
                elif isinstance(reply[1], TokenOutput):
                    self.orderer.push(reply[1])
            if self.orderer.ready:
                ready = list(self.orderer.ready)
                self.orderer.ready.clear()
                self.on_outputs(ready)
            while (report := loads.recv_nowait()) is not None:
                self.on_load(report[1])
        sub.close(linger=0)
        self._replies.close()


def _resubscribe(sub: zmq.Socket, connected: set[str], wanted: frozenset[str]) -> set[str]:
    """Connect the SUB socket to new engines' load endpoints and drop those that left."""
    for endpoint in wanted - connected:
        sub.connect(endpoint)
    for endpoint in connected - wanted:
        sub.disconnect(endpoint)
    return set(wanted)
