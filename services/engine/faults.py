"""An engine's fault inputs (docs/failures.md): a lost router, KV or a hand-off that could not be
delivered, a failed step, a new shard group, waits past their bound. Each ends the requests it
concerns, alone and (where the mesh is at fault) retryably, so the router re-runs them from their
tokens; their batch-mates go on. `EngineFaults` decides which requests each fault ends; the
`Engine` it is given ends them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import structlog

from common.protocol import DecodeHandoff, ShardAddress
from services.engine.engine import Engine
from services.engine.kv_tiers import SWAP_TIMEOUT_S
from services.engine.outbox import Outbox
from services.engine.runner import ShardLink

log = structlog.get_logger(__name__)

# How long a hand-off may wait for its KV to land in this engine's cache (docs/failures.md).
HANDOFF_KV_WAIT_S = 30.0


class EngineFaults:
    """The fault inputs of one `Engine` (its worker calls them)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def expire(self, now: float) -> Outbox:
        """Bounds on waiting: free local KV whose hand-off never came (`KvIngress` leases), and
        end, retryably, hand-offs whose KV has not landed, or found no room, within
        `HANDOFF_KV_WAIT_S` (they would block the queue behind them for good), and requests
        whose KV swap stalled."""
        e = self.engine
        if expired := e.kv_ingress.expire_leases():
            log.warning("unclaimed KV freed after its lease", engine=e.engine_id,
                        req_ids=expired[:8], num_freed=len(expired))  # fmt: skip
        landed, bound = e.kv_ingress.is_complete, HANDOFF_KV_WAIT_S
        out = e.end_all([h.req_id for h in e.admission.stalled(now, bound, landed)],
                        e.why(f"the request's KV did not arrive within {bound} s"))  # fmt: skip
        starved = e.admission.starved(now, bound, e.local, landed, e.table.whole_len)
        out += e.end_all(
            [h.req_id for h in starved],
            e.why(f"no room for the request's whole length within {bound} s"),
        )
        if out or e.admission.waiting:  # an abort may have freed room since (no step ran)
            out += e.admit_handoffs()
        return out + e.end_all(
            e.tiers.expired(now), e.why(f"its KV swap did not finish within {SWAP_TIMEOUT_S} s")
        )

    def lost_reply_to(self, reply_to: str) -> Outbox:
        """A router this engine reports to is gone (its connection down for a while): end its
        requests here, retryably; the error waits in its queue in case it comes back. Its count
        of received requests goes too, so the reports stay one entry per live router."""
        e = self.engine
        e.reports.forget_router(reply_to)
        lost = e.table.of_router(reply_to)
        if lost:
            log.warning("router lost; ending its requests", engine=e.engine_id,
                        router=reply_to, num_requests=len(lost))  # fmt: skip
        return e.end_all(lost, e.why("lost its router"))

    def kv_undelivered(self, req_id: str) -> Outbox:
        """A request's KV transfer failed (its receiver died or stopped reading): if it is still
        here, it ends retryably; once handed off, its token engine's KV wait ends it."""
        e = self.engine
        if req_id not in e.table:
            return Outbox()
        return e.end(req_id, e.why("its KV could not be delivered"), retryable=True)

    def undelivered_handoff(self, handoff: DecodeHandoff) -> Outbox:
        """A hand-off its token engine would not take (gone, or not reading)."""
        return Outbox.refusal(handoff, self.engine.why("its token engine is unreachable"))

    def fail_all(self, error: str) -> Outbox:
        """A step failed, for no one request's fault (a shard answered with an error, a kernel
        raised): end every request here, retryably, and free all. The router re-runs each from
        its tokens (the self-healing path), at most `max_migrations` times."""
        return self.engine.end_all(list(self.engine.table.routes), error)

    def relink(self, links: Seq[ShardLink], shards: Seq[ShardAddress], reason: str) -> Outbox:
        """Decode against `shards` from now on (empty: local attention only).

        Every request tied to the old group (decoding against it, or waiting to, preempted
        included) ends with a retryable error: the router re-runs it from its tokens on a whole
        group. Its KV is freed on every shard of the old group: this engine cannot tell which
        one died (a free sent to a dead shard is dropped with its socket), and the live ones may
        hold it without ever having decoded it (a handoff still waiting), so no other free
        would come.
        """
        e = self.engine
        tied = [s.req_id for s in e.admission.sharded]
        tied += [h.req_id for h in e.admission.waiting if h.shards]
        tied += [s.req_id for _, s in e.admission.preempted]  # to be recomputed on the old group
        tied += sorted(e.admission.resuming)
        tied += e.tiers.moving()  # mid-swap, to or from the old group
        out = e.end_all(tied, e.why(reason))
        e.runner.relink(links, shards)
        log.warning("shard group relinked", engine=e.engine_id, reason=reason,
                    num_failed=len(tied), shards=[s.service_id for s in shards])  # fmt: skip
        return out


__all__ = ["HANDOFF_KV_WAIT_S", "EngineFaults"]
