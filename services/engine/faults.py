"""An engine's fault inputs (docs/failures.md): a lost router, KV or a hand-off that could not be
delivered, a failed step, a lost shard, a new shard group, waits past their bound. Each ends the
requests it concerns, alone and (where the mesh is at fault) retryably, so the router re-runs them
from their tokens; their batch-mates go on. A head-split group's lost shard costs only its heads:
its requests wait for them to be rebuilt (shard_rebuild.py), and migrate only where that fails.
`EngineFaults` decides which requests each fault ends; the `Engine` it is given ends them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import structlog

from common.protocol import DecodeHandoff, KvRebuilt, ShardAddress
from common.scheduling.shard_rebuild import RebuildChoice
from services.engine.engine import Engine
from services.engine.kv_tiers import SWAP_TIMEOUT_S
from services.engine.outbox import Outbox
from services.engine.runner import ShardLink
from services.engine.shard_rebuild import LostShards, rebuild_requests

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
        out += e.end_all(
            e.tiers.expired(now), e.why(f"its KV swap did not finish within {SWAP_TIMEOUT_S} s")
        )
        e.rebuilds.settle(e.admission.parked)
        if e.rebuilds.overdue(now):
            out += self.abandon_rebuild(f"its lost shard heads were not rebuilt within "
                                   f"{e.rebuilds.bound_s} s")  # fmt: skip
        return out

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

    def shard_lost(self, slots: set[int], now: float) -> Outbox:
        """Shards of the group (`slots`) died mid-step; every other shard's replies were read.

        A head-split group's sharded requests are parked for the rebuild of the lost heads, and
        the survivors keep their KV: the worker keeps their links (`rebuilds.held()`). Waiting
        hand-offs and swaps end as on any relink. A loss while a rebuild is under way (the
        replacement or a survivor died), or one the rules do not rebuild, ends the group's
        requests, retryably: the router re-runs them.
        """
        e, rebuilds = self.engine, self.engine.rebuilds
        reason = "a shard of its group stopped answering"
        if rebuilds.lost is not None:
            out = self.abandon_rebuild(f"{reason} while its lost heads were rebuilt")
            return out + self.relink([], [], reason, now=now)
        plan = rebuilds.first_plan(e.shards)
        if plan.choice is RebuildChoice.MIGRATE:
            return self.relink([], [], f"{reason}; {plan.reason}", now=now)
        rebuilds.lost = LostShards(e.shards, frozenset(slots), now)
        parked = e.admission.park()
        log.warning("shard lost; its heads will be rebuilt", engine=e.engine_id,
                    slots=sorted(slots), num_parked=len(parked))  # fmt: skip
        return self.relink([], [], reason, now=now)

    def kv_rebuilt(self, msg: KvRebuilt) -> Outbox:
        """A prompt engine rebuilt (or could not rebuild) a parked request's lost heads: it
        decodes again from the next step, or ends, retryably."""
        e, rebuilds = self.engine, self.engine.rebuilds
        if msg.req_id not in rebuilds.rebuilding:  # late: it ended meanwhile
            return Outbox()
        rebuilds.rebuilding.discard(msg.req_id)
        out = Outbox()
        if msg.error:
            rebuilds.num_fallbacks += 1
            why = e.why(f"its lost shard heads could not be rebuilt: {msg.error}")
            out = e.end(msg.req_id, why, retryable=True)
        elif e.admission.resume(msg.req_id):
            rebuilds.num_rebuilt += 1
        rebuilds.settle(e.admission.parked)
        return out

    def _rebuild_onto(self, group: Seq[ShardAddress], rebuilders: Seq[str], now: float) -> Outbox:
        """The keeper named the group (`LinkShards`): rebuild the parked requests' lost heads
        on it, wait for a whole one, or end them (`plan_rebuild`)."""
        e, rebuilds = self.engine, self.engine.rebuilds
        if rebuilds.lost is None:
            return Outbox()
        if rebuilds.onto is not None:  # under way: the same group again changes nothing
            if list(group) == list(rebuilds.onto):
                return Outbox()
            return self.abandon_rebuild("its shard group changed while its lost heads were rebuilt")
        plan = rebuilds.plan(group, len(rebuilders), now)
        if plan.choice is RebuildChoice.WAIT:
            return Outbox()
        if plan.choice is RebuildChoice.MIGRATE:
            return self.abandon_rebuild(plan.reason)
        parked = list(e.admission.parked)
        rebuilds.onto, rebuilds.rebuilding = tuple(group), set(parked)
        log.warning("rebuilding lost shard heads", engine=e.engine_id, num_requests=len(parked),
                    shards=[group[t].service_id for t in plan.targets])  # fmt: skip
        return rebuild_requests(parked, e.table, group, plan.targets, rebuilders,
                                e.parts.command_endpoint)  # fmt: skip

    def abandon_rebuild(self, why: str) -> Outbox:
        """End every parked request, retryably: the router re-runs it (migration). Also the
        worker's, when it must close the survivors' links (a link fault)."""
        e, rebuilds = self.engine, self.engine.rebuilds
        parked = list(e.admission.parked)
        rebuilds.num_fallbacks += len(parked)
        if parked:
            log.warning("lost shard heads not rebuilt; migrating", engine=e.engine_id, why=why,
                        num_requests=len(parked))  # fmt: skip
        out = e.end_all(parked, e.why(why))
        rebuilds.settle(())
        return out

    def relink(
        self,
        links: Seq[ShardLink],
        shards: Seq[ShardAddress],
        reason: str,
        rebuilders: Seq[str] = (),
        now: float | None = None,
    ) -> Outbox:
        """Decode against `shards` from now on (empty: local attention only).

        Every request tied to the old group (decoding against it, or waiting to, preempted
        included) ends with a retryable error: the router re-runs it from its tokens on a whole
        group. Its KV is freed on every shard of the old group: this engine cannot tell which
        one died (a free sent to a dead shard is dropped with its socket), and the live ones may
        hold it without ever having decoded it (a handoff still waiting), so no other free
        would come. Requests
        parked for a rebuild are not tied: `rebuilders` (prompt engines) may rebuild their lost
        heads on `shards` (`_rebuild_onto`; `now`: monotonic seconds, by default the clock's).
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
        now = time.monotonic() if now is None else now
        return out + self._rebuild_onto(shards, rebuilders, now)


__all__ = ["HANDOFF_KV_WAIT_S", "EngineFaults"]
