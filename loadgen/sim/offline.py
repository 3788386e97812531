"""The simulator's offline mode: one batch job through a group of GPUs, Seesaw against fixed
shardings (Seesaw §6, Fig. 9-10), on the measured A100/H100 profiles.

    python -m loadgen.sim offline [--hardware a100-80gb] [--gpus 8] [--requests 2000]

The job's lengths come from the Azure conversation trace. Each mode runs the scheduling policy the
live group runs (`common/scheduling/seesaw.py`) with step times from the profiles:

- a prefill with (tp, pp) shards: the profile's TP=tp prefill time of the batch, divided by pp
  (the stages work on micro-batches in a full pipeline; bubbles are left out);
- a decode step with (tp, pp) shards over a batch B: the profile's TP=tp step at B/pp, once per
  stage pass (micro-batches of B/pp, each stage reading its 1/pp of the weights);
- a change of stage: a pipeline-parallel sharding starts empty, (pp - 1) / pp of a step lost to
  its bubble; a change of sharding (prefill <-> decode in another one): every GPU reloads its
  shard of the weights over PCIe; swaps of KV between the CPU buffer and the GPUs overlap
  compute (§5.2), so they cost only what exceeds the step they hide behind.

Modes: `tp` (TP over every GPU, prefill first: vLLM's), `pp` (tp=2, the rest pipeline stages,
prefill first), `seesaw` (prefill in `pp`'s sharding, decode in `tp`'s, transition-minimizing),
`prefill_first` and `decode_first` (Seesaw's shardings under those schedules). A pure mode keeps
its KV on the GPUs (no buffer: its decode batch is what GPU memory holds); the re-sharding modes
buffer prefilled KV in host memory.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from common.perf_model import PerfModel, load_perf_model
from common.scheduling.seesaw import (
    OfflineState,
    Schedule,
    SeesawKnobs,
    Stage,
    Waiting,
    apply,
    next_step,
)
from loadgen.sim.workload import read_trace
from loadgen.traces import shared_dir

# Llama2-70B in 16-bit: the model of the profiles.
WEIGHT_BYTES = 140e9
KV_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 2  # K and V, 80 layers, 8 KV heads of 128, 2 bytes
GPU_BYTES = 80e9
PCIE_BYTES_S = 25e9  # per GPU, host <-> device
MAX_DECODE_BATCH = 64  # the profiles' largest batch: no extrapolation past what was measured


@dataclass(frozen=True)
class Sharding:
    tp: int
    pp: int


@dataclass(frozen=True)
class OfflineMode:
    prefill: Sharding
    decode: Sharding
    schedule: Schedule
    buffered: bool  # prefilled KV waits in host memory (re-sharding modes)


def modes(gpus: int) -> dict[str, OfflineMode]:
    tp, pp = Sharding(gpus, 1), Sharding(2, gpus // 2)
    return {
        "tp": OfflineMode(tp, tp, Schedule.PREFILL_FIRST, buffered=False),
        "pp": OfflineMode(pp, pp, Schedule.PREFILL_FIRST, buffered=False),
        "seesaw": OfflineMode(pp, tp, Schedule.TRANSITION_MINIMIZING, buffered=True),
        "prefill_first": OfflineMode(pp, tp, Schedule.PREFILL_FIRST, buffered=True),
        "decode_first": OfflineMode(pp, tp, Schedule.DECODE_FIRST, buffered=True),
    }


@dataclass
class OfflineResult:
    mode: str
    wall_s: float = 0.0
    num_tokens: int = 0
    num_transitions: int = 0
    reshard_s: float = 0.0
    exposed_swap_s: float = 0.0
    bubble_s: float = 0.0  # pipelines refilling after a stage change
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s else 0.0


class ProfileTimes:
    """Step times of a sharding from the TP profiles (fitted once per tp)."""

    def __init__(self, profile_csv: str, hardware: str) -> None:
        self.csv, self.hardware = profile_csv, hardware
        self._models: dict[int, PerfModel] = {}

    def _model(self, tp: int) -> PerfModel:
        if tp not in self._models:
            self._models[tp] = load_perf_model(self.csv, "llama2-70b", self.hardware, tp)
        return self._models[tp]

    def prefill_s(self, s: Sharding, tokens: int) -> float:
        return self._model(s.tp).prefill_s(tokens) / s.pp

    def decode_s(self, s: Sharding, batch: int) -> float:
        return self._model(s.tp).decode_s(max(1, -(-batch // s.pp)))


def decode_slots(gpus: int, mean_context: float) -> int:
    """Requests whose KV fits the GPUs beside the weights, capped at the profiled batch."""
    free = gpus * GPU_BYTES - WEIGHT_BYTES
    return max(1, min(MAX_DECODE_BATCH, int(free / (KV_BYTES_PER_TOKEN * mean_context))))


def simulate_offline(
    name: str, mode: OfflineMode, lengths: list[tuple[int, int]], times: ProfileTimes,
    gpus: int, buffer_requests: int, max_prefill_tokens: int = 8192,
) -> OfflineResult:  # fmt: skip
    """Run the job to its end under `mode`; figures in simulated seconds."""
    mean_context = sum(p + o / 2 for p, o in lengths) / len(lengths)
    slots = decode_slots(gpus, mean_context)
    # A pure mode's prefilled KV stays on the GPUs: its "buffer" is the decode slots themselves.
    buffer = buffer_requests if mode.buffered else slots
    state = OfflineState([Waiting(i, p) for i, (p, _) in enumerate(lengths)], [], [],
                         buffer, slots)  # fmt: skip
    knobs = SeesawKnobs(max_prefill_tokens, mode.schedule)
    left = {i: o for i, (_, o) in enumerate(lengths)}
    reshard = WEIGHT_BYTES / gpus / PCIE_BYTES_S
    result = OfflineResult(name)
    last_stage: Stage | None = None
    while (step := next_step(state, knobs)) is not None:
        switched = step.stage is not last_stage
        if last_stage is not None and switched:
            result.num_transitions += 1
            if mode.prefill != mode.decode:
                result.reshard_s += reshard
                result.wall_s += reshard
        last_stage = step.stage
        finished = []
        if step.stage is Stage.PREFILL:
            tokens = sum(lengths[i][0] for i in step.prefill)
            t = times.prefill_s(mode.prefill, tokens)
            result.prefill_s += t
            rows = list(step.prefill)
        else:
            rows = [*state.decoding, *step.swap_in]
            t = times.decode_s(mode.decode, len(rows))
            result.decode_s += t
            if mode.buffered and step.swap_in:
                swap = sum(lengths[i][0] for i in step.swap_in) * KV_BYTES_PER_TOKEN
                exposed = max(0.0, swap / gpus / PCIE_BYTES_S - t)  # hidden behind the step
                result.exposed_swap_s += exposed
                t += exposed
        sharding = mode.prefill if step.stage is Stage.PREFILL else mode.decode
        if switched and sharding.pp > 1:
            # The pipeline starts empty after a switch: pp - 1 stage times before it is full.
            bubble = t * (sharding.pp - 1) / sharding.pp
            result.bubble_s += bubble
            t += bubble
        result.wall_s += t
        for i in rows:
            left[i] -= 1
            result.num_tokens += 1
            if left[i] == 0:
                finished.append(i)
        apply(state, step, finished)
    return result


def compare(lengths: list[tuple[int, int]], profile_csv: str, hardware: str, gpus: int = 8,
            buffer_requests: int = 256) -> dict[str, OfflineResult]:  # fmt: skip
    times = ProfileTimes(profile_csv, hardware)
    return {name: simulate_offline(name, mode, lengths, times, gpus, buffer_requests)
            for name, mode in modes(gpus).items()}  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    rows = read_trace(args.trace)[: args.requests]
    lengths = [(r.input_len, max(1, r.output_len)) for r in rows]
    results = compare(lengths, args.profile, args.hardware, args.gpus, args.buffer_requests)
    best_other = max(r.tokens_per_s for name, r in results.items() if name != "seesaw")
    print(f"{len(lengths)} requests on {args.gpus} x {args.hardware}, buffer of "
          f"{args.buffer_requests} requests")  # fmt: skip
    print(
        "| mode | tokens/s | transitions | re-shard s | pipeline refill s | prefill s | decode s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r.tokens_per_s:,.0f} | {r.num_transitions} | {r.reshard_s:,.1f} | "
              f"{r.bubble_s:,.1f} | {r.prefill_s:,.0f} | {r.decode_s:,.0f} |")  # fmt: skip
    ratio = results["seesaw"].tokens_per_s / best_other
    print(json.dumps({"hardware": args.hardware, "gpus": args.gpus, "requests": len(lengths),
                      "tokens_per_s": {n: round(r.tokens_per_s, 1) for n, r in results.items()},
                      "seesaw_over_best_other": round(ratio, 3)}))  # fmt: skip
    return 0


def add_offline_parser(sub: Any) -> None:
    shared = shared_dir()
    p = sub.add_parser("offline", help="an offline batch job: Seesaw against fixed shardings")
    p.add_argument("--trace", default=str(shared / "traces" / "AzureLLMInferenceTrace_conv.csv"))
    p.add_argument("--profile", default=str(shared / "perf" / "splitwise_perf_model.csv"))
    p.add_argument("--hardware", default="a100-80gb",
                   choices=("a100-80gb", "h100-80gb", "h100-80gb-pcap"))  # fmt: skip
    p.add_argument("--gpus", type=int, default=8, choices=(4, 8))
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--buffer-requests", type=int, default=256,
                   help="requests' KV the host buffer holds")  # fmt: skip
    p.set_defaults(func=_run)
