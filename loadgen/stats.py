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

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def trace_stats(rows: Iterable[TraceRow]) -> TraceStats:
    """Stream `rows` once and summarise them; only the two lengths per request are kept."""
    input_lens: list[int] = []
    output_lens: list[int] = []
    first_s = last_s = 0.0
    for index, row in enumerate(rows):
        if index == 0:
            first_s = row.arrival_s
        last_s = max(last_s, row.arrival_s)
        input_lens.append(row.input_len)
        output_lens.append(row.output_len)
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
    )


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
        ]
    )
