"""`python -m loadgen.sim autoscale`: a trace with load steps on an autoscaled cluster.

Each deployment is sized by the live mesh's decision (`loadgen/sim/autoscale_replay.py`);
prints each scale event, then replica-seconds by deployment, the scale events, and TTFT / TBT p90
against Table VI's limits over the run and within each step; the last line is one JSON object:

python -m loadgen.sim autoscale --trace ../shared/traces/AzureLLMInferenceTrace_conv.csv \\
    --design Splitwise-HH --initial 11P3T --max 30P10T --rate 25 --duration 1800 \\
    --step 3x@600s+600s --startup-s 60 [--policy policy.yaml]

`--policy` is a YAML file of `AutoscaleOptions` fields (`startup_s`, `interval_s`,
`look_back_s`, `shards_per_group`) and, per deployment (`prompt`, `token`, or `mixed` for a
baseline), the knobs a deploy YAML's `policy_kwargs` takes (`targets`, `upscale_after_s`, ...);
the command line's `--startup-s` wins over the file's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import yaml

from common.roles import Role
from loadgen.sim.autoscale_replay import (
    default_options,
    parse_step,
    roles_of,
    simulate_autoscaled,
    stepped,
    summary,
)
from loadgen.sim.designs import DESIGNS, parse_cluster
from loadgen.sim.workload import as_recorded, poisson, read_trace


def add_autoscale_parser(sub: Any) -> None:
    """The `autoscale` subcommand, added to `python -m loadgen.sim`'s subparsers."""
    p = sub.add_parser("autoscale", help="load steps on an autoscaled cluster")
    p.add_argument("--trace", required=True)
    p.add_argument("--design", required=True, choices=sorted(DESIGNS))
    p.add_argument("--max", required=True, help="the pool: max replicas, e.g. 30P10T (or 40)")
    p.add_argument("--initial", default="", help="machines at time 0 (default: min_replicas)")
    p.add_argument(
        "--rate", type=float, default=0.0, help="Poisson base rate (default: as recorded)"
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="as recorded: time x this")
    p.add_argument("--duration", type=float, default=1800.0, help="simulated seconds of arrivals")
    p.add_argument("--step", action="append", default=[], help="e.g. 3x@600s+600s (repeatable)")
    p.add_argument("--startup-s", type=float, default=None, help="provisioning to first work")
    p.add_argument("--policy", default="", help="YAML: per-deployment knobs and options")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_autoscale)


def counts(design_name: str, text: str) -> dict[Role, int]:
    """`30P10T` (or `40` for a baseline) as machines per deployment."""
    cluster = parse_cluster(f"{design_name}:{text}")
    if not cluster.design.split:
        return {Role.MIXED: cluster.num_prompt}
    return {Role.PROMPT: cluster.num_prompt, Role.TOKEN: cluster.num_token}


def run_autoscale(args: argparse.Namespace) -> int:
    design = DESIGNS[args.design]
    file: dict[str, Any] = yaml.safe_load(Path(args.policy).read_text()) if args.policy else {}
    overrides = dict(file or {})
    if args.startup_s is not None:
        overrides["startup_s"] = args.startup_s
    if args.initial:
        overrides["initial"] = counts(args.design, args.initial)
    options = default_options(design, counts(args.design, args.max), **overrides)
    steps = [parse_step(text) for text in args.step]
    rows = read_trace(args.trace)
    # The base load for as long as the steps' windows compress more of it into the duration.
    extra = sum(s.duration_s * (s.factor - 1) for s in steps)
    if args.rate:
        base = poisson(rows, args.rate, args.duration + extra, args.seed)
    else:
        base = list(as_recorded(rows, args.time_scale))
    requests = [r for r in stepped(base, steps) if r.arrival_s < args.duration]
    started = time.perf_counter()
    result = simulate_autoscaled(design, requests, options, args.duration,
                                 progress=not args.no_progress)  # fmt: skip
    wall_s = time.perf_counter() - started
    for event in result.events:
        print(f"{event.time_s:8.0f} s  {event.role.value:<7} {event.before:>3} -> {event.after}")
    figures = summary(result, args.duration, steps)
    print(
        f"{design.name}, {len(requests)} requests, {figures['completed']} completed, "
        f"simulated in {wall_s:.1f} s"
    )
    for role in roles_of(design):
        print(
            f"  {role.value:<7} {figures['replica_s'][role.value]:>10.0f} replica-s  "
            f"{figures['scale_events'][role.value]} scale events"
        )
    windows = [("run", figures["attainment"])]
    windows += [(f"step {s.factor:g}x@{s.start_s:g}s", a)
                for s, a in zip(steps, figures["attainment_in_steps"], strict=True)]  # fmt: skip
    for name, a in windows:
        print(
            f"  {name:<16} TTFT p90 {a['ttft_p90']:.2f}x (limit {a['ttft_limit']:g}x, "
            f"{a['ttft_within']:.1%} within), TBT p90 {a['tbt_p90']:.2f}x "
            f"(limit {a['tbt_limit']:g}x, {a['tbt_within']:.1%} within)"
        )
    print(json.dumps({"design": design.name, **figures, "wall_s": round(wall_s, 2)}))
    return 0
