"""How `bench/serve.py` judges its figures: each served path's ratio to the in-process engine, the
served engine's CPU per token over the in-process one's, the ceiling's reach, and `targets_met`
against issue 20's targets (on direct ingress, what users run; the proxy's for comparison)."""

from __future__ import annotations

import argparse
from typing import Any

TARGETS = {
    "local_ratio_batch8_min": 0.85,
    "local_ratio_batch32_min": 0.85,
    "mesh_ratio_batch32_small_min": 0.6,
    "router_cpu_ms_per_token_max": 0.3,
}


def record(
    results: dict[str, Any],
    name: str,
    by_mode: dict[str, dict[int, dict[str, float]]],
    engine_tok_s: dict[int, float],
) -> None:
    """Each mode's figures as `results[name]` (streamed) and `results[name + "_plain"]`, with
    their first ratios (against the first in-process run; `rate_ratios` redoes them at the end)."""
    for mode, figures in by_mode.items():
        key = name + ("" if mode == "stream" else f"_{mode}")
        for batch, f in figures.items():
            if batch in engine_tok_s:
                f["ratio"] = f["tok_s"] / engine_tok_s[batch]
            print(f"  {key} batch {batch}: " + ", ".join(f"{k} {v:.3g}" for k, v in f.items()))
        results[key] = figures


def reachable(results: dict[str, Any], suffix: str = "") -> dict[str, bool]:
    """Whether the front end alone (the ceiling at the engine's rate) passes the local target."""
    ratios = {b: f["ratio"] for b, f in results.get("ceiling_direct" + suffix, {}).items()}
    return {f"batch{b}": ratios[b] >= TARGETS[f"local_ratio_batch{b}_min"]
            for b in (8, 32) if b in ratios}  # fmt: skip


def rate_ratios(results: dict[str, Any], engine_tok_s: dict[int, float]) -> None:
    """Every served figure's `ratio`, against the engine's best of its two measurements."""
    for figures in results.values():
        if isinstance(figures, dict) and all(isinstance(f, dict) for f in figures.values()):
            for batch, f in figures.items():
                if "tok_s" in f and batch in engine_tok_s:
                    f["ratio"] = f["tok_s"] / engine_tok_s[batch]


BESIDE = "inprocess_beside_"  # + cores: the `neighbor` path's figures (bench/cpu_load.py)


def neighbor_bounds(results: dict[str, Any]) -> None:
    """`ratio_bound` of each `local` figure: the in-process engine's ratio beside a synthetic load
    of as many cores as that run's `others_cores` (all but the engine's threads: the client, Ray,
    the Router's front end), interpolated linearly over the `neighbor` path's loads (no load:
    1.0), extrapolated past the last from the last two: the served ratio if the others' CPU were
    all the served path cost its engine."""
    loads = sorted((float(name[len(BESIDE):]), figures) for name, figures in results.items()
                   if name.startswith(BESIDE))  # fmt: skip
    if not loads:
        return
    for name, figures in results.items():
        if not name.startswith("local_") or not isinstance(figures, dict):
            continue
        for batch, f in figures.items():
            if not isinstance(f, dict) or "others_cores" not in f:
                continue
            points = [(0.0, 1.0)] + [(c, by_batch[batch]["ratio"]) for c, by_batch in loads
                                     if batch in by_batch]  # fmt: skip
            if len(points) > 1:
                f["ratio_bound"] = interpolate(points, f["others_cores"])


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """y at x on the polyline through `points` (sorted by x, two or more), extended past the
    last segment's end along it."""
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y1
    return points[-1][1]


def engine_efficiency(results: dict[str, Any]) -> dict[str, dict[int, float]]:
    """`local_<ingress>[_plain]_engine_cpu_over_inprocess`: CPU per token of the served engine's
    threads over the in-process engine's, per batch (1.0: the replica costs the engine nothing;
    above it, the same tokens took more CPU: time its threads spun at OpenMP barriers while one
    of them was preempted, `engine_preemptions_per_s` against `inprocess.preemptions_per_s`)."""
    inprocess = results.get("inprocess", {})
    out = {}
    for name, figures in results.items():
        if name.startswith("local_") and isinstance(figures, dict):
            out[f"{name}_engine_cpu_over_inprocess"] = {
                b: f["engine_cpu_ms_per_token"] / inprocess[b]["cpu_ms_per_token"]
                for b, f in figures.items()
                if isinstance(f, dict) and "engine_cpu_ms_per_token" in f and b in inprocess
            }
    return {k: v for k, v in out.items() if v}


def bound_reachable(results: dict[str, Any], suffix: str = "") -> dict[str, bool]:
    """Whether the served engine's `ratio_bound` (what the others' CPU alone leaves it) passes
    the local target: False says no front end could meet it on this machine in that run."""
    figures = results.get("local_direct" + suffix, {})
    return {f"batch{b}": f["ratio_bound"] >= TARGETS[f"local_ratio_batch{b}_min"]
            for b, f in figures.items() if b in (8, 32) and "ratio_bound" in f}  # fmt: skip


def judge(results: dict[str, Any], args: argparse.Namespace) -> None:
    """The ceiling's and the neighbour bound's reach and every `targets_met*` map, added to
    `results`."""
    if 1 in args.ceiling_speedup:
        for suffix in ("", "_plain"):
            if "ceiling_direct" + suffix in results:
                results["ceiling_local_ratio_reachable" + suffix] = reachable(results, suffix)
    for suffix in ("", "_plain"):
        if reach := bound_reachable(results, suffix):
            results["bound_local_ratio_reachable" + suffix] = reach
    for ingress in args.ingress:  # direct: what users run; the proxy's for comparison
        name = "targets_met" + ("" if ingress == "direct" else f"_{ingress}")
        results[name] = targets_met(results, args.preset, f"_{ingress}")
        if "plain" in args.modes:  # the table: non-streaming requests
            results[name + "_plain"] = targets_met(results, args.preset, f"_{ingress}_plain")
        if args.stream_interval:
            results[name + "_stream_interval"] = targets_met(
                results, args.preset, f"_{ingress}_si{args.stream_interval}"
            )


def targets_met(results: dict[str, Any], preset: str, suffix: str = "") -> dict[str, bool | None]:
    """The targets of the runs named `<path><suffix>` (`_<ingress>[_si<N>]`)."""

    def ratio(path: str, batch: int) -> float | None:
        return results.get(path + suffix, {}).get(batch, {}).get("ratio")

    def at_least(value: float | None, bound: float) -> bool | None:
        return None if value is None else value >= bound

    cpu = [f["router_cpu_ms_per_token"] for p in ("local", "mesh")
           for f in results.get(p + suffix, {}).values()]  # fmt: skip
    return {
        "local_ratio_batch8_min": at_least(ratio("local", 8), 0.85),
        "local_ratio_batch32_min": at_least(ratio("local", 32), 0.85),
        "mesh_ratio_batch32_small_min": (
            at_least(ratio("mesh", 32), 0.6) if preset == "small" else None
        ),
        "router_cpu_ms_per_token_max": (max(cpu) <= 0.3) if cpu else None,
    }


def served_over_baselines(results: dict[str, Any]) -> dict[str, Any]:
    """Per batch both ran (plain): the served mesh's tok/s over its processes' without Ray
    (`..._over_processes`), and over the same processes beside the idle served mesh
    (`..._over_beside_served`); those over the processes alone (`..._beside_served_over_alone`);
    and the served local engine's over the in-process engine beside the idle served local
    (`local_<ingress>[_plain]_over_engine_beside_served`), per mode."""
    pairs = {
        "mesh_direct_plain_over_processes": ("mesh_direct_plain", "mesh_processes_plain"),
        "mesh_direct_plain_over_beside_served": (
            "mesh_direct_plain", "mesh_processes_beside_served_plain"),
        "mesh_processes_beside_served_over_alone": (
            "mesh_processes_beside_served_plain", "mesh_processes_plain"),
    }  # fmt: skip
    for key in ("local_direct", "local_direct_plain", "local_proxy", "local_proxy_plain"):
        pairs[f"{key}_over_engine_beside_served"] = (key, "engine_beside_served")
    ratios = {}
    for name, (top, bottom) in pairs.items():
        over, under = results.get(top), results.get(bottom)
        if over and under:
            ratios[name] = {b: over[b]["tok_s"] / f["tok_s"] for b, f in under.items() if b in over}
    return ratios
