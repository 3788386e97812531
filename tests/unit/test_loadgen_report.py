"""The results summary: percentiles, throughput, error counts, files and plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadgen.replay import ReplayResult, RequestRecord
from loadgen.report import format_summary, read_records, summarize, write_results
from loadgen.slo import parse_slos


def make_records() -> list[RequestRecord]:
    records = []
    for i in range(1, 101):  # TTFT 1..100 ms, 10 gaps of i ms, 11 output tokens
        gaps = [i / 1000] * 10
        records.append(
            RequestRecord(
                i,
                float(i) / 10,
                50,
                11,
                send_s=float(i) / 10,
                ttft_s=i / 1000,
                itl_s=gaps,
                e2e_s=i / 1000 + sum(gaps),
                prompt_tokens=50,
                output_tokens=11,
            )  # fmt: skip
        )
    records.append(RequestRecord(101, 10.1, 50, 11, send_s=10.1, error="ConnectError: refused"))
    records.append(RequestRecord(102, 10.2, 50, 11, send_s=10.2, error="ServerError: HTTP 503: x"))
    return records


def test_percentiles_throughput_and_errors() -> None:
    summary = summarize(ReplayResult(make_records(), duration_s=20.0))
    ttfts = np.arange(1, 101, dtype=float)
    assert summary["completed"] == 100 and summary["failed"] == 2
    assert summary["error_kinds"] == {"ConnectError": 1, "ServerError: HTTP 503": 1}
    for pct in (50, 90, 99):
        assert summary[f"p{pct}_ttft_ms"] == pytest.approx(np.percentile(ttfts, pct))
    assert summary["p50_ttft_ms"] == pytest.approx(50.5)
    assert summary["p99_ttft_ms"] == pytest.approx(99.01)
    assert summary["mean_itl_ms"] == pytest.approx(50.5)
    assert summary["p50_tpot_ms"] == pytest.approx(50.5)
    assert summary["p50_e2el_ms"] == pytest.approx(50.5 * 11)
    assert summary["request_throughput"] == 5.0
    assert summary["output_throughput"] == 1100 / 20.0
    assert summary["total_token_throughput"] == (1100 + 5000) / 20.0
    assert summary["offered_rate"] == pytest.approx(102 / 10.2)


def test_empty_run_reports_nan_not_crash(tmp_path: Path) -> None:
    failed = [RequestRecord(0, 0.0, 5, 5, error="ConnectError")]
    summary = summarize(ReplayResult(failed, duration_s=0.5), parse_slos("ttft:p99:1s"))
    assert summary["completed"] == 0 and summary["request_goodput"] == 0.0
    assert np.isnan(summary["p99_ttft_ms"])
    assert "0 / 1" in format_summary(summary)
    results = write_results(tmp_path, summary, failed)
    assert json.loads(results.read_text())["p99_ttft_ms"] is None  # strict JSON: NaN -> null


def test_results_files_round_trip_and_plots(tmp_path: Path) -> None:
    from loadgen.plots import plot_run, plot_sweep

    records = make_records()
    summary = summarize(ReplayResult(records, duration_s=20.0), parse_slos("ttft:p90:95ms"))
    write_results(tmp_path, summary, records)
    loaded = json.loads((tmp_path / "results.json").read_text())
    assert loaded["slos"][0]["met"] is True and loaded["completed"] == 100
    assert read_records(tmp_path) == records
    paths = plot_run(records, 20.0, tmp_path)
    sweep = plot_sweep([summary | {"rate": 1.0}, summary | {"rate": 2.0}], tmp_path)
    for path in [*paths, sweep]:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
