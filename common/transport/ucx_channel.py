"""A point-to-point UCX tensor channel (`ucxx` core API) with a blocking, synchronous API.

A message is a msgspec envelope `(specs, header)` plus the tensors' raw bytes (`tensor_frames`).
Two wire forms, chosen per message by size:

- inline (tensors <= `INLINE_LIMIT` bytes in all): one UCX tag message
  `[prefix | envelope | tensor bytes ...]`, packed into a send buffer the channel reuses once its
  last send is done, and received into a buffer that is always pre-posted. Tensors may be strided
  (a token engine's head slices): each is copied into or out of the message in one pass.
  Per-layer q / attention-output messages take this form: one message per direction is the
  cheapest round trip (each extra UCX message costs a thread wake-up, dearer on a few busy cores
  than a copy), and the two memcpys of <= 192 KiB cost microseconds.
- zero-copy (larger): the envelope message, then one tag message per tensor sent straight from the
  tensor's memory and received straight into the destination (UCX rendezvous: no copy at all).

Why the core API, progressed by the calling thread in UCX's blocking mode: the engine's loop is a
plain thread running torch, and on a few cores each wake-up of a blocked thread is costly and
spinning starves the model. A caller waiting on a request runs `progress_worker_event`, which
progresses the worker and, when nothing is left, sleeps in `epoll_wait` on the worker's event fd:
one wake-up per message, as with a blocking socket, and no busy-polling. The alternatives cost more
hops: ucxx's progress thread hands completions to Python only through asyncio futures (progress
thread -> notifier thread -> event loop -> caller, an asyncio task each, ucxx issue #305) or by
spinning on `request.completed` (ucxx-core's default thread mode, whose spinning takes the cores
the model needs); the ucxx asyncio API adds tasks, and on a background loop two thread hand-offs
per call (ucxx's own send_recv bench compares it with the core API). The price: a large send moves
only while some channel of the same worker is inside `send`/`recv`/`wait`, which is what a
synchronous engine loop does anyway.

Transports: `UCX_TLS` if set, else `PHASEMESH_UCX_TLS`, else `DEFAULT_UCX_TLS` (tcp: works on one
host and across hosts).

Connections: a `UcxListener` (ucx_listener.py) publishes its UCX *worker address* (hex), not a
host:port, and `connect` meets it with a signed hello (ucx_handshake.py). There is no sockaddr
listener (ucxx's binds every interface): each worker listens only on the network device of the
host it is given (`lo` for a loopback mesh, IPv4 or IPv6), so a loopback mesh is reachable from
its own host alone; a worker whose host is on no local device refuses to start
(`MeshHostError`) rather than listen on every one.

NOTE: a worker (a listener and the channels it accepts, or one connected channel) is not thread
safe; use it from one thread. Tags carry a random per-channel id so that channels accepted by one
listener never match each other's messages.
"""

from __future__ import annotations

import os
import secrets
import select
import struct
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic

import numpy as np
import structlog
import torch

DEFAULT_UCX_TLS = "tcp"
# UCX's tcp defaults (8 KiB segments; rendezvous from 8 KiB, which ucxx sets) turn a 16 KiB message
# into several wake-ups per direction; one 256 KiB eager segment sends it whole, for a fraction of
# the round trip. Larger messages still go zero-copy by rendezvous.
# NOTE: set in os.environ, before ucxx is imported: `import ucxx` writes its own UCX_RNDV_THRESH,
# and transport options passed in UCXContext's config_dict do not take effect. A value
# the user already set wins.
DEFAULT_UCX_TUNING = {"TCP_TX_SEG_SIZE": "256k", "TCP_RX_SEG_SIZE": "256k", "RNDV_THRESH": "256k"}
for _name, _value in DEFAULT_UCX_TUNING.items():
    os.environ.setdefault(f"UCX_{_name}", _value)
# `import ucxx` sets UCX_MEMTYPE_CACHE, which this UCX build no longer reads: without this, every
# process prints two "unused environment variable" warnings at start.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

from common.transport.tensor_frames import (  # noqa: E402
    EnvelopeCodec,
    HeaderT,
    ReceiveInto,
    byte_view,
    empty_like_spec,
    nbytes,
    pack_frames,
    receive_targets,
    unpack_frames,
)
from common.transport.ucx_handshake import (  # noqa: E402
    ACK,
    ACK_TAG,
    HELLO_TAG,
    signed_hello,
    ucx_device_options,
)

log = structlog.get_logger(__name__)

# UCX errors that mean the peer is gone (closed, crashed, unreachable), not a bad message.
_PEER_GONE = (
    ucx_api.UCXCanceledError,
    ucx_api.UCXConnectionResetError,
    ucx_api.UCXEndpointTimeoutError,
    ucx_api.UCXNotConnectedError,
    ucx_api.UCXUnreachableError,
    ucx_api.UCXIOError,
)


class ChannelClosed(ConnectionError):
    """The peer of a UCX channel went away (closed its end, or died); the channel is unusable."""


INLINE_LIMIT = 192 * 1024
MAX_ENVELOPE_BYTES = 64 * 1024
_PREFIX = struct.Struct("<II")  # envelope length, 1 if the tensors are inline
_ALIGN = 64
_KIND_ENVELOPE, _KIND_DATA = 0, 1
_MAX_OUTBOX_ARRAYS = 64
TENSORS_TIMEOUT_S = 30.0  # `recv`: a zero-copy message's tensors, once its envelope came
# Upper bound on one epoll sleep, so that a deadline is noticed even if no event comes.
_MAX_EPOLL_MS = 100


def ucx_config() -> dict[str, str]:
    """UCX options this process passes to each context: the transports (`UCX_TLS` wins)."""
    if "UCX_TLS" in os.environ:
        return {}
    return {"TLS": os.environ.get("PHASEMESH_UCX_TLS", DEFAULT_UCX_TLS)}


def ucx_settings() -> dict[str, str]:
    """The UCX settings in effect for new workers (for logs and bench reports)."""
    tuning = {k: os.environ[f"UCX_{k}"] for k in DEFAULT_UCX_TUNING}
    return {"TLS": os.environ.get("UCX_TLS", ucx_config().get("TLS", "")), **tuning}


class UcxWorker:
    """One UCX context + worker in blocking progress mode, progressed by whoever waits on it.
    `host`: the mesh host, whose network device alone it listens and connects on (None: every
    device); a host on no local device raises `MeshHostError` (`net_device_for`)."""

    def __init__(self, host: str | None = None) -> None:
        features = (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
        config = ucx_config() | ucx_device_options(host)
        self.context = ucx_api.UCXContext(config_dict=config, feature_flags=features)
        self.worker = ucx_api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        # `wake`'s eventfd, in the epoll set the worker's waits sleep in (ucxx binds no call
        # that wakes them): edge-triggered, so each write wakes a wait once and nobody reads it.
        # Registered through a duplicate of the set's descriptor, whose close leaves the set.
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        weakref.finalize(self, os.close, self._wake_fd)
        with select.epoll.fromfd(os.dup(self.worker.epoll_file_descriptor)) as waits:
            waits.register(self._wake_fd, select.EPOLLIN | select.EPOLLET)
        # Receive buffers of posted requests that may outlive their channel: UCX may still write
        # into them until the worker goes away, so they live as long as the worker.
        self.posted_buffers: list[np.ndarray] = []

    def wake(self) -> None:
        """Wake the thread sleeping in this worker's epoll (`progress_until`, `idle_until`) now,
        from any thread, so that its loop looks at its own state again (a close, rather than
        waiting out an idle timeout)."""
        os.eventfd_write(self._wake_fd, 1)

    def wait(self, requests: Sequence[Any], timeout: float | None) -> None:
        """Block (in epoll, not spinning) until every request completes; raise its error if any."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(r.completed for r in requests):
            self.progress_until(deadline)
        for request in requests:
            try:
                request.check_error()
            except _PEER_GONE as exc:
                raise ChannelClosed(f"UCX peer gone: {exc}") from exc

    def progress_until(self, deadline: float | None) -> None:
        """Progress once, sleeping in epoll until an event or the deadline (TimeoutError)."""
        epoll_ms = _MAX_EPOLL_MS
        if deadline is not None:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms < 0:
                raise TimeoutError("UCX operation timed out")
            epoll_ms = min(epoll_ms, left_ms)
        self.worker.progress_worker_event(epoll_timeout=epoll_ms)

    def idle_until(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """An idle thread's wait: progress, sleeping in epoll, until `ready()` (True) or
        `timeout_s` (False). Each sleep lasts until an event or the timeout, not at most
        `_MAX_EPOLL_MS`: an idle worker wakes per message, hello or timeout, not ten times a
        second (each wake-up costs its process CPU while nothing happens)."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return False
            self.worker.progress_worker_event(epoll_timeout=left_ms)
        return True


@dataclass
class PendingReceive(Generic[HeaderT]):
    """A received message whose tensors may still be arriving (`UcxTensorChannel.recv_start`)."""

    header: HeaderT
    targets: list[torch.Tensor]
    staging: list[torch.Tensor]  # where the bytes land: a target, or a contiguous copy of it
    requests: list[Any]

    def done(self) -> bool:
        return all(r.completed for r in self.requests)


@dataclass
class SendHandle:
    """An in-flight send: holds every buffer until `UcxTensorChannel.wait` says it is done."""

    requests: list[Any]
    buffers: list[Any] = field(default_factory=list)


class UcxTensorChannel(Generic[HeaderT]):
    """Sends and receives `(header, tensors)` to one peer over UCX; see the module docstring.

    Build with `UcxTensorChannel.connect(address, header_type)` or `UcxListener.accept()`.
    `header_type` is any msgspec-decodable type (typically a tagged union); both ends use the
    same type.
    """

    def __init__(self, worker: UcxWorker, endpoint: Any, channel_id: int, is_server: bool,
                 header_type: Any) -> None:  # fmt: skip
        self._worker = worker
        self._endpoint = endpoint
        self._codec: EnvelopeCodec[HeaderT] = EnvelopeCodec(header_type)
        send_dir, recv_dir = (1, 0) if is_server else (0, 1)
        self._send_tags = [ucx_api.UCXXTag(_tag(channel_id, send_dir, k)) for k in (0, 1)]
        self._recv_tags = [ucx_api.UCXXTag(_tag(channel_id, recv_dir, k)) for k in (0, 1)]
        self._inbox = np.empty(MAX_ENVELOPE_BYTES + INLINE_LIMIT, dtype=np.uint8)
        self._inbox_array = Array(self._inbox)
        self._inbox_bytes = self._inbox.data
        worker.posted_buffers.append(self._inbox)
        self._inbox_request = self._post_inbox()
        # Inline messages are packed into this one buffer while its last send is done (an eager
        # send usually completes before tag_send returns), else into a fresh one. Its Arrays are
        # kept per message length: per-layer messages repeat a handful of lengths.
        self._outbox = np.empty(MAX_ENVELOPE_BYTES + INLINE_LIMIT, dtype=np.uint8)
        self._outbox_arrays: dict[int, Any] = {}
        self._outbox_request: Any = None
        self._closed = False

    @classmethod
    def connect(
        cls,
        address: str,
        header_type: Any,
        timeout: float = 10.0,
        host: str = "127.0.0.1",
        key: bytes = b"",
    ) -> UcxTensorChannel[Any]:
        """Connect to the `UcxListener` whose `address` this is; `host`: this side's mesh host
        (its worker listens on that host's device only); `key`: the mesh's, as the listener's.
        Raises ChannelClosed if the listener does not accept the link within `timeout`."""
        worker = UcxWorker(host)
        remote = ucx_api.UCXAddress.create_from_buffer(bytes.fromhex(address))
        endpoint = ucx_api.UCXEndpoint.create_from_worker_address(worker.worker, remote, True)
        channel_id = secrets.randbits(56)
        ack = np.empty(ACK.size, dtype=np.uint8)
        worker.posted_buffers.append(ack)
        acked = worker.worker.tag_recv(Array(ack), ucx_api.UCXXTag(ACK_TAG))
        signed = signed_hello(channel_id, worker.worker.address.tobytes(), key)
        hello = np.frombuffer(signed, dtype=np.uint8).copy()
        try:
            worker.wait([endpoint.tag_send(Array(hello), ucx_api.UCXXTag(HELLO_TAG))], timeout)
            worker.wait([acked], timeout)
        except TimeoutError as exc:
            raise ChannelClosed(
                "the listener did not accept the link (another mesh's key?)"
            ) from exc
        return cls(worker, endpoint, channel_id, is_server=False, header_type=header_type)

    def send(self, header: HeaderT, tensors: Sequence[torch.Tensor] = (),
             timeout: float | None = 30.0) -> None:  # fmt: skip
        """Send and block until UCX is done with every buffer (the tensors may then change)."""
        self.wait(self.send_async(header, tensors), timeout)

    def send_async(self, header: HeaderT, tensors: Sequence[torch.Tensor] = ()) -> SendHandle:
        """Post a send; the tensors must not change until `wait(handle)` returns."""
        envelope = self._codec.encode(header, tensors)
        if len(envelope) > MAX_ENVELOPE_BYTES - _PREFIX.size:
            raise ValueError(f"envelope of {len(envelope)} B exceeds {MAX_ENVELOPE_BYTES} B")
        if sum(nbytes(t) + _ALIGN for t in tensors) <= INLINE_LIMIT:  # with worst-case padding
            return self._send_inline(envelope, tensors)
        views = [byte_view(t) for t in tensors]  # strided tensors: a contiguous copy, kept alive
        message = _pack_inline(np.empty(MAX_ENVELOPE_BYTES, np.uint8), envelope, [], inline=False)
        requests = [self._endpoint.tag_send(Array(message), self._send_tags[0])]
        requests += [self._endpoint.tag_send(Array(v), self._send_tags[1]) for v in views if v.size]
        return SendHandle(requests, [message, *views, *tensors])

    def _send_inline(self, envelope: bytes, tensors: Sequence[torch.Tensor]) -> SendHandle:
        outbox_free = self._outbox_request is None or self._outbox_request.completed
        if not outbox_free:
            message = _pack_inline(np.empty_like(self._outbox), envelope, tensors)
            request = self._endpoint.tag_send(Array(message), self._send_tags[0])
            return SendHandle([request], [message])
        length = _pack_inline(self._outbox, envelope, tensors).size
        array = self._outbox_arrays.get(length)
        if array is None:
            if len(self._outbox_arrays) >= _MAX_OUTBOX_ARRAYS:
                self._outbox_arrays.clear()
            array = self._outbox_arrays[length] = Array(self._outbox[:length])
        self._outbox_request = self._endpoint.tag_send(array, self._send_tags[0])
        return SendHandle([self._outbox_request])

    def wait(self, handle: SendHandle, timeout: float | None = 30.0) -> None:
        """Progress until a `send_async` completes; then its buffers are released."""
        self._worker.wait(handle.requests, timeout)
        handle.buffers.clear()

    def recv(self, out: ReceiveInto = None,
             timeout: float | None = None) -> tuple[HeaderT, list[torch.Tensor]]:  # fmt: skip
        """Receive one message into `out` (tensors, or a function of (header, specs) returning
        them; exact dtypes and shapes) or into fresh tensors.

        Raises TimeoutError if no message arrives within `timeout`, or ValueError if `out` does not
        match (the message is then consumed and dropped); the channel stays usable after both.
        Raises ChannelClosed once the peer has gone.
        A malformed envelope raises msgspec.DecodeError; a zero-copy message's payload is then
        left in flight and the channel is unusable.
        """
        pending = self.recv_start(out, timeout)
        self._worker.wait(pending.requests, timeout=TENSORS_TIMEOUT_S)
        return self.recv_finish(pending)

    def recv_start(
        self, out: ReceiveInto = None, timeout: float | None = None
    ) -> PendingReceive[HeaderT]:
        """`recv`'s first half: wait (up to `timeout`) for a message's envelope and post the
        receives of its tensors; an inline message's are done at once. For a loop that serves
        several channels of one worker (kv_links.py): it progresses the worker while the tensors
        arrive, finishes with `recv_finish` once `done()`, and bounds the wait per channel (a
        sender stopped mid-message: `give_up`, then close the channel). Raises as `recv`; an
        `out` that does not match waits for the payload here, to drop it."""
        self._worker.wait([self._inbox_request], timeout)
        try:
            env_len, inline = _PREFIX.unpack_from(self._inbox_bytes, 0)
            specs, header = self._codec.decode(
                self._inbox_bytes[_PREFIX.size : _PREFIX.size + env_len]
            )
            if inline:
                targets = receive_targets(specs, header, out)
                _unpack_inline(self._inbox, _PREFIX.size + env_len, targets)
                return PendingReceive(header, targets, targets, [])
        finally:
            self._inbox_request = self._post_inbox()
        try:
            targets = receive_targets(specs, header, out)
        except ValueError:
            scratch = self._post_payload(header, [empty_like_spec(s) for s in specs])
            self._worker.wait(scratch.requests, timeout=TENSORS_TIMEOUT_S)  # stream aligned
            raise
        return self._post_payload(header, targets)

    def recv_finish(self, pending: PendingReceive[HeaderT]) -> tuple[HeaderT, list[torch.Tensor]]:
        """The message of a `recv_start` whose tensors have all arrived (ChannelClosed if the
        peer went away meanwhile)."""
        self._worker.wait(pending.requests, timeout=0.0)
        for target, staged in zip(pending.targets, pending.staging, strict=True):
            if staged is not target:
                target.copy_(staged)
        return pending.header, pending.targets

    def give_up(self, pending: PendingReceive[HeaderT]) -> None:
        """A `recv_start` that will not be finished: its buffers live as long as the worker
        (UCX may still write into them)."""
        self._worker.posted_buffers.extend(byte_view(t) for t in pending.staging)

    def has_message(self) -> bool:
        """Whether a message has arrived (or the peer has gone): `recv` would not wait for one.
        For a loop that serves several channels of one worker (`common/transport/kv_links.py`)."""
        return bool(self._inbox_request.completed)

    def _post_payload(
        self, header: HeaderT, targets: list[torch.Tensor]
    ) -> PendingReceive[HeaderT]:
        # Straight into each target's memory; a strided target through a contiguous staging copy.
        staging = [t if t.is_contiguous() else torch.empty_like(t) for t in targets]
        views = [byte_view(t) for t in staging]
        requests = [self._endpoint.tag_recv(Array(v), self._recv_tags[1]) for v in views if v.size]
        return PendingReceive(header, targets, staging, requests)

    def _post_inbox(self) -> Any:
        # Always posted, so an incoming small message lands here without UCX's unexpected queue.
        return self._endpoint.tag_recv(self._inbox_array, self._recv_tags[0])

    def close(self) -> None:
        """Close the endpoint and cancel this channel's posted receives (the peer may be gone).

        NOTE: `close_blocking`, not `close()`: the latter returns a null request (which crashes
        when touched) once the peer has already closed the endpoint.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._endpoint.close_blocking()
        except Exception as exc:  # noqa: BLE001 - closing must never raise
            log.debug("ucx_close_failed", error=str(exc))


def refuse(link: UcxTensorChannel[Any], reply: Any, timeout: float = 1.0) -> None:
    """Answer a message `link` could not receive with `reply` (no tensors) before closing it: the
    peer is not told that this end closed (its receive waits on), so a peer waiting for a reply
    would otherwise wait out its own timeout. Best effort."""
    try:
        link.send(reply, [], timeout=timeout)
    except (ChannelClosed, TimeoutError, ValueError) as exc:
        log.debug("refusal not delivered", error=repr(exc))


def _tag(channel_id: int, direction: int, kind: int) -> int:
    # [channel id: 56 bits][direction: 1 bit][kind: 1 bit]
    return (channel_id << 2) | (direction << 1) | kind


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def _pack_inline(
    buffer: np.ndarray, envelope: bytes, tensors: Sequence[torch.Tensor], inline: bool = True
) -> np.ndarray:
    """Write `[prefix | envelope | tensor bytes, each 64-byte aligned]` at the start of `buffer`
    and return that part of it; strided tensors (slices of a larger one) are copied in, in one
    pass each (`pack_frames`)."""
    starts, end = _frame_starts(_PREFIX.size + len(envelope), tensors)
    message = buffer[:end]
    _PREFIX.pack_into(message.data, 0, len(envelope), int(inline))
    message[_PREFIX.size : _PREFIX.size + len(envelope)] = np.frombuffer(envelope, np.uint8)
    if tensors:
        pack_frames(message, starts, tensors)
    return message


def _unpack_inline(inbox: np.ndarray, offset: int, targets: Sequence[torch.Tensor]) -> None:
    """Copy each inline tensor out of `inbox` into its target (the inbox is reused at once)."""
    unpack_frames(inbox, _frame_starts(offset, targets)[0], targets)


def _frame_starts(offset: int, tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Where each tensor's bytes start after `offset` (each 64-byte aligned), and where the last
    ends: the one layout both ends of an inline message compute."""
    starts = []
    for tensor in tensors:
        starts.append(_aligned(offset))
        offset = starts[-1] + nbytes(tensor)
    return starts, offset
