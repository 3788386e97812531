"""Trace readers, `stats` and `convert`, checked against the shared traces' published numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.convert import write_mooncake_jsonl
from loadgen.stats import trace_stats
from loadgen.traces import (
    TraceFormatError,
    TraceRow,
    parse_azure_timestamp,
    read_azure_csv,
    read_mooncake_jsonl,
    read_trace,
    shared_dir,
    trace_format,
)

REPO = Path(__file__).resolve().parents[2]
AZURE_CONV = shared_dir() / "traces" / "AzureLLMInferenceTrace_conv.csv"
KIMI_CONV = shared_dir() / "traces" / "conversation_trace.jsonl"

# Published in /work/shared/traces/README.md (and Lamina Table 4 / Splitwise).
PUBLISHED = {
    AZURE_CONV: {"num_requests": 19366, "input_mean": 1154.7, "output_mean": 211.1, "span_s": 3502},
    KIMI_CONV: {"num_requests": 12031, "input_mean": 12035.1, "output_mean": 342.6, "span_s": 3537},
}


def run_loadgen(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "loadgen", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )


def stats_json(trace: Path) -> dict[str, float]:
    proc = run_loadgen("stats", "--trace", str(trace), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_published(stats: dict[str, float], published: dict[str, float]) -> None:
    assert stats["num_requests"] == published["num_requests"]
    assert round(stats["input_mean"], 1) == published["input_mean"]
    assert round(stats["output_mean"], 1) == published["output_mean"]
    assert abs(stats["span_s"] - published["span_s"]) < 1.0
    assert stats["rate_rps"] == pytest.approx(stats["num_requests"] / stats["span_s"])


@pytest.mark.parametrize("trace", [AZURE_CONV, KIMI_CONV], ids=["azure-conv", "kimi-conv"])
def test_shared_trace_matches_published_numbers(trace: Path) -> None:
    assert_published(trace_stats(read_trace(trace)).to_dict(), PUBLISHED[trace])


@pytest.mark.parametrize("trace", [AZURE_CONV, KIMI_CONV], ids=["azure-conv", "kimi-conv"])
def test_stats_subprocess_json_matches_published_numbers(trace: Path) -> None:
    stats = stats_json(trace)
    assert set(stats) == {
        "num_requests", "span_s", "rate_rps", "input_mean", "input_p50", "input_p99",
        "output_mean", "output_p50", "output_p99", "prefix_reuse",
    }  # fmt: skip
    assert_published(stats, PUBLISHED[trace])
    # Kimi's hash ids: 37.4% of its prompt tokens repeat an earlier prefix; Azure has none.
    assert stats["prefix_reuse"] == (pytest.approx(0.374, abs=5e-4) if trace == KIMI_CONV else 0)
    assert stats["input_p50"] <= stats["input_p99"]


def test_azure_2023_stamps_keep_seven_fractional_digits(tmp_path: Path) -> None:
    # CRLF, no newline at the end, 7 fractional digits: the 2023 release's exact shape.
    path = tmp_path / "azure2023.csv"
    path.write_bytes(
        b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        b"2023-11-16 18:15:46.6805900,374,44\r\n"
        b"2023-11-16 18:15:46.6805901,396,109\r\n"
        b"2023-11-16 18:16:47.0000000,879,55"
    )
    rows = list(read_azure_csv(path))
    assert [(r.input_len, r.output_len) for r in rows] == [(374, 44), (396, 109), (879, 55)]
    assert rows[0].arrival_s == 0.0
    assert rows[1].arrival_s == pytest.approx(1e-7, abs=1e-9)
    assert rows[2].arrival_s == pytest.approx(60.31941, abs=1e-6)


def test_azure_2024_utc_stamps_with_and_without_fraction(tmp_path: Path) -> None:
    path = tmp_path / "azure2024.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.009930+00:00,2048,28\n"
        "2024-05-10 00:00:01+00:00,1000,10\n"
        "2024-05-10 02:00:01.5+02:00,7,3\n"  # same instant as 00:00:01.5 UTC
    )
    rows = list(read_trace(path))
    assert [r.arrival_s for r in rows] == pytest.approx([0.0, 0.99007, 1.49007])
    assert parse_azure_timestamp("2024-05-10 00:00:01+00:00") == (1715299201, 0.0)


@pytest.mark.parametrize(
    ("bad_row", "reason"),
    [
        ("2023-11-16 18:15:xx.1,1,1", "bad timestamp"),
        ("2023-11-16 18:15:47.1,ten,1", "ContextTokens"),
        ("2023-11-16 18:15:47.1,10,-1", "negative"),
        ("2023-11-16 18:15:47.1,10", "3 comma-separated"),
    ],
)
def test_azure_bad_row_names_file_and_line(tmp_path: Path, bad_row: str, reason: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(
        f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,5,5\n{bad_row}\n"
    )
    with pytest.raises(TraceFormatError, match=reason) as info:
        list(read_azure_csv(path))
    assert str(info.value).startswith(f"{path}:3:")
    assert info.value.line_no == 3


def test_azure_wrong_header_is_line_one(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("time,in,out\n2023-11-16 18:15:46.1,5,5\n")
    with pytest.raises(TraceFormatError, match=rf"^{path}:1: expected header"):
        list(read_azure_csv(path))


def test_mooncake_rows_and_relative_timestamps(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]}\n'
        "\n"
        '{"timestamp": 30535, "input_length": 6472, "output_length": 26, "hash_ids": [46, 52]}\n'
    )
    rows = list(read_mooncake_jsonl(path))
    assert [r.arrival_s for r in rows] == pytest.approx([0.0, 3.053])
    assert rows[1].hash_ids == (46, 52) and rows[1].input_len == 6472
    assert trace_format(path) == "mooncake"


@pytest.mark.parametrize(
    "bad_line",
    [
        '{"timestamp": 5, "input_length": 10}',  # output_length missing
        '{"timestamp": 5, "input_length": "ten", "output_length": 1}',
        '{"timestamp": 5, "input_length": 10, "output_length": -3}',
        '{"timestamp": 5, "input_length": 10, "output_len',  # truncated
    ],
)
def test_mooncake_bad_row_names_file_and_line(tmp_path: Path, bad_line: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}'
    path.write_text(f"{good}\n{good}\n{bad_line}\n")
    with pytest.raises(TraceFormatError) as info:
        list(read_mooncake_jsonl(path))
    assert str(info.value).startswith(f"{path}:3:")


def test_readers_stream_without_reading_the_whole_file(tmp_path: Path) -> None:
    # A bad row far down is only reached once iteration gets there: rows before it arrive first.
    path = tmp_path / "late_error.jsonl"
    good = '{"timestamp": 0, "input_length": 1, "output_length": 1}\n'
    path.write_text(good * 1000 + "not json\n")
    rows = read_mooncake_jsonl(path)
    assert next(rows).input_len == 1
    with pytest.raises(TraceFormatError, match=":1001:"):
        list(rows)


def test_convert_round_trip_gives_the_same_stats(tmp_path: Path) -> None:
    out = tmp_path / "azure_conv.jsonl"
    proc = run_loadgen("convert", "--trace", str(AZURE_CONV), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    original, converted = stats_json(AZURE_CONV), stats_json(out)
    # Mooncake stores milliseconds: the span can move by at most one rounding step.
    assert converted.pop("span_s") == pytest.approx(original.pop("span_s"), abs=1e-3)
    assert converted.pop("rate_rps") == pytest.approx(original.pop("rate_rps"), rel=1e-6)
    assert converted == original


def test_convert_keeps_hash_ids(tmp_path: Path) -> None:
    rows = list(read_mooncake_jsonl(KIMI_CONV))[:50]
    out = tmp_path / "kimi_head.jsonl"
    assert write_mooncake_jsonl(rows, out) == 50
    assert list(read_mooncake_jsonl(out)) == rows


def test_cli_reports_bad_trace_without_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,5,oops\n")
    proc = run_loadgen("stats", "--trace", str(path))
    assert proc.returncode == 2
    assert f"{path}:2:" in proc.stderr and "Traceback" not in proc.stderr


def test_the_prefix_reuse_bound_counts_leading_blocks_an_earlier_prompt_began_with() -> None:
    """Hash ids name a block given its whole chain: [1, 2] then [1, 3] share one block, [9, 2]
    shares none (block 2 follows another prefix there); a prompt shorter than its blocks counts
    its own length only."""
    rows = [
        TraceRow(0.0, 1024, 1, (1, 2)),
        TraceRow(1.0, 1024, 1, (1, 3)),  # 512 reused
        TraceRow(2.0, 1024, 1, (9, 2)),  # none: 2 after 9 is not 2 after 1
        TraceRow(3.0, 700, 1, (1, 2)),  # both blocks seen, capped at its 700 tokens
        TraceRow(4.0, 300, 1, ()),  # no hash ids: nothing claimed
    ]
    stats = trace_stats(rows)
    assert stats.prefix_reuse == pytest.approx((512 + 700) / (1024 * 3 + 700 + 300))
    assert trace_stats([TraceRow(0.0, 10, 1)]).prefix_reuse == 0.0
