"""Turn trace rows into a schedule of `RequestSpec`s: arrival process, token scaling, window, limit.

Arrival modes:

- `trace`: the trace's own timestamps, each gap multiplied by `time_scale` (2.0 = half speed, like
  SGLang's `--mooncake-slowdown-factor`; 0.5 = twice as fast).
- `poisson`: exponential gaps at `rate` requests/s (`inf`: every request at once, vLLM's default).
- `gamma`: gamma gaps at `rate` with shape `burstiness` (1.0 is Poisson; below 1 is burstier),
  vLLM bench's `--burstiness` convention.

In the rate-driven modes the lengths (and hash_ids) still come from the trace, in trace order,
cycling if the schedule outlasts the trace; the seed fixes the gaps.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from loadgen.target import RequestSpec
from loadgen.traces import TraceRow

ARRIVAL_MODES = ("trace", "poisson", "gamma")
MOONCAKE_BLOCK_LEN = 512


def parse_scale(text: str) -> float:
    """Read a scale factor written as `0.125`, `1/8` or `x1/8`."""
    value = float(Fraction(text.strip().lstrip("xX")))
    if value <= 0:
        raise ValueError(f"scale must be positive, got {text!r}")
    return value


def scale_tokens(num_tokens: int, scale: float) -> int:
    """Scale a token count, rounding to nearest, never below 1 (a request needs >= 1 token)."""
    return max(1, round(num_tokens * scale))


@dataclass(frozen=True)
class ArrivalConfig:
    """How to schedule a trace; see the module docstring for the modes."""

    mode: str = "trace"
    time_scale: float = 1.0
    rate: float | None = None
    burstiness: float = 1.0
    start_s: float = 0.0
    duration_s: float | None = None
    num_requests: int | None = None
    token_scale: float = 1.0
    output_scale: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ARRIVAL_MODES:
            raise ValueError(f"arrival mode must be one of {ARRIVAL_MODES}, got {self.mode!r}")
        if self.mode != "trace" and (self.rate is None or self.rate <= 0):
            raise ValueError(f"arrival mode {self.mode!r} needs a positive rate")
        if self.time_scale <= 0 or self.burstiness <= 0 or self.token_scale <= 0:
            raise ValueError("time_scale, burstiness and token_scale must be positive")
        if self.num_requests is not None and self.num_requests < 0:
            raise ValueError("num_requests must be >= 0")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be positive")

    @property
    def effective_output_scale(self) -> float:
        return self.token_scale if self.output_scale is None else self.output_scale


def arrival_gaps(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Endless gamma-distributed gaps with mean 1/rate (shape `burstiness`; 1.0 = Poisson)."""
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
    rng = np.random.default_rng(seed)
    scale = 1.0 / (rate * burstiness)
    while True:
        # Draw in blocks: one numpy call per 1024 gaps instead of one per request.
        yield from rng.gamma(shape=burstiness, scale=scale, size=1024).tolist()


def _timed_rows(
    rows: Iterable[TraceRow], config: ArrivalConfig
) -> Iterator[tuple[float, TraceRow]]:
    """(time the window is checked against, row): trace time for `trace`, else replay time."""
    if config.mode == "trace":
        for row in rows:
            yield row.arrival_s, row
        return
    assert config.rate is not None  # checked in __post_init__
    arrival_s = 0.0
    gaps = arrival_gaps(config.rate, config.burstiness, config.seed)
    # Cycle the trace only when a limit or window bounds the schedule; else one pass, not forever.
    bounded = config.num_requests is not None or config.duration_s is not None
    for row in itertools.cycle(rows) if bounded else rows:
        yield arrival_s, row
        arrival_s += next(gaps)


def plan_requests(rows: Iterable[TraceRow], config: ArrivalConfig) -> Iterator[RequestSpec]:
    """Yield the requests to send, lazily, with arrival times relative to the replay start.

    Only arrivals in `[start_s, start_s + duration_s)` are kept and shifted to start at 0; at most
    `num_requests` are yielded. In `trace` mode the window is in the trace's own time, so the same
    requests are replayed whatever the `time_scale` (their gaps then scaled); in the rate-driven
    modes it is in replay time.
    """
    end_s = None if config.duration_s is None else config.start_s + config.duration_s
    block_len = scale_tokens(MOONCAKE_BLOCK_LEN, config.token_scale)
    limit = config.num_requests
    scale = config.time_scale if config.mode == "trace" else 1.0
    count = 0
    for arrival_s, row in _timed_rows(rows, config):
        if limit is not None and count >= limit:
            return
        if end_s is not None and arrival_s >= end_s:
            if config.mode != "trace":
                return  # rate-driven arrivals only grow; a trace may be unsorted
            continue
        if arrival_s < config.start_s:
            continue
        yield RequestSpec(
            req_index=count,
            arrival_s=(arrival_s - config.start_s) * scale,
            input_len=scale_tokens(row.input_len, config.token_scale),
            output_len=scale_tokens(row.output_len, config.effective_output_scale),
            hash_ids=row.hash_ids,
            block_len=block_len,
            # A dataset's own text has its own length: kept only while lengths are not scaled.
            prompt_text=row.prompt if config.token_scale == 1.0 else None,
        )
        count += 1
