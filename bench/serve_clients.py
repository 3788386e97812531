"""The client side of `bench/serve.py`: the requests it sends (streamed through the official
`openai` client, or plain), their figures, and probes of the served processes' CPU."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.host_cpu import box_busy_s, process_cpu_s, process_tree


def prompts_for(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 65, (batch,), generator=gen).tolist()
    return [torch.randint(8, vocab, (n,), generator=gen).tolist() for n in lengths]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_stream(client: Any, model: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    stamps: list[float] = []
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    num_tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    if num_tokens != tokens:
        raise RuntimeError(f"asked {tokens} tokens, got {num_tokens}")
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"ttft": stamps[0] - start, "gaps": gaps, "chunks": len(stamps)}


async def one_plain(client: Any, model: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    """A non-streaming request (the issue's table): one response, its latency."""
    start = time.perf_counter()
    response = await client.completions.create(
        model=model, prompt=prompt, max_tokens=tokens, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    if response.usage is None or response.usage.completion_tokens != tokens:
        raise RuntimeError(f"asked {tokens} tokens, got {response.usage}")
    return {"latency": time.perf_counter() - start}


async def served_batch(
    url: str, model: str, prompts: list[list[int]], tokens: int, mode: str = "stream"
) -> dict:
    import openai

    one = one_stream if mode == "stream" else one_plain
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        start = time.perf_counter()
        runs = await asyncio.gather(*(one(client, model, p, tokens) for p in prompts))
        wall = time.perf_counter() - start
    if mode == "plain":
        latencies = [r["latency"] for r in runs]
        return {"tok_s": len(prompts) * tokens / wall,
                "latency_ms_p50": 1e3 * percentile(latencies, 0.5),
                "latency_ms_p90": 1e3 * percentile(latencies, 0.9)}  # fmt: skip
    ttfts = [r["ttft"] for r in runs]
    gaps = [g for r in runs for g in r["gaps"]]
    return {
        "tok_s": len(prompts) * tokens / wall,
        "ttft_ms_p50": 1e3 * percentile(ttfts, 0.5), "ttft_ms_p90": 1e3 * percentile(ttfts, 0.9),
        "tbt_ms_p50": 1e3 * percentile(gaps, 0.5), "tbt_ms_p90": 1e3 * percentile(gaps, 0.9),
        "chunks_per_request": statistics.mean(r["chunks"] for r in runs),
    }  # fmt: skip


def threads_cpu_and_preemptions(pid: int, comm: str | None = None) -> tuple[float, int]:
    """CPU seconds (user + system) of `pid`'s live threads whose OS name is `comm` (all of them
    when None), and how often they were preempted (involuntary context switches): on a machine
    whose every core the engine's threads use, each preemption stalls the others at their next
    OpenMP barrier, where they spin."""
    ticks = preempted = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            if comm is not None and (task / "comm").read_text().strip() != comm:
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = (task / "status").read_text()
        except OSError:
            continue  # it exited
        ticks += int(fields[11]) + int(fields[12])
        preempted += int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
    return ticks / os.sysconf("SC_CLK_TCK"), preempted


def ray_pid(root: int, title_part: str) -> int | None:
    """The Ray worker below `root` whose process title holds `title_part`."""
    for pid in process_tree(root):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if title.startswith("ray::") and title_part in title:
            return pid
    return None


@dataclass(frozen=True)
class CpuSnapshot:
    """Cumulative CPU seconds of the served processes, the machine and this client, at `at`."""

    at: float
    router: float  # the Router replica process, engine threads included
    engine: float  # a local engine's threads (by their OS name), 0 without one
    preempted: int  # how often those were preempted
    proxy: float
    box: float  # every core of the machine
    client: float  # this process: the `openai` client


class ServedCpu:
    """Where the CPU went over one served batch: the Router replica (`router_pid`) less its
    engine's threads (`engine_thread`, their OS name), those threads, Serve's proxy, the client,
    and everything else the machine ran."""

    def __init__(self, router_pid: int, proxy_pid: int | None, engine_thread: str) -> None:
        self.router_pid, self.proxy_pid, self.engine_thread = router_pid, proxy_pid, engine_thread

    def snapshot(self) -> CpuSnapshot:
        engine, preempted = threads_cpu_and_preemptions(self.router_pid, self.engine_thread)
        proxy = process_cpu_s(self.proxy_pid) if self.proxy_pid else 0.0
        return CpuSnapshot(time.perf_counter(), process_cpu_s(self.router_pid), engine, preempted,
                           proxy, box_busy_s(), process_cpu_s(os.getpid()))  # fmt: skip

    def figures(self, a: CpuSnapshot, b: CpuSnapshot, requests: int, tokens: int) -> dict:
        """The batch's CPU figures from the snapshots before (`a`) and after (`b`) it."""
        wall, engine = b.at - a.at, b.engine - a.engine
        # The router's own; /proc counts in clock ticks (10 ms), per thread and per process
        # apart, so a short batch's difference can round below zero.
        router = max(0.0, b.router - a.router - engine)
        figures = {"router_cpu_ms_per_token": 1e3 * router / tokens,
                   "router_cpu_ms_per_request": 1e3 * router / requests}  # fmt: skip
        if self.proxy_pid:  # Serve's HTTP proxy (idle with direct ingress): its share, per chunk
            figures["proxy_cpu_ms_per_token"] = 1e3 * (b.proxy - a.proxy) / tokens
        if engine:  # `topology: local`: the engine's threads, told apart by their name
            figures["engine_cpu_ms_per_token"] = 1e3 * engine / tokens
            figures["engine_preemptions_per_s"] = (b.preempted - a.preempted) / wall
            # Everything else the machine ran meanwhile (the client, Ray, the Router's other
            # threads), in cores: the `neighbor` path's load to compare with.
            figures["others_cores"] = max(0.0, b.box - a.box - engine) / wall
            figures["client_cores"] = (b.client - a.client) / wall
        return figures
