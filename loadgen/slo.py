"""SLOs: parsing, the Splitwise preset, unloaded baselines, attainment and goodput.

An SLO is `METRIC[:pPCT]:LIMIT` with METRIC one of ttft, tbt, e2e and LIMIT either absolute
(`500ms`, `0.5s`, a bare number is milliseconds as in vLLM's `--goodput`) or a slowdown over the
unloaded baseline (`2x`).

- With a percentile (`ttft:p99:6x`), the SLO is a distribution check, as in Splitwise: it holds
  when at least PCT% of requests are within the limit, failed requests counting as misses. TBT
  percentile SLOs look at every inter-token gap, TTFT and E2E at one value per request.
- Without one (`ttft:500ms`), it is a per-request threshold, as in DistServe/vLLM goodput; TBT
  then means the request's TPOT (mean gap).

Goodput = completed requests per second that meet every per-request SLO, and 0 when any
percentile SLO fails (Splitwise asks all nine to hold).

Slowdowns divide by a `Baseline`: what a request of the same size takes on an idle server. It is
fitted from an unloaded run's records: TTFT linear in prompt tokens, TBT the median gap, and
E2E = TTFT + (output tokens - 1) * TBT.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadgen.replay import RequestRecord
from loadgen.stats import percentile

SLO_METRICS = ("ttft", "tbt", "e2e")
_SLO_PATTERN = re.compile(r"^(ttft|tbt|e2e)(?::p(\d+(?:\.\d+)?))?:(\d+(?:\.\d+)?)(ms|s|x)?$")

# Splitwise Table VI: P50/P90/P99 slowdowns over a request on an uncontended machine.
SPLITWISE_PRESET = (
    "ttft:p50:2x,ttft:p90:3x,ttft:p99:6x,"
    "tbt:p50:1.25x,tbt:p90:1.5x,tbt:p99:5x,"
    "e2e:p50:1.25x,e2e:p90:1.5x,e2e:p99:5x"
)


@dataclass(frozen=True)
class SloTarget:
    """One SLO; `limit` is seconds, or a multiple of the baseline when `slowdown`."""

    metric: str
    percentile: float | None
    limit: float
    slowdown: bool

    def __str__(self) -> str:
        pct = f":p{self.percentile:g}" if self.percentile is not None else ""
        limit = f"{self.limit:g}x" if self.slowdown else f"{self.limit * 1000:g}ms"
        return f"{self.metric}{pct}:{limit}"


def parse_slos(text: str) -> list[SloTarget]:
    """Parse a comma-separated SLO list; `splitwise` expands to the Table VI preset."""
    targets: list[SloTarget] = []
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        if item == "splitwise":
            targets.extend(parse_slos(SPLITWISE_PRESET))
            continue
        match = _SLO_PATTERN.match(item.lower())
        if match is None:
            raise ValueError(f"bad SLO {item!r}: expected METRIC[:pPCT]:LIMIT[ms|s|x]")
        metric, pct, value, unit = match.groups()
        limit = float(value) / 1000.0 if unit in (None, "ms") else float(value)
        targets.append(SloTarget(metric, float(pct) if pct else None, limit, unit == "x"))
    return targets


@dataclass(frozen=True)
class Baseline:
    """Unloaded latency of a request: TTFT = intercept + slope * prompt tokens; a fixed TBT."""

    ttft_intercept_s: float
    ttft_per_token_s: float
    tbt_s: float

    def ttft(self, input_len: int) -> float:
        return self.ttft_intercept_s + self.ttft_per_token_s * input_len

    def e2e(self, input_len: int, output_tokens: int) -> float:
        return self.ttft(input_len) + max(output_tokens - 1, 0) * self.tbt_s

    @classmethod
    def from_records(cls, records: Sequence[RequestRecord]) -> Baseline:
        """Fit from an unloaded run's completed records (least squares, slope kept >= 0)."""
        done = [r for r in records if r.ok and r.ttft_s is not None]
        if not done:
            raise ValueError("baseline run has no completed requests")
        lens = np.array([r.input_len for r in done], dtype=np.float64)
        ttfts = np.array([r.ttft_s for r in done], dtype=np.float64)
        slope = 0.0
        if len(set(lens.tolist())) > 1:
            slope = max(float(np.polyfit(lens, ttfts, 1)[0]), 0.0)
        intercept = max(float(np.median(ttfts - slope * lens)), 1e-9)
        gaps = [gap for r in done for gap in r.itl_s]
        tbt = float(np.median(gaps)) if gaps else 1e-9
        return cls(intercept, slope, max(tbt, 1e-9))

    @classmethod
    def from_values(cls, ttft_s: float, tbt_s: float) -> Baseline:
        """A size-independent baseline from two measured numbers."""
        return cls(ttft_s, 0.0, tbt_s)

    def to_dict(self) -> dict[str, float]:
        return {
            "ttft_intercept_s": self.ttft_intercept_s,
            "ttft_per_token_s": self.ttft_per_token_s,
            "tbt_s": self.tbt_s,
        }


def _distribution(
    metric: str, records: Sequence[RequestRecord], baseline: Baseline | None
) -> list[float]:
    """The values a percentile SLO looks at, as slowdowns when a baseline is given."""
    done = [r for r in records if r.ok]
    if metric == "tbt":
        scale = baseline.tbt_s if baseline else 1.0
        return [gap / scale for r in done for gap in r.itl_s]
    values = (_request_value(metric, r, baseline, per_request=False) for r in done)
    return [v for v in values if v is not None]


def _request_value(
    metric: str, record: RequestRecord, baseline: Baseline | None, *, per_request: bool
) -> float | None:
    """One request's value of `metric` (TBT as TPOT), divided by its baseline if one is given."""
    if metric == "ttft":
        value, base = record.ttft_s, (baseline.ttft(record.input_len) if baseline else 1.0)
    elif metric == "e2e":
        value = record.e2e_s
        base = baseline.e2e(record.input_len, record.output_tokens) if baseline else 1.0
    else:
        value, base = record.tpot_s, (baseline.tbt_s if baseline else 1.0)
        if value is None and record.ok and per_request:
            value = 0.0  # a 1-token output has no gaps: it cannot miss a TBT SLO (vLLM does this)
    return None if value is None else value / base


def evaluate_slos(
    targets: Sequence[SloTarget],
    records: Sequence[RequestRecord],
    duration_s: float,
    baseline: Baseline | None = None,
) -> dict[str, Any]:
    """Check every target; return per-SLO results, `all_met`, good requests and goodput."""
    if any(t.slowdown for t in targets) and baseline is None:
        raise ValueError("slowdown SLOs need a baseline (--baseline)")
    results = [_check_percentile(t, records, baseline) for t in targets if t.percentile is not None]
    per_request = [t for t in targets if t.percentile is None]
    good = sum(1 for r in records if r.ok and _meets_all(per_request, r, baseline))
    all_met = all(result["met"] for result in results)
    goodput = good / duration_s if all_met and duration_s > 0 else 0.0
    per_request_results = [
        {"slo": str(t), "attained_fraction": _attained(t, records, baseline)} for t in per_request
    ]
    return {
        "slos": results + per_request_results,
        "all_percentile_slos_met": all_met,
        "good_requests": good,
        "request_goodput": goodput,
    }


def _meets_all(targets: Sequence[SloTarget], record: RequestRecord, base: Baseline | None) -> bool:
    for target in targets:
        scale = base if target.slowdown else None
        value = _request_value(target.metric, record, scale, per_request=True)
        if value is None or value > target.limit:
            return False
    return True


def _attained(target: SloTarget, records: Sequence[RequestRecord], base: Baseline | None) -> float:
    if not records:
        return float("nan")
    return sum(1 for r in records if r.ok and _meets_all([target], r, base)) / len(records)


def _check_percentile(
    target: SloTarget, records: Sequence[RequestRecord], baseline: Baseline | None
) -> dict[str, Any]:
    assert target.percentile is not None
    values = _distribution(target.metric, records, baseline if target.slowdown else None)
    num_failed = sum(1 for r in records if not r.ok)
    # Failed requests miss TTFT/E2E SLOs; they add no TBT gaps they never produced.
    total = len(values) + (num_failed if target.metric != "tbt" else 0)
    within = sum(1 for v in values if v <= target.limit)
    attained = within / total if total else float("nan")
    return {
        "slo": str(target),
        "measured": percentile(values, target.percentile),
        "unit": "x" if target.slowdown else "s",
        "attained_fraction": attained,
        "met": bool(total) and attained >= target.percentile / 100.0 - 1e-12,
    }
