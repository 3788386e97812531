"""An engine's prefill: a batch of prompts through the model, their first tokens sampled. For a
prompt that decodes elsewhere (Splitwise's prompt machine) its KV is shipped while it is computed
(`KvShipper`: to the request's shard group, or to its token engine's KV listener; layer-wise for
long prompts), and the request is then handed off (`DecodeHandoff`) to its token engine; one that
finished at its first token is not handed off, and the KV it just shipped is freed where it went.
A failed send is the worker's input (the engine's `kv_undelivered`), not this step's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

from common.engine.core import forward_and_sample
from common.engine.request import Request
from common.protocol import DecodeHandoff, KvEvent, ShardAddress
from common.sampling import SampledRow, Sampler
from common.scheduling.batching import Batch
from common.telemetry.metrics import ITERATION_TOKENS
from services.engine.kv_shipper import KvRoute, KvSend, KvShipper
from services.engine.outbox import Outbox
from services.engine.requests import RequestTable
from services.engine.routing import RequestRoute
from services.engine.runner import MeshModelRunner, StepPlan
from services.engine.telemetry import EngineTelemetry


class Prefill:
    """Runs prefill batches, shipping the KV of prompts that decode elsewhere."""

    def __init__(
        self,
        runner: MeshModelRunner,
        sampler: Sampler,
        kv_send: KvSend,
        telemetry: EngineTelemetry,
        layer_wise_min_tokens: int,
    ) -> None:
        self.runner, self.sampler, self.kv_send = runner, sampler, kv_send
        self.telemetry = telemetry
        self.layer_wise_min_tokens = layer_wise_min_tokens  # Splitwise §IV-C
        self.num_layers = len(runner.model.layers)
        self.num_kv_heads = runner.model.config.num_key_value_heads
        self.num_computed_tokens = 0  # prompt tokens computed, i.e. not found in a cached prefix
        self.kv_events: deque[KvEvent] = deque(maxlen=256)  # `prefilled`, as each one ships

    def run(self, batch: Batch, table: RequestTable) -> list[SampledRow]:
        """Prefill prompts that decode on this engine (a mixed engine's own)."""
        return self._forward(
            batch, table, self.runner.plan_prefill(batch, table.token_ids(batch.seqs))
        )

    def run_chunk(self, chunk: Batch, table: RequestTable) -> None:
        """One chunk of a long prefill (prefill_chunks.py): its K/V into the cache, no token."""
        self.num_computed_tokens += chunk.num_tokens
        self.telemetry.histograms.observe(ITERATION_TOKENS, chunk.num_tokens)
        self.runner.run(self.runner.plan_prefill(chunk, table.token_ids(chunk.seqs)))

    def run_and_ship(
        self, batch: Batch, table: RequestTable, generations: Mapping[str, int] | None = None
    ) -> list[SampledRow]:
        """Prefill prompts that decode elsewhere, each one's KV shipped as it is computed.
        `generations`: preempted requests recomputed by their token engine, each with the
        generation of its new KV (`KvPages.kv_generation`)."""
        gens = generations or {}
        routes = [self._kv_route(s.req_id, s.num_tokens, table, gens.get(s.req_id, 0))
                  for s in batch.seqs]  # fmt: skip
        shipper = KvShipper(routes, self.num_layers, self.kv_send)
        plan = self.runner.plan_prefill(batch, table.token_ids(batch.seqs), shipper)
        sampled = self._forward(batch, table, plan)
        end_ns = time.time_ns()
        shipper.finish()
        self.telemetry.kv_shipped(routes, shipper.num_layers, end_ns)
        for seq in batch.seqs:
            self.kv_events.append(KvEvent("prefilled", seq.req_id, self.num_layers - 1,
                                          shipper.last_layer_done_at))  # fmt: skip
        return sampled

    def _forward(self, batch: Batch, table: RequestTable, plan: StepPlan) -> list[SampledRow]:
        start_ns = self.telemetry.prefill_started(s.req_id for s in batch.seqs)
        self.num_computed_tokens += batch.num_tokens
        self.telemetry.histograms.observe(ITERATION_TOKENS, batch.num_tokens)
        reqs = [table.requests[s.req_id] for s in batch.seqs]
        sampled = forward_and_sample(self.runner, self.sampler, plan, reqs, batch.phase)
        self.telemetry.prefill_done(batch.seqs, start_ns, time.time_ns())
        return sampled

    def _kv_route(
        self, req_id: str, num_tokens: int, table: RequestTable, kv_generation: int = 0
    ) -> KvRoute:
        r = table.routes[req_id]
        dests = list(r.shards) or [ShardAddress(
            r.token_kv_endpoint, 0, self.num_kv_heads, kv_address=r.token_kv_address
        )]  # fmt: skip
        # Shards hold the KV shipped and grow it per decode step; the token engine preempts
        # when they would run out (admission.py).
        reserve = num_tokens if r.shards else 0
        return KvRoute(req_id, dests, num_tokens >= self.layer_wise_min_tokens, reserve,
                       traceparent=self.telemetry.traceparent(req_id),
                       kv_generation=kv_generation)  # fmt: skip

    def hand_off(self, req: Request, route: RequestRoute) -> Outbox:
        """The prefilled request, to its token engine."""
        handoff = DecodeHandoff(
            req_id=req.req_id,
            token_ids=req.all_token_ids,
            num_prompt_tokens=len(req.prompt_token_ids),
            sampling=req.params.to_spec(),
            reply_to=route.reply_to,
            num_kv_layers=self.num_layers,
            shards=list(route.shards),
            traceparent=self.telemetry.handed_off(req.req_id),
        )
        return Outbox(handoffs=[(route.token_engine, handoff)])


def free_shipped(req_id: str, route: RequestRoute) -> Outbox:
    """A request that finished at its first token: free the KV just shipped for it."""
    endpoints = [s.kv_endpoint for s in route.shards] or [route.token_kv_endpoint]
    return Outbox.free(req_id, endpoints)


__all__ = ["Prefill", "free_shipped"]
