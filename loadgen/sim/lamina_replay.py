"""Decode-only trace replay on a Lamina cluster or its homogeneous baseline (Lamina §6.1).

As in Lamina's evaluation, prefill is elsewhere and not counted: every request of the trace
slice is queued at time 0 with its prompt's KV ready, and the cluster decodes as many at once as
its KV memory holds, FCFS. A request is admitted only when its whole final context (prompt +
output) fits, so nothing is ever preempted; a request larger than the whole memory is refused.
KV sits on the attention group head- or request-partitioned (`lamina_placement.py`).
The running requests are split into `n` equal batches rotating through the pipeline
(`common.scheduling.lamina_pipeline.plan_layer`); every request gains one token per
`layers x period`. Between two completions nothing changes but the contexts' growth, so each
stretch is one step of the loop, costed at its mid-point context.

Throughput is measured over the saturated window (from 0 until the last request is admitted:
the queue is never empty), as a closed-loop benchmark does; the drain after it is not counted.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from common.scheduling.lamina_pipeline import (
    LayerCosts,
    PipelinePlan,
    choose_num_batches,
    plan_layer,
)
from loadgen.sim.lamina_config import MAX_AUTO_BATCHES, LaminaCluster
from loadgen.sim.lamina_placement import KVPlacement

# The `PipelinePlan` figures a breakdown sums: per-layer times (a token's: times the layers),
# then per-step figures.
PER_LAYER_TIMES = ("model_s", "attention_s", "network_s", "hidden_s", "wait_s")
PER_STEP = ("compute_busy", "memory_busy", "num_batches")


@dataclass
class Breakdown:
    """Time-weighted sums over a window, per token (Fig. 12), by figure: seconds x step seconds."""

    sums: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(PER_LAYER_TIMES + PER_STEP, 0.0)
    )

    def add(self, plan: PipelinePlan, layers: int, weight_s: float) -> None:
        for name in PER_LAYER_TIMES:
            self.sums[name] += getattr(plan, name) * layers * weight_s
        for name in PER_STEP:
            self.sums[name] += getattr(plan, name) * weight_s

    def mean(self, total_s: float) -> dict[str, float]:
        if total_s <= 0:
            return {}
        return {name: value / total_s for name, value in self.sums.items()}


@dataclass
class DecodeReplayResult:
    """What a replay measured. Window figures are over the saturated window."""

    cluster: LaminaCluster
    num_requests: int
    num_refused: int
    window_s: float = 0.0
    window_tokens: int = 0
    window_batch_s: float = 0.0  # sum of batch size x step time
    window_pulled_bytes: float = 0.0  # new requests' KV the attention group pulled
    window_spare_link_bytes: float = 0.0  # what its NICs could take beside q, k and v
    end_s: float = 0.0
    num_tokens: int = 0
    breakdown: Breakdown = field(default_factory=Breakdown)

    @property
    def tokens_per_s(self) -> float:
        return self.window_tokens / self.window_s if self.window_s else 0.0

    @property
    def mean_batch(self) -> float:
        """Running requests in the window, time-weighted (all n batches together)."""
        return self.window_batch_s / self.window_s if self.window_s else 0.0

    @property
    def mean_tbt_s(self) -> float:
        """Token-weighted mean time between tokens in the window."""
        return self.window_batch_s / self.window_tokens if self.window_tokens else 0.0

    @property
    def kv_pull_share(self) -> float:
        """Share of the attention group's spare inbound NIC capacity that pulling new requests'
        prompt KV takes (§5: shards read it in their free periods); < 1: it fits."""
        spare = self.window_spare_link_bytes
        return self.window_pulled_bytes / spare if spare > 0 else 0.0

    @property
    def tokens_per_usd(self) -> float:
        return self.tokens_per_s * 3600.0 / self.cluster.usd_per_hour


def step_plan(
    cluster: LaminaCluster, batch_size: int, context_tokens: float, imbalance: float = 1.0
) -> PipelinePlan:
    """The pipeline's per-layer plan for `batch_size` running requests holding
    `context_tokens` of KV, split into the cluster's `n` equal batches (or the best n)."""

    def costs_for(n: int) -> LayerCosts:
        return cluster.layer_costs(batch_size / n, context_tokens / n, imbalance)

    if cluster.num_batches == 0:
        return choose_num_batches(costs_for, MAX_AUTO_BATCHES, cluster.replicas, cluster.overlap)
    n = cluster.num_batches
    return plan_layer(costs_for(n), n, cluster.replicas, cluster.overlap)


class DecodeReplay:
    """One replay's state: the FCFS queue, the running requests by finish step, their KV."""

    def __init__(self, cluster: LaminaCluster, max_batch: int, max_tbt_s: float) -> None:
        self.cluster = cluster
        self.max_batch = max_batch
        self.max_tbt_s = max_tbt_s
        num_devices = max(cluster.num_memory, 1)
        self.kv = KVPlacement(cluster.kv_capacity_tokens(), num_devices, cluster.partition)
        self.queue: deque[tuple[int, int]] = deque()
        self.finish: list[tuple[int, int, int]] = []  # (finish step, final context, KV pool)
        self.step = 0
        self.now = 0.0
        m = cluster.model
        self.kv_bytes_per_token = m.spec.kv_bytes_per_token
        self.inbound_bytes_per_token = m.num_layers * (
            m.q_bytes_per_token + m.kv_out_bytes_per_token
        )
        self.memory_link_bytes_s = cluster.num_memory * cluster.memory.nic_gbps * 1e9 / 8

    def admit(self, result: DecodeReplayResult) -> None:
        """FCFS while the head of the queue finds room (and the batch cap allows)."""
        while self.queue and not (self.max_batch and len(self.finish) >= self.max_batch):
            prompt_len, output_len = self.queue[0]
            if self.max_tbt_s and self.finish and self.tbt_with(prompt_len + 1) > self.max_tbt_s:
                return
            pool = self.kv.place(prompt_len + output_len, prompt_len + 1)
            if pool is None:
                return
            self.queue.popleft()
            heapq.heappush(self.finish, (self.step + output_len - 1, prompt_len + output_len, pool))
            if self.step > 0:  # the first fill is a burst before the steady state
                result.window_pulled_bytes += prompt_len * self.kv_bytes_per_token

    def tbt_with(self, context: int) -> float:
        """The time between tokens if one more request, at `context` tokens, joined now."""
        batch = len(self.finish) + 1
        total = self.kv.total_context() + context
        plan = step_plan(self.cluster, batch, total, self.kv.imbalance())
        return self.cluster.model.num_layers * plan.period_s

    def advance(self, result: DecodeReplayResult) -> None:
        """Run until the next completion: one plan for the whole stretch, at its mid-point."""
        batch = len(self.finish)
        num_steps = self.finish[0][0] - self.step
        mid = (num_steps - 1) / 2
        plan = step_plan(self.cluster, batch, self.kv.total_context(mid), self.kv.imbalance(mid))
        layers = self.cluster.model.num_layers
        stretch_s = num_steps * layers * plan.period_s
        self.now += stretch_s
        result.num_tokens += batch * num_steps
        self.kv.advance(num_steps)
        self.step += num_steps
        if self.queue:  # saturated: somebody is waiting for room
            result.window_s += stretch_s
            result.window_tokens += batch * num_steps
            result.window_batch_s += batch * stretch_s
            result.breakdown.add(plan, layers, stretch_s)
            if self.cluster.is_lamina:
                decode_in = batch * num_steps * self.inbound_bytes_per_token
                spare = self.memory_link_bytes_s * stretch_s - decode_in
                result.window_spare_link_bytes += spare
        while self.finish and self.finish[0][0] == self.step:
            _, tokens, pool = heapq.heappop(self.finish)
            self.kv.free(pool, tokens)  # prompt + first token + output - 1 decoded


def replay_decode(
    cluster: LaminaCluster,
    requests: Iterable[tuple[int, int]],
    max_batch: int = 0,
    max_tbt_s: float = 0.0,
) -> DecodeReplayResult:
    """Decode every (prompt_len, output_len) request. `max_batch` caps running requests;
    `max_tbt_s` admits a request only while the step it joins stays under it (0: no cap; a
    lone request always runs)."""
    replay = DecodeReplay(cluster, max_batch, max_tbt_s)
    num_requests = num_refused = 0
    for prompt_len, output_len in requests:
        num_requests += 1
        if output_len <= 1:
            continue  # the first token comes from prefill: nothing to decode
        if not replay.kv.fits_alone(prompt_len + output_len):
            num_refused += 1
            continue
        replay.queue.append((prompt_len, output_len))
    result = DecodeReplayResult(cluster, num_requests, num_refused)
    while replay.queue or replay.finish:
        replay.admit(result)
        replay.advance(result)
    result.end_s = replay.now
    if result.window_s == 0.0:
        raise ValueError(
            f"{cluster.label}: the whole slice fit at once; no saturated window to measure "
            "(replay more requests)"
        )
    return result
