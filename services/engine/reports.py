"""What an engine tells the mesh about itself: `EngineStats` (its counters, KV events and step
times, for tests, benches and the router's `/stats`) and the `LoadReport` routers place by (its
pool, queues and free KV where its decode KV lives). A mixin of `Engine` (engine.py): reading
only, it changes no state; the state it reads is the engine's (declared here).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import structlog

from common.block_manager import BlockManager
from common.engine.request import Request
from common.kv_ingress import KvIngress
from common.protocol import EngineStats, KvEvent, LoadReport, ShardAddress
from common.scheduling.batching import EngineScheduler
from common.scheduling.role_lease import RoleLease
from services.engine.admission import DecodeAdmission
from services.engine.routing import EngineRole, RequestRoute, kv_endpoints, shard_kv_tokens
from services.engine.runner import MeshModelRunner

log = structlog.get_logger(__name__)


class EngineReports:
    """`Engine`'s reports; the state they read is the engine's (declared here)."""

    engine_id: str
    role: EngineRole
    pool: RoleLease
    blocks: BlockManager
    kv_ingress: KvIngress
    admission: DecodeAdmission
    ship_queue: EngineScheduler
    local: EngineScheduler
    runner: MeshModelRunner
    shards: tuple[ShardAddress, ...]
    requests: dict[str, Request]
    routing: dict[str, RequestRoute]
    kv_events: deque[KvEvent]
    num_prefill_tokens: int
    num_decode_steps: int
    num_group_relinks: int
    received_requests: dict[str, int]
    num_two_batch_steps: int
    step_times: deque[tuple[float, float, int]]
    _told_negative_pending = False  # its own: set on the engine the first time it logs

    if TYPE_CHECKING:  # the engine's own, or another mixin's: no runtime stub to shadow it

        def _local_growth(self) -> int: ...  # Engine's

    def stats(self) -> EngineStats:
        used = self.blocks.num_used_blocks + self.admission.shard_blocks.num_used_blocks
        return EngineStats(
            self.engine_id, self.pool.current(time.monotonic()), used, self.blocks.num_blocks,
            len(self.requests), [*self.kv_ingress.events, *self.kv_events],
            self.num_prefill_tokens, self.blocks.num_hit_tokens, home_role=self.role.name,
            num_loans=self.pool.num_loans, num_decode_steps=self.num_decode_steps,
            num_two_batch_steps=self.num_two_batch_steps, num_group_relinks=self.num_group_relinks,
            step_times_s=[[p, m, float(kind)] for p, m, kind in self.step_times],
            decode_breakdown=self.runner.times.report() if self.shards else None,
            **self._peer_counts(),
        )  # fmt: skip

    def _peer_counts(self) -> dict[str, int]:
        peers = self.runner.model_peers
        if peers is None:
            return {}
        return {"num_peer_slices": peers.counts.num_slices,
                "num_peers_lost": peers.counts.num_lost,
                "num_peers_joined": peers.counts.num_joined}  # fmt: skip

    def load_report(self, now: float) -> LoadReport:
        return LoadReport(
            engine_id=self.engine_id,
            role=self.pool.current(time.monotonic()),
            home_role=self.role.name,
            pending_prompt_tokens=self._pending_prompt_tokens(),
            running_decode_tokens=self._decode_tokens(),
            num_running=len(self.local.running) + len(self.admission.sharded),
            num_waiting=self.ship_queue.num_unfinished + len(self.admission.waiting),
            # Where its decode KV lives: the shard group (as this engine accounts it) or its own.
            free_kv_blocks=self.admission.free_shard_blocks()
            if self.shards
            else max(self.blocks.num_free_blocks - self._local_growth(), 0),
            time=now,
            shard_endpoints=kv_endpoints(self.shards),
            shard_kv_tokens=shard_kv_tokens(self.shards, self.admission.reserved_tokens()),
            handoff_tokens=self._handoff_tokens(),
            received_requests=dict(self.received_requests),
        )

    def _decode_tokens(self) -> int:
        """The tokens of the requests it decodes or holds to decode: hand-offs waiting for their
        KV (or room) too. Their prompt engine stopped reporting them when it handed them off,
        and a router must not see this engine as free of them meanwhile."""
        decoding = sum(s.num_tokens for s in self.local.running + self.admission.sharded)
        return decoding + sum(len(h.token_ids) for h in self.admission.waiting)

    def _pending_prompt_tokens(self) -> int:
        """The schedulers' running counts of prompt tokens to prefill, never below 0: a router
        drops a report with a negative count (common/protocol/control.py `Count`), and an engine
        whose reports all dropped would keep its last load in every router's view."""
        pending = self.ship_queue.pending_prompt_tokens() + self.local.pending_prompt_tokens()
        if pending < 0 and not self._told_negative_pending:  # once, not every 50 ms
            self._told_negative_pending = True
            log.error("pending prompt tokens below zero; reported as 0", pending=pending)
        return max(pending, 0)

    def _handoff_tokens(self) -> dict[str, int]:
        """The tokens of the prompts it will hand off, by the token engine each goes to."""
        bound: dict[str, int] = {}
        for req_id, seq in self.ship_queue.seqs.items():
            route = self.routing.get(req_id)
            if route is not None and route.token_engine:
                bound[route.token_engine] = bound.get(route.token_engine, 0) + seq.num_tokens
        return bound


__all__ = ["EngineReports"]
