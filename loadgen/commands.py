"""What each `python -m loadgen` subcommand does, given parsed arguments.

CLI output (summaries, the final JSON line) is printed here; library modules only log.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from common.gc_heap import freeze_startup_heap
from loadgen.arrivals import ArrivalConfig, plan_requests
from loadgen.convert import write_mooncake_jsonl
from loadgen.datasets import random_rows
from loadgen.http_target import OpenAIStreamingTarget, Prompts, endpoint_path, is_chat
from loadgen.prompts import PromptBuilder
from loadgen.replay import ReplayResult, replay, warmup_specs
from loadgen.report import (
    format_summary,
    json_safe,
    read_records,
    summarize,
    write_requests_csv,
    write_results,
)
from loadgen.slo import Baseline, SloTarget, parse_slos
from loadgen.stats import format_stats, trace_stats
from loadgen.target import RequestSpec, Target
from loadgen.text_prompts import text_prompt_builder
from loadgen.traces import TraceRow, read_trace

CountTokens = Callable[[str], int]

# The keys of one sweep point kept in sweep.json's compact table.
SWEEP_KEYS = (
    "rate", "completed", "failed", "request_throughput", "output_throughput", "p50_ttft_ms",
    "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p99_e2el_ms", "request_goodput",
)  # fmt: skip


def cmd_stats(args: argparse.Namespace) -> int:
    """Print a trace's statistics; with --json the last line is one JSON object."""
    count = text_prompt_builder(args.tokenizer, 0, chat=False).count if args.tokenizer else None
    stats = trace_stats(read_trace(args.trace, count))
    print(format_stats(stats))
    if args.json:
        print(json.dumps(json_safe(stats.to_dict())))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Write the trace as Mooncake JSONL."""
    count = write_mooncake_jsonl(read_trace(args.trace), args.out)
    print(f"wrote {count} requests to {args.out}")
    return 0


def arrival_mode(args: argparse.Namespace) -> str:
    """`--arrival`, else Poisson at `--rate` when one is given, else the trace's timestamps."""
    return args.arrival or ("poisson" if args.rate is not None else "trace")


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


RANDOM_DEFAULT_REQUESTS = 1000  # vLLM's --num-prompts default


def dataset_rows(args: argparse.Namespace, count_tokens: CountTokens | None) -> Iterator[TraceRow]:
    """The rows of `--trace` (its format named by `--dataset-name` or detected), or random ones."""
    if args.dataset_name == "random":
        if args.trace:
            raise ValueError("--dataset-name random takes no --trace")
        return random_rows(
            args.num_requests or RANDOM_DEFAULT_REQUESTS, args.random_input_len,
            args.random_output_len, args.random_range_ratio, args.seed,
        )  # fmt: skip
    if not args.trace:
        raise ValueError(
            "--trace (or --dataset-path) is required, except with --dataset-name random"
        )
    kind = None if args.dataset_name == "auto" else args.dataset_name
    return read_trace(args.trace, count_tokens, kind)


def plan(
    args: argparse.Namespace, session: Session, mode: str, rate: float | None, time_scale: float
) -> list[RequestSpec]:
    rows = dataset_rows(args, session.count_tokens)
    return list(plan_requests(rows, arrival_config(args, mode, rate, time_scale)))


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


@dataclass(frozen=True)
class ServedModel:
    """The first model of `GET /v1/models`: its id, and its vocabulary size when the server
    reports one (PhaseMesh does; OpenAI does not)."""

    name: str
    vocab_size: int | None


def request_headers(args: argparse.Namespace) -> dict[str, str]:
    """The API key's `Authorization` and every `--header`, for all requests."""
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    return ({"Authorization": f"Bearer {api_key}"} if api_key else {}) | dict(args.header)


async def wait_for_model(url: str, headers: dict[str, str], timeout_s: float) -> ServedModel:
    """Poll `GET /v1/models` (and `/health`, where the server has one) until the server lists a
    model and is healthy, at most `timeout_s`; then return that model. A server that is still
    starting (refused connections, 503s, no model yet) is waited for; one that refuses the
    credentials, or is not up in time, is a `ValueError` that says why."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    told = False
    async with httpx.AsyncClient(base_url=url, timeout=5.0, headers=headers) as client:
        while True:
            try:
                served, last = await _probe(client)
                if served is not None:
                    return served
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}".rstrip(": ")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ValueError(
                    f"the server at {url} did not list a model within {timeout_s:g} s "
                    f"(GET /v1/models: {last}); is it up? (--ready-timeout)"
                )
            if not told:
                print(f"waiting for {url}/v1/models (up to {timeout_s:g} s): {last}",
                      file=sys.stderr)  # fmt: skip
                told = True
            await asyncio.sleep(min(1.0, remaining))  # another process starting: nothing to await


async def _probe(client: httpx.AsyncClient) -> tuple[ServedModel | None, str]:
    """One look at the server: its first model once it is ready, else why not."""
    response = await client.get("/v1/models")
    if response.status_code in (401, 403):
        raise ValueError(f"GET /v1/models: HTTP {response.status_code}: check --api-key/--header")
    if response.status_code != 200:
        return None, f"HTTP {response.status_code}"
    try:
        card = response.json()["data"][0]
        name = str(card["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None, "no model listed"
    if (await client.get("/health")).status_code == 503:
        return None, "listed a model, /health says 503"
    vocab = card.get("vocab_size")
    return ServedModel(name, vocab if isinstance(vocab, int) and vocab >= 8 else None), "ready"


@dataclass(frozen=True)
class Session:
    """What every replay of one command shares: the server's model, the request headers, the
    prompts, and how to count a dataset's text (a tokenizer was given)."""

    model: str | None
    headers: dict[str, str]
    prompts: Prompts | None
    count_tokens: CountTokens | None
    tokenizer: str | None = None  # what the text prompts were counted with


def open_session(args: argparse.Namespace) -> Session:
    """Wait for the server and take its model (http target), then build the prompts."""
    if args.trace and not Path(args.trace).is_file():  # before waiting on a server for it
        raise ValueError(f"no such trace file: {args.trace}")
    chat = is_chat(endpoint_path(args.endpoint))
    if args.target != "http":
        builder = (
            text_prompt_builder(args.tokenizer, args.seed, chat=chat) if args.tokenizer else None
        )
        return Session(None, {}, builder, builder.count if builder else None, args.tokenizer)
    if not args.url:
        raise ValueError("--url is required for the http target")
    headers = request_headers(args)
    served = asyncio.run(wait_for_model(args.url.rstrip("/"), headers, args.ready_timeout))
    model = args.model or served.name
    if args.tokenizer or chat:
        # Chat sends text; without --tokenizer, vLLM's rule: the served model names it.
        name = args.tokenizer or model
        try:
            builder = text_prompt_builder(name, args.seed, chat=chat)
        except Exception as exc:  # any loader failure: a missing folder, no network, bad JSON
            raise ValueError(
                f"cannot load the tokenizer {name!r} ({type(exc).__name__}: {exc}); the chat "
                "endpoint sends text counted with the served model's tokenizer: pass --tokenizer "
                "with its folder, tokenizer.json or Hub name"
            ) from None
        return Session(model, headers, builder, builder.count, name)
    # Prompt token ids must be ids the served model has: its own vocabulary unless told.
    vocab_size = args.vocab_size or served.vocab_size or DEFAULT_VOCAB_SIZE
    return Session(model, headers, PromptBuilder(vocab_size=vocab_size, seed=args.seed), None)


def build_target(args: argparse.Namespace, session: Session) -> Target:
    """The HTTP client, or the simulator for `--target sim:CONFIG` (`loadgen.sim.target`)."""
    if args.target.startswith("sim:"):
        if args.max_concurrency is not None:
            raise ValueError("--max-concurrency needs a real-time target: not with sim:")
        try:
            sim_target = importlib.import_module("loadgen.sim.target")
        except ImportError as exc:
            raise ValueError(f"the simulator target is not available: {exc}") from None
        target: Target = sim_target.make_target(args.target[len("sim:") :])
        return target
    if args.target != "http":
        raise ValueError(f"unknown target {args.target!r}: use 'http' or 'sim:CONFIG'")
    assert session.model is not None  # open_session waited for it
    return OpenAIStreamingTarget(
        args.url,
        session.model,
        endpoint=args.endpoint,
        prompts=session.prompts,
        connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.read_timeout,
        max_connections=args.max_connections,
        send_min_tokens=not args.no_min_tokens,
        extra_body=args.extra_body,
        headers=session.headers,
    )


async def run_specs(
    specs: list[RequestSpec], args: argparse.Namespace, session: Session
) -> ReplayResult:
    target = build_target(args, session)
    # Our own full collections would land in the latencies we measure (common/gc_heap.py).
    freeze_startup_heap()
    try:
        return await replay(
            specs, target, progress=not args.disable_tqdm,
            max_concurrency=args.max_concurrency, warmup=warmup_specs(specs, args.warmup),
        )  # fmt: skip
    finally:
        await target.aclose()


def run_settings(
    args: argparse.Namespace, session: Session, mode: str, rate: float | None, time_scale: float
) -> dict[str, Any]:
    """The settings a run was made with, first in results.json (vLLM's keys where it has them:
    `date`, `backend`, `model_id`, `tokenizer_id`, `num_prompts`, `request_rate`, `burstiness`,
    `max_concurrency`). Header values are left out: they may hold credentials."""
    endpoint = endpoint_path(args.endpoint)
    return {
        "date": datetime.now(UTC).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if is_chat(endpoint) else "openai",
        "model_id": session.model,
        "tokenizer_id": session.tokenizer,
        "base_url": args.url if args.target == "http" else args.target,
        "endpoint": endpoint,
        "trace": args.trace,
        "dataset_name": args.dataset_name,
        "arrival": mode,
        "request_rate": ("inf" if rate is not None and math.isinf(rate) else rate),
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "time_scale": time_scale,
        "token_scale": args.token_scale,
        "output_token_scale": args.output_token_scale,
        "start": args.start,
        "duration_s": args.duration,
        "num_prompts": args.num_requests,
        "seed": args.seed,
        "extra_body": args.extra_body,
        "header_names": sorted(name for name, _ in args.header),
    }


def run_and_report(
    specs: list[RequestSpec], args: argparse.Namespace, session: Session,
    settings: dict[str, Any], out_dir: Path | None, csv_path: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Replay `specs`, summarise, and write results and plots under `out_dir` if given."""
    slos, baseline = slo_setup(args)
    result = asyncio.run(run_specs(specs, args, session))
    summary = settings | summarize(result, slos, baseline)
    if out_dir is not None:
        write_results(out_dir, summary, result.records)
        if not args.no_plots:
            from loadgen.plots import plot_run  # matplotlib is slow to import; only when needed

            plot_run(result.records, result.duration_s, out_dir)
    if csv_path is not None:
        write_requests_csv(csv_path, result.records)
    return summary


def cmd_replay(args: argparse.Namespace) -> int:
    """Replay the trace once; print the summary and, last, the results as one JSON line."""
    session = open_session(args)
    mode = arrival_mode(args)
    specs = plan(args, session, mode, args.rate, args.time_scale)
    settings = run_settings(args, session, mode, args.rate, args.time_scale)
    out_dir = Path(args.out) if args.out else None
    summary = run_and_report(
        specs, args, session, settings, out_dir, Path(args.csv) if args.csv else None
    )
    print(format_summary(summary))
    print(json.dumps(json_safe(summary)))
    return 0


def _native_rate(args: argparse.Namespace, session: Session) -> float:
    """Requests/s of the trace's own timestamps over the chosen window (time scale 1)."""
    specs = plan(args, session, "trace", None, 1.0)
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
    session = open_session(args)
    native = _native_rate(args, session) if mode == "trace" else None
    out_root = Path(args.out) if args.out else None
    points = []
    for rate in rates:
        scale = native / rate if native is not None else args.time_scale
        specs = plan(args, session, mode, None if native else rate, scale)
        settings = run_settings(args, session, mode, rate, scale)
        out_dir = out_root / f"rate_{rate:g}" if out_root else None
        summary = run_and_report(specs, args, session, settings, out_dir) | {"rate": rate}
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
