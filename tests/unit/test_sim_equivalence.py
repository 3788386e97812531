"""The simulator's results, request by request, against a frozen copy of what it produced before
it was made fast (indexed JSQ loads, no per-arrival scan of every machine): routing, first-token
and finish times, prefix hits and the cluster counters must be exactly what they were.

`tests/unit/sim_results.json` was written by this module's `main` with the simulator of
bbcd222, before that change (`python -m tests.unit.test_sim_equivalence --write`); its
`large_cluster` entry by the simulator of efc218a, before the per-event work was cut (named
tuples, inline counts, packed heaps). Rewrite it only for a change meant to move results, and
say so in that commit.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from common.perf_model import PerfModel, PiecewiseLinear
from loadgen.sim.designs import (
    DGX_H100,
    DGX_H100_TOKEN,
    LLAMA2_70B,
    ClusterSpec,
    Design,
    parse_cluster,
    perf_model_for,
)
from loadgen.sim.shared_cpu import HostModel, SharedCPU, Station
from loadgen.sim.simulator import SimOptions, SimRequest, Simulator
from loadgen.sim.slo import slowdowns
from loadgen.sim.workload import as_recorded, poisson, read_trace
from loadgen.traces import shared_dir

FIXTURE = Path(__file__).with_name("sim_results.json")
AZURE = shared_dir() / "traces" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = shared_dir() / "traces" / "conversation_trace.jsonl"


def split_overload() -> tuple[ClusterSpec, list[SimRequest], SimOptions]:
    """Past what the token pool holds: machines are borrowed into the mixed pool and return."""
    rows = read_trace(AZURE)[:3000]
    return parse_cluster("Splitwise-HH:4P2T"), poisson(rows, 25.0, 25.0, seed=2), SimOptions()


def baseline() -> tuple[ClusterSpec, list[SimRequest], SimOptions]:
    rows = read_trace(AZURE)[1000:3000]
    return parse_cluster("Baseline-H100:3"), poisson(rows, 9.0, 30.0, seed=3), SimOptions()


def preemptions() -> tuple[ClusterSpec, list[SimRequest], SimOptions]:
    """Token machines with little KV: decodes are preempted and recomputed."""
    token = replace(DGX_H100_TOKEN, kv_pool_tokens=24_000)
    design = Design("small-kv", DGX_H100, token, model=LLAMA2_70B)
    rows = read_trace(AZURE)[:2000]
    return ClusterSpec(design, 2, 2), poisson(rows, 12.0, 25.0, seed=4), SimOptions()


def prefix_routing() -> tuple[ClusterSpec, list[SimRequest], SimOptions]:
    """Mooncake's block ids: prefix caches with eviction, and KV-aware routing."""
    rows = read_trace(MOONCAKE)[:400]
    prompt = replace(DGX_H100, kv_pool_tokens=200_000)
    design = Design("prefix", prompt, DGX_H100_TOKEN, model=LLAMA2_70B)
    options = SimOptions(prefix_block_len=512, prefix_weight=1.0)
    return ClusterSpec(design, 3, 2), poisson(rows, 6.0, 40.0, seed=5), options


def shared_host() -> tuple[ClusterSpec, list[SimRequest], SimOptions]:
    """PhaseMesh's CPU mesh on one shared host: the front end's loops, stretches, hand-offs."""
    cpu = SharedCPU(
        cores=2.0, background_cores=0.3, prompt_cores=1.0,
        decode_cores_by_batch=((1, 1.1), (16, 1.6)), chain_cores_by_batch=((1, 1.0), (16, 1.2)),
    )  # fmt: skip
    stations = (Station("client", 0.004, 0.001, priority=True),) + tuple(
        Station(n, 0.004, 0.001) for n in ("proxy", "router")
    )
    host = HostModel(0.030, cpu, stations, handoff_s=0.002, frontend_jitter_s=(0.0, 0.003, 0.01))
    perf = PerfModel(
        PiecewiseLinear((16.0, 64.0, 256.0), (0.010, 0.020, 0.060)),
        PiecewiseLinear((1.0, 4.0, 16.0), (0.015, 0.024, 0.040)),
    )
    rows = read_trace(AZURE)[:150]
    requests = [
        SimRequest(r.arrival_s, max(1, r.prompt_len // 16), max(1, r.output_len // 16))
        for r in as_recorded(rows, time_scale=0.25)
    ]
    return parse_cluster("PhaseMesh-CPU:1P1T"), requests, SimOptions(host=host, perf=perf)


def large_cluster() -> tuple[ClusterSpec, list[SimRequest], SimOptions]:
    """A hundred machines for a few seconds: pools of dozens on the load board, its heaps
    renewed many times, runs cut by landings on busy token machines."""
    rows = read_trace(AZURE)
    return parse_cluster("Splitwise-HH:25P75T"), poisson(rows, 250.0, 6.0, seed=6), SimOptions()


SCENARIOS: dict[str, Callable[[], tuple[ClusterSpec, list[SimRequest], SimOptions]]] = {
    "split_overload": split_overload,
    "baseline": baseline,
    "preemptions": preemptions,
    "prefix_routing": prefix_routing,
    "shared_host": shared_host,
    "large_cluster": large_cluster,
}


def run_scenario(name: str) -> dict[str, Any]:
    """What a scenario produced: per request (prompt machine, token machine, first token, done,
    prefix hit tokens) and the cluster's counters."""
    cluster, requests, options = SCENARIOS[name]()
    simulator = Simulator(cluster, options)
    result = simulator.run(requests)
    return {
        "requests": [
            [r.prompt_machine, r.token_machine, r.first_token_s, r.done_s, r.prefix_hit_tokens]
            for r in result.records
        ],
        "end_s": result.end_s,
        "num_pool_moves": result.num_pool_moves,
        "busy_s_by_machine": result.busy_s_by_machine,
        "num_prefill_tokens": result.num_prefill_tokens,
        "num_prefix_hit_tokens": result.num_prefix_hit_tokens,
        "num_preemptions": sum(m.policy.num_preemptions for m in simulator.machines),
    }


@pytest.fixture(scope="module")
def frozen() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_results_equal_the_frozen_ones_request_by_request(name: str, frozen: dict) -> None:
    now, before = run_scenario(name), frozen[name]
    assert len(now["requests"]) == len(before["requests"]) > 0
    for i, (got, want) in enumerate(zip(now["requests"], before["requests"], strict=True)):
        assert got == want, f"{name}: request {i}"
    assert now == before


def test_the_scenarios_exercise_what_they_are_named_for(frozen: dict) -> None:
    """Each frozen run takes the path it is there to check (else equality would prove little)."""
    assert frozen["split_overload"]["num_pool_moves"] > 0
    assert frozen["preemptions"]["num_preemptions"] > 0
    assert frozen["prefix_routing"]["num_prefix_hit_tokens"] > 0
    for run in frozen.values():  # every request finished
        assert all(done == done for *_, done, _ in run["requests"])


def test_slowdowns_are_the_records_own_latencies_over_the_unloaded_ones() -> None:
    """The SLO check's columns (numpy over all records at once, a prefill time per distinct
    prompt length) hold exactly what each record's own properties give, unfinished ones
    infinite."""
    cluster, requests, options = SCENARIOS["baseline"]()
    result = Simulator(cluster, options).run(requests)
    skip_s = 5.0
    unfinished = next(r for r in result.records if r.arrival_s >= skip_s and r.output_len > 1)
    unfinished.done_s = float("nan")
    prompt_perf = perf_model_for(cluster.design.prompt_type, cluster.model)
    tbt0 = perf_model_for(cluster.design.token_type, cluster.model).decode_s(1)
    records = [r for r in result.records if r.arrival_s >= skip_s and r.output_len > 0]
    ttft0 = [prompt_perf.prefill_s(r.prompt_len) for r in records]
    want = {
        "ttft": [r.ttft_s / t0 for r, t0 in zip(records, ttft0, strict=True)],
        "tbt": [r.tbt_s / tbt0 for r in records if r.output_len > 1],
        "e2e": [
            r.e2e_s / (t0 + (r.output_len - 1) * tbt0) for r, t0 in zip(records, ttft0, strict=True)
        ],
    }
    got = slowdowns(result, skip_before_s=skip_s)
    for metric, values in want.items():
        expected = [v if v == v else math.inf for v in values]
        assert got[metric].tolist() == expected, metric
    assert math.inf in got["e2e"].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"rewrite {FIXTURE.name}")
    args = parser.parse_args()
    results = {name: run_scenario(name) for name in SCENARIOS}
    text = json.dumps(results, separators=(",", ":"))
    if args.write:
        FIXTURE.write_text(text + "\n")
    for name, run in results.items():
        counts = (len(run["requests"]), run["num_pool_moves"], run["num_preemptions"])
        print(name, "requests, pool moves, preemptions:", *counts)


if __name__ == "__main__":
    main()
