"""`KvPuller`: a shard fetching announced KV from prompt engines' holds (`kv_transfer: pull`).

A `KvAnnounce` (on the shard's KV-ingress socket) names a request, its heads and the prompt
engine's hold endpoint. The puller's thread asks that hold for the request's KV (a `KvPull` on a
DEALER, one per hold), and lands the answer through `land` inside a `StepGate` free period, so
the shard's decode steps never share the CPU with a landing mid-step.

What can go wrong, and what the token engine then hears (`lost`, reported as `kv_lost`):
- the hold does not answer within `timeout_s` (its prompt engine died or hangs): lost; the socket
  is dropped so a late answer is never taken for another request's;
- the hold answers a miss (its lease ran out, the request was never held): lost;
- the answer does not fit this shard (wrong heads or shape: `land` raises) or is refused (no
  room): lost, by `land`'s own reporting.
This shard dying mid-pull breaks its token engine's group: the engine relinks and ends the
group's requests retryably, and the hold frees what nobody pulled when its lease runs out.

A traced request's pull is recorded as a `kv.pull` span (`services/shard/telemetry.py`): from the
announce's arrival here to the landing, or to the failure (status ERROR, the reason); a pull still
queued when the shard closes or dies records nothing.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import structlog
import torch
import zmq

from common.protocol import KvAnnounce, KvPages, KvPull, KvPullMiss, KvPullReply
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import TypedSocket, connect
from services.shard.step_gate import StepGate
from services.shard.telemetry import KvPullTrace, trace_pull

log = structlog.get_logger(__name__)

PULL_TIMEOUT_S = 5.0  # a hold that has not answered by then is taken for dead


class _HoldSocket:
    def __init__(self, ctx: zmq.Context, endpoint: str, auth: CurveKeys | None) -> None:
        sock = connect(ctx, zmq.DEALER, endpoint, auth=auth)
        self.ask: TypedSocket[KvPull] = TypedSocket(sock, KvPull)
        self.answers: TypedSocket[KvPullReply] = TypedSocket(sock, KvPullReply)


class KvPuller:
    def __init__(
        self,
        gate: StepGate,
        land: Callable[[KvPages, list[torch.Tensor]], None],
        lost: Callable[[str, str], None],
        auth: CurveKeys | None,
        timeout_s: float = PULL_TIMEOUT_S,
        shard_id: str = "",
    ) -> None:
        self.gate, self.land, self.lost, self.timeout_s = gate, land, lost, timeout_s
        self.shard_id = shard_id  # names this shard on `kv.pull` spans
        self._auth = auth
        self._ctx = zmq.Context()
        self._sockets: dict[str, _HoldSocket] = {}
        # Announces with their arrival time (`time.time_ns()`), where a `kv.pull` span starts.
        self._queue: queue.SimpleQueue[tuple[KvAnnounce, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-puller", daemon=True)
        self._thread.start()

    def announce(self, announce: KvAnnounce) -> None:
        self._queue.put((announce, time.time_ns()))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=self.timeout_s + 1)
        for hold in self._sockets.values():
            hold.ask.close()
        self._ctx.term()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            announce, announced_ns = item
            trace = trace_pull(announce, self.shard_id, announced_ns)
            try:
                why = self._pull(announce, trace)
            except Exception as exc:  # noqa: BLE001 - one bad pull must not stop the others
                log.exception("KV pull failed", req_id=announce.req_id)
                why = repr(exc)
            if trace is not None:  # recorded first: whoever hears of the loss finds the span
                trace.end(why)
            if why:
                self.lost(announce.req_id, why)

    def _pull(self, a: KvAnnounce, trace: KvPullTrace | None) -> str:
        """Pull and land one announced KV; why it is lost, "" when it landed."""
        hold = self._sockets.get(a.source)
        if hold is None:
            hold = self._sockets[a.source] = _HoldSocket(self._ctx, a.source, self._auth)
        hold.ask.send(KvPull(a.req_id, a.head_start, a.head_end))
        if trace is not None:
            trace.asked()
        answer = self._answer(hold, a.req_id)
        if answer is None:
            self._sockets.pop(a.source).ask.close()  # a late answer must not meet the next pull
            return f"its prompt engine's hold did not answer in {self.timeout_s} s"
        if isinstance(answer[0], KvPullMiss):
            return answer[0].why
        if trace is not None:
            trace.answered(sum(t.nbytes for t in answer[1]), answer[0].num_layers)
        with self.gate.free_period():
            self.land(answer[0], answer[1])
        return ""

    def _answer(
        self, hold: _HoldSocket, req_id: str
    ) -> tuple[KvPages | KvPullMiss, list[torch.Tensor]] | None:
        """The hold's answer about `req_id`, None if none in time. One pull is in flight per
        socket and a socket that timed out is dropped, so anything else is malformed: skipped."""
        deadline = time.monotonic() + self.timeout_s
        while hold.answers.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            item = hold.answers.recv_tensors_nowait()
            if item is not None and item[0].req_id == req_id:
                return item
        return None


__all__ = ["PULL_TIMEOUT_S", "KvPuller"]
