"""`KvHoldServer`: a prompt engine's KV hold (`common/kv_hold.py`) answering shards' pulls.

Its own thread and ROUTER socket, so a pull never waits for the engine loop (a prefill batch can
take long). Each `KvPull` gets one answer: a `KvPages` with every layer of the asked heads (k, v
buffers), or a `KvPullMiss`. The thread also frees held KV whose lease ran out.

If this process dies, the shards' pulls go unanswered: each shard gives up after its timeout and
reports the request's KV lost, and the token engine ends it retryably (the router re-runs it).
"""

from __future__ import annotations

import threading

import structlog
import zmq

from common.kv_hold import KvHold
from common.protocol import KvPull, KvPullMiss, KvPullReply
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import TypedSocket, bind_random

log = structlog.get_logger(__name__)

POLL_S = 0.2  # idle wake-up: leases, shutdown


class KvHoldServer:
    def __init__(self, hold: KvHold, host: str, auth: CurveKeys | None) -> None:
        self.hold = hold
        self._ctx = zmq.Context()
        sock, self.endpoint = bind_random(self._ctx, zmq.ROUTER, host, auth=auth)
        self._requests: TypedSocket[KvPull] = TypedSocket(sock, KvPull)
        self._replies: TypedSocket[KvPullReply] = TypedSocket(sock, KvPullReply)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-hold", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._running:
            item = self._requests.recv(POLL_S)
            if item is not None:
                self._answer(item[0], item[1])
            if expired := self.hold.expire():
                log.warning("held KV nobody pulled freed after its lease",
                            keys=expired[:8], num_freed=len(expired))  # fmt: skip
        self._requests.close()
        self._ctx.term()

    def _answer(self, identity: list[bytes], pull: KvPull) -> None:
        taken = self.hold.take(pull.req_id, pull.head_start, pull.head_end)
        # Every answer is a tensor message (a miss with none), behind the asker's identity.
        self._replies.sock.send_multipart(identity, zmq.SNDMORE)
        if isinstance(taken, str):
            self._replies.send_tensors(KvPullMiss(pull.req_id, taken), [])
        else:
            self._replies.send_tensors(taken[0], [taken[1], taken[2]])

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2)


__all__ = ["KvHoldServer"]
