"""The prompt role's step (Splitwise's prompt machine): prefill a batch of prompts whose decode
happens elsewhere, ship each one's KV while it is computed (`KvShipper`: to the request's shard
group, or to its token engine's KV listener; layer-wise for long prompts) and hand the request
off (`DecodeHandoff`) to its token engine. A request that finished at its first token is not
handed off: the KV it just shipped is freed where it went.

A mixin of `Engine` (engine.py); the state it acts on is the engine's (declared here). A failed
send is the worker's input (`faults.py`), not this step's.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from common.block_manager import BlockManager
from common.engine.request import Request
from common.model.llama import LlamaForCausalLM
from common.protocol import DecodeHandoff, KvEvent, ShardAddress
from common.sampling import SampledRow
from common.scheduling.batching import Batch, EngineScheduler
from services.engine.kv_shipper import KvRoute, KvSend, KvShipper
from services.engine.outbox import Outbox
from services.engine.routing import EngineRole, RequestRoute
from services.engine.runner import MeshModelRunner, StepPlan
from services.engine.telemetry import EngineTelemetry


class EnginePrefillShip:
    """`Engine`'s prompt-role step; the state it acts on is the engine's (declared here)."""

    role: EngineRole
    model: LlamaForCausalLM
    runner: MeshModelRunner
    blocks: BlockManager
    kv_send: KvSend
    telemetry: EngineTelemetry
    ship_queue: EngineScheduler
    requests: dict[str, Request]
    routing: dict[str, RequestRoute]
    kv_events: deque[KvEvent]  # `prefilled`, as each request's last layer is shipped
    num_prefill_tokens: int

    if TYPE_CHECKING:  # the engine's own, or another mixin's: no runtime stub to shadow it

        def _forward(self, batch: Batch, plan: StepPlan) -> list[SampledRow]: ...  # Engine's

        def _token_ids(self, batch: Batch) -> dict[str, list[int]]: ...  # Engine's

        def _emit(self, req_id: str, sampled: SampledRow) -> Outbox: ...  # EngineTokenOutput's

    def _prefill_and_ship(self, batch: Batch) -> Outbox:
        routes = []
        for seq in batch.seqs:
            r = self.routing[seq.req_id]
            dests = list(r.shards) or [ShardAddress(
                r.token_kv_endpoint, 0, self._num_kv_heads, kv_address=r.token_kv_address
            )]  # fmt: skip
            layer_wise = seq.num_tokens >= self.role.layer_wise_min_tokens
            # Shards hold a request's whole length from its first page (they cannot preempt).
            reserve = (
                seq.num_tokens + self.requests[seq.req_id].params.max_tokens if r.shards else 0
            )
            trace = self.telemetry.traceparent(seq.req_id)  # travels with its KV pages
            routes.append(KvRoute(seq.req_id, dests, layer_wise, reserve, traceparent=trace))
        shipper = KvShipper(routes, len(self.runner.model.layers), self.kv_send)
        start_ns = self.telemetry.prefill_started(s.req_id for s in batch.seqs)
        self.num_prefill_tokens += batch.num_tokens
        sampled = self._forward(
            batch, self.runner.plan_prefill(batch, self._token_ids(batch), shipper)
        )
        end_ns = time.time_ns()
        shipper.finish()
        self.telemetry.prefill_done(batch.seqs, start_ns, end_ns)
        self.telemetry.kv_shipped(routes, shipper.num_layers, end_ns)
        for seq in batch.seqs:
            last = len(self.runner.model.layers) - 1
            self.kv_events.append(
                KvEvent("prefilled", seq.req_id, last, shipper.last_layer_done_at)
            )
        out = Outbox()
        for seq, row in zip(batch.seqs, sampled, strict=True):
            route = self.routing[seq.req_id]
            out += self._emit(seq.req_id, row)
            if seq.req_id in self.requests:
                out += self._hand_off(seq.req_id)
            else:  # finished at its first token: free the KV it just shipped
                endpoints = [s.kv_endpoint for s in route.shards] or [route.token_kv_endpoint]
                out += Outbox.free(seq.req_id, endpoints)
            self.blocks.mark_computed(seq.req_id, seq.num_tokens)  # its prefix stays cached
            self.ship_queue.remove(seq.req_id)
        return out

    def _hand_off(self, req_id: str) -> Outbox:
        req, route = self.requests.pop(req_id), self.routing.pop(req_id)
        handoff = DecodeHandoff(
            req_id=req_id,
            token_ids=req.all_token_ids,
            num_prompt_tokens=len(req.prompt_token_ids),
            sampling=req.params.to_spec(),
            reply_to=route.reply_to,
            num_kv_layers=len(self.runner.model.layers),
            shards=list(route.shards),
            traceparent=self.telemetry.handed_off(req_id),
        )
        return Outbox(handoffs=[(route.token_engine, handoff)])

    @property
    def _num_kv_heads(self) -> int:
        return self.model.config.num_key_value_heads


__all__ = ["EnginePrefillShip"]
