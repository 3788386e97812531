"""Arrival processes, windows, limits and token scaling."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.arrivals import ArrivalConfig, parse_scale, plan_requests, scale_tokens
from loadgen.traces import TraceRow


def trace_rows(count: int, gap_s: float = 1.0) -> list[TraceRow]:
    return [TraceRow(i * gap_s, 100 + i, 10 + i, (i,)) for i in range(count)]


def arrivals(config: ArrivalConfig, rows: list[TraceRow]) -> list[float]:
    return [spec.arrival_s for spec in plan_requests(rows, config)]


def test_trace_arrivals_follow_timestamps_times_time_scale() -> None:
    rows = [TraceRow(t, 5, 5) for t in (0.0, 0.5, 2.0, 2.0, 7.25)]
    assert arrivals(ArrivalConfig(), rows) == [0.0, 0.5, 2.0, 2.0, 7.25]
    assert arrivals(ArrivalConfig(time_scale=2.0), rows) == [0.0, 1.0, 4.0, 4.0, 14.5]
    assert arrivals(ArrivalConfig(time_scale=0.5), rows)[-1] == 3.625


def test_rate_arrivals_are_reproducible_for_a_seed() -> None:
    rows = trace_rows(200)
    config = ArrivalConfig(mode="poisson", rate=5.0, seed=7)
    assert arrivals(config, rows) == arrivals(config, rows)
    assert arrivals(config, rows) != arrivals(ArrivalConfig(mode="poisson", rate=5.0, seed=8), rows)


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_arrivals_have_the_requested_mean_rate(burstiness: float) -> None:
    config = ArrivalConfig(
        mode="gamma", rate=8.0, burstiness=burstiness, num_requests=40_001, seed=3
    )
    times = np.array(arrivals(config, trace_rows(100)))
    gaps = np.diff(times)
    assert len(times) / times[-1] == pytest.approx(8.0, rel=0.03)
    # Gamma with shape k has coefficient of variation 1/sqrt(k): 1 for Poisson, 2 for k=0.25.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_rate_arrivals_take_lengths_from_the_trace_in_order_cycling() -> None:
    rows = trace_rows(3)
    specs = list(plan_requests(rows, ArrivalConfig(mode="poisson", rate=1.0, num_requests=7)))
    assert [s.input_len for s in specs] == [100, 101, 102, 100, 101, 102, 100]
    assert [s.req_index for s in specs] == list(range(7))


def test_unbounded_rate_arrivals_make_one_pass_over_the_trace() -> None:
    specs = list(plan_requests(trace_rows(5), ArrivalConfig(mode="poisson", rate=1.0)))
    assert len(specs) == 5


def test_window_and_limit() -> None:
    rows = trace_rows(100)  # arrivals 0, 1, ..., 99 s
    window = ArrivalConfig(start_s=10.0, duration_s=5.0)
    specs = list(plan_requests(rows, window))
    assert [s.arrival_s for s in specs] == [0.0, 1.0, 2.0, 3.0, 4.0]  # shifted to start at 0
    assert [s.input_len for s in specs] == [110, 111, 112, 113, 114]
    limited = ArrivalConfig(start_s=10.0, duration_s=50.0, num_requests=3)
    assert [s.input_len for s in plan_requests(rows, limited)] == [110, 111, 112]
    # A trace window is in trace time: the same requests at any speed, gaps scaled.
    scaled = ArrivalConfig(time_scale=2.0, start_s=10.0, duration_s=5.0)
    assert arrivals(scaled, rows) == [0.0, 2.0, 4.0, 6.0, 8.0]
    timed = ArrivalConfig(mode="poisson", rate=50.0, duration_s=2.0, seed=1)
    assert max(arrivals(timed, rows)) < 2.0


def test_token_scaling_of_lengths_and_hash_blocks() -> None:
    rows = [TraceRow(0.0, 6955, 52, (46, 47)), TraceRow(1.0, 3, 1)]
    specs = list(plan_requests(rows, ArrivalConfig(token_scale=parse_scale("x1/8"))))
    assert [(s.input_len, s.output_len) for s in specs] == [(869, 6), (1, 1)]
    assert specs[0].block_len == 64 and specs[0].hash_ids == (46, 47)
    kept_output = ArrivalConfig(token_scale=0.125, output_scale=1.0)
    assert next(plan_requests(rows, kept_output)).output_len == 52


def test_parse_scale_and_scale_tokens() -> None:
    assert parse_scale("1/8") == parse_scale("x1/8") == parse_scale("0.125") == 0.125
    with pytest.raises(ValueError):
        parse_scale("0")
    assert scale_tokens(0, 0.5) == 1
    assert scale_tokens(13, 0.5) == 6  # round half to even: 6.5 -> 6


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="positive rate"):
        ArrivalConfig(mode="poisson")
    with pytest.raises(ValueError, match="arrival mode"):
        ArrivalConfig(mode="uniform")
    with pytest.raises(ValueError):
        ArrivalConfig(time_scale=0.0)
