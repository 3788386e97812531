"""What reaches the router from the mesh: token streams on the event loop, load reports on a thread.

`MeshInbox` owns the router's PULL socket (every engine pushes a `TokenBatch` per step, and
`TokenOutput`s for outputs with more, to its `reply_endpoint`; an `OutputsDropped` when it gave
requests up for want of room in this inbox, each then a retryable error) and a SUB socket
connected to every engine's load publisher.

Token replies are drained on the event loop the requests run on (`attach`, at each request's
start): the loop wakes on the socket itself (its ZeroMQ file descriptor, `add_reader`), restores
each request's token order (`TokenStreamOrderer`: a request's first token comes from its prompt
engine, the rest from its token engine, on different connections) and puts the outputs straight
into their streams. A thread in between would cost a wake-up of that thread and then one of the
loop per engine step: Router CPU on every streamed chunk and, on a few busy cores, a longer gap
between tokens (docs/serving.md, "The per-step path of tokens").

Load reports come at a fixed rate, with or without requests (the scheduler needs them before the
first), so the SUB socket stays on a thread that blocks in `zmq.Poller.poll`: woken by a report,
by a change of the engines to subscribe to (`load_endpoints`, set by the membership thread) or by
`close`, through a pipe of its own, and by nothing else (an idle router's thread sleeps).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import structlog
import zmq

from common.protocol import LoadReport, OutputsDropped, ServiceReply, TokenBatch, TokenOutput
from common.token_stream import TokenStreamOrderer
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import TypedSocket, bind_random
from common.wake_pipe import WakePipe
from services.router.streams import running_loop

log = structlog.get_logger(__name__)

DETACH_TIMEOUT_S = 5.0  # close() waits this long for a running loop to let go of the socket


class MeshInbox:
    """The router's receiving sockets: token replies drained on an event loop, load reports on
    a thread of their own."""

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
        self._replies_fd = int(pull.getsockopt(zmq.FD))
        self.orderer = TokenStreamOrderer(expected_only=True)  # the router says what it sent
        # The loop that drains the replies, and who may touch the PULL socket: only that loop's
        # thread, under this lock (which also fences a move to another loop).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._replies_lock = threading.Lock()
        # The engines' load endpoints to subscribe to; replaced whole by the membership thread,
        # which wakes the load thread through the pipe (as `close` does).
        self._load_endpoints: frozenset[str] = frozenset()
        self._wake = WakePipe()
        self._closed = threading.Event()
        self.drain_error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="mesh-inbox", daemon=True)

    @property
    def load_endpoints(self) -> frozenset[str]:
        return self._load_endpoints

    @load_endpoints.setter
    def load_endpoints(self, endpoints: frozenset[str]) -> None:
        """Subscribe to these engines' load reports (and no others) from now on."""
        changed = endpoints != self._load_endpoints
        self._load_endpoints = endpoints
        if changed:
            self._wake.wake()

    def start(self) -> None:
        self.thread.start()

    def healthy(self) -> bool:
        """Load reports are read and no drain of replies failed. A failed drain may have lost
        outputs that streams wait for: the router is unhealthy, and Serve replaces it, as when
        the thread that drained the replies died."""
        return self.thread.is_alive() and self.drain_error is None

    def attach(self) -> None:
        """Drain token replies on the running event loop from now on, unless another loop that
        still runs does (outputs reach streams on other loops through their own loops). Called
        at each request's start, before it is sent: its replies cannot arrive earlier."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        with self._replies_lock:
            old = self._loop
            if self._closed.is_set() or old is loop or (old is not None and old.is_running()):
                return
            if old is not None and not old.is_closed():
                old.remove_reader(self._replies_fd)  # stopped, not closed: it will not run it
            self._loop = loop
            loop.add_reader(self._replies_fd, self._drain_replies, loop)
        self._drain_replies(loop)  # what came before: the descriptor signals only new arrivals

    def close(self) -> None:
        if self._closed.is_set():
            return  # closed already (its pipe too)
        self._closed.set()
        self._wake.wake()
        self.thread.join(timeout=5)
        with self._replies_lock:
            loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            _remove_reader(loop, self._replies_fd)
        self._replies.close()
        self._wake.close()

    def _drain_replies(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`: every queued reply, in token order, to the streams. ZeroMQ's descriptor is
        edge-triggered, so this reads until the socket says it has nothing more."""
        try:
            self._drain(loop)
        except Exception as exc:  # a bug: say so in the health check, keep the loop serving
            log.exception("draining the router's replies failed")
            self.drain_error = exc

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._replies_lock:
            if self._loop is not loop:
                return  # left behind by a move to another loop
            while (reply := self._replies.recv_nowait()) is not None:
                if isinstance(reply[1], TokenBatch):
                    for out in reply[1].outputs():
                        self.orderer.push(out)
                elif isinstance(reply[1], TokenOutput):
                    self.orderer.push(reply[1])
                elif isinstance(reply[1], OutputsDropped):  # re-run at once (mesh_client.py)
                    for req_id in reply[1].req_ids:
                        self.orderer.push(
                            TokenOutput(req_id, [], "error", error=reply[1].error, retryable=True)
                        )
        if self.orderer.ready:
            ready = list(self.orderer.ready)
            self.orderer.ready.clear()
            self.on_outputs(ready)

    def _run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.auth.join(sub)
        loads: TypedSocket[LoadReport] = TypedSocket(sub, LoadReport)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(self._wake.fileno(), zmq.POLLIN)
        connected: set[str] = set()
        while not self._closed.is_set():
            connected = _resubscribe(sub, connected, self._load_endpoints)
            events = dict(poller.poll())  # a report, a change of endpoints, or close
            if self._wake.fileno() in events:
                self._wake.clear()  # every wake-up so far: the loop applies them all
            while (report := loads.recv_nowait()) is not None:
                try:
                    self.on_load(report[1])
                except Exception:  # noqa: BLE001 - one report must not blind the router
                    # (a dead thread would fail the health check: Serve would replace the
                    # router, and every stream on it with it)
                    log.exception("load report not applied", engine_id=report[1].engine_id)
        sub.close(linger=0)


def _remove_reader(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    """Stop `loop` watching `fd`, from any thread, before the socket behind it closes."""
    if running_loop() is loop or not loop.is_running():
        loop.remove_reader(fd)
        return
    done = threading.Event()

    def remove() -> None:
        loop.remove_reader(fd)
        done.set()

    try:
        loop.call_soon_threadsafe(remove)
    except RuntimeError:
        return  # closed meanwhile: it watches nothing now
    if not done.wait(DETACH_TIMEOUT_S):
        log.warning("event loop did not release the router's reply socket in time")


def _resubscribe(sub: zmq.Socket, connected: set[str], wanted: frozenset[str]) -> set[str]:
    """Connect the SUB socket to new engines' load endpoints and drop those that left."""
    for endpoint in wanted - connected:
        sub.connect(endpoint)
    for endpoint in connected - wanted:
        sub.disconnect(endpoint)
    return set(wanted)
