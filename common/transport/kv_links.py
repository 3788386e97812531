"""KV pages over UCX: a prompt engine's `KvSender` and a receiver's `KvReceiver` (token engines,
shards). ZeroMQ carries only control around them (frees, shutdown); see docs/mesh.md.

Sender: one thread owns one `UcxTensorChannel` per receiver (connected on first use, its hello
signed with the mesh key) and sends what the prefill loop queued, in order. The prefill loop only
queues (`send`), so a layer's transfer runs while the next layers compute (Splitwise §IV-C): the
thread sleeps in epoll while UCX moves the bytes, and torch releases the GIL while it computes.
The queue is bounded (`MAX_QUEUED`): a receiver slower than prefill makes `send` wait, at most
`QUEUE_WAIT_S`, then that request's transfer fails. Every UCX wait has a deadline, so a dead or
stopped receiver fails the requests whose KV was for it (`take_failed`), never the sender.

Receiver: one thread owns a `UcxListener` and every link it accepted (one per prompt engine, all
on the listener's one worker), progresses them in epoll, receives each message into fresh tensors
and hands it to `deliver`. A large message's tensors arrive after its header: the thread serves
the other links meanwhile, and a link whose message is not whole within `PAYLOAD_TIMEOUT_S` (its
sender stopped mid-message) is dropped alone. A link whose sender died is dropped; its request's
KV is freed by the lease (`KvIngress`), as before.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from common.protocol import FetchKv, KvPages, KvSwapAck, ShardIngress
from common.transport.ucx_channel import ChannelClosed, PendingReceive, UcxTensorChannel
from common.transport.ucx_listener import UcxListener
from common.wake_pipe import WakePipe

log = structlog.get_logger(__name__)

MAX_QUEUED = 256  # messages queued for the sender thread (layers x destinations of a few batches)
QUEUE_WAIT_S = 5.0  # how long `send` waits for room before that request's transfer fails
CONNECT_TIMEOUT_S = 5.0  # a receiver that does not accept a link within this is taken as dead
SEND_TIMEOUT_S = 10.0  # one message; a receiver that stops reading fails the transfer after this
PAYLOAD_TIMEOUT_S = SEND_TIMEOUT_S  # a sender whose message stops half-way loses its link then
DEAD_HOLD_S = 30.0  # a receiver that failed is not retried for this long (its KV fails at once)
POLL_S = 0.2  # the receiver's wake-up while a message's tensors are on their way
IDLE_WAIT_S = 1.0  # an idle receiver's, to notice `close`: hellos and messages wake it at once

Deliver = Callable[[ShardIngress, list[torch.Tensor]], None]


@dataclass
class _Transfer:
    address: str  # the receiver's KV listener (UCX worker address, hex)
    header: ShardIngress  # KV pages (k, v), or a tensorless message (`send_message`)
    tensors: list[torch.Tensor]


class KvSender:
    """A prompt engine's KV links; see the module docstring. `host`: this side's mesh host;
    `key`: the mesh's (bytes)."""

    def __init__(self, host: str, key: bytes) -> None:
        self._host, self._key = host, key
        self._queue: queue.Queue[_Transfer | None] = queue.Queue(MAX_QUEUED)
        self._failed: deque[str] = deque()
        self._links: dict[str, UcxTensorChannel[ShardIngress]] = {}
        self._dead: dict[str, float] = {}  # address -> when it failed
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def send(self, address: str, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue one message; `k` and `v` must not change afterwards (the shipper's are fresh)."""
        self.send_message(address, pages, [k, v])

    def send_message(
        self, address: str, header: FetchKv | KvPages | KvSwapAck, tensors: list[torch.Tensor]
    ) -> None:
        """Queue any KV-plane message (a shard's swap replies: `KvPages`, `KvSwapAck`)."""
        try:
            self._queue.put(_Transfer(address, header, tensors), timeout=QUEUE_WAIT_S)
        except queue.Full:
            log.warning("KV sender backed up; the transfer fails", req_id=header.req_id)
            self._failed.append(header.req_id)

    def take_failed(self) -> list[str]:
        """Requests whose KV could not be delivered since the last call (each once)."""
        failed: list[str] = []
        while self._failed:
            req_id = self._failed.popleft()
            if req_id not in failed:
                failed.append(req_id)
        return failed

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=SEND_TIMEOUT_S)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._link(item.address).send(item.header, item.tensors, SEND_TIMEOUT_S)
            except (ChannelClosed, TimeoutError) as exc:
                self._fail(item, exc)
            except Exception as exc:  # noqa: BLE001 - one bad transfer must not stop the thread
                log.exception("KV transfer failed")
                self._fail(item, exc)
        for link in self._links.values():
            link.close()

    def _link(self, address: str) -> UcxTensorChannel[ShardIngress]:
        if (link := self._links.get(address)) is not None:
            return link
        failed_at = self._dead.get(address)
        if failed_at is not None and time.monotonic() - failed_at < DEAD_HOLD_S:
            raise ChannelClosed("the receiver failed recently")
        link = UcxTensorChannel.connect(
            address, ShardIngress, CONNECT_TIMEOUT_S, self._host, self._key
        )
        self._links[address] = link
        return link

    def _fail(self, item: _Transfer, exc: Exception) -> None:
        """The receiver is gone or stuck: drop its link (UCX may hold the buffers until then)."""
        if item.address not in self._dead or item.address in self._links:
            log.warning("KV receiver unreachable", req_id=_req_id(item), error=repr(exc))
        self._dead[item.address] = time.monotonic()
        if (link := self._links.pop(item.address, None)) is not None:
            link.close()
        self._failed.append(_req_id(item))


def _req_id(item: _Transfer) -> str:
    return getattr(item.header, "req_id", "")


class KvReceiver:
    """A receiver's KV listener and its links, on one thread; see the module docstring.
    `address` is what the receiver publishes (`WorkerReady.kv_address`)."""

    def __init__(self, host: str, key: bytes, deliver: Deliver) -> None:
        self._listener = UcxListener(ShardIngress, host, key)
        self.address = self._listener.address
        self._deliver = deliver
        self._links: list[UcxTensorChannel[ShardIngress]] = []
        # Per link, a message whose tensors are on their way, and until when they may be.
        self._pending: dict[UcxTensorChannel[ShardIngress], tuple[PendingReceive[Any], float]] = {}
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._running = False
        self._listener.wake()  # not to wait out an idle wait
        self._thread.join(timeout=IDLE_WAIT_S + 1)

    def _has_news(self) -> bool:
        """A hello, or a link with a message (or whose peer has gone), or `close`."""
        return (not self._running or self._listener.has_hello()
                or any(link.has_message() for link in self._links))  # fmt: skip

    def _run(self) -> None:
        while self._running:
            if self._pending:  # tensors on their way: `_drain` checks their deadlines
                self._listener.progress(POLL_S)
            else:
                self._listener.idle_until(self._has_news, IDLE_WAIT_S)
            while self._listener.has_hello():
                try:
                    self._links.append(self._listener.accept(timeout=0.0))
                except TimeoutError:
                    break
            for link in list(self._links):
                self._drain(link)
        for link in self._links:
            link.close()
        self._listener.close()

    def _drain(self, link: UcxTensorChannel[ShardIngress]) -> None:
        """Every message of `link` that has arrived whole; one whose tensors are still on their
        way waits for them (`_pending`) while the other links are served, up to
        `PAYLOAD_TIMEOUT_S`: a sender stopped mid-message costs its own link only."""
        while True:
            pending = self._pending.pop(link, None)
            try:
                if pending is None:
                    if not link.has_message():
                        return
                    pending = (link.recv_start(timeout=0.0), time.monotonic() + PAYLOAD_TIMEOUT_S)
                receive, deadline = pending
                if not receive.done():
                    if time.monotonic() > deadline:
                        link.give_up(receive)
                        raise TimeoutError(f"a message unfinished after {PAYLOAD_TIMEOUT_S} s")
                    self._pending[link] = pending
                    return
                header, tensors = link.recv_finish(receive)
            except Exception as exc:  # noqa: BLE001 - one link's fault must not stop the thread
                # Its sender died or stopped mid-message, or sent what cannot be received
                # (garbage, tensors that fit neither the message nor memory: the stream may be
                # misaligned): drop the link; the KV it had begun is freed by its lease. The
                # other links are served on.
                log.warning("KV link dropped", error=repr(exc))
                self._links.remove(link)
                link.close()
                return
            try:
                self._deliver(header, tensors)
            except Exception:  # noqa: BLE001 - one bad message must not stop the receiver
                log.exception("KV message failed; dropped", kind=type(header).__name__)


class KvInbox:
    """KV received on another thread, for a poll loop that owns its engine: `put` queues and wakes
    the loop through `fileno` (register it with `zmq.Poller`), `drain` takes all that came."""

    def __init__(self) -> None:
        self._items: deque[tuple[ShardIngress, list[torch.Tensor]]] = deque()
        self._wake = WakePipe()

    def fileno(self) -> int:
        return self._wake.fileno()

    def put(self, header: ShardIngress, tensors: list[torch.Tensor]) -> None:
        self._items.append((header, tensors))
        self._wake.wake()

    def drain(self) -> list[tuple[ShardIngress, list[torch.Tensor]]]:
        self._wake.clear()
        items = []
        while self._items:
            items.append(self._items.popleft())
        return items

    def close(self) -> None:
        self._wake.close()


__all__ = ["KvInbox", "KvReceiver", "KvSender"]
