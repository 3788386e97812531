"""SLO parsing, absolute and slowdown attainment, baselines, goodput."""

from __future__ import annotations

import pytest

from loadgen.replay import RequestRecord
from loadgen.slo import Baseline, SloTarget, evaluate_slos, parse_slos


def record(index: int, ttft_s: float, gaps: list[float], *, input_len: int = 100, error=None):
    done = error is None
    return RequestRecord(
        req_index=index,
        scheduled_s=float(index),
        input_len=input_len,
        output_len=len(gaps) + 1,
        ttft_s=ttft_s if done else None,
        itl_s=list(gaps),
        e2e_s=ttft_s + sum(gaps) if done else None,
        output_tokens=len(gaps) + 1 if done else 0,
        error=error,
    )


def test_parse_units_percentiles_and_preset() -> None:
    assert parse_slos("ttft:p99:500ms") == [SloTarget("ttft", 99.0, 0.5, False)]
    assert parse_slos("tbt:0.1s, e2e:250") == [
        SloTarget("tbt", None, 0.1, False),
        SloTarget("e2e", None, 0.25, False),  # a bare number is milliseconds, as in vLLM
    ]
    preset = parse_slos("splitwise")
    assert len(preset) == 9 and all(t.slowdown for t in preset)
    table = {(t.metric, t.percentile): t.limit for t in preset}
    assert table[("ttft", 50.0)] == 2.0 and table[("ttft", 99.0)] == 6.0
    assert table[("tbt", 90.0)] == 1.5 and table[("e2e", 99.0)] == 5.0
    assert str(SloTarget("ttft", 90.0, 3.0, True)) == "ttft:p90:3x"
    with pytest.raises(ValueError, match="bad SLO"):
        parse_slos("latency:p99:1s")


def test_absolute_percentile_slo_counts_requests_within_the_limit() -> None:
    records = [record(i, ttft_s=(i + 1) / 100, gaps=[0.01]) for i in range(100)]  # 10..1000 ms
    result = evaluate_slos(parse_slos("ttft:p50:500ms,ttft:p90:850ms"), records, duration_s=10.0)
    p50, p90 = result["slos"]
    assert p50["attained_fraction"] == 0.5 and p50["met"]
    assert p50["measured"] == pytest.approx(0.505)
    assert p90["attained_fraction"] == 0.85 and not p90["met"]
    assert not result["all_percentile_slos_met"] and result["request_goodput"] == 0.0


def test_failed_requests_count_as_misses() -> None:
    records = [record(i, 0.01, [0.01]) for i in range(98)]
    records += [record(98, 0.0, [], error="ConnectError"), record(99, 0.0, [], error="X")]
    result = evaluate_slos(parse_slos("ttft:p99:1s,tbt:p99:1s"), records, duration_s=1.0)
    ttft, tbt = result["slos"]
    assert ttft["attained_fraction"] == 0.98 and not ttft["met"]
    assert tbt["attained_fraction"] == 1.0 and tbt["met"]  # failures add no gaps


def test_slowdown_slos_divide_by_the_baseline_per_request_size() -> None:
    baseline = Baseline(ttft_intercept_s=0.010, ttft_per_token_s=0.0001, tbt_s=0.020)
    # Unloaded TTFT: 0.02 s at 100 tokens, 0.11 s at 1000 tokens.
    records = [
        record(0, 0.04, [0.02, 0.02], input_len=100),  # ttft slowdown 2.0
        record(1, 0.33, [0.03, 0.03], input_len=1000),  # ttft slowdown 3.0, tbt 1.5
    ]
    result = evaluate_slos(
        parse_slos("ttft:p50:2x,tbt:p99:1.5x,e2e:p50:1.2x"), records, 1.0, baseline
    )
    ttft, tbt, e2e = result["slos"]
    assert ttft["measured"] == pytest.approx(2.5) and ttft["attained_fraction"] == 0.5
    assert ttft["met"] and tbt["met"] and tbt["unit"] == "x"
    # E2E baseline = TTFT(size) + (tokens - 1) * TBT: 0.06 and 0.15 s; measured 0.08 and 0.39.
    assert e2e["attained_fraction"] == 0.0 and not e2e["met"]


def test_slowdown_without_baseline_is_refused() -> None:
    with pytest.raises(ValueError, match="baseline"):
        evaluate_slos(parse_slos("splitwise"), [record(0, 0.1, [0.1])], 1.0)


def test_goodput_counts_requests_meeting_every_per_request_slo() -> None:
    records = [
        record(0, 0.1, [0.01, 0.01]),  # good
        record(1, 0.3, [0.01, 0.01]),  # TTFT too slow
        record(2, 0.1, [0.05, 0.05]),  # TPOT too slow
        record(3, 0.1, []),  # one token: no TPOT, cannot miss it
        record(4, 0.0, [], error="ReadTimeout"),
    ]
    result = evaluate_slos(parse_slos("ttft:200ms,tbt:20ms"), records, duration_s=2.0)
    assert result["good_requests"] == 2
    assert result["request_goodput"] == 1.0
    assert [s["attained_fraction"] for s in result["slos"]] == [0.6, 0.6]


def test_baseline_fit_recovers_a_linear_ttft() -> None:
    records = [record(i, 0.005 + 0.0002 * n, [0.01, 0.012, 0.01], input_len=n) for i, n in
               enumerate([64, 128, 512, 1024, 2048])]  # fmt: skip
    baseline = Baseline.from_records(records)
    assert baseline.ttft_per_token_s == pytest.approx(0.0002)
    assert baseline.ttft_intercept_s == pytest.approx(0.005)
    assert baseline.tbt_s == pytest.approx(0.01)
    assert baseline.e2e(100, 11) == pytest.approx(0.005 + 0.02 + 10 * 0.01)
    with pytest.raises(ValueError):
        Baseline.from_records([record(0, 0, [], error="boom")])
