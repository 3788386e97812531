"""Turn a replay's records into the results dict, the JSON files and the terminal summary.

Keys follow vLLM bench's (`completed`, `failed`, `errors` (one string per request, empty for a
completed one), `request_throughput`, `output_throughput`, `mean_ttft_ms`, `p99_itl_ms`,
`request_goodput`, `max_concurrent_requests`, ...). ITL is the papers' TBT: every gap between
streamed chunks. `requests.csv` holds one row per request, for spreadsheets.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.replay import ReplayResult, RequestRecord
from loadgen.slo import Baseline, SloTarget, evaluate_slos
from loadgen.stats import percentile

REPORT_PERCENTILES = (50, 90, 99)


def latency_summary(name: str, values_s: Sequence[float]) -> dict[str, float]:
    """mean/median/std/p50/p90/p99 of `values_s`, in milliseconds, under vLLM's key names."""
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = len(values_ms) == 0
    summary = {
        f"mean_{name}_ms": float("nan") if empty else float(values_ms.mean()),
        f"median_{name}_ms": percentile(values_ms, 50),
        f"std_{name}_ms": float("nan") if empty else float(values_ms.std()),
    }
    for pct in REPORT_PERCENTILES:
        summary[f"p{pct}_{name}_ms"] = percentile(values_ms, pct)
    return summary


def error_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Failed requests per error kind (the exception class, or `ServerError: HTTP 503`)."""
    kinds: Counter[str] = Counter()
    for record in records:
        if record.error is not None:
            head = record.error.split(":", 2)
            is_http = head[0] == "ServerError" and len(head) > 1 and head[1].startswith(" HTTP")
            kinds[":".join(head[:2]) if is_http else head[0]] += 1
    return dict(kinds)


def usage_mismatches(done: Sequence[RequestRecord]) -> dict[str, int]:
    """Completed requests whose server-reported `usage` differs from what was asked: prompt
    tokens other than `input_len` (a text prompt the server counts otherwise), completion tokens
    other than `output_len` (with `ignore_eos` and `max_tokens` they must be equal), and requests
    with no usage at all (counts then come from chunks)."""
    return {
        "prompt_tokens": sum(r.prompt_tokens not in (None, r.input_len) for r in done),
        "completion_tokens": sum(r.prompt_tokens is not None and r.output_tokens != r.output_len
                                 for r in done),
        "no_usage": sum(r.prompt_tokens is None for r in done),
    }  # fmt: skip


def summarize(
    result: ReplayResult,
    slos: Sequence[SloTarget] = (),
    baseline: Baseline | None = None,
) -> dict[str, Any]:
    """The results dict of one run: counts, throughputs, latency percentiles, errors, SLOs."""
    records = result.records
    done = [r for r in records if r.ok]
    duration = result.duration_s
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_tokens or r.input_len for r in done)
    last_arrival = max((r.scheduled_s for r in records), default=0.0)
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": [r.error or "" for r in sorted(records, key=lambda r: r.req_index)],
        "error_kinds": error_counts(records),
        "max_concurrent_requests": result.peak_in_flight,
        "num_warmups": len(result.warmup_records),
        "warmup_failed": sum(not r.ok for r in result.warmup_records),
        "duration": duration,
        "offered_rate": len(records) / last_arrival if last_arrival > 0 else float("nan"),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0.0,
    }
    summary |= latency_summary("ttft", [r.ttft_s for r in done if r.ttft_s is not None])
    summary |= latency_summary("tpot", [t for r in done if (t := r.tpot_s) is not None])
    summary |= latency_summary("itl", [gap for r in done for gap in r.itl_s])
    summary |= latency_summary("e2el", [r.e2e_s for r in done if r.e2e_s is not None])
    # How late the generator sent each request against its schedule: if this grows, the client
    # (not the server) is the bottleneck and the offered load was not what was asked for.
    summary |= latency_summary("send_lag", [r.send_s - r.scheduled_s for r in records])
    summary["usage_mismatches"] = usage_mismatches(done)
    if slos:
        summary |= evaluate_slos(slos, records, duration, baseline)
    if baseline is not None:
        summary["baseline"] = baseline.to_dict()
    return summary


def json_safe(value: Any) -> Any:
    """NaN/inf become null: strict JSON readers (jq, JavaScript) reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def write_results(out_dir: Path, summary: dict[str, Any], records: Sequence[RequestRecord]) -> Path:
    """Write `results.json` (the summary), `requests.jsonl` (one record per request, every gap)
    and `requests.csv` (one row per request)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.json"
    results_path.write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    with open(out_dir / "requests.jsonl", "w") as out:
        for record in records:
            out.write(json.dumps(json_safe(asdict(record))) + "\n")
    write_requests_csv(out_dir / "requests.csv", records)
    return results_path


CSV_COLUMNS = (
    "req_index", "scheduled_s", "send_s", "input_len", "output_len", "prompt_tokens",
    "output_tokens", "ttft_ms", "tpot_ms", "mean_itl_ms", "max_itl_ms", "e2el_ms", "error",
)  # fmt: skip


def csv_row(record: RequestRecord) -> tuple[Any, ...]:
    """One request as `CSV_COLUMNS` (times in ms, blank where not measured)."""

    def ms(value_s: float | None) -> str:
        return "" if value_s is None else f"{value_s * 1000.0:.3f}"

    gaps = record.itl_s
    return (
        record.req_index, f"{record.scheduled_s:.6f}", f"{record.send_s:.6f}", record.input_len,
        record.output_len, "" if record.prompt_tokens is None else record.prompt_tokens,
        record.output_tokens, ms(record.ttft_s), ms(record.tpot_s),
        ms(sum(gaps) / len(gaps) if gaps else None), ms(max(gaps, default=None)),
        ms(record.e2e_s), record.error or "",
    )  # fmt: skip


def write_requests_csv(path: Path, records: Sequence[RequestRecord]) -> None:
    """One row per request, in request order, under a `CSV_COLUMNS` header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(CSV_COLUMNS)
        writer.writerows(csv_row(r) for r in sorted(records, key=lambda r: r.req_index))


def read_records(path: Path) -> list[RequestRecord]:
    """Load `requests.jsonl` (or the run folder holding it), e.g. to fit a baseline."""
    if path.is_dir():
        path = path / "requests.jsonl"
    with open(path) as lines:
        return [RequestRecord(**json.loads(line)) for line in lines if line.strip()]


def format_summary(summary: dict[str, Any]) -> str:
    """A vLLM-style result block for the terminal."""
    lines = [
        "{s:=^60}".format(s=" Serving Benchmark Result "),
        f"{'Requests (completed / failed):':<40}{summary['completed']} / {summary['failed']}",
        f"{'Peak concurrent requests:':<40}{summary['max_concurrent_requests']}",
        f"{'Duration (s):':<40}{summary['duration']:.2f}",
        f"{'Offered rate (req/s):':<40}{summary['offered_rate']:.2f}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:.2f}",
    ]
    for name, title in (("ttft", "TTFT"), ("itl", "TBT (ITL)"), ("e2el", "E2E"), ("tpot", "TPOT")):
        cells = "  ".join(
            f"p{pct} {summary[f'p{pct}_{name}_ms']:.1f}" for pct in REPORT_PERCENTILES
        )
        lines.append(f"{title + ' (ms):':<40}mean {summary[f'mean_{name}_ms']:.1f}  {cells}")
    lag = f"mean {summary['mean_send_lag_ms']:.1f}  p99 {summary['p99_send_lag_ms']:.1f}"
    lines.append(f"{'Client send lag (ms):':<40}{lag}")
    for field, count in summary.get("usage_mismatches", {}).items():
        if count:
            lines.append(f"{'Usage mismatches (' + field + '):':<40}{count}")
    if summary.get("max_concurrency") is not None:
        lines.insert(3, f"{'Maximum request concurrency:':<40}{summary['max_concurrency']}")
    if summary["num_warmups"]:
        warm = f"{summary['num_warmups']} ({summary['warmup_failed']} failed)"
        lines.append(f"{'Warm-up requests (left out):':<40}{warm}")
    for kind, count in summary["error_kinds"].items():
        lines.append(f"{'Errors ' + kind + ':':<40}{count}")
    for slo in summary.get("slos", []):
        verdict = "met" if slo.get("met", True) else "MISSED"
        measured = slo.get("measured")
        shown = f"measured {measured:.3g}{slo['unit']}  " if measured is not None else ""
        lines.append(
            f"{'SLO ' + slo['slo'] + ':':<40}{shown}attained {slo['attained_fraction']:.3f}"
            f"  {verdict if 'met' in slo else ''}"
        )
    if "request_goodput" in summary:
        lines.append(f"{'Goodput (req/s):':<40}{summary['request_goodput']:.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)
