"""Served throughput against the in-process engine, per batch size: what the front end costs.

    python bench/serve.py [--preset tiny|small|smollm2] [--quick] [--batches 1 8 32] [--tokens 256]
                          [--paths inprocess local mesh] [--modes stream plain]
                          [--mesh-args '{"token_engine_threads": 1}'] [--scheduler-steps 1]

For each batch size, `batch` requests go together (greedy, `ignore_eos`, `--tokens` new tokens
each, the same prompts on every path) to:
- `inprocess`: one `LLMEngine` in this process, no front end;
- `local`: `serve run deploy/single.yaml` (`topology: local`: the engine inside the Router
  replica, on as many torch threads as the in-process one), over HTTP behind Serve's direct
  ingress as `make run` starts it, read by aiohttp as raw SSE lines (`--client openai`: the
  official client; bench/serve_server.py says why not by default);
- `mesh`: `serve run deploy/local.yaml` (a prompt engine, a token engine, 2 attention shards), the
  same way; `--mesh-args` (JSON) changes its `mesh:` args.

`--scheduler-steps N` runs the in-process and `local` engines at up to N greedy decode
iterations a call (docs/serving.md#decode-steps-per-call): tokens then stream N at a time.

Each batch goes streamed and, in the same server, plain (`--modes`; reported as `<path>_plain`).
A path's figures are its best of 3 runs of each batch (`local`'s of 5), after a warm-up batch:
tok/s and `ratio` over the in-process engine's (which runs first and again last: the better of
the two), TTFT and TBT (the gap between streamed chunks) p50/p90 or a plain request's latency
p50/p90; and the Router process's CPU per token over all its runs (less a local engine's
threads) and the client's (this process: it shares the served engine's cores here, as the Router
does). `local` is judged against the in-process engine beside its idle served runtime, run by
run: each of its 5 runs of a batch right after the engine generated the same prompts with the
server up, its `ratio` the median of the 5 pairs' (`engine_beside_tok_s`: the engine's median;
the table's `inprocess+idle` row), so that the host's drift over the minutes between runs
cancels out.
A served path also reports, over 10 s with the server up and idle before its batches,
`server_idle_box_cores`: the whole machine's busy cores (Ray's runtime and the idle replicas,
what the served engines share their cores with, plus whatever else a shared machine runs), and
`server_idle_tree_cores`: the server's own processes' (every process of the `serve run`'s
session; `bench/idle_cost.py` splits it up). The box comes from /proc/stat, which kernels that
account CPU by the tick (`CONFIG_TICK_CPU_ACCOUNTING`) sample every tick: an idle runtime's runs,
thousands a second and far shorter than a tick, read low or high there; the tree is each
process's exact run time, and can read above the box.

The last line is one JSON object with `targets` and `targets_met` (streamed requests; plain
ones in `targets_met_plain`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # NOTE: not bench/, whose profile.py would shadow the stdlib's

from bench.machine import cpu_variant  # noqa: E402
from bench.serve_server import CLIENTS, REPEATS, model_vocab, prompts_for, served  # noqa: E402
from common.engine.core import LLMEngine  # noqa: E402
from common.gc_heap import freeze_startup_heap  # noqa: E402
from common.mesh_options import mesh_options  # noqa: E402
from common.model.default import PRESETS, default_model_path  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402

PATHS = ["inprocess", "local", "mesh"]
SERVED = ("local", "local_plain", "mesh", "mesh_plain")  # the served figures, by path and mode
ENGINE_ARGS = {"num_blocks": 2048, "block_size": 16, "max_num_batched_tokens": 2048,
               "max_num_seqs": 64}  # fmt: skip
TARGETS = {
    # Served `local` against the engine beside the idle served runtime (issue 54).
    "local_ratio_batch8_min": 0.95,
    "local_ratio_batch32_min": 0.95,
    "mesh_ratio_batch32_small_min": 0.6,  # the small preset only: tiny's steps are all overhead
    "router_cpu_ms_per_token_max": 0.3,
    # The idle server (issue 54): the whole machine's busy cores (what a served engine shares
    # its cores with; other work on a shared machine adds to it) and the server's own processes'.
    "mesh_idle_box_cores_max": 0.10,
    "local_idle_box_cores_max": 0.05,
    "mesh_idle_tree_cores_max": 0.10,
    "local_idle_tree_cores_max": 0.05,
}


def engine_args(steps: int = 1) -> dict[str, int]:
    """The engines' options, in process and `local` alike: ENGINE_ARGS at `steps` greedy decode
    iterations a call (`num_scheduler_steps`)."""
    return ENGINE_ARGS | {"num_scheduler_steps": steps}


def engine_runner(preset: str, tokens: int, steps: int = 1) -> Callable[[list[list[int]]], float]:
    """One `LLMEngine`, warmed up: a function that generates `tokens` tokens for each prompt
    (token ids only: no front end) and gives the batch's tok/s."""
    engine = LLMEngine.from_path(default_model_path(preset), **engine_args(steps))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    engine.generate(prompts_for(2, model_vocab(preset), seed=99), params)

    def run(prompts: list[list[int]]) -> float:
        start = time.perf_counter()
        engine.generate(prompts, params)
        return len(prompts) * tokens / (time.perf_counter() - start)

    return run


def in_process(
    preset: str, batches: list[int], tokens: int, steps: int = 1
) -> dict[int, dict[str, float]]:
    """The in-process engine's best tok/s of `REPEATS` runs of each batch (the best of a few: a
    shared machine's noise only slows runs)."""
    run, vocab = engine_runner(preset, tokens, steps), model_vocab(preset)
    return {b: {"tok_s": max(run(prompts_for(b, vocab)) for _ in range(REPEATS))} for b in batches}


def served_paths(
    args: argparse.Namespace, batches: list[int], tokens: int, threads: int
) -> dict[str, dict[int, dict[str, float]]]:
    """`local` and `mesh` as asked, each mode's figures as `<path>` (streamed), `<path>_plain`."""
    app_args = {"model": args.preset, "served_model_name": args.preset}
    local_engine = engine_args(args.scheduler_steps) | {"num_threads": threads}
    configs = {"local": ("single.yaml", {"engine": local_engine}),
               "mesh": ("local.yaml", {"mesh": mesh_args(args)})}  # fmt: skip
    results: dict[str, Any] = {}
    for path in (p for p in ("local", "mesh") if p in args.paths):
        config, extra = configs[path]
        # `local` against the engine beside its idle served runtime, run by run (issue 54).
        beside = (engine_runner(args.preset, tokens, args.scheduler_steps)
                  if path == "local" and "inprocess" in args.paths else None)  # fmt: skip
        by_mode = served(REPO / "deploy" / config, app_args | extra, args.preset, batches, tokens,
                         tuple(args.modes), args.client, beside)  # fmt: skip
        del beside  # its engine's memory, before the next server starts
        first = next(iter(by_mode.values()), {})  # the first mode's engine runs, for the table
        beside_tok_s = {b: f["engine_beside_tok_s"] for b, f in first.items()
                        if "engine_beside_tok_s" in f}  # fmt: skip
        if beside_tok_s:
            results["inprocess_beside_local"] = beside_tok_s
        for mode, figures in by_mode.items():
            name = path + ("" if mode == "stream" else f"_{mode}")
            for batch, f in figures.items():
                print(f"  {name} batch {batch}: " + ", ".join(f"{k} {v:.3g}" for k, v in f.items()))
            results[name] = figures
    return results


def add_ratios(results: dict[str, Any], engine_tok_s: dict[int, float]) -> None:
    """Every served figure's `ratio`: its tok/s over the in-process engine's at that batch, but
    where it has one already (`local`'s, paired run by run with the engine beside it)."""
    for name in (n for n in SERVED if n in results):
        for batch, f in results[name].items():
            if batch in engine_tok_s and "ratio" not in f:
                f["ratio"] = f["tok_s"] / engine_tok_s[batch]


def print_table(results: dict[str, Any], batches: list[int]) -> None:
    """tok/s per path and batch; a served path's ratio to the in-process engine beside it."""
    best = results.get("inprocess_tok_s_best", {})
    rows = {"inprocess": {b: f"{tok_s:.0f}" for b, tok_s in best.items()}}
    beside = results.get("inprocess_beside_local", {})
    if beside:
        rows["inprocess+idle"] = {b: f"{tok_s:.0f}" for b, tok_s in beside.items()}
    for name in (n for n in SERVED if n in results):
        rows[name] = {b: f"{f['tok_s']:.0f}" + (f" ({f['ratio']:.2f})" if "ratio" in f else "")
                      for b, f in results[name].items()}  # fmt: skip
    print(f"{'tok/s (ratio)':<14}" + "".join(f"{f'batch {b}':>16}" for b in batches))
    for name, cells in rows.items():
        print(f"{name:<14}" + "".join(f"{cells.get(b, '-'):>16}" for b in batches))


def targets_met(results: dict[str, Any], preset: str, suffix: str = "") -> dict[str, bool | None]:
    """`TARGETS` judged on the runs named `<path><suffix>`: None (not measured) where that run,
    or the figure a target reads, is missing (a path not run; results from before a figure
    existed)."""

    def at_least(path: str, batch: int, bound: float) -> bool | None:
        ratio = results.get(path + suffix, {}).get(batch, {}).get("ratio")
        return None if ratio is None else ratio >= bound

    cpu = [f["router_cpu_ms_per_token"] for p in ("local", "mesh")
           for f in results.get(p + suffix, {}).values()
           if "router_cpu_ms_per_token" in f]  # fmt: skip

    def idle_at_most(path: str, figure: str) -> bool | None:
        """The idle server's cores (the same figure beside each of a path's batches)."""
        key = f"server_idle_{figure}_cores"
        cores = [f[key] for f in results.get(path + suffix, {}).values() if key in f]
        return cores[0] <= TARGETS[f"{path}_idle_{figure}_cores_max"] if cores else None

    return {
        "local_ratio_batch8_min": at_least("local", 8, TARGETS["local_ratio_batch8_min"]),
        "local_ratio_batch32_min": at_least("local", 32, TARGETS["local_ratio_batch32_min"]),
        "mesh_ratio_batch32_small_min": (
            at_least("mesh", 32, TARGETS["mesh_ratio_batch32_small_min"])
            if preset == "small"
            else None
        ),
        "router_cpu_ms_per_token_max": (
            max(cpu) <= TARGETS["router_cpu_ms_per_token_max"] if cpu else None
        ),
        **{
            f"{path}_idle_{figure}_cores_max": idle_at_most(path, figure)
            for path in ("mesh", "local")
            for figure in ("box", "tree")
        },  # fmt: skip
    }


def yaml_mesh_args() -> dict[str, Any]:
    """deploy/local.yaml's `mesh:` args (a served config's args are replaced key by key)."""
    config = yaml.safe_load((REPO / "deploy" / "local.yaml").read_text())
    return dict(config["applications"][0]["args"]["mesh"])


def mesh_args(args: argparse.Namespace) -> dict[str, Any]:
    """The mesh args of this run: deploy/local.yaml's, changed by `--mesh-args`."""
    return yaml_mesh_args() | args.mesh_args


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", choices=PRESETS,
                        help="the model: a random preset, or smollm2 (`make run`'s)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, 64 tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--paths", nargs="+", default=PATHS, choices=PATHS)
    parser.add_argument("--modes", nargs="+", default=["stream", "plain"],
                        choices=["stream", "plain"],
                        help="streamed requests, and/or plain (non-streaming) ones")  # fmt: skip
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default=CLIENTS[0],
        help="what reads the served responses (default: aiohttp, raw SSE lines)",
    )
    parser.add_argument(
        "--scheduler-steps", type=int, default=1,
        help="greedy decode iterations per engine call, in process and `local` alike (the "
        "engine's num_scheduler_steps; the mesh's engines take one)",
    )  # fmt: skip
    parser.add_argument("--mesh-args", type=json.loads, default={},
                        help="JSON: deploy/local.yaml's mesh args to change")  # fmt: skip
    args = parser.parse_args()
    try:  # here, not after minutes of benching and a server that never comes up
        if not isinstance(args.mesh_args, dict):
            raise ValueError("a JSON object of mesh args")
        mesh_options(mesh_args(args))
    except ValueError as exc:
        parser.error(f"--mesh-args: {exc}")
    if args.scheduler_steps < 1:
        parser.error("--scheduler-steps: at least 1")
    return args


def main() -> None:
    args = parse_args()
    batches = args.batches or ([1, 8] if args.quick else [1, 8, 32])
    tokens = args.tokens or (64 if args.quick else 256)
    threads = torch.get_num_threads()  # the in-process engine's; the local one gets as many
    # Ray starts its workers at nice 15, where every other process on a shared machine (this
    # bench's in-process engine included) would preempt them: serve at the engine's priority.
    os.environ["RAY_worker_niceness"] = "0"  # `serve run` passes it to Ray
    # What Ray sets for a Router of `num_cpus: <threads>` (deploy/single.yaml's advice when the
    # local engine decodes on more than one thread); Ray's replicas keep a value they inherit.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    print(f"preset {args.preset}, batches {batches}, {tokens} tokens, {threads} torch threads, "
          f"load {os.getloadavg()}")  # fmt: skip
    # The client's own full collections would land in the served figures; Serve freezes its
    # replicas' heaps likewise (common/gc_heap.py).
    freeze_startup_heap()
    results: dict[str, Any] = {"preset": args.preset, "cpu": cpu_variant(), "tokens": tokens,
                               "torch_threads": threads, "mesh_args": args.mesh_args,
                               "client": args.client, "scheduler_steps": args.scheduler_steps,
                               "load_avg_start": os.getloadavg()}  # fmt: skip
    if "inprocess" in args.paths:
        results["inprocess"] = in_process(args.preset, batches, tokens, args.scheduler_steps)
    results.update(served_paths(args, batches, tokens, threads))
    if "inprocess" in args.paths:  # again: a shared machine's load moves while the servers run
        end = results["inprocess_end"] = in_process(
            args.preset, batches, tokens, args.scheduler_steps
        )
        best = {b: max(f["tok_s"], end[b]["tok_s"]) for b, f in results["inprocess"].items()}
        results["inprocess_tok_s_best"] = best
        add_ratios(results, best)
    print_table(results, batches)
    results["load_avg_end"] = os.getloadavg()
    results["targets"] = TARGETS
    results["targets_met"] = targets_met(results, args.preset)
    if "plain" in args.modes:
        results["targets_met_plain"] = targets_met(results, args.preset, "_plain")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
