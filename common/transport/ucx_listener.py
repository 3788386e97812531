"""`UcxListener`: where token engines link to an attention shard over UCX.

It publishes its worker's address (hex) through discovery, listens only on the mesh host's
network device, and accepts a peer only after its hello checks out against the mesh's key
(ucx_handshake.py); anything else sent to the hello tag is logged and dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog

from common.transport.ucx_channel import Array, UcxTensorChannel, UcxWorker, ucx_api
from common.transport.ucx_handshake import (
    ACK,
    ACK_TAG,
    HELLO_MAX_BYTES,
    HELLO_TAG,
    ReplayGuard,
    verified_hello,
)

log = structlog.get_logger(__name__)


class UcxListener:
    """Accepts `UcxTensorChannel`s; `address` (its worker's, hex) is what to publish through
    discovery. `host`: the mesh host, whose network device alone it listens on (`MeshHostError`
    if no local device holds it); `key`: the mesh's
    key, which every hello must be signed with (empty: any peer that can reach it is accepted).

    The listener's worker serves every channel it accepts, so use them from one thread.
    """

    def __init__(self, header_type: Any, host: str = "127.0.0.1", key: bytes = b"") -> None:
        self._header_type = header_type
        self._key = key
        self._worker = UcxWorker(host)
        self.address = self._worker.worker.address.tobytes().hex()
        self._hello = np.empty(HELLO_MAX_BYTES, dtype=np.uint8)
        self._worker.posted_buffers.append(self._hello)
        self._hello_request = self._post_hello()
        self._replays = ReplayGuard()  # hellos accepted lately: a replayed one is refused

    def _post_hello(self) -> Any:
        return self._worker.worker.tag_recv(Array(self._hello), ucx_api.UCXXTag(HELLO_TAG))

    def accept(self, timeout: float | None = 10.0) -> UcxTensorChannel[Any]:
        """Block until a peer says hello; return the channel to it (TimeoutError if none does).
        A malformed hello is logged and dropped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            request = self._hello_request
            try:
                self._worker.wait([request], left)
            except TimeoutError:
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. a hello larger than the buffer
                self._hello_request = self._post_hello()
                log.warning("ucx_hello_dropped", error=repr(exc))
                continue
            hello = self._hello.tobytes()
            self._hello_request = self._post_hello()
            try:
                channel_id, sent_at, peer = verified_hello(hello, self._key)
                self._replays.check(channel_id, sent_at, time.time())
                endpoint = ucx_api.UCXEndpoint.create_from_worker_address(
                    self._worker.worker, ucx_api.UCXAddress.create_from_buffer(peer), True
                )
                ack = np.frombuffer(ACK.pack(channel_id), dtype=np.uint8).copy()
                self._worker.wait([endpoint.tag_send(Array(ack), ucx_api.UCXXTag(ACK_TAG))], 5.0)
            except Exception as exc:  # noqa: BLE001 - a hostile or broken peer: not ours to die of
                log.warning("ucx_hello_dropped", error=repr(exc))
                continue
            return UcxTensorChannel(self._worker, endpoint, channel_id, is_server=True,
                                    header_type=self._header_type)  # fmt: skip

    def has_hello(self) -> bool:
        """Whether a hello has arrived: `accept` would not wait for one."""
        return self._hello_request is not None and bool(self._hello_request.completed)

    def progress(self, timeout: float) -> None:
        """Progress the listener's worker (and so every channel it accepted) once, sleeping in
        epoll until an event or `timeout`: one loop can then serve all of them."""
        try:
            self._worker.progress_until(time.monotonic() + timeout)
        except TimeoutError:
            pass

    def idle_until(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Progress the listener's worker (every channel it accepted too), sleeping in epoll,
        until `ready()` (True: a hello, a channel's message) or `timeout_s` (False): an idle
        loop's wait, woken by what it waits for rather than by a clock (`UcxWorker.idle_until`)."""
        return self._worker.idle_until(ready, timeout_s)

    def wake(self) -> None:
        """Wake the thread in `idle_until` or `progress` now, from any thread (`UcxWorker.wake`)."""
        self._worker.wake()

    def close(self) -> None:
        """Stop accepting; channels already accepted keep working."""
        self._hello_request = None


__all__ = ["UcxListener"]
