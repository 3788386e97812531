"""Simulator bench: speed on the full Azure conversation trace, and Splitwise's iso-power result.

1. Replays the whole one-hour trace (19,366 requests, as recorded) through a 40-machine
   Splitwise-HH cluster and times it (target: under 60 s).
2. At iso-power (40 DGX-H100s, power 70 in DGX-A100 units), finds the highest Poisson request rate
   within all nine Table VI SLOs for Baseline-H100 (40 mixed machines) and for the best
   Splitwise-HH prompt/token mix of 40 machines. Splitwise's claim: Splitwise-HH sustains more.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

from loadgen.sim.designs import DESIGNS, ClusterSpec
from loadgen.sim.provision import best_under_budget, format_table, max_rate
from loadgen.sim.rate_search import Probe, SearchSettings
from loadgen.sim.simulator import simulate
from loadgen.sim.slo import check_slos
from loadgen.sim.workload import as_recorded, read_trace
from loadgen.traces import shared_dir

TARGETS = {
    "full_trace_wall_s_lt_60": "the 40-machine hour replays in under 60 s",
    "splitwise_hh_over_baseline_gt_1": "Splitwise-HH beats Baseline-H100 at iso-power",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--trace", default=str(shared_dir() / "traces/AzureLLMInferenceTrace_conv.csv")
    )
    parser.add_argument("--duration", type=float, default=60.0, help="simulated s per rate probe")
    args = parser.parse_args()
    rows = read_trace(args.trace)

    full = ClusterSpec(DESIGNS["Splitwise-HH"], 15, 25)
    started = time.perf_counter()
    result = simulate(full, as_recorded(rows))
    replay_s = time.perf_counter() - started
    print(
        f"full trace: {len(rows)} requests, {result.end_s:.0f} s simulated on {full.label} "
        f"in {replay_s:.1f} s wall ({result.num_events} events), "
        f"SLOs met: {check_slos(result).met}"
    )

    settings = SearchSettings(
        Probe(duration_s=args.duration), min_rate=5.0, max_rate=200.0, rate_step=10.0,
        num_bisections=4,
    )  # fmt: skip
    started = time.perf_counter()
    baseline = ClusterSpec(DESIGNS["Baseline-H100"], 40)
    baseline_rps = max_rate(baseline, rows, settings)
    best, candidates = best_under_budget(
        DESIGNS["Splitwise-HH"],
        rows,
        baseline.power,
        "power",
        step=5,
        settings=settings,
        min_each=10,
    )
    search_s = time.perf_counter() - started
    print(f"iso-power {baseline.power:g} (DGX-A100 = 1), conversation trace, Poisson load:")
    print(f"  {baseline.label}: {baseline_rps:.1f} RPS within all nine SLOs")
    print(format_table(candidates))
    print(
        f"  best {best.cluster.label}: {best.max_rate:.1f} RPS "
        f"({best.max_rate / max(baseline_rps, 1e-9):.2f}x Baseline-H100); search {search_s:.0f} s"
    )
    figures = {
        "full_trace_requests": len(rows),
        "full_trace_wall_s": round(replay_s, 2),
        "baseline_h100_40_rps": round(baseline_rps, 1),
        "splitwise_hh_best": best.cluster.label,
        "splitwise_hh_rps": round(best.max_rate, 1),
        "hh_over_baseline": round(best.max_rate / max(baseline_rps, 1e-9), 3),
        "direction_reproduced": best.max_rate > baseline_rps,
    }
    met = {
        "full_trace_wall_s_lt_60": replay_s < 60.0,
        "splitwise_hh_over_baseline_gt_1": best.max_rate > baseline_rps,
    }
    print(json.dumps({**figures, "targets": TARGETS, "targets_met": met}))


if __name__ == "__main__":
    main()
