"""`bench/serve.py`'s served paths: one `serve run` started, measured batch by batch with the
`openai` client, and stopped with every process below it, whatever happened meanwhile."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.host_cpu import box_busy_s, process_cpu_s, process_tree, stop_survivors
from bench.serve_clients import ServedCpu, prompts_for, ray_pid, served_batch
from bench.serve_engine import REPEATS, model_vocab
from services.router.engine_client import ENGINE_THREAD_NAME
from tests.e2e.serve_process import Ingress, ServeRun

ROUTER_TITLE = "ServeReplica:phasemesh:Router"
PROXY_TITLE = "ProxyActor"
IDLE_S = 3.0  # how long the Router's CPU is sampled with no request in flight

ByMode = dict[str, dict[int, dict[str, float]]]  # {mode: {batch: figures}}


def served(
    config: Path,
    args: dict,
    preset: str,
    batches: list[int],
    tokens: int,
    ingress: Ingress,
    modes: tuple[str, ...] = ("stream",),
    while_up: Callable[[], None] | None = None,
) -> ByMode:
    """Start `serve run <config>`, then run every batch through it with the `openai` client,
    once per mode (`stream`, `plain`): {mode: {batch: figures}}. `while_up` runs after the
    batches, the server still up and idle."""
    with tempfile.TemporaryDirectory() as workdir:
        server = ServeRun(config, Path(workdir), args, ingress)
        started = time.monotonic()
        try:
            url = server.start()
            print(f"  {config.name} ({ingress}): up in {time.monotonic() - started:.0f} s at {url}",
                  flush=True)  # fmt: skip
            assert server.pid is not None
            pid = ray_pid(server.pid, ROUTER_TITLE)
            if pid is None:
                raise RuntimeError("no Router replica process below serve run")
            cpu = ServedCpu(pid, ray_pid(server.pid, PROXY_TITLE), ENGINE_THREAD_NAME)
            vocab = model_vocab(preset)
            asyncio.run(served_batch(url, preset, prompts_for(2, vocab, seed=99), tokens))
            idle = idle_figures(pid)
            result: ByMode = {}
            for mode, batch in ((m, b) for m in modes for b in batches):
                prompts = prompts_for(batch, vocab)
                # The best of a few, as the in-process engine's.
                runs = [
                    _timed_batch(url, preset, prompts, tokens, mode, cpu) for _ in range(REPEATS)
                ]
                best = max(runs, key=lambda figures: figures["tok_s"])
                # A server's first batch of a size pays what the in-process engine's first run
                # does and its best leaves out (the first touches of each new shape's buffers,
                # among others): reported, not compared.
                best["first_run_tok_s"] = runs[0]["tok_s"]
                result.setdefault(mode, {})[batch] = best | idle
            if while_up is not None:
                while_up()
            return result
        finally:
            tree = process_tree(server.pid) if server.pid else set()
            server.stop()
            stop_survivors({p for p in tree if Path(f"/proc/{p}").exists()})


def idle_figures(router_pid: int) -> dict[str, float]:
    """With no request in flight, over `IDLE_S`: what the Router process burns (Ray's threads,
    health checks: part of every served figure, most of it at batch 1, where a batch is long and
    light), and the whole machine's busy cores (Ray's runtime and the idle replicas: what every
    served path shares its cores with; docs/mesh.md, its presence, not its share)."""
    router_before, box_before = process_cpu_s(router_pid), box_busy_s()
    time.sleep(IDLE_S)
    return {
        "router_idle_cpu_ms_per_s": 1e3 * (process_cpu_s(router_pid) - router_before) / IDLE_S,
        "server_idle_box_cores": (box_busy_s() - box_before) / IDLE_S,
    }


def _timed_batch(
    url: str, preset: str, prompts: list[list[int]], tokens: int, mode: str, cpu: ServedCpu
) -> dict[str, float]:
    """One batch's client figures and the Router's (and proxy's, engine's) CPU over it."""
    before = cpu.snapshot()
    figures = asyncio.run(served_batch(url, preset, prompts, tokens, mode))
    figures.update(cpu.figures(before, cpu.snapshot(), len(prompts), len(prompts) * tokens))
    return figures
