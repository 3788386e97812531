"""SLO check of a simulation (Splitwise Table VI): percentiles of per-request slowdowns.

A request's slowdown is its latency over the same request alone on an idle machine of the design
(`unloaded`): TTFT = prefill of its prompt on the prompt machine type, TBT = one decode step at
batch size 1 on the token machine type, E2E = TTFT + (output - 1) * TBT. TBT here is a request's
mean gap after its first token. A request that never finished counts as an infinite slowdown.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.sim.designs import ClusterSpec, MachineType, perf_model_for
from loadgen.sim.simulator import SimResult

# Table VI: metric -> ((percentile, max slowdown), ...)
SPLITWISE_SLOS: dict[str, tuple[tuple[float, float], ...]] = {
    "ttft": ((50, 2.0), (90, 3.0), (99, 6.0)),
    "tbt": ((50, 1.25), (90, 1.5), (99, 5.0)),
    "e2e": ((50, 1.25), (90, 1.5), (99, 5.0)),
}


@dataclass(frozen=True)
class SLOCheck:
    """Measured slowdown percentiles against their limits."""

    slowdowns: dict[str, float]  # e.g. "ttft_p99" -> 3.2
    limits: dict[str, float]

    @property
    def met(self) -> bool:
        return all(self.slowdowns[k] <= self.limits[k] for k in self.limits)

    @property
    def violated(self) -> list[str]:
        return [k for k in self.limits if not self.slowdowns[k] <= self.limits[k]]


def slowdowns(
    result: SimResult,
    reference: tuple[MachineType, MachineType] | None = None,
    skip_before_s: float = 0.0,
    until_s: float = float("inf"),
) -> dict[str, np.ndarray]:
    """Per-request slowdowns by metric, for requests arriving in [`skip_before_s`, `until_s`)."""
    cluster: ClusterSpec = result.cluster
    prompt_type, token_type = reference or (cluster.design.prompt_type, cluster.design.token_type)
    prompt_perf = perf_model_for(prompt_type, cluster.model)
    tbt0 = perf_model_for(token_type, cluster.model).decode_s(1)
    records = [r for r in result.records
               if skip_before_s <= r.arrival_s < until_s and r.output_len > 0]  # fmt: skip
    # Column by column (millions of records in a big replay): each distinct prompt length's
    # unloaded prefill computed once, the latencies by numpy with the records' own float ops.
    prompt = np.array([r.prompt_len for r in records], dtype=np.int64)
    lengths, where = np.unique(prompt, return_inverse=True)
    ttft0 = np.array([prompt_perf.prefill_s(int(n)) for n in lengths], dtype=float)[where]
    out = np.array([r.output_len for r in records], dtype=float)
    arrival = np.array([r.arrival_s for r in records], dtype=float)
    first = np.array([r.first_token_s for r in records], dtype=float)
    done = np.array([r.done_s for r in records], dtype=float)
    ttft = first - arrival
    e2e = done - arrival
    multi = out > 1
    tbt = (done[multi] - first[multi]) / (out[multi] - 1)
    return {
        "ttft": np.nan_to_num(ttft / ttft0, nan=np.inf),
        "tbt": np.nan_to_num(tbt / tbt0, nan=np.inf),
        "e2e": np.nan_to_num(e2e / (ttft0 + (out - 1) * tbt0), nan=np.inf),
    }


def check_slos(
    result: SimResult,
    slos: dict[str, tuple[tuple[float, float], ...]] | None = None,
    skip_before_s: float = 0.0,
) -> SLOCheck:
    """Compare the slowdown percentiles of `result` with `slos` (default: Table VI)."""
    by_metric = slowdowns(result, skip_before_s=skip_before_s)
    measured: dict[str, float] = {}
    limits: dict[str, float] = {}
    for metric, targets in (slos or SPLITWISE_SLOS).items():
        values = by_metric[metric]
        for pct, limit in targets:
            key = f"{metric}_p{pct:g}"
            measured[key] = float(np.percentile(values, pct)) if len(values) else 0.0
            limits[key] = limit
    return SLOCheck(measured, limits)


def attainment(
    result: SimResult, start_s: float = 0.0, end_s: float = float("inf"), percentile: float = 90
) -> dict[str, float | bool]:
    """TTFT and TBT at `percentile` against Table VI's limits there, for the requests arriving
    in [`start_s`, `end_s`): each metric's slowdown at the percentile, its limit, and the share
    of requests within the limit (`ttft_within`); `met`: both percentiles within their limits."""
    by_metric = slowdowns(result, skip_before_s=start_s, until_s=end_s)
    out: dict[str, float | bool] = {}
    met = True
    for metric in ("ttft", "tbt"):
        limit = dict(SPLITWISE_SLOS[metric])[percentile]
        values = by_metric[metric]
        at = float(np.percentile(values, percentile)) if len(values) else 0.0
        out[f"{metric}_p{percentile:g}"] = at
        out[f"{metric}_limit"] = limit
        out[f"{metric}_within"] = float(np.mean(values <= limit)) if len(values) else 1.0
        met = met and at <= limit
    out["met"] = met
    return out
