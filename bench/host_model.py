"""The simulator's host model (`host.json`, `loadgen/sim/shared_cpu.py`) of a running server.

`measure_host` measures it from /proc (`bench/host_cpu.py`) and from requests through the
server's HTTP API, for `bench/sim_validation.py`: the mesh's idle cores; from requests sent one at
a time, the front end's latency alone (its low decile and each request's excess over it), the
hand-off's stall of the token engine, each front-end loop's CPU per request and the cores a
prefill takes; from served decode steps at several batch sizes, the cores they take and the
loops' CPU per token; and the background (other processes' cores, above the mesh's priority or
at it).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from host_cpu import ROLES, BackgroundMeter, CpuSampler, minus, process_nice, role_pids

from bench.remote_decode import steady_token_times
from common.perf_model import load_perf_model
from loadgen.sim.designs import TINY, parse_cluster
from loadgen.sim.shared_cpu import HostModel, SharedCPU, Station
from loadgen.stats import percentile

REPO = Path(__file__).resolve().parents[1]
HARDWARE = "cpu-local-mesh"
FRONTEND = ("client", "proxy", "router")  # the way in
CHAIN = ("token", "shard")  # a decode step's own processes
DECODE = CHAIN + FRONTEND  # ... and the front end streaming its tokens


def load_profile_bench() -> ModuleType:
    """`bench/profile.py`, imported under another name (`profile` is a stdlib module)."""
    spec = importlib.util.spec_from_file_location("bench_profile", REPO / "bench" / "profile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def vocab_size() -> int:
    from common.model.default import default_model_path

    return int(json.loads((default_model_path("tiny") / "config.json").read_text())["vocab_size"])


def background(meter: BackgroundMeter, pids: dict[int, str], *client: int) -> tuple[float, float]:
    """The other processes' cores since `meter` started: (above, at) the mesh's priority."""
    mesh_nice = min(process_nice(pid) for pid in pids)
    return meter.stop({*pids, os.getpid(), *client}, mesh_nice)


def measure_idle(pids: dict[int, str], seconds: float) -> dict[str, float]:
    """Cores per role while the mesh is idle."""
    with CpuSampler(pids) as sampler:
        start = time.monotonic()
        time.sleep(seconds)  # NOTE: measuring an idle window
    return sampler.cores(start, time.monotonic())


def sequential_requests(url: str, sizes: list[int], gap_s: float) -> tuple[list[Any], float, float]:
    """Requests one at a time (2 output tokens each, `gap_s` apart): (records, start, end)."""
    from loadgen.http_target import OpenAIStreamingTarget
    from loadgen.prompts import PromptBuilder
    from loadgen.replay import replay
    from loadgen.target import RequestSpec

    async def run() -> Any:
        prompts = PromptBuilder(vocab_size=vocab_size(), seed=99)
        target = OpenAIStreamingTarget(url, "tiny", prompts=prompts)
        try:
            specs = [RequestSpec(i, i * gap_s, p, 2) for i, p in enumerate(sizes)]
            return await replay(specs, target, progress=False)
        finally:
            await target.aclose()

    start = time.monotonic()
    result = asyncio.run(run())
    return [r for r in result.records if r.ok and r.ttft_s], start, time.monotonic()


@dataclass(frozen=True)
class Alone:
    """What requests sent one at a time show (see `measure_alone`)."""

    frontend_s: float
    frontend_jitter_s: tuple[float, ...]
    handoff_s: float
    per_request: dict[str, float]
    prompt_cores: float


def measure_alone(
    url: str, pids: dict[int, str], idle: dict[str, float], profile_csv: Path, sizes: list[int]
) -> Alone:
    """From requests sent one at a time, two tokens each: the front end's latency alone (TTFT
    minus the profiled prefill of the prompt); the hand-off's stall (the gap to the second token,
    the first from the token engine, minus a profiled batch-1 step and the KV transfer); each
    front-end loop's CPU seconds per request (its two tokens' way out included); the cores a
    prefill takes."""
    perf = load_perf_model(profile_csv, TINY.name, HARDWARE, 1, decode_context=TINY.decode_context)
    transfer = parse_cluster("PhaseMesh-CPU:1P1T").transfer_model()
    with CpuSampler(pids) as sampler:
        records, start, end = sequential_requests(url, sizes, gap_s=0.4)
    cores, span = sampler.cores(start, end), end - start
    # The front end's latency alone: its low decile, and each request's excess over it.
    alone = sorted(r.ttft_s - perf.prefill_s(r.input_len) for r in records)
    frontend_s = percentile(alone, 10)
    jitter = tuple(round(max(x - frontend_s, 0.0), 5) for x in alone)
    handoff_s = statistics.median(
        r.itl_s[0] - perf.decode_s(1) - transfer.visible_s(r.input_len) for r in records if r.itl_s
    )
    per_request = {r: minus(cores, idle, (r,)) * span / len(records) for r in FRONTEND}
    prefill_s = sum(perf.prefill_s(r.input_len) for r in records)
    prompt_cores = minus(cores, idle, ("prompt",)) * span / prefill_s
    return Alone(frontend_s, jitter, max(handoff_s, 0.0), per_request, prompt_cores)


def measure_decode(
    bench_profile: ModuleType,
    url: str,
    pids: dict[int, str],
    idle: dict[str, float],
    batch_sizes: list[int],
) -> tuple[list[tuple[int, float]], list[tuple[int, float]], dict[str, float]]:
    """Served decode steps alone at each batch size, over the window where the whole batch
    decodes: (the cores they take with the front end streaming, the cores of the token engine
    and its shards alone, each front-end loop's CPU seconds per token, pooled)."""
    probe = bench_profile.HttpDecode(url, vocab_size())
    points, chain, allowance = [], [], 8
    loop_cpu, num_tokens = dict.fromkeys(FRONTEND, 0.0), 0
    for batch_size in batch_sizes:
        cell = bench_profile.Cell(TINY.decode_context, batch_size)
        prompts = bench_profile.prompt_ids(cell, vocab_size(), 7)
        with CpuSampler(pids) as sampler:
            times, allowance = steady_token_times(probe, prompts, 32, allowance)
        start, end = max(t[1] for t in times), min(t[-1] for t in times)
        cores = sampler.cores(start, end)
        points.append((batch_size, round(minus(cores, idle, DECODE), 3)))
        chain.append((batch_size, round(minus(cores, idle, CHAIN), 3)))
        num_tokens += sum(start < x <= end for t in times for x in t)
        for role in FRONTEND:
            loop_cpu[role] += minus(cores, idle, (role,)) * (end - start)
    return points, chain, {role: cpu / max(num_tokens, 1) for role, cpu in loop_cpu.items()}


def measure_host(
    url: str,
    server_pid: int,
    profile_csv: Path,
    sizes: list[int],
    meter: BackgroundMeter,
    idle_s: float,
    decode_batches: list[int],
) -> tuple[HostModel, float]:
    """The host model (its background: the other processes' over the profile and these
    measurements, since `meter` started), and the cores the mesh's processes take while idle
    (health checks, idle polls: part of the background)."""
    bench_profile = load_profile_bench()
    pids = role_pids(server_pid)
    idle = measure_idle(pids, idle_s)
    # Everything the model does not know by name: other processes (other users' jobs, Ray's own)
    # by priority against the mesh's, and the mesh's idle loops (at its own priority).
    idle_mesh = sum(idle[r] for r in ROLES)
    alone = measure_alone(url, pids, idle, profile_csv, sizes)
    measured = measure_decode(bench_profile, url, pids, idle, decode_batches)
    decode, chain, per_token = measured
    above, shared = background(meter, pids)
    mesh_nice = min(process_nice(pid) for pid in pids)
    stations = tuple(
        Station(
            role, round(alone.per_request[role], 6), round(per_token[role], 6),
            priority=role == "client" and os.getpriority(os.PRIO_PROCESS, 0) < mesh_nice,
        )
        for role in FRONTEND
    )  # fmt: skip
    cpu = SharedCPU(
        cores=float(len(os.sched_getaffinity(0))),
        background_cores=round(above, 3),
        shared_background_cores=round(shared + idle_mesh, 3),
        prompt_cores=round(alone.prompt_cores, 3),
        decode_cores_by_batch=tuple(decode),
        chain_cores_by_batch=tuple(chain),
    )
    host = HostModel(
        round(alone.frontend_s, 5), cpu, stations, round(alone.handoff_s, 5),
        alone.frontend_jitter_s,
    )  # fmt: skip
    return host, idle_mesh
