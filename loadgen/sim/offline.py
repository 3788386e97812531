"""The simulator's offline mode: one batch job through a group of GPUs, Seesaw against fixed
shardings (Seesaw §6, Fig. 10-11), on the measured A100/H100 profiles with the link of the
group's hardware profile (NVLink as measured, or the paper's PCIe).

    python -m loadgen.sim offline [--hardware a100-80gb|a100-80gb-pcie|h100-80gb] [--gpus 8]

The job's lengths come from the Azure conversation trace. Each mode runs the scheduling policy the
live group runs (`common/scheduling/seesaw.py`) with step times from the profiles:

- a prefill with (tp, pp) shards: the profile's TP=tp prefill time of the batch, divided by pp
  (the stages work on micro-batches in a full pipeline; bubbles are left out);
- a decode step with (tp, pp) shards over a batch B: the profile's TP=tp step at B/pp, once per
  stage pass (micro-batches of B/pp, each stage reading its 1/pp of the weights);
- in both, the communication is priced by the hardware profile's link (`Interconnect`): the
  profiles' own all-reduces (measured over NVLink) are taken out and the link's put in: per
  stage pass, two ring all-reduces per layer of a micro-batch's activations over tp GPUs
  (2 (tp - 1)/tp of the bytes over the link's bandwidth, 2 (tp - 1) latencies), and pp sends of
  a micro-batch's activations to the next stage;
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
NUM_LAYERS, HIDDEN_SIZE, DTYPE_BYTES = 80, 8192, 2
KV_BYTES_PER_TOKEN = 2 * NUM_LAYERS * 8 * 128 * DTYPE_BYTES  # K and V, 8 KV heads of 128
GPU_BYTES = 80e9
MAX_DECODE_BATCH = 64  # the profiles' largest batch: no extrapolation past what was measured


@dataclass(frozen=True)
class Interconnect:
    """The GPU-to-GPU link of a group: what TP's all-reduces and PP's activation sends cross.
    `bytes_s`: one direction, per GPU; `latency_s`: per message (one ring hop, one send)."""

    name: str
    bytes_s: float
    latency_s: float

    def all_reduce_s(self, tp: int, num_bytes: float) -> float:
        """A ring all-reduce of `num_bytes` over `tp` GPUs."""
        if tp <= 1:
            return 0.0
        return 2 * (tp - 1) / tp * num_bytes / self.bytes_s + 2 * (tp - 1) * self.latency_s

    def send_s(self, num_bytes: float) -> float:
        return num_bytes / self.bytes_s + self.latency_s


# NVLink as in the DGX machines the profiles were measured on (A100: 600 GB/s, H100: 900 GB/s,
# both directions together); PCIe 4.0 x8 per GPU, the paper's PCIe systems (§6.1: 16 GiB/s).
NVLINK_A100 = Interconnect("NVLink 3", 300e9, 1e-6)
NVLINK_H100 = Interconnect("NVLink 4", 450e9, 1e-6)
PCIE4_X8 = Interconnect("PCIe 4.0 x8", 16 * 2**30, 3e-6)


@dataclass(frozen=True)
class HardwareProfile:
    """A group's GPUs: `profile`, the Splitwise profile's hardware name (its step times, measured
    over `measured_link`); `link`, the link this group has; `host_bytes_s`, host <-> device per
    GPU (re-shard reloads, KV swaps)."""

    profile: str
    measured_link: Interconnect
    link: Interconnect
    host_bytes_s: float


HARDWARE = {
    "a100-80gb": HardwareProfile("a100-80gb", NVLINK_A100, NVLINK_A100, 25e9),
    "h100-80gb": HardwareProfile("h100-80gb", NVLINK_H100, NVLINK_H100, 25e9),
    "h100-80gb-pcap": HardwareProfile("h100-80gb-pcap", NVLINK_H100, NVLINK_H100, 25e9),
    # Seesaw §6.4's A100 PCIe: the A100's compute, every GPU on its own PCIe 4.0 x8 link.
    "a100-80gb-pcie": HardwareProfile("a100-80gb", NVLINK_A100, PCIE4_X8, PCIE4_X8.bytes_s),
}


@dataclass(frozen=True)
class Sharding:
    tp: int
    pp: int

    @property
    def label(self) -> str:
        return f"TP{self.tp}" + (f"xPP{self.pp}" if self.pp > 1 else "")


@dataclass(frozen=True)
class OfflineMode:
    prefill: Sharding
    decode: Sharding
    schedule: Schedule
    buffered: bool  # prefilled KV waits in host memory (re-sharding modes)


def shardings(gpus: int) -> list[Sharding]:
    """The group's shardings with tp >= 2 (the profiles' smallest TP for the 70B model)."""
    return [Sharding(gpus // pp, pp) for pp in (1, 2, 4, 8) if gpus // pp >= 2]


def modes(gpus: int, prefill: Sharding, decode: Sharding) -> dict[str, OfflineMode]:
    """Pure TP, pure PP (tp=2), the shardings between, and Seesaw's `prefill` -> `decode` under
    each schedule."""
    fixed = {
        ("tp" if s.pp == 1 else "pp" if s.tp == 2 else f"tp{s.tp}pp{s.pp}"): s
        for s in shardings(gpus)
    }
    return {
        **{n: OfflineMode(s, s, Schedule.PREFILL_FIRST, buffered=False) for n, s in fixed.items()},
        "seesaw": OfflineMode(prefill, decode, Schedule.TRANSITION_MINIMIZING, buffered=True),
        "prefill_first": OfflineMode(prefill, decode, Schedule.PREFILL_FIRST, buffered=True),
        "decode_first": OfflineMode(prefill, decode, Schedule.DECODE_FIRST, buffered=True),
    }


@dataclass
class OfflineResult:
    mode: str
    shardings: str = ""  # prefill's -> decode's, as "TP2xPP4 -> TP8"
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
    """Step times of a sharding from the TP profiles (fitted once per tp), with the
    communication of `hardware`'s link in place of the profiles' own."""

    def __init__(self, profile_csv: str, hardware: str) -> None:
        self.csv, self.hardware = profile_csv, HARDWARE[hardware]
        self._models: dict[int, PerfModel] = {}

    def _model(self, tp: int) -> PerfModel:
        if tp not in self._models:
            self._models[tp] = load_perf_model(self.csv, "llama2-70b", self.hardware.profile, tp)
        return self._models[tp]

    def _comm_s(self, link: Interconnect, s: Sharding, tokens: float) -> float:
        """One stage pass's communication: `tokens` per micro-batch, pp micro-batches."""
        act = tokens * HIDDEN_SIZE * DTYPE_BYTES
        pipeline = s.pp * link.send_s(act) if s.pp > 1 else 0.0
        return 2 * NUM_LAYERS * link.all_reduce_s(s.tp, act) + pipeline

    def _compute_s(self, measured_s: float, tp: int, tokens: float) -> float:
        """A profile time (TP=tp, the whole model, `tokens` in the batch) less its all-reduces
        over the link it was measured on (never below half of it: the model's bound)."""
        act = tokens * HIDDEN_SIZE * DTYPE_BYTES
        comm = 2 * NUM_LAYERS * self.hardware.measured_link.all_reduce_s(tp, act)
        return max(measured_s - comm, measured_s / 2)

    def prefill_s(self, s: Sharding, tokens: int) -> float:
        compute = self._compute_s(self._model(s.tp).prefill_s(tokens), s.tp, tokens)
        return compute / s.pp + self._comm_s(self.hardware.link, s, tokens / s.pp)

    def decode_s(self, s: Sharding, batch: int) -> float:
        micro = max(1, -(-batch // s.pp))
        compute = self._compute_s(self._model(s.tp).decode_s(micro), s.tp, micro)
        return compute + self._comm_s(self.hardware.link, s, micro)


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
    host_bytes_s = times.hardware.host_bytes_s
    reshard = WEIGHT_BYTES / gpus / host_bytes_s
    result = OfflineResult(name, f"{mode.prefill.label} -> {mode.decode.label}")
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
                exposed = max(0.0, swap / gpus / host_bytes_s - t)  # hidden behind the step
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
            buffer_requests: int = 256,
            max_prefill_tokens: int = 8192) -> dict[str, OfflineResult]:  # fmt: skip
    times = ProfileTimes(profile_csv, hardware)
    # Seesaw's shardings: each stage's fastest by the profile on this link (§4.1), at a full
    # prefill batch and a full decode batch.
    mean_context = sum(p + o / 2 for p, o in lengths) / len(lengths)
    slots = decode_slots(gpus, mean_context)
    prefill = min(shardings(gpus), key=lambda s: times.prefill_s(s, max_prefill_tokens))
    decode = min(shardings(gpus), key=lambda s: times.decode_s(s, slots))
    return {name: simulate_offline(name, mode, lengths, times, gpus, buffer_requests,
                                   max_prefill_tokens)
            for name, mode in modes(gpus, prefill, decode).items()}  # fmt: skip


def seesaw_over_best_other(results: dict[str, OfflineResult]) -> float:
    best = max(r.tokens_per_s for name, r in results.items() if name != "seesaw")
    return results["seesaw"].tokens_per_s / best


def simulated_gain(hardware: str = "a100-80gb-pcie", requests: int = 2000) -> float:
    """Seesaw over the best other mode for the default job on `hardware` (8 GPUs): the GPU case
    beside `bench/seesaw.py`'s CPU figure."""
    shared = shared_dir()
    rows = read_trace(str(shared / "traces" / "AzureLLMInferenceTrace_conv.csv"))[:requests]
    lengths = [(r.input_len, max(1, r.output_len)) for r in rows]
    return seesaw_over_best_other(
        compare(lengths, str(shared / "perf" / "splitwise_perf_model.csv"), hardware)
    )


def _run(args: argparse.Namespace) -> int:
    rows = read_trace(args.trace)[: args.requests]
    lengths = [(r.input_len, max(1, r.output_len)) for r in rows]
    results = compare(lengths, args.profile, args.hardware, args.gpus, args.buffer_requests)
    print(f"{len(lengths)} requests on {args.gpus} x {args.hardware}, buffer of "
          f"{args.buffer_requests} requests")  # fmt: skip
    print(
        "| mode | shardings | tokens/s | transitions | re-shard s | pipeline refill s | prefill s "
        "| decode s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r.shardings} | {r.tokens_per_s:,.0f} | {r.num_transitions} | "
              f"{r.reshard_s:,.1f} | {r.bubble_s:,.1f} | {r.prefill_s:,.0f} | "
              f"{r.decode_s:,.0f} |")  # fmt: skip
    ratio = seesaw_over_best_other(results)
    print(json.dumps({"hardware": args.hardware, "gpus": args.gpus, "requests": len(lengths),
                      "tokens_per_s": {n: round(r.tokens_per_s, 1) for n, r in results.items()},
                      "seesaw_shardings": results["seesaw"].shardings,
                      "seesaw_over_best_other": round(ratio, 3)}))  # fmt: skip
    return 0


def add_offline_parser(sub: Any) -> None:
    shared = shared_dir()
    p = sub.add_parser("offline", help="an offline batch job: Seesaw against fixed shardings")
    p.add_argument("--trace", default=str(shared / "traces" / "AzureLLMInferenceTrace_conv.csv"))
    p.add_argument("--profile", default=str(shared / "perf" / "splitwise_perf_model.csv"))
    p.add_argument(
        "--hardware",
        default="a100-80gb",
        choices=tuple(HARDWARE),
        help="the profile's GPUs and their link (a100-80gb-pcie: Seesaw's PCIe A100s)",
    )
    p.add_argument("--gpus", type=int, default=8, choices=(4, 8))
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--buffer-requests", type=int, default=256,
                   help="requests' KV the host buffer holds")  # fmt: skip
    p.set_defaults(func=_run)
