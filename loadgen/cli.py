"""`python -m loadgen {replay,sweep,convert,stats}`: argument parsing; the work is in `commands`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import structlog

from loadgen import commands
from loadgen.arrivals import ARRIVAL_MODES, parse_scale
from loadgen.traces import TRACE_FORMATS


def parse_rate(text: str) -> float:
    """Requests/s: a positive number or `inf`."""
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"rate must be positive or inf, got {text!r}")
    return rate


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def json_object(text: str) -> dict[str, Any]:
    """`--extra-body`: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object ({...})")
    return value


def parse_header(text: str) -> tuple[str, str]:
    """`NAME:VALUE` or vLLM's `NAME=VALUE`: split at whichever comes first (a header name holds
    neither; a value may hold both)."""
    cut = min((i for i in (text.find(":"), text.find("=")) if i >= 0), default=-1)
    name, value = text[:cut].strip(), text[cut + 1 :].strip()
    if cut <= 0 or not name:
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return name, value


def _add_schedule_args(parser: argparse.ArgumentParser) -> None:
    """What is sent (a trace or random lengths, scaled) and when (arrivals, limits)."""
    group = parser.add_argument_group("schedule")
    _add_dataset_args(group)
    _add_arrival_args(group)
    _add_length_scale_args(group)


def _add_dataset_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--trace", "--dataset-path", dest="trace", default=None,
        help="Azure CSV, Mooncake JSONL, ShareGPT JSON or BurstGPT CSV (detected from content)",
    )  # fmt: skip
    group.add_argument(
        "--dataset-name", default="auto", choices=("auto", *TRACE_FORMATS, "random"),
        help="the trace's format (default: detected), or 'random' for fixed lengths (no trace)",
    )  # fmt: skip
    group.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens")
    group.add_argument("--random-output-len", type=int, default=128, help="output tokens")
    group.add_argument(
        "--random-range-ratio", type=float, default=0.0,
        help="draw lengths uniformly within ±this fraction (0: fixed)",
    )  # fmt: skip


def _add_arrival_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--arrival",
        choices=ARRIVAL_MODES,
        default=None,
        help="trace timestamps, or poisson/gamma at --rate (default: poisson with --rate, "
        "else trace, for replay; poisson for sweep)",
    )
    group.add_argument(
        "--time-scale",
        type=parse_scale,
        default=1.0,
        help="multiply trace inter-arrival gaps (2 = half speed)",
    )
    group.add_argument(
        "--rate", "--request-rate", dest="rate", type=parse_rate, default=None,
        help="requests/s for poisson/gamma arrivals; 'inf' sends every request at once",
    )  # fmt: skip
    group.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson, < 1 burstier"
    )
    group.add_argument("--start", type=float, default=0.0, help="skip arrivals before (s)")
    group.add_argument("--duration", type=float, help="keep arrivals in [start, start+duration)")
    group.add_argument(
        "--num-requests", "--num-prompts", dest="num_requests", type=int,
        help="send at most this many requests (random: this many, default 1000)",
    )  # fmt: skip
    group.add_argument(
        "--max-concurrency", type=positive_int, default=None,
        help="closed loop: at most N requests in flight (with a rate, both apply)",
    )  # fmt: skip
    group.add_argument(
        "--warmup", "--num-warmups", dest="warmup", type=int, default=0,
        help="send N requests first, all at once, and leave them out of the results",
    )  # fmt: skip


def _add_length_scale_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--token-scale",
        type=parse_scale,
        default=1.0,
        help="scale prompt (and output) lengths, e.g. 1/8",
    )
    group.add_argument(
        "--output-token-scale",
        type=parse_scale,
        default=None,
        help="scale output lengths separately (default: --token-scale)",
    )
    group.add_argument("--seed", type=int, default=0, help="seeds arrival gaps and prompt ids")


def _add_target_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("target")
    group.add_argument("--url", "--base-url", dest="url", help="server base URL, http://host:port")
    group.add_argument(
        "--target",
        default="http",
        help="'http' (default, needs --url) or 'sim:CONFIG' for the simulator",
    )
    group.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    group.add_argument(
        "--endpoint", default="completions",
        help="'completions' (/v1/completions), 'chat' (/v1/chat/completions) or a path",
    )  # fmt: skip
    group.add_argument(
        "--extra-body", type=json_object, default=None, metavar="JSON",
        help="a JSON object merged into every request body (last: it may replace any field)",
    )  # fmt: skip
    group.add_argument(
        "--header", action="append", type=parse_header, default=[], metavar="NAME:VALUE",
        help="an HTTP header for every request (NAME=VALUE also works); repeatable",
    )  # fmt: skip
    group.add_argument(
        "--ready-timeout", "--ready-check-timeout-sec", dest="ready_timeout", type=float,
        default=600.0, help="seconds to wait for GET /v1/models to list a model before starting",
    )  # fmt: skip
    group.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    group.add_argument(
        "--vocab-size", type=int, default=None,
        help="range of prompt token ids (default: the served model's, as /v1/models reports it; "
        "else 32000)",
    )  # fmt: skip
    group.add_argument(
        "--tokenizer", default=None, metavar="PATH_OR_NAME",
        help="send text prompts that this tokenizer (a model folder, a tokenizer.json or a Hub "
        "name: the served model's) encodes to exactly the trace's lengths, instead of token ids; "
        "chat counts them with its chat template (default for chat: the served model's name)",
    )  # fmt: skip
    group.add_argument(
        "--no-min-tokens",
        action="store_true",
        help="do not send min_tokens (for servers that reject it)",
    )
    group.add_argument("--connect-timeout", type=float, default=10.0, help="seconds")
    group.add_argument(
        "--read-timeout",
        type=float,
        default=60.0,
        help="seconds without a byte before a request fails",
    )
    group.add_argument("--max-connections", type=int, default=None)


def _add_report_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("report")
    group.add_argument(
        "--slo",
        action="append",
        default=[],
        help="METRIC[:pPCT]:LIMIT[ms|s|x], comma-separated or repeated; "
        "'splitwise' = Table VI slowdowns",
    )
    group.add_argument(
        "--baseline",
        default=None,
        help="unloaded run (its folder or requests.jsonl) for slowdown SLOs",
    )
    group.add_argument("--baseline-ttft", type=float, default=None, help="ms, instead of a run")
    group.add_argument("--baseline-tbt", type=float, default=None, help="ms, instead of a run")
    group.add_argument(
        "--out", default=None, help="folder for results.json, requests.jsonl/.csv, PNGs"
    )
    group.add_argument("--csv", default=None, help="also write the per-request CSV here")
    group.add_argument("--no-plots", action="store_true")
    group.add_argument("--disable-tqdm", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    """The `python -m loadgen` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m loadgen", description="Replay LLM request traces against a server."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log each failed request")
    sub = parser.add_subparsers(dest="command", required=True)
    replay = sub.add_parser("replay", help="replay a trace and report latency, SLOs, goodput")
    for add in (_add_schedule_args, _add_target_args, _add_report_args):
        add(replay)
    replay.set_defaults(func=commands.cmd_replay)
    sweep = sub.add_parser("sweep", help="replay at several rates: a latency-vs-load curve")
    for add in (_add_schedule_args, _add_target_args, _add_report_args):
        add(sweep)
    sweep.add_argument("--rates", required=True, help="comma-separated requests/s, e.g. 1,2,4")
    sweep.set_defaults(func=commands.cmd_sweep)
    convert = sub.add_parser("convert", help="write a trace (e.g. Azure CSV) as Mooncake JSONL")
    convert.add_argument("--trace", required=True)
    convert.add_argument("--out", required=True, help="output .jsonl path")
    convert.set_defaults(func=commands.cmd_convert)
    stats = sub.add_parser("stats", help="request count, span, rate and token statistics")
    stats.add_argument("--trace", required=True)
    stats.add_argument("--tokenizer", default=None, help="counts a ShareGPT dataset's tokens")
    stats.add_argument("--json", action="store_true", help="last line: one JSON object")
    stats.set_defaults(func=commands.cmd_stats)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and run the subcommand; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # Logs go to stderr so that stdout's last line stays the machine-readable JSON.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.DEBUG if args.verbose else logging.WARNING
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    try:
        return int(args.func(args))
    except (ValueError, OSError) as exc:
        # Bad input (a malformed trace row names its file:line) is a message, not a traceback.
        parser.exit(2, f"error: {exc}\n")
