"""What an engine counts for the router's `/metrics`, in plain integers: no telemetry call per
step. Its load report carries the counts (`common.protocol.EngineCounters`); the router turns them
into Prometheus series (services/router/metrics_endpoint.py).

`EngineHistograms` holds the engine's histograms that `/metrics` serves (`REPORTED_HISTOGRAMS`):
tokens per forward pass (vLLM's `iteration_tokens_total`: a prefill batch's prompt tokens, or a
decode batch's rows; the mixed policy's iteration runs as a prefill batch, then a decode batch:
two forwards) and the request phases the engine also records to OpenTelemetry and Ray (queue,
prefill, decode time), each in its metric's buckets.
"""

from __future__ import annotations

import bisect

from common.protocol import EngineCounters, HistogramCounts
from common.telemetry.metrics import (
    DECODE_TIME,
    ITERATION_TOKENS,
    PREFILL_TIME,
    QUEUE_TIME,
    MetricSpec,
    short_name,
)

REPORTED_HISTOGRAMS = (ITERATION_TOKENS, QUEUE_TIME, PREFILL_TIME, DECODE_TIME)


class BucketCounts:
    """One histogram: the count of samples in each bucket (+Inf last) and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # a bound is its bucket's
        self.total += value

    def snapshot(self) -> HistogramCounts:
        return HistogramCounts(list(self.counts), self.total)


class EngineHistograms:
    """The engine's `REPORTED_HISTOGRAMS`, observed by spec."""

    def __init__(self) -> None:
        self.by_name = {spec.name: BucketCounts(spec.buckets) for spec in REPORTED_HISTOGRAMS}

    def observe(self, spec: MetricSpec, value: float) -> None:
        self.by_name[spec.name].observe(value)

    def snapshot(self) -> dict[str, HistogramCounts]:
        """Those with samples, by short name (`iteration_tokens_total`, ...)."""
        return {short_name(n): h.snapshot() for n, h in self.by_name.items() if h.total}


def engine_counters(
    *,
    queried: int,
    hits: int,
    preemptions: int,
    kv_blocks_used: int,
    histograms: EngineHistograms,
) -> EngineCounters:
    """What a load report carries for `/metrics`, read from an engine's parts."""
    return EngineCounters(
        prefix_cache_queries=queried,
        prefix_cache_hits=hits,
        num_preemptions=preemptions,
        kv_blocks_used=kv_blocks_used,
        histograms=histograms.snapshot(),
    )
