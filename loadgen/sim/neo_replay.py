"""Neo in the simulator: one machine whose every iteration is planned by `NeoPolicy`, with and
without its offload tier, and the highest Poisson rate it sustains at a latency SLO (Neo Fig. 6).

The machine is a GPU slice serving one model (Llama2-70B at tensor parallelism TP on A100s or
H100s: the `../shared/perf` profiles) plus its host: KV that does not fit in HBM lives in host
memory, and its decode attention runs at the host's memory bandwidth (Neo §3.1: attention reads
each KV byte once, so host attention is bandwidth-bound). Costs come from
`common.perf_model.neo_costs_from_profile`; swap-outs and swap-ins of running decodes cost
their KV bytes over PCIe on top of the step (prefill swap-outs overlap the prefill layer by
layer, as in Neo, and cost nothing).

Each iteration is one event (no run-ahead: the policy re-plans every step, as Neo does), so a
probe costs O(iterations x running requests). The latency metric is Neo's: a request's full
latency over its output tokens, averaged over the requests that arrived after the warm-up; a
request still running at the end of the drain counts as infinite.

    python -m loadgen.sim.neo_replay --trace ../shared/traces/AzureLLMInferenceTrace_conv.csv
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from common.perf_model import NeoCostTables, neo_costs_from_profile
from common.scheduling.neo import NeoPolicy
from common.scheduling.neo_state import (
    DecodeRequest,
    NeoConfig,
    NeoPlan,
    NeoState,
    PrefillRequest,
    blocks_for,
)
from loadgen.sim.designs import LLAMA2_70B, ModelSpec, profile_path
from loadgen.sim.rate_search import Probe, SearchSettings, climb_and_bisect
from loadgen.sim.simulator import SimRequest
from loadgen.sim.workload import poisson, read_trace


@dataclass(frozen=True)
class NeoMachineType:
    """A GPU slice and its host. Bandwidths are effective (sustained) bytes per second."""

    name: str
    hardware: str  # the profile's `hardware` column
    tensor_parallel: int
    host_attention_bytes_s: float  # the host's memory bandwidth for offloaded attention
    pcie_bytes_s: float  # all the slice's GPUs to host together
    hbm_bytes_per_gpu: int = 80 * 10**9
    memory_utilization: float = 0.9
    host_kv_bytes: int = 512 * 10**9

    def local_kv_tokens(self, model: ModelSpec) -> int:
        free = self.hbm_bytes_per_gpu * self.tensor_parallel * self.memory_utilization
        return max(0, int((free - model.weight_bytes) // model.kv_bytes_per_token))

    def costs(self, model: ModelSpec) -> NeoCostTables:
        key = (model.name, self.hardware, self.tensor_parallel)
        return neo_costs_from_profile(
            profile_path(), key, model.kv_bytes_per_token, self.host_attention_bytes_s
        )


# A quarter of a DGX host per 2-GPU slice: DGX-H100's two Xeon 8480C (16 DDR5-4800 channels,
# 614 GB/s peak) and DGX-A100's two EPYC 7742 (16 DDR4-3200 channels, 410 GB/s peak), at about
# two thirds of peak sustained. PCIe: Gen5 x16 per H100, Gen4 x16 per A100, ~80% of peak.
NEO_MACHINES: dict[str, NeoMachineType] = {
    m.name: m
    for m in (
        NeoMachineType("H100x2", "h100-80gb", 2, 100e9, 2 * 50e9),
        NeoMachineType("A100x2", "a100-80gb", 2, 70e9, 2 * 25e9),
        NeoMachineType("H100x4", "h100-80gb", 4, 200e9, 4 * 50e9),
        NeoMachineType("A100x4", "a100-80gb", 4, 140e9, 4 * 25e9),
    )
}


@dataclass
class _Req:
    arrival_s: float
    prompt_len: int
    output_len: int
    generated: int = 0
    generated_in_prompt: int = 0  # after a preemption: tokens re-prefilled with the prompt
    first_token_s: float = math.nan
    finish_s: float = math.nan

    @property
    def context_len(self) -> int:
        """The KV it holds while decoding (the last sampled token's is written next step), or
        its prefill's length while waiting."""
        return self.prompt_len + max(self.generated - 1 - self.generated_in_prompt, 0)


@dataclass
class NeoRunResult:
    """One simulated run: per-request latencies and how the iterations went."""

    per_token_s: list[float] = field(default_factory=list)  # inf: unfinished
    num_iterations: int = 0
    num_two_batch: int = 0
    num_swaps: int = 0
    num_preempted: int = 0
    max_running: int = 0

    @property
    def mean_per_token_s(self) -> float:
        return sum(self.per_token_s) / len(self.per_token_s) if self.per_token_s else 0.0


class NeoSimMachine:
    """The machine's tiers and queues; `run` replays requests through `NeoPolicy`."""

    def __init__(self, machine: NeoMachineType, offload: bool, model: ModelSpec = LLAMA2_70B):
        self.model = model
        self.block_size = 16
        self.local_blocks = machine.local_kv_tokens(model) // self.block_size
        offload_tokens = machine.host_kv_bytes // model.kv_bytes_per_token if offload else 0
        self.offload_blocks = offload_tokens // self.block_size
        self.swap_s_per_block = self.block_size * model.kv_bytes_per_token / machine.pcie_bytes_s
        config = NeoConfig(block_size=self.block_size, max_prefill_tokens=4096,
                           prefill_floor_tokens=256, allow_offload=offload)  # fmt: skip
        self.policy = NeoPolicy(config, machine.costs(model))
        self.reqs: list[_Req] = []
        self.waiting: list[int] = []  # FCFS (preempted requests go to the front)
        self.local: dict[int, None] = {}  # insertion order = age order
        self.offload: dict[int, None] = {}

    def fits(self, prompt_len: int) -> bool:
        """Whether a prompt can ever run here (local-only: its KV must fit in HBM)."""
        blocks = blocks_for(prompt_len + 1, self.block_size)
        return blocks <= self.local_blocks or blocks <= self.offload_blocks

    def run(self, requests: Sequence[SimRequest], until_s: float) -> NeoRunResult:
        result = NeoRunResult()
        self.reqs = [_Req(r.arrival_s, r.prompt_len, r.output_len) for r in requests]
        now, next_arrival = 0.0, 0
        while now < until_s:
            while next_arrival < len(self.reqs) and self.reqs[next_arrival].arrival_s <= now:
                self.waiting.append(next_arrival)
                next_arrival += 1
            plan = self.policy.schedule(self._state())
            if plan.is_empty and not (plan.swap_out_ids or plan.swap_in_ids):
                if next_arrival >= len(self.reqs):
                    break  # nothing runs and nothing comes: done (or stuck)
                now = max(now, self.reqs[next_arrival].arrival_s)
                continue
            step_s = plan.step_s + self._swap_s(plan)
            now += step_s
            self._apply(plan, now, result)
        result.per_token_s = [
            (r.finish_s - r.arrival_s) / r.output_len if r.finish_s == r.finish_s else math.inf
            for r in self.reqs
        ]
        return result

    def _state(self) -> NeoState:
        bs, reqs = self.block_size, self.reqs
        local = tuple(DecodeRequest(i, reqs[i].context_len) for i in self.local)
        offload = tuple(DecodeRequest(i, reqs[i].context_len) for i in self.offload)
        used_local = sum(r.blocks(bs) for r in local)
        used_offload = sum(r.blocks(bs) for r in offload)
        waiting = tuple(PrefillRequest(i, reqs[i].context_len) for i in self.waiting[:64])
        return NeoState(local, offload, waiting, self.local_blocks - used_local,
                        max(0, self.offload_blocks - used_offload), self.local_blocks)  # fmt: skip

    def _swap_s(self, plan: NeoPlan) -> float:
        moved = [*plan.swap_out_ids, *plan.swap_in_ids]
        blocks = sum(blocks_for(self.reqs[int(i)].context_len, self.block_size) for i in moved)
        return blocks * self.swap_s_per_block

    def _apply(self, plan: NeoPlan, now: float, result: NeoRunResult) -> None:
        result.num_iterations += 1
        result.num_two_batch += plan.two_batch
        result.num_swaps += len(plan.swap_out_ids) + len(plan.swap_in_ids)
        result.num_preempted += len(plan.preempted_ids)
        for i in plan.swap_out_ids:
            del self.local[int(i)]
            self.offload[int(i)] = None
        for i in plan.swap_in_ids:
            del self.offload[int(i)]
            self.local[int(i)] = None
        for i in plan.preempted_ids:  # recomputed later over its prompt and tokens so far
            del self.local[int(i)]
            r = self.reqs[int(i)]
            r.prompt_len += r.generated - r.generated_in_prompt  # every token known so far
            r.generated_in_prompt = r.generated
            self.waiting.insert(0, int(i))
        offloaded = set(plan.prefill_offload_ids)
        for i in plan.prefill_ids:
            self.waiting.remove(int(i))
            (self.offload if i in offloaded else self.local)[int(i)] = None
        for i in (*plan.prefill_ids, *plan.local_ids, *plan.offload0_ids, *plan.offload1_ids):
            self._generate(int(i), now)
        result.max_running = max(result.max_running, len(self.local) + len(self.offload))

    def _generate(self, i: int, now: float) -> None:
        r = self.reqs[i]
        r.generated += 1
        if r.first_token_s != r.first_token_s:
            r.first_token_s = now
        if r.generated >= r.output_len:
            r.finish_s = now
            self.local.pop(i, None)
            self.offload.pop(i, None)


# Poisson probes of `duration_s` (then a drain of the same length); the climb starts at 0, not
# at `min_rate`.
NEO_RATES = SearchSettings(
    Probe(duration_s=120.0, warmup_s=20.0), rate_step=0.5, max_rate=40.0, num_bisections=4
)


@dataclass(frozen=True)
class NeoSearch:
    """The SLO, mean latency per output token, and how to search for the rate that holds it."""

    slo_per_token_s: float = 0.2
    rates: SearchSettings = NEO_RATES


def probe(
    machine: NeoMachineType, rows: list, rate: float, offload: bool, s: NeoSearch
) -> tuple[bool, NeoRunResult]:
    """Whether `machine` holds the SLO at `rate` (with or without offload), and the run."""
    sim = NeoSimMachine(machine, offload)
    # NOTE: both arms get the same requests: those the local-only machine can ever hold.
    local_only = sim if not offload else NeoSimMachine(machine, False)
    usable = [r for r in rows if local_only.fits(r.input_len)] or rows
    p = s.rates.probe
    requests = poisson(usable, rate, p.duration_s, p.seed)
    result = sim.run(requests, until_s=2 * p.duration_s)
    counted = [
        t for t, r in zip(result.per_token_s, requests, strict=True) if r.arrival_s >= p.warmup_s
    ]
    counted_result = replace(result, per_token_s=counted)
    ok = bool(counted) and counted_result.mean_per_token_s <= s.slo_per_token_s
    return ok, counted_result


def compare(machine: NeoMachineType, rows: list, s: NeoSearch) -> dict[str, float]:
    """Sustained rate without and with offload on one machine type, and their ratio."""
    local = climb_and_bisect(lambda rate: probe(machine, rows, rate, False, s)[0], 0.0, s.rates)
    neo = climb_and_bisect(lambda rate: probe(machine, rows, rate, True, s)[0], 0.0, s.rates)
    return {
        "local_kv_tokens": machine.local_kv_tokens(LLAMA2_70B),
        "local_only_rps": round(local, 3),
        "neo_rps": round(neo, 3),
        "neo_over_local": round(neo / local, 3) if local else math.inf,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen.sim.neo_replay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", required=True)
    parser.add_argument("--machines", nargs="+", default=list(NEO_MACHINES))
    parser.add_argument("--slo", type=float, default=0.2, help="mean per-token latency, s")
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--host-gbs", type=float, default=0.0, help="override host GB/s")
    args = parser.parse_args(argv)
    rows = read_trace(args.trace)
    rates = replace(NEO_RATES, probe=replace(NEO_RATES.probe, duration_s=args.duration))
    s = NeoSearch(args.slo, rates)
    started, table = time.perf_counter(), {}
    print(f"{'machine':<8} {'local KV tok':>12} {'local-only RPS':>15} {'Neo RPS':>8} {'ratio':>6}")
    for name in args.machines:
        machine = NEO_MACHINES[name]
        if args.host_gbs:
            machine = replace(machine, host_attention_bytes_s=args.host_gbs * 1e9)
        row = table[name] = compare(machine, rows, s)
        print(f"{name:<8} {row['local_kv_tokens']:>12} {row['local_only_rps']:>15.2f} "
              f"{row['neo_rps']:>8.2f} {row['neo_over_local']:>6.2f}")  # fmt: skip
    wall_s = round(time.perf_counter() - started, 1)
    print(json.dumps({"slo_per_token_s": args.slo, "machines": table, "wall_s": wall_s}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
