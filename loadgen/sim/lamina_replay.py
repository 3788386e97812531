"""Decode-only trace replay on a Lamina cluster or its homogeneous baseline (Lamina §6.1).

As in Lamina's evaluation, prefill is elsewhere and not counted: every request of the trace
slice is queued at time 0 with its prompt's KV ready, and the cluster decodes as many at once as
its KV memory holds, FCFS. A request is admitted only when its whole final context (prompt +
output) fits, so nothing is ever preempted; a request larger than the whole memory is refused.
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

from common.scheduling.lamina_pipeline import PipelinePlan, plan_layer
from loadgen.sim.lamina_config import LaminaCluster


@dataclass
class Breakdown:
    """Time-weighted sums over a window, per token (Fig. 12): seconds x step seconds."""

    model_s: float = 0.0
    attention_s: float = 0.0
    network_s: float = 0.0
    hidden_s: float = 0.0
    wait_s: float = 0.0
    compute_busy: float = 0.0
    memory_busy: float = 0.0

    def add(self, plan: PipelinePlan, layers: int, weight_s: float) -> None:
        self.model_s += plan.model_s * layers * weight_s
        self.attention_s += plan.attention_s * layers * weight_s
        self.network_s += plan.network_s * layers * weight_s
        self.hidden_s += plan.hidden_s * layers * weight_s
        self.wait_s += plan.wait_s * layers * weight_s
        self.compute_busy += plan.compute_busy * weight_s
        self.memory_busy += plan.memory_busy * weight_s

    def mean(self, total_s: float) -> dict[str, float]:
        if total_s <= 0:
            return {}
        return {name: value / total_s for name, value in vars(self).items()}


@dataclass
class DecodeReplayResult:
    """What a replay measured. Window figures are over the saturated window."""

    cluster: LaminaCluster
    num_requests: int
    num_refused: int
    window_s: float = 0.0
    window_tokens: int = 0
    window_batch_s: float = 0.0  # sum of batch size x step time
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
    def tokens_per_usd(self) -> float:
        return self.tokens_per_s * 3600.0 / self.cluster.usd_per_hour


def step_plan(cluster: LaminaCluster, batch_size: int, context_tokens: float) -> PipelinePlan:
    """The pipeline's per-layer plan for `batch_size` running requests holding
    `context_tokens` of KV, split into the cluster's `n` equal batches."""
    n = cluster.num_batches
    costs = cluster.layer_costs(batch_size / n, context_tokens / n)
    return plan_layer(costs, n, cluster.replicas, cluster.overlap)


def replay_decode(
    cluster: LaminaCluster, requests: Iterable[tuple[int, int]], max_batch: int = 0
) -> DecodeReplayResult:
    """Decode every (prompt_len, output_len) request; `max_batch` caps running requests."""
    capacity = cluster.kv_capacity_tokens()
    queue: deque[tuple[int, int]] = deque()
    num_requests = num_refused = 0
    for prompt_len, output_len in requests:
        num_requests += 1
        if output_len <= 1:
            continue  # the first token comes from prefill: nothing to decode
        if prompt_len + output_len > capacity:
            num_refused += 1
            continue
        queue.append((prompt_len, output_len))
    result = DecodeReplayResult(cluster, num_requests, num_refused)
    layers = cluster.model.num_layers
    finish: list[tuple[int, int]] = []  # (finish step, reserved = final context tokens)
    step = 0
    now = reserved = context = 0.0
    while queue or finish:
        while queue and reserved + sum(queue[0]) <= capacity:
            if max_batch and len(finish) >= max_batch:
                break
            prompt_len, output_len = queue.popleft()
            reserved += prompt_len + output_len
            context += prompt_len + 1
            heapq.heappush(finish, (step + output_len - 1, prompt_len + output_len))
        batch = len(finish)
        num_steps = finish[0][0] - step
        saturated = bool(queue)
        # The stretch's contexts grow by one token per request per step: cost it mid-way.
        plan = step_plan(cluster, batch, context + batch * (num_steps - 1) / 2)
        stretch_s = num_steps * layers * plan.period_s
        now += stretch_s
        result.num_tokens += batch * num_steps
        context += batch * num_steps
        step += num_steps
        if saturated:
            result.window_s += stretch_s
            result.window_tokens += batch * num_steps
            result.window_batch_s += batch * stretch_s
            result.breakdown.add(plan, layers, stretch_s)
        while finish and finish[0][0] == step:
            _, tokens = heapq.heappop(finish)
            reserved -= tokens
            context -= tokens  # prompt + first token + output - 1 decoded
    result.end_s = now
    if result.window_s == 0.0:
        raise ValueError(
            f"{cluster.label}: the whole slice fit at once; no saturated window to measure "
            "(replay more requests)"
        )
    return result
