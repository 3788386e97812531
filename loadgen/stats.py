"""Summary statistics of a trace (the `stats` subcommand) and the one percentile rule."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from loadgen.traces import TraceRow


def percentile(values: Sequence[float] | np.ndarray, pct: float) -> float:
    """The `pct`-th percentile with linear interpolation (numpy's default, as vLLM bench uses);
    NaN for no values, so an empty run reports NaN instead of raising."""
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), pct))


@dataclass(frozen=True)
class TraceStats:
    """Request count, time span, mean arrival rate, and input/output token statistics."""

    num_requests: int
    span_s: float
    rate_rps: float
    input_mean: float
    input_p50: float
    input_p99: float
    output_mean: float
    output_p50: float
    output_p99: float
    # The prefix reuse bound: the fraction of prompt tokens in leading hash blocks (Mooncake
    # `hash_ids`) that an earlier request's prompt began with too: the most a prefix cache big
    # enough for everything could skip. 0 for traces without hash ids (Azure).
    prefix_reuse: float = 0.0

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def trace_stats(rows: Iterable[TraceRow]) -> TraceStats:
    """Stream `rows` once and summarise them; only the two lengths per request are kept."""
    input_lens: list[int] = []
    output_lens: list[int] = []
    first_s = last_s = 0.0
    reuse = PrefixReuse()
    for index, row in enumerate(rows):
        if index == 0:
            first_s = row.arrival_s
        last_s = max(last_s, row.arrival_s)
        input_lens.append(row.input_len)
        output_lens.append(row.output_len)
        reuse.add(row.hash_ids, row.input_len)
    inputs = np.asarray(input_lens, dtype=np.int64)
    outputs = np.asarray(output_lens, dtype=np.int64)
    span_s = last_s - first_s
    count = len(inputs)
    return TraceStats(
        num_requests=count,
        span_s=span_s,
        # NOTE: n arrivals over a span have n-1 gaps; n/span is what the papers quote.
        rate_rps=count / span_s if span_s > 0 else float("nan"),
        input_mean=float(inputs.mean()) if count else float("nan"),
        input_p50=percentile(inputs, 50),
        input_p99=percentile(inputs, 99),
        output_mean=float(outputs.mean()) if count else float("nan"),
        output_p50=percentile(outputs, 50),
        output_p99=percentile(outputs, 99),
        prefix_reuse=reuse.fraction,
    )


MOONCAKE_BLOCK_TOKENS = 512  # the prompt tokens one Mooncake hash id stands for


class PrefixReuse:
    """The prefix reuse bound over requests in arrival order (see `TraceStats.prefix_reuse`).

    A hash id names a block *given everything before it* only in a chain, so prefixes are keyed by
    their whole chain of ids (a hash of the chain so far), as a prefix cache keys its blocks."""

    def __init__(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self.seen: set[int] = set()
        self.reused_tokens = 0
        self.prompt_tokens = 0

    def add(self, hash_ids: Sequence[int], input_len: int) -> None:
        chain, matched, extends = 0, 0, True
        for hash_id in hash_ids:
            chain = hash((chain, hash_id))
            if extends and chain in self.seen:
                matched += 1
            else:
                extends = False
                self.seen.add(chain)
        self.reused_tokens += min(matched * self.block_tokens, input_len)
        self.prompt_tokens += input_len

    @property
    def fraction(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def format_stats(stats: TraceStats) -> str:
    """A human-readable block for the terminal."""
    return "\n".join(
        [
            f"requests:        {stats.num_requests}",
            f"span:            {stats.span_s:.1f} s",
            f"mean rate:       {stats.rate_rps:.3f} req/s",
            f"input tokens:    mean {stats.input_mean:.1f}  p50 {stats.input_p50:.0f}"
            f"  p99 {stats.input_p99:.0f}",
            f"output tokens:   mean {stats.output_mean:.1f}  p50 {stats.output_p50:.0f}"
            f"  p99 {stats.output_p99:.0f}",
            f"prefix reuse:    {stats.prefix_reuse:.3f} of prompt tokens (bound, hash_ids)",
        ]
    )
