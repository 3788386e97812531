"""What each `python -m loadgen` subcommand does, given parsed arguments.

CLI output (summaries, the final JSON line) is printed here; library modules only log.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
from pathlib import Path
from typing import Any

import httpx

from common.gc_heap import freeze_startup_heap
from loadgen.arrivals import ArrivalConfig, plan_requests
from loadgen.convert import write_mooncake_jsonl
from loadgen.http_target import OpenAIStreamingTarget, Prompts
from loadgen.prompts import PromptBuilder
from loadgen.replay import ReplayResult, replay
from loadgen.report import format_summary, json_safe, read_records, summarize, write_results
from loadgen.slo import Baseline, SloTarget, parse_slos
from loadgen.stats import format_stats, trace_stats
from loadgen.target import RequestSpec, Target
from loadgen.text_prompts import TextPromptBuilder, load_tokenizer
from loadgen.traces import read_trace

# The keys of one sweep point kept in sweep.json's compact table.
SWEEP_KEYS = (
    "rate", "completed", "failed", "request_throughput", "output_throughput", "p50_ttft_ms",
    "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p99_e2el_ms", "request_goodput",
)  # fmt: skip


def cmd_stats(args: argparse.Namespace) -> int:
    """Print a trace's statistics; with --json the last line is one JSON object."""
    stats = trace_stats(read_trace(args.trace))
    print(format_stats(stats))
    if args.json:
        print(json.dumps(json_safe(stats.to_dict())))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Write the trace as Mooncake JSONL."""
    count = write_mooncake_jsonl(read_trace(args.trace), args.out)
    print(f"wrote {count} requests to {args.out}")
    return 0


def arrival_config(
    args: argparse.Namespace, mode: str, rate: float | None, time_scale: float
) -> ArrivalConfig:
    return ArrivalConfig(
        mode=mode,
        time_scale=time_scale,
        rate=rate,
        burstiness=args.burstiness,
        start_s=args.start,
        duration_s=args.duration,
        num_requests=args.num_requests,
        token_scale=args.token_scale,
        output_scale=args.output_token_scale,
        seed=args.seed,
    )


def slo_setup(args: argparse.Namespace) -> tuple[list[SloTarget], Baseline | None]:
    """Parse --slo and build the baseline that slowdown SLOs divide by."""
    slos = [target for text in args.slo for target in parse_slos(text)]
    baseline = None
    if args.baseline:
        baseline = Baseline.from_records(read_records(Path(args.baseline)))
    elif args.baseline_ttft is not None and args.baseline_tbt is not None:
        baseline = Baseline.from_values(args.baseline_ttft / 1000.0, args.baseline_tbt / 1000.0)
    if any(t.slowdown for t in slos) and baseline is None:
        raise ValueError("slowdown SLOs need --baseline RUN or --baseline-ttft and --baseline-tbt")
    return slos, baseline


DEFAULT_VOCAB_SIZE = 32000  # when neither --vocab-size nor the server says


async def discover_model(url: str, api_key: str | None) -> tuple[str, int | None]:
    """The first model of `GET /v1/models`: its id (`default` when the server lists none) and
    its vocabulary size when the server reports one (PhaseMesh does; OpenAI does not)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5.0, headers=headers) as client:
            card = (await client.get("/v1/models")).json()["data"][0]
        vocab = card.get("vocab_size")
        return str(card["id"]), vocab if isinstance(vocab, int) and vocab >= 8 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return "default", None


async def build_target(args: argparse.Namespace) -> Target:
    """The HTTP client, or the simulator for `--target sim:CONFIG` (`loadgen.sim.target`)."""
    if args.target.startswith("sim:"):
        try:
            sim_target = importlib.import_module("loadgen.sim.target")
        except ImportError as exc:
            raise ValueError(f"the simulator target is not available: {exc}") from None
        target: Target = sim_target.make_target(args.target[len("sim:") :])
        return target
    if args.target != "http":
        raise ValueError(f"unknown target {args.target!r}: use 'http' or 'sim:CONFIG'")
    if not args.url:
        raise ValueError("--url is required for the http target")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    served, served_vocab = await discover_model(args.url, api_key)
    prompts: Prompts
    if args.tokenizer:
        prompts = TextPromptBuilder(load_tokenizer(args.tokenizer), seed=args.seed)
    else:
        # Prompt token ids must be ids the served model has: its own vocabulary unless told.
        vocab_size = args.vocab_size or served_vocab or DEFAULT_VOCAB_SIZE
        prompts = PromptBuilder(vocab_size=vocab_size, seed=args.seed)
    return OpenAIStreamingTarget(
        args.url,
        args.model or served,
        endpoint=args.endpoint,
        prompts=prompts,
        api_key=api_key,
        connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.read_timeout,
        max_connections=args.max_connections,
        send_min_tokens=not args.no_min_tokens,
    )


async def run_specs(specs: list[RequestSpec], args: argparse.Namespace) -> ReplayResult:
    target = await build_target(args)
    # Our own full collections would land in the latencies we measure (common/gc_heap.py).
    freeze_startup_heap()
    try:
        return await replay(specs, target, progress=not args.disable_tqdm)
    finally:
        await target.aclose()


def run_and_report(
    specs: list[RequestSpec], args: argparse.Namespace, out_dir: Path | None
) -> dict[str, Any]:
    """Replay `specs`, summarise, and write results and plots under `out_dir` if given."""
    slos, baseline = slo_setup(args)
    result = asyncio.run(run_specs(specs, args))
    summary = summarize(result, slos, baseline)
    if out_dir is not None:
        write_results(out_dir, summary, result.records)
        if not args.no_plots:
            from loadgen.plots import plot_run  # matplotlib is slow to import; only when needed

            plot_run(result.records, result.duration_s, out_dir)
    return summary


def cmd_replay(args: argparse.Namespace) -> int:
    """Replay the trace once; print the summary and, last, the results as one JSON line."""
    config = arrival_config(args, args.arrival or "trace", args.rate, args.time_scale)
    specs = list(plan_requests(read_trace(args.trace), config))
    summary = run_and_report(specs, args, Path(args.out) if args.out else None)
    print(format_summary(summary))
    print(json.dumps(json_safe(summary)))
    return 0


def _native_rate(args: argparse.Namespace) -> float:
    """Requests/s of the trace's own timestamps over the chosen window (time scale 1)."""
    specs = list(plan_requests(read_trace(args.trace), arrival_config(args, "trace", None, 1.0)))
    span = max((s.arrival_s for s in specs), default=0.0)
    if span <= 0:
        raise ValueError("the trace window spans no time: cannot scale it to a rate")
    return len(specs) / span


def cmd_sweep(args: argparse.Namespace) -> int:
    """Replay at each rate of --rates; write sweep.json and sweep.png; last line is JSON.

    With `--arrival trace` a rate is reached by scaling the trace's timestamps (its burstiness is
    kept); otherwise arrivals are Poisson/gamma at that rate.
    """
    rates = [float(text) for text in args.rates.split(",") if text.strip()]
    mode = args.arrival or "poisson"
    native = _native_rate(args) if mode == "trace" else None
    out_root = Path(args.out) if args.out else None
    points = []
    for rate in rates:
        scale = native / rate if native is not None else args.time_scale
        config = arrival_config(args, mode, None if native else rate, scale)
        specs = list(plan_requests(read_trace(args.trace), config))
        out_dir = out_root / f"rate_{rate:g}" if out_root else None
        summary = run_and_report(specs, args, out_dir) | {"rate": rate}
        points.append(summary)
        print(f"rate {rate:g} req/s: " + json.dumps(json_safe(_compact(summary))))
    table = [_compact(point) for point in points]
    if out_root is not None:
        (out_root / "sweep.json").write_text(json.dumps(json_safe(table), indent=2) + "\n")
        if not args.no_plots:
            from loadgen.plots import plot_sweep

            plot_sweep(points, out_root)
    print(json.dumps(json_safe({"sweep": table})))
    return 0


def _compact(summary: dict[str, Any]) -> dict[str, Any]:
    return {key: summary.get(key) for key in SWEEP_KEYS}
