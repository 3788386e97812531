"""Provisioning search (Splitwise §IV-D): the best prompt/token machine mix for a trace and SLOs.

For each candidate mix the simulator finds the highest Poisson request rate at which all SLOs hold
at that rate and at every lower one (sizes drawn from the trace). Feasibility is not monotone in
the rate: with few token machines, moderate load overloads them before the router starts
borrowing machines into the mixed pool, which heavier load triggers (Splitwise-HH 35P/5T on the
conversation trace misses its SLOs at 20-40 RPS and meets them at 50-80), so a plain bisection can
jump over the rates a cluster cannot serve: the search climbs a grid of rates to the first miss,
then bisects below it (`rate_search.py`). Constraints: a power or cost budget (maximize
throughput) or a throughput target (minimize cost or power). Results print as a table and plot
like Splitwise Fig. 12 (prompt machines on x, token machines on y).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from loadgen.sim.designs import ClusterSpec, Design
from loadgen.sim.rate_search import Probe, SearchSettings, climb_and_bisect
from loadgen.sim.simulator import SimOptions, simulate
from loadgen.sim.slo import check_slos
from loadgen.sim.workload import poisson
from loadgen.traces import TraceRow


@dataclass(frozen=True)
class Candidate:
    """One machine mix and the highest rate it sustains within SLOs (0 if none)."""

    cluster: ClusterSpec
    max_rate: float

    @property
    def rate_per_cost(self) -> float:
        return self.max_rate / self.cluster.cost


def meets_slos(
    cluster: ClusterSpec,
    rows: list[TraceRow],
    rate: float,
    probe: Probe,
    options: SimOptions | None = None,
) -> bool:
    """Whether `cluster` holds every SLO at `rate` requests/s."""
    requests = poisson(rows, rate, probe.duration_s, probe.seed)
    result = simulate(cluster, requests, options)
    return check_slos(result, skip_before_s=probe.warmup_s).met


def max_rate(
    cluster: ClusterSpec,
    rows: list[TraceRow],
    settings: SearchSettings | None = None,
    options: SimOptions | None = None,
) -> float:
    """The highest rate within SLOs with every grid rate below it within them too: climb from
    `min_rate` in `rate_step`s to the first miss, then bisect below it (0 when `min_rate` fails;
    `max_rate` when nothing up to it does)."""
    s = settings or SearchSettings()

    def meets(rate: float) -> bool:
        return meets_slos(cluster, rows, rate, s.probe, options)

    return climb_and_bisect(meets, s.min_rate, s) if meets(s.min_rate) else 0.0


def mixes_within(
    design: Design, budget: float, by: str, step: int = 5, min_each: int = 1
) -> Iterator[ClusterSpec]:
    """Split-design mixes on a `step` grid whose cost or power (`by`) fits `budget`, using as much
    of it as the grid allows (a baseline: the single largest count)."""
    unit = {"power": lambda c: c.power, "cost": lambda c: c.cost}[by]
    if not design.split:
        n = 1
        while unit(ClusterSpec(design, n + 1)) <= budget + 1e-9:
            n += 1
        yield ClusterSpec(design, n)
        return
    for num_prompt in range(min_each, 1000, step):
        if unit(ClusterSpec(design, num_prompt, 1)) > budget + 1e-9:
            return
        num_token = 1
        while unit(ClusterSpec(design, num_prompt, num_token + 1)) <= budget + 1e-9:
            num_token += 1
        yield ClusterSpec(design, num_prompt, num_token)


def best_under_budget(
    design: Design,
    rows: list[TraceRow],
    budget: float,
    by: str = "power",
    step: int = 5,
    settings: SearchSettings | None = None,
    min_each: int = 1,
) -> tuple[Candidate, list[Candidate]]:
    """Throughput-optimized mix under a power or cost budget: (best, all evaluated)."""
    candidates = [
        Candidate(c, max_rate(c, rows, settings))
        for c in mixes_within(design, budget, by, step, min_each)
    ]
    return max(candidates, key=lambda c: c.max_rate), candidates


def cheapest_for_rate(
    design: Design,
    rows: list[TraceRow],
    rate: float,
    grid: tuple[range, range],
    by: str = "cost",
    settings: SearchSettings | None = None,
) -> tuple[Candidate | None, list[tuple[ClusterSpec, bool]]]:
    """Iso-throughput: the cheapest (by cost or power) mix on `grid` holding SLOs at `rate`."""
    s = settings or SearchSettings()
    evaluated = [
        (c, meets_slos(c, rows, rate, s.probe))
        for c in (ClusterSpec(design, p, t) for p in grid[0] for t in grid[1])
    ]
    feasible = [c for c, ok in evaluated if ok]
    if not feasible:
        return None, evaluated
    best = min(feasible, key=lambda c: (getattr(c, by), c.num_machines))
    return Candidate(best, rate), evaluated


def format_table(candidates: list[Candidate]) -> str:
    """A fixed-width table of mixes and their sustained rates."""
    lines = [f"{'cluster':<34} {'cost':>7} {'power':>7} {'max RPS':>8} {'RPS/cost':>9}"]
    for c in candidates:
        k = c.cluster
        numbers = f"{k.cost:>7.2f} {k.power:>7.2f} {c.max_rate:>8.1f} {c.rate_per_cost:>9.2f}"
        lines.append(f"{k.label:<34} {numbers}")
    return "\n".join(lines)


def plot_design_space(
    evaluated: list[tuple[ClusterSpec, bool]],
    best: Candidate | None,
    path: str,
    title: str,
    rates: dict[ClusterSpec, float] | None = None,
) -> None:
    """Fig. 12-style scatter: prompt vs token machines, feasible mixes colored by cost and
    labelled with the rate each sustains (`rates`, RPS), the optimum starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    ok = [c for c, good in evaluated if good]
    bad = [c for c, good in evaluated if not good]
    ax.scatter([c.num_prompt for c in bad], [c.num_token for c in bad], c="lightgrey", marker="x")
    points = ax.scatter(
        [c.num_prompt for c in ok],
        [c.num_token for c in ok],
        c=[c.cost for c in ok],
        cmap="viridis",
    )
    if ok:
        fig.colorbar(points, ax=ax, label="cost (DGX-A100 = 1)")
    for c in ok if rates else ():
        ax.annotate(f"{rates[c]:.0f} RPS", (c.num_prompt, c.num_token), textcoords="offset points",
                    xytext=(6, 4), fontsize=7)  # fmt: skip
    if best is not None:
        k = best.cluster
        ax.scatter([k.num_prompt], [k.num_token], marker="*", s=300, c="red", label=k.label)
        ax.legend(loc="upper right", fontsize=8)
    ax.margins(x=0.15, y=0.1)  # room for the labels at the edges
    ax.set_xlabel("prompt machines")
    ax.set_ylabel("token machines")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
