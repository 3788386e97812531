"""`python -m loadgen.sim`: replay a trace, or search a provisioning, with the simulator.

python -m loadgen.sim replay --trace T.csv --cluster Splitwise-HH:25P15T [--rate 70]
    [--home-roles 30,120]
python -m loadgen.sim provision --trace T.csv --design Splitwise-HH --power 70 --plot out.png
python -m loadgen.sim provision --trace T.csv --design Splitwise-HH --rate 70 --by cost
python -m loadgen.sim lamina --trace T.csv [--memory 4 8] [--batches 1 2 3 4]
python -m loadgen.sim offline [--hardware a100-80gb] [--gpus 8] [--requests 2000]
python -m loadgen.sim devices [--profiles A100x2 H100x2 results/device/device_profile.json]
python -m loadgen.sim autoscale --trace T.csv --design Splitwise-HH --max 30P10T --rate 25 \
    --step 3x@600s+600s
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import replace

from loadgen.sim import compiled

# Run as `python -m loadgen.sim`: the compiled hot modules when built and current
# (loadgen/sim/compiled.py), else pure Python, decided before the imports below load them.
# Imported (by tests), it changes nothing: that process keeps the pure-Python modules.
COMPILED = compiled.enable() if __name__ == "__main__" else False

from common.scheduling.home_roles import HomeRoleThresholds
from loadgen.sim.autoscale_cli import add_autoscale_parser
from loadgen.sim.designs import DESIGNS, parse_cluster
from loadgen.sim.device_directions import add_devices_parser
from loadgen.sim.lamina_cli import add_lamina_parser
from loadgen.sim.offline import add_offline_parser
from loadgen.sim.provision import (
    best_under_budget,
    cheapest_for_rate,
    format_table,
    plot_design_space,
)
from loadgen.sim.rate_search import Probe, SearchSettings
from loadgen.sim.simulator import SimOptions, simulate
from loadgen.sim.slo import check_slos
from loadgen.sim.workload import as_recorded, poisson, read_trace


def _replay(args: argparse.Namespace) -> int:
    rows = read_trace(args.trace)
    cluster = parse_cluster(args.cluster)
    requests = poisson(rows, args.rate, args.duration) if args.rate else list(as_recorded(rows))
    options = None
    if args.home_roles:  # homes follow the queue mix, by the live router's policy
        hold_s, cooldown_s = (float(x) for x in args.home_roles.split(","))
        homes = HomeRoleThresholds(hold_s=hold_s, cooldown_s=cooldown_s)
        options = SimOptions(thresholds=replace(SimOptions().thresholds, home_roles=homes))
    started = time.perf_counter()
    result = simulate(cluster, requests, options)
    wall_s = time.perf_counter() - started
    check = check_slos(result)
    print(
        f"{cluster.label}: {result.num_completed}/{len(result.records)} requests, "
        f"{result.end_s:.0f} s simulated in {wall_s:.1f} s, {result.num_events} events"
    )
    for key, value in check.slowdowns.items():
        print(f"  {key:<9} {value:6.2f}x  (limit {check.limits[key]:g}x)")
    print(json.dumps({"cluster": cluster.label, "slos_met": check.met, "wall_s": round(wall_s, 2),
                      "num_home_moves": result.num_home_moves, "compiled": COMPILED}))  # fmt: skip
    return 0


def _provision(args: argparse.Namespace) -> int:
    rows = read_trace(args.trace)
    design = DESIGNS[args.design]
    settings = SearchSettings(Probe(duration_s=args.duration))
    if args.rate:
        grid = (range(args.step, args.max_machines + 1, args.step),) * 2
        best, evaluated = cheapest_for_rate(design, rows, args.rate, grid, args.by, settings)
        print(
            f"{design.name} at {args.rate:g} RPS: {len(evaluated)} mixes, "
            f"{sum(ok for _, ok in evaluated)} within SLOs"
        )
        print(format_table([best]) if best else "no mix on the grid meets the SLOs")
        if args.plot:
            title = f"{design.name}, {args.rate:g} RPS, {args.by}-optimal"
            plot_design_space(evaluated, best, args.plot, title)
        return 0
    budget, by = (args.power, "power") if args.power else (args.cost, "cost")
    best, candidates = best_under_budget(design, rows, budget, by, args.step, settings)
    print(format_table(candidates))
    print(f"best: {best.cluster.label} at {best.max_rate:.1f} RPS")
    if args.plot:
        evaluated = [(c.cluster, c.max_rate > 0) for c in candidates]
        rates = {c.cluster: c.max_rate for c in candidates}
        title = f"{design.name}, iso-{by} {budget:g}: max RPS within SLOs"
        plot_design_space(evaluated, best, args.plot, title, rates)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen.sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    replay = sub.add_parser("replay", help="simulate one cluster on a trace")
    replay.add_argument("--trace", required=True)
    replay.add_argument(
        "--cluster", required=True, help="e.g. Splitwise-HH:25P15T, Baseline-H100:40"
    )
    replay.add_argument(
        "--rate", type=float, default=0.0, help="Poisson rate (default: as recorded)"
    )
    replay.add_argument("--duration", type=float, default=120.0, help="seconds, with --rate")
    replay.add_argument(
        "--home-roles", default="", metavar="HOLD_S,COOLDOWN_S",
        help="machines' homes follow the queue mix (common/scheduling/home_roles.py)",
    )  # fmt: skip
    replay.set_defaults(func=_replay)
    prov = sub.add_parser("provision", help="search the prompt/token machine mix")
    prov.add_argument("--trace", required=True)
    prov.add_argument("--design", required=True, choices=sorted(DESIGNS))
    budget = prov.add_mutually_exclusive_group(required=True)
    budget.add_argument("--power", type=float, help="power budget (DGX-A100 = 1)")
    budget.add_argument("--cost", type=float, help="cost budget (DGX-A100 = 1)")
    budget.add_argument("--rate", type=float, help="throughput target (RPS): minimize --by")
    prov.add_argument("--by", choices=("cost", "power"), default="cost")
    prov.add_argument("--step", type=int, default=5, help="machine-count grid step")
    prov.add_argument("--max-machines", type=int, default=40, help="grid bound with --rate")
    prov.add_argument("--duration", type=float, default=90.0, help="simulated seconds per probe")
    prov.add_argument("--plot", default="", help="write a Fig. 12-style PNG here")
    prov.set_defaults(func=_provision)
    add_lamina_parser(sub)
    add_offline_parser(sub)
    add_autoscale_parser(sub)
    add_devices_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
