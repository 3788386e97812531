"""Tokens per forward pass, counted where an engine runs one: vLLM's `iteration_tokens_total`.

A forward is one batch: a prefill batch's prompt tokens, or a decode batch's rows (the mixed
policy's iteration runs as a prefill batch, then a decode batch: two forwards). The engine counts
each into fixed buckets, in plain integers (no telemetry call per step), and its load report
carries the counts (`common.protocol.EngineCounters`); the router's `/metrics` turns them into a
Prometheus histogram.
"""

from __future__ import annotations

import bisect

from common.protocol import EngineCounters

# vLLM's buckets for `vllm:iteration_tokens_total` (upper bounds; +Inf follows).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class IterationTokens:
    """The count of forwards in each bucket (+Inf last) and the tokens of all of them."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.total = 0

    def observe(self, num_tokens: int) -> None:
        """One forward of `num_tokens` tokens (0, an empty batch, is not a forward)."""
        if num_tokens <= 0:
            return
        self.counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.total += num_tokens


def engine_counters(
    *,
    queried: int,
    hits: int,
    preemptions: int,
    kv_blocks_used: int,
    iterations: IterationTokens,
) -> EngineCounters:
    """What a load report carries for `/metrics`, read from an engine's parts."""
    return EngineCounters(
        prefix_cache_queries=queried, prefix_cache_hits=hits, num_preemptions=preemptions,
        kv_blocks_used=kv_blocks_used, iteration_tokens=list(iterations.counts),
        iteration_tokens_sum=iterations.total,
    )  # fmt: skip
