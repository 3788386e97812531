"""The engine's fault inputs: what it does when a peer is lost, a send fails, a step fails, its
shard group changes or a wait runs past its bound (docs/failures.md). A mixin of `Engine`
(engine.py): each input ends the requests it concerns, alone and (where the mesh is at fault)
retryably, so the router re-runs them from their tokens; their batch-mates go on.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import structlog

from common.engine.request import Request
from common.kv_ingress import KvIngress
from common.protocol import DecodeHandoff, ShardAddress, TokenOutput
from common.scheduling.batching import EngineScheduler
from services.engine.admission import DecodeAdmission
from services.engine.outbox import Outbox
from services.engine.routing import RequestRoute, kv_endpoints
from services.engine.runner import MeshModelRunner, ShardLink
from services.engine.telemetry import EngineTelemetry

log = structlog.get_logger(__name__)

# How long a hand-off may wait for its KV to land in this engine's cache (docs/failures.md).
HANDOFF_KV_WAIT_S = 30.0


class EngineFaults:
    """`Engine`'s fault inputs; the state they act on is the engine's (declared here)."""

    engine_id: str
    telemetry: EngineTelemetry
    kv_ingress: KvIngress
    admission: DecodeAdmission
    local: EngineScheduler
    runner: MeshModelRunner
    shards: tuple[ShardAddress, ...]
    num_group_relinks: int
    requests: dict[str, Request]
    routing: dict[str, RequestRoute]
    received_requests: dict[str, int]

    def on_abort(self, req_id: str) -> Outbox:
        raise NotImplementedError  # Engine's

    def _admit_handoffs(self) -> Outbox:
        raise NotImplementedError  # Engine's

    def _max_len(self, req_id: str) -> int:
        raise NotImplementedError  # Engine's

    def _expire_swaps(self, now: float) -> Outbox:
        raise NotImplementedError  # EngineTiering's

    def _moving(self) -> list[str]:
        raise NotImplementedError  # EngineTiering's

    def expire(self, now: float) -> Outbox:
        """Bounds on waiting: free local KV whose hand-off never came (`KvIngress` leases), and
        end, retryably, hand-offs whose KV has not landed, or found no room, within
        `HANDOFF_KV_WAIT_S` (they would block the queue behind them for good)."""
        if expired := self.kv_ingress.expire_leases():
            log.warning("unclaimed KV freed after its lease", engine=self.engine_id,
                        req_ids=expired[:8], num_freed=len(expired))  # fmt: skip
        out = Outbox()
        landed = self.kv_ingress.is_complete
        for h in self.admission.stalled(now, HANDOFF_KV_WAIT_S, landed):
            out += self._end(h.req_id, f"engine {self.engine_id}: the request's KV did not "
                             f"arrive within {HANDOFF_KV_WAIT_S} s", retryable=True)  # fmt: skip
        for h in self.admission.starved(now, HANDOFF_KV_WAIT_S, self.local, landed, self._max_len):
            why = f"no room for the request's whole length within {HANDOFF_KV_WAIT_S} s"
            out += self._end(h.req_id, f"engine {self.engine_id}: {why}", retryable=True)
        if out or self.admission.waiting:  # an abort may have freed room since (no step ran)
            out += self._admit_handoffs()
        return out + self._expire_swaps(now)

    def lost_reply_to(self, reply_to: str) -> Outbox:
        """A router this engine reports to is gone (its connection down for a while): end its
        requests here, retryably; the error waits in its queue in case it comes back. Its count
        of received requests goes too, so the reports stay one entry per live router (one that
        does come back counts its next placements as on their way for at most the router's
        `PLACEMENT_TTL_S`)."""
        self.received_requests.pop(reply_to, None)
        lost = [req_id for req_id, route in self.routing.items() if route.reply_to == reply_to]
        if lost:
            log.warning("router lost; ending its requests", engine=self.engine_id,
                        router=reply_to, num_requests=len(lost))  # fmt: skip
        return self._end_all(lost, f"engine {self.engine_id}: lost its router")

    def kv_undelivered(self, req_id: str) -> Outbox:
        """A request's KV transfer failed (its receiver died or stopped reading): if it is still
        here, it ends retryably; once handed off, its token engine's KV wait ends it."""
        if req_id not in self.routing:
            return Outbox()
        return self._end(req_id, f"engine {self.engine_id}: its KV could not be delivered",
                         retryable=True)  # fmt: skip

    def undelivered_handoff(self, handoff: DecodeHandoff) -> Outbox:
        """A hand-off its token engine would not take (gone, or not reading)."""
        return self._refuse_handoff(handoff, "its token engine is unreachable")

    def _refuse_handoff(self, handoff: DecodeHandoff, why: str, retryable: bool = True) -> Outbox:
        """A hand-off that will not decode here: the router re-runs the request (a retryable
        error, unless the request itself is at fault), and its shards' KV is freed (a local-KV
        engine's lease frees its own)."""
        error = TokenOutput(
            handoff.req_id, [], "error", handoff.num_prompt_tokens,
            error=f"engine {self.engine_id}: {why}", retryable=retryable,
        )  # fmt: skip
        return Outbox.output(handoff.reply_to, error) + Outbox.free(
            handoff.req_id, kv_endpoints(handoff.shards)
        )

    def fail_all(self, error: str) -> Outbox:
        """A step failed, for no one request's fault (a shard answered with an error, a kernel
        raised): end every request here, retryably, and free all. The router re-runs each from
        its tokens (the self-healing path), at most `max_migrations` times."""
        return self._end_all(list(self.routing), error)

    def _end_all(self, req_ids: list[str], error: str) -> Outbox:
        """End each of `req_ids` retryably (the router re-runs them from their tokens)."""
        out = Outbox()
        for req_id in req_ids:
            out += self._end(req_id, error, retryable=True)
        return out

    def _end(self, req_id: str, error: str, retryable: bool = False) -> Outbox:
        """End one request with an error to its client, and forget it here (frees included)."""
        route = self.routing[req_id]
        self.telemetry.aborted(req_id, RuntimeError(error))
        message = TokenOutput(req_id, [], "error", route.num_prompt_tokens, error=error,
                              retryable=retryable)  # fmt: skip
        return Outbox.output(route.reply_to, message) + self.on_abort(req_id)

    def relink(self, links: Seq[ShardLink], shards: Seq[ShardAddress], reason: str) -> Outbox:
        """Decode against `shards` from now on (empty: local attention only).

        Every request tied to the old group (decoding against it, or waiting to) ends with a
        retryable error: the router re-runs it from its tokens on a whole group. Its KV is freed
        on every shard of the old group: this engine cannot tell which one died (a free sent to
        a dead shard is dropped with its socket), and the live ones may hold it without ever
        having decoded it (a handoff still waiting), so no other free would come.
        """
        tied = [s.req_id for s in self.admission.sharded]
        tied += [h.req_id for h in self.admission.waiting if h.shards]
        tied += self._moving()  # mid-swap, to or from the old group
        error = f"engine {self.engine_id}: {reason}"
        out = self._end_all(tied, error)
        self.shards = tuple(shards)
        self.num_group_relinks += 1
        self.runner.shard_links = list(links)
        self.runner.shards = list(shards)
        log.warning("shard group relinked", engine=self.engine_id, reason=reason,
                    num_failed=len(tied), shards=[s.service_id for s in shards])  # fmt: skip
        return out
