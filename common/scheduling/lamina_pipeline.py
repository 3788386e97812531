"""Lamina's decode pipeline (§4.2.2, §4.3) as a pure function: how long one layer of one batch
takes when `n` batches rotate between compute replicas and a shared attention (memory) group.

Per layer, a batch runs its model slice on a compute replica (`model_s`, t_m: post-attention of
the previous layer and pre-attention of this one), sends q, k, v to the memory group, which
attends over the batch's KV (`attention_s`, t_a), and gets the attention output back. With `n`
batches in flight the resources work on different batches at once (rotational staggered
pipelining, Fig. 8). The pipeline is a closed cycle of deterministic stages, so its steady state
is a marked graph's: the time each batch takes per layer (`period_s`) is the largest of

- the critical path of one batch (model, both network hops, attention; `n` = 1 has only this),
- each resource's occupancy by all `n` batches: compute `n * t_m / replicas` (the rotation
  spreads batches evenly over replicas), memory `n * t_a`, each link direction `n * wire`.

Lamina sizes the memory group so that t_a = t_m / (n - 1) with n - 1 replicas: then compute and
memory are both busy all the time (`idle` 0). Anything else leaves one of them idle; the plan says
which resource bounds the period and how long each device idles per layer.

q-early overlap (§4.2.2): Q-proj runs first and q leaves at once; the memory group attends over
the previous tokens while K/V-proj runs and k, v travel, and folds in the new token's K/V with the
log-sum-exp combine. Two paths then join at the memory group: q's (its wire, then attention) and
k/v's (K/V-proj, then their wire, which waits for q's if q is still on the wire), so the critical
path loses `min(kv_proj + kv_wire, q_wire + t_a, kv_proj + t_a)` (`hidden_s`). Overlap changes no
resource's occupancy (the same work, reordered).

NOTE: the network is one full-duplex link: the memory group's NICs, which every batch's bytes
cross. Callers give wire times at the slower end of the replica-to-memory path, so when the
replica's NICs are the slower end the link's occupancy is an over-estimate (each replica's own
NICs carry only its batches). Imports nothing but the standard library: the live engine can call
`choose_num_batches` to pick `n`, the simulator replays traces through `plan_layer`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class LayerCosts:
    """One batch's costs for one layer, in seconds.

    `model_s` is t_m on one compute replica; `attention_s` t_a on the whole memory group (its
    devices split the batch's heads or requests); the wire times are bytes over bandwidth at the
    slower end (q, then k and v, towards the memory group; the attention output back);
    `latency_s` is one message's one-way latency; `kv_proj_s` the part of `model_s` after Q-proj
    (K and V projections), which q-early overlaps with attention."""

    model_s: float
    attention_s: float
    q_wire_s: float = 0.0
    kv_wire_s: float = 0.0
    out_wire_s: float = 0.0
    latency_s: float = 0.0
    kv_proj_s: float = 0.0

    def __post_init__(self) -> None:
        wires = (self.q_wire_s, self.kv_wire_s, self.out_wire_s)
        times = (self.model_s, self.attention_s, *wires, self.latency_s, self.kv_proj_s)
        if any(t < 0 or not math.isfinite(t) for t in times):
            raise ValueError(f"lamina pipeline: layer costs must be finite and >= 0: {self}")
        if self.kv_proj_s > self.model_s:
            raise ValueError("lamina pipeline: kv_proj_s is part of model_s, so at most model_s")

    @property
    def network_s(self) -> float:
        """The network's share of one batch's critical path: two hops' latency and all bytes."""
        return 2 * self.latency_s + self.q_wire_s + self.kv_wire_s + self.out_wire_s


class Bound(StrEnum):
    """What sets a pipeline's period."""

    LATENCY = "latency"  # one batch's own critical path: too few batches to fill the devices
    COMPUTE = "compute"
    MEMORY = "memory"
    NETWORK = "network"


@dataclass(frozen=True)
class PipelinePlan:
    """The steady state of `num_batches` batches on `num_replicas` compute replicas, per layer.

    `period_s`: each batch advances one layer every `period_s` (a token takes layers x period).
    The breakdown of one batch's period (Fig. 12): `model_s + attention_s + network_s -
    hidden_s + wait_s == period_s`, where `wait_s` is time a batch waits for a busy device.
    Busy fractions are of each resource's time; 1 - busy is its idle share."""

    num_batches: int
    num_replicas: int
    period_s: float
    critical_path_s: float
    bound: Bound
    model_s: float
    attention_s: float
    network_s: float
    hidden_s: float
    wait_s: float
    compute_busy: float
    memory_busy: float
    link_busy: float

    @property
    def compute_idle_s(self) -> float:
        """Per period, how long each compute replica idles."""
        return (1.0 - self.compute_busy) * self.period_s

    @property
    def memory_idle_s(self) -> float:
        """Per period, how long the memory group idles (when Lamina's shards pull prefill KV)."""
        return (1.0 - self.memory_busy) * self.period_s


def _overlap_hidden_s(costs: LayerCosts) -> float:
    """What q-early takes off one batch's path: serially Q-proj end -> K/V-proj -> q, k, v on the
    wire -> attention; overlapped, the later of q's path (q wire + t_a) and k/v's (K/V-proj, then
    the k/v wire after q's wire)."""
    kv_path = max(costs.kv_proj_s, costs.q_wire_s) + costs.kv_wire_s
    q_path = costs.q_wire_s + costs.attention_s
    serial = costs.kv_proj_s + costs.q_wire_s + costs.kv_wire_s + costs.attention_s
    return serial - max(q_path, kv_path)


def default_replicas(num_batches: int) -> int:
    """Lamina's layout: n - 1 model replicas for n batches (n = 1 and 2 share one)."""
    return max(1, num_batches - 1)


def plan_layer(
    costs: LayerCosts, num_batches: int, num_replicas: int = 0, overlap: bool = True
) -> PipelinePlan:
    """The steady-state period of `num_batches` equal batches with `costs` each, on
    `num_replicas` compute replicas (0: `default_replicas`), with or without q-early overlap."""
    if num_batches < 1:
        raise ValueError(f"lamina pipeline: need at least one batch, got {num_batches}")
    replicas = num_replicas or default_replicas(num_batches)
    if replicas < 1:
        raise ValueError(f"lamina pipeline: need at least one replica, got {num_replicas}")
    n = num_batches
    hidden = _overlap_hidden_s(costs) if overlap else 0.0
    critical = costs.model_s + costs.attention_s + costs.network_s - hidden
    # NOTE: with fewer batches than replicas this is below t_m, and the critical path governs.
    compute = n * costs.model_s / replicas
    memory = n * costs.attention_s
    link = n * max(costs.q_wire_s + costs.kv_wire_s, costs.out_wire_s)
    candidates = (
        (critical, Bound.LATENCY),
        (compute, Bound.COMPUTE),
        (memory, Bound.MEMORY),
        (link, Bound.NETWORK),
    )
    period, bound = max(candidates, key=lambda c: c[0])
    if period <= 0:
        raise ValueError("lamina pipeline: a layer must take some time")
    return PipelinePlan(
        num_batches=n,
        num_replicas=replicas,
        period_s=period,
        critical_path_s=critical,
        bound=bound,
        model_s=costs.model_s,
        attention_s=costs.attention_s,
        network_s=costs.network_s,
        hidden_s=hidden,
        wait_s=period - critical,
        compute_busy=n * costs.model_s / (replicas * period),
        memory_busy=memory / period,
        link_busy=link / period,
    )


def choose_num_batches(
    costs_for: Callable[[int], LayerCosts],
    max_batches: int,
    num_replicas: int = 0,
    overlap: bool = True,
) -> PipelinePlan:
    """For a fixed set of running requests, the `n` (1..`max_batches`) that generates tokens
    fastest: `costs_for(n)` is one batch's layer costs when the requests are split into `n`
    batches. Tokens per second are total requests / (layers x period), so the shortest period
    wins; ties go to the smaller `n` (fewer, larger batches: less per-batch overhead)."""
    if max_batches < 1:
        raise ValueError("lamina pipeline: max_batches must be >= 1")
    plans = [plan_layer(costs_for(n), n, num_replicas, overlap) for n in range(1, max_batches + 1)]
    return min(plans, key=lambda p: (p.period_s, p.num_batches))
