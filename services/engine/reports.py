"""What an engine tells the mesh about itself: `EngineStats` (its counters and KV events, for
tests, benches and the router's `/stats`) and the `LoadReport` routers place by (its pool, queues
and free KV where its decode KV lives). `EngineReports` reads the engine's parts and changes none
of them; the one state it keeps is the count of requests each router placed here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import structlog

from common.block_manager import BlockManager
from common.kv_ingress import KvIngress
from common.protocol import EngineStats, LoadReport, ShardAddress
from common.scheduling.batching import EngineScheduler
from common.scheduling.role_lease import RoleLease
from common.telemetry.engine_counts import engine_counters
from services.engine.admission import DecodeAdmission
from services.engine.kv_tiers import KvTiers
from services.engine.prefill_ship import Prefill
from services.engine.requests import RequestTable
from services.engine.routing import kv_endpoints, shard_kv_tokens
from services.engine.runner import MeshModelRunner
from services.engine.telemetry import EngineTelemetry

log = structlog.get_logger(__name__)


class EngineReports:
    """Stats and load reports of one engine, read from its parts."""

    def __init__(
        self,
        engine_id: str,
        pool: RoleLease,  # its home and current pool
        table: RequestTable,
        blocks: BlockManager,
        kv_ingress: KvIngress,
        queues: tuple[EngineScheduler, EngineScheduler],
        admission: DecodeAdmission,
        prefill: Prefill,
        tiers: KvTiers,
        runner: MeshModelRunner,
        telemetry: EngineTelemetry,
    ) -> None:
        self.engine_id, self.pool, self.table = engine_id, pool, table
        self.blocks, self.kv_ingress, self.admission = blocks, kv_ingress, admission
        self.ship_queue, self.local = queues  # prompts to hand off, requests decoding here
        self.prefill, self.tiers, self.runner, self.telemetry = prefill, tiers, runner, telemetry
        # `GenerateRequest`s received, by the router (`reply_to`) that sent them: each router's
        # placements its reports hold already (`LoadReport.received_requests`).
        self.received_requests: dict[str, int] = {}
        self.received_handoffs: dict[str, int] = {}  # `DecodeHandoff`s, likewise (KV admission)
        self.prompt_tokens_in = 0  # of the `GenerateRequest`s received (`LoadReport`'s counter)
        self._told_negative_pending = False

    def received(self, reply_to: str, handoff: bool = False, prompt_tokens: int = 0) -> None:
        """A request (or hand-off) from `reply_to`, counted placed whatever becomes of it."""
        self.prompt_tokens_in += prompt_tokens
        counts = self.received_handoffs if handoff else self.received_requests
        counts[reply_to] = counts.get(reply_to, 0) + 1

    def forget_router(self, reply_to: str) -> None:
        """A router is gone: one that comes back counts its next placements as on their way for
        at most its `PLACEMENT_TTL_S`."""
        self.received_requests.pop(reply_to, None)
        self.received_handoffs.pop(reply_to, None)

    def stats(self, shards: Seq[ShardAddress]) -> EngineStats:
        used = self.blocks.num_used_blocks + self.admission.shard_blocks.num_used_blocks
        t = self.telemetry
        return EngineStats(
            self.engine_id, self.pool.current(time.monotonic()), used, self.blocks.num_blocks,
            len(self.table.requests),
            [*self.kv_ingress.events, *self.prefill.kv_events, *self.tiers.kv_events],
            self.prefill.num_computed_tokens, self.blocks.num_hit_tokens, home_role=self.pool.home,
            num_loans=self.pool.num_loans, num_home_moves=self.pool.num_home_moves,
            num_decode_steps=t.num_decode_steps,
            num_two_batch_steps=t.num_two_batch_steps, num_group_relinks=self.runner.num_relinks,
            num_preemptions=self.admission.num_preemptions + self.local.num_preemptions,
            step_times_s=[[p, m, float(kind)] for p, m, kind in t.step_times],
            decode_breakdown=self.runner.times.report() if shards else None,
            **self._peer_counts(),
        )  # fmt: skip

    def _peer_counts(self) -> dict[str, int]:
        peers = self.runner.model_peers
        if peers is None:
            return {}
        return {"num_peer_slices": peers.counts.num_slices,
                "num_peers_lost": peers.counts.num_lost,
                "num_peers_joined": peers.counts.num_joined}  # fmt: skip

    def load_report(self, now: float, shards: Seq[ShardAddress]) -> LoadReport:
        return LoadReport(
            engine_id=self.engine_id,
            role=self.pool.current(time.monotonic()),
            home_role=self.pool.home,
            prompt_tokens_in=self.prompt_tokens_in,
            pending_prompt_tokens=self._pending_prompt_tokens(),
            running_decode_tokens=self._decode_tokens(),
            num_running=len(self.local.running) + len(self.admission.sharded),
            num_waiting=self._num_waiting(),
            free_kv_blocks=self._free_kv_blocks(shards),
            time=now,
            shard_endpoints=kv_endpoints(shards),
            shard_kv_tokens=shard_kv_tokens(shards, self.admission.reserved_tokens()),
            handoff_tokens=self._handoff_tokens(),
            received_requests=dict(self.received_requests),
            received_handoffs=dict(self.received_handoffs),
            total_kv_blocks=self.admission.shard_blocks.num_blocks
            if shards
            else self.blocks.num_blocks,
            counters=engine_counters(
                queried=self.blocks.num_queried_tokens,
                hits=self.blocks.num_hit_tokens,
                preemptions=self.ship_queue.num_preemptions + self.local.num_preemptions,
                kv_blocks_used=self.admission.shard_blocks.num_used_blocks
                if shards
                else self.blocks.num_used_blocks,
                histograms=self.telemetry.histograms,
            ),
        )

    def _free_kv_blocks(self, shards: Seq[ShardAddress]) -> int:
        """Where its decode KV lives: the shard group (as this engine accounts it: its requests'
        tokens so far), or its own cache less what its local requests may still grow into;
        less, either way, what the hand-offs waiting to decode here and the preempted requests
        will take (a router must not count their room: preempted ones go first)."""
        if shards:
            free = self.admission.free_shard_blocks()
        else:
            free = self.blocks.num_free_blocks - self.local.blocks_to_grow(self.table.whole_len)
        return max(free - self.admission.waiting_blocks(self.blocks), 0)

    def _num_waiting(self) -> int:
        a = self.admission
        return self.ship_queue.num_unfinished + len(a.waiting) + len(a.preempted)

    def _decode_tokens(self) -> int:
        """The tokens of the requests it decodes or holds to decode: hand-offs waiting for their
        KV (or room) too. Their prompt engine stopped reporting them when it handed them off,
        and a router must not see this engine as free of them meanwhile."""
        decoding = sum(s.num_tokens for s in self.local.running + self.admission.sharded)
        preempted = sum(s.num_tokens for _, s in self.admission.preempted)
        return decoding + preempted + sum(len(h.token_ids) for h in self.admission.waiting)

    def _pending_prompt_tokens(self) -> int:
        """The schedulers' running counts of prompt tokens to prefill, never below 0: a router
        drops a report with a negative count (common/protocol/control.py `Count`), and an engine
        whose reports all dropped would keep its last load in every router's view."""
        pending = self.ship_queue.pending_prompt_tokens() + self.local.pending_prompt_tokens()
        if pending < 0 and not self._told_negative_pending:  # once, not every report
            self._told_negative_pending = True
            log.error("pending prompt tokens below zero; reported as 0", pending=pending)
        return max(pending, 0)

    def _handoff_tokens(self) -> dict[str, int]:
        """The tokens of the prompts it will hand off, by the token engine each goes to."""
        bound: dict[str, int] = {}
        for req_id, seq in self.ship_queue.seqs.items():
            route = self.table.routes.get(req_id)
            if route is not None and route.token_engine:
                bound[route.token_engine] = bound.get(route.token_engine, 0) + seq.num_tokens
        return bound


__all__ = ["EngineReports"]
