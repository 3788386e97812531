"""`bench/serve.py`'s served paths: one `serve run` started, measured batch by batch (streamed or
plain requests) with aiohttp reading the raw SSE lines, as vLLM's and SGLang's serving benchmarks
do, or with the official `openai` client, and stopped with every process below it, whatever
happened meanwhile.

NOTE: why aiohttp by default: the client shares the server's cores here, and the `openai`
client's per-chunk parsing (its SSE decoder and a pydantic model per chunk) costs more CPU per
streamed token than the Router does, so the figure measured the client as much as the server.
`--client openai` measures with it; the API's conformance is tested with it (tests/)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import torch

from bench.host_cpu import CLK_TCK, box_busy_s, process_cpu_s, process_tree, stop_survivors
from common.model.default import default_model_path
from services.router.engine_client import ENGINE_THREAD_NAME
from tests.e2e.serve_process import ServeRun, kill_session, session_pids

ROUTER_TITLE = "ServeReplica:phasemesh:Router"
IDLE_S = 10.0  # how long the idle server is sampled (/proc counts in 10 ms ticks)
REPEATS = 3  # each batch's figures are its best of this many runs
CPU_FIGURES = ("router_cpu_ms_per_token", "client_cpu_ms_per_token")  # per run, averaged
PAIRS = 5  # runs of a batch paired with the engine beside it (`beside`): the ratio is their median

ByMode = dict[str, dict[int, dict[str, float]]]  # {mode: {batch: figures}}


CLIENTS = ("aiohttp", "openai")  # the first is the default


@dataclass(frozen=True)
class Server:
    """A `serve run` up and healthy (`serving`): where to send requests, and its processes."""

    url: str
    pid: int  # `serve run`'s: Ray and every replica run below it
    router_pid: int  # the Router replica's process, whose CPU each run's figures count
    preset: str


@contextlib.contextmanager
def serving(config: Path, args: dict[str, Any], preset: str) -> Iterator[Server]:
    """`serve run <config>` (its app's `args` changed by `args`; direct ingress, as `make run`)
    for the `with` block; on leaving it, however it is left, the server is stopped with every
    process below it."""
    with tempfile.TemporaryDirectory() as workdir:
        server = ServeRun(config, Path(workdir), args, preset=preset)
        started = time.monotonic()
        try:
            url = server.start()
            print(f"  {config.name}: up in {time.monotonic() - started:.0f} s at {url}", flush=True)
            assert server.pid is not None
            router_pid = ray_pid(server.pid, ROUTER_TITLE)
            if router_pid is None:
                raise RuntimeError("no Router replica process below serve run")
            yield Server(url, server.pid, router_pid, preset)
        finally:
            tree = process_tree(server.pid) if server.pid else set()
            server.stop()
            if server.pid:
                # Its session as well, read after the stop: a replica Serve started after `tree`
                # was read (one replaced mid-measure) is in the session, in no tree read before.
                kill_session(server.pid)
            stop_survivors({p for p in tree if Path(f"/proc/{p}").exists()})


def measure(
    server: Server, batches: list[int], tokens: int, modes: tuple[str, ...] = ("stream",),
    client: str = CLIENTS[0], beside: Callable[[list[list[int]]], float] | None = None,
) -> ByMode:  # fmt: skip
    """Every batch through `server` once per mode (`stream`, `plain`) with `client`, after a
    warm-up batch: {mode: {batch: figures}}, each with the idle server's `server_idle_box_cores`.
    `beside`: the engine the served path is judged against, which generates the same prompts and
    gives its tok/s with the server up and idle; it runs right before each served run of a batch,
    and the batch's `ratio` is the median of the pairs' (`paired_figures`)."""
    vocab = model_vocab(server.preset)
    warm_up = prompts_for(2, vocab, seed=99)
    asyncio.run(served_batch(server.url, server.preset, warm_up, tokens, client=client))
    idle = idle_cores(server.pid)
    result: ByMode = {}
    for mode, batch in ((m, b) for m in modes for b in batches):
        prompts = prompts_for(batch, vocab)
        runs, engine_runs = [], []
        for _ in range(REPEATS if beside is None else PAIRS):
            if beside is not None:
                engine_runs.append(beside(prompts))
            runs.append(timed_batch(server.url, server.preset, prompts, tokens, mode,
                                    server.router_pid, client))  # fmt: skip
        # CPU per token over every run (the same tokens each): /proc's clock ticks are
        # coarse beside one run's CPU; a slow run's CPU is no larger for being slow.
        cpu = {key: statistics.mean(f[key] for f in runs) for key in CPU_FIGURES}
        best = max(runs, key=lambda f: f["tok_s"])
        figures = best | cpu | idle
        if engine_runs:
            figures |= paired_figures([f["tok_s"] for f in runs], engine_runs)
        result.setdefault(mode, {})[batch] = figures
    return result


def served(
    config: Path, args: dict[str, Any], preset: str, batches: list[int], tokens: int,
    modes: tuple[str, ...] = ("stream",), client: str = CLIENTS[0],
    beside: Callable[[list[list[int]]], float] | None = None,
) -> ByMode:  # fmt: skip
    """`measure` on a server `serving` starts for it, stopped afterwards."""
    with serving(config, args, preset) as server:
        return measure(server, batches, tokens, modes, client, beside)


def paired_figures(served_tok_s: list[float], engine_tok_s: list[float]) -> dict[str, float]:
    """A served path against the engine run right before each of its runs: `ratio`, the median
    of the pairs' ratios, and `engine_beside_tok_s`, the engine's median. Why pairs: the host's
    own speed drifts over the minutes a bench runs (memory bandwidth, other guests), and a ratio
    of figures taken minutes apart measured the drift as much as the server."""
    if not served_tok_s or len(served_tok_s) != len(engine_tok_s):
        raise ValueError("a served run for every engine run, and at least one")
    return {
        "ratio": statistics.median(s / e for s, e in zip(served_tok_s, engine_tok_s, strict=True)),
        "engine_beside_tok_s": statistics.median(engine_tok_s),
    }


def server_pids(root: int) -> set[int]:
    """Every process of the `serve run` at `root`: its tree and its session (Ray moves workers to
    process groups of their own, not out of the session)."""
    return process_tree(root) | set(session_pids(root))


def idle_cores(root: int) -> dict[str, float]:
    """Busy cores over `IDLE_S` with the server at `root` up and no request in flight:
    `server_idle_box_cores`, the whole machine's (Ray's runtime and the idle replicas, what every
    served path shares its cores with, and whatever else the machine runs), and
    `server_idle_tree_cores`, the server's own processes' alone (what a shared machine's other
    work does not inflate)."""
    pids = server_pids(root)
    # The box's window holds the tree's (box read first and last), so that no CPU the tree used
    # while ~40 processes' /proc files were read falls outside the box's. The two still differ:
    # /proc/stat samples at the tick, a process's times are exact (bench/serve.py says more).
    start, box_before = time.perf_counter(), box_busy_s()
    tree_before = sum(map(process_cpu_s, pids))
    time.sleep(IDLE_S)
    tree_after = sum(map(process_cpu_s, pids))  # an exited one reads 0: the tree reads less
    box_after, span = box_busy_s(), time.perf_counter() - start
    box, tree = (box_after - box_before) / span, (tree_after - tree_before) / span
    # NOTE: /proc/stat counts in clock ticks: a box busy throughout can read a hair over its cores.
    return {"server_idle_box_cores": min(box, float(os.cpu_count() or 1)),
            "server_idle_tree_cores": max(tree, 0.0)}  # fmt: skip


def timed_batch(
    url: str, preset: str, prompts: list[list[int]], tokens: int, mode: str, router_pid: int,
    client: str = CLIENTS[0],
) -> dict[str, float]:  # fmt: skip
    """One batch's client figures, the Router process's CPU per token over it, less a local
    engine's threads (`topology: local` runs the engine inside the Router), and this process's:
    the client's, which shares the served engine's cores here."""
    before = process_cpu_s(router_pid) - threads_cpu_s(router_pid, ENGINE_THREAD_NAME)
    client_before = time.process_time()
    figures = asyncio.run(served_batch(url, preset, prompts, tokens, mode, client))
    client_s = time.process_time() - client_before
    after = process_cpu_s(router_pid) - threads_cpu_s(router_pid, ENGINE_THREAD_NAME)
    # NOTE: /proc counts in clock ticks, per thread and per process apart: a short batch's
    # difference can round below zero.
    figures["router_cpu_ms_per_token"] = 1e3 * max(0.0, after - before) / (len(prompts) * tokens)
    figures["client_cpu_ms_per_token"] = 1e3 * client_s / (len(prompts) * tokens)
    return figures


async def served_batch(
    url: str, model: str, prompts: list[list[int]], tokens: int, mode: str = "stream",
    client: str = CLIENTS[0],
) -> dict[str, float]:  # fmt: skip
    """The prompts sent together through `client`: tok/s, and TTFT and the gaps between streamed
    chunks (TBT) p50/p90, or a plain request's latency p50/p90."""
    if client not in CLIENTS:
        raise ValueError(f"client must be one of {CLIENTS}, not {client!r}")
    start = time.perf_counter()
    if client == "openai":
        runs = await openai_batch(url, model, prompts, tokens, mode)
    else:
        one = aiohttp_stream if mode == "stream" else aiohttp_plain
        async with aiohttp.ClientSession(base_url=url) as session:
            runs = await asyncio.gather(*(one(session, model, p, tokens) for p in prompts))
    wall = time.perf_counter() - start
    figures = {"tok_s": len(prompts) * tokens / wall}
    if mode == "plain":
        latencies = [r["latency"] for r in runs]
        return figures | {"latency_ms_p50": 1e3 * percentile(latencies, 0.5),
                          "latency_ms_p90": 1e3 * percentile(latencies, 0.9)}  # fmt: skip
    ttfts = [r["ttft"] for r in runs]
    gaps = [g for r in runs for g in r["gaps"]]
    return figures | {
        "ttft_ms_p50": 1e3 * percentile(ttfts, 0.5), "ttft_ms_p90": 1e3 * percentile(ttfts, 0.9),
        "tbt_ms_p50": 1e3 * percentile(gaps, 0.5), "tbt_ms_p90": 1e3 * percentile(gaps, 0.9),
        "chunks_per_request": statistics.mean(r["chunks"] for r in runs),
    }  # fmt: skip


def completion_body(model: str, prompt: list[int], tokens: int, stream: bool) -> dict[str, Any]:
    """A greedy completion of exactly `tokens` tokens (`ignore_eos`)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def stream_figures(start: float, stamps: list[float], num_tokens: int, tokens: int) -> dict:
    """TTFT, the gaps between chunks and their count; a stream cut short fails the run."""
    if num_tokens != tokens:
        raise RuntimeError(f"asked {tokens} tokens, got {num_tokens}")
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"ttft": stamps[0] - start, "gaps": gaps, "chunks": len(stamps)}


async def aiohttp_stream(
    session: aiohttp.ClientSession, model: str, prompt: list[int], tokens: int
) -> dict[str, Any]:
    """A streamed request read as raw `data:` lines, one JSON decode a chunk."""
    start = time.perf_counter()
    stamps: list[float] = []
    num_tokens = 0
    body = completion_body(model, prompt, tokens, stream=True)
    async with session.post("/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data:") or (data := line[5:].strip()) == b"[DONE]":
                continue
            chunk = msgspec.json.decode(data)
            if "error" in chunk:
                raise RuntimeError(f"in-band error: {chunk['error']}")
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    return stream_figures(start, stamps, num_tokens, tokens)


async def aiohttp_plain(
    session: aiohttp.ClientSession, model: str, prompt: list[int], tokens: int
) -> dict[str, Any]:
    """A non-streaming request: one response, its latency."""
    start = time.perf_counter()
    body = completion_body(model, prompt, tokens, stream=False)
    async with session.post("/v1/completions", json=body) as response:
        response.raise_for_status()
        usage = msgspec.json.decode(await response.read()).get("usage") or {}
    if usage.get("completion_tokens") != tokens:
        raise RuntimeError(f"asked {tokens} tokens, got {usage}")
    return {"latency": time.perf_counter() - start}


async def openai_batch(
    url: str, model: str, prompts: list[list[int]], tokens: int, mode: str
) -> list[dict[str, Any]]:
    import openai

    one = one_stream if mode == "stream" else one_plain
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        return await asyncio.gather(*(one(client, model, p, tokens) for p in prompts))


def openai_kwargs(model: str, prompt: list[int], tokens: int, stream: bool) -> dict[str, Any]:
    """`completion_body` as the `openai` client takes it: what the API does not name (ignore_eos)
    goes in `extra_body`."""
    body = completion_body(model, prompt, tokens, stream)
    ignore_eos = body.pop("ignore_eos")
    return {**body, "extra_body": {"ignore_eos": ignore_eos}}


async def one_stream(client: Any, model: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    stamps: list[float] = []
    stream = await client.completions.create(**openai_kwargs(model, prompt, tokens, stream=True))
    num_tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    return stream_figures(start, stamps, num_tokens, tokens)


async def one_plain(client: Any, model: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    """A non-streaming request: one response, its latency."""
    start = time.perf_counter()
    response = await client.completions.create(**openai_kwargs(model, prompt, tokens, stream=False))
    if response.usage is None or response.usage.completion_tokens != tokens:
        raise RuntimeError(f"asked {tokens} tokens, got {response.usage}")
    return {"latency": time.perf_counter() - start}


def prompts_for(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`batch` random prompts of 16 to 64 tokens, the same for a seed on every path."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 65, (batch,), generator=gen).tolist()
    return [torch.randint(8, vocab, (n,), generator=gen).tolist() for n in lengths]


def model_vocab(preset: str) -> int:
    config = json.loads((default_model_path(preset) / "config.json").read_text())
    return int(config["vocab_size"])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def threads_cpu_s(pid: int, comm: str) -> float:
    """CPU seconds (user + system) of `pid`'s live threads whose OS name is `comm`."""
    ticks = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            if (task / "comm").read_text().strip() != comm:
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLK_TCK


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
