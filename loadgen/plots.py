"""PNG plots of a run (matplotlib, Agg backend: no display needed).

- `ttft_cdf.png`, `tbt_cdf.png`: empirical CDFs.
- `latency_over_time.png`: TTFT and E2E of each request against its send time; failures marked.
- `load.png`: offered (arrivals) vs achieved (completions) requests/s in time bins; for a sweep,
  achieved vs offered rate and the latency-vs-load curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # NOTE: before pyplot: headless machines have no display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadgen.replay import RequestRecord  # noqa: E402


def _cdf(ax: Any, values_s: Sequence[float], label: str) -> None:
    values_ms = np.sort(np.asarray(values_s, dtype=np.float64)) * 1000.0
    if len(values_ms):
        ax.plot(values_ms, np.arange(1, len(values_ms) + 1) / len(values_ms))
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests" if label == "TTFT" else "fraction of gaps")
    ax.set_title(f"{label} CDF")
    ax.grid(True, alpha=0.3)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(records: Sequence[RequestRecord], duration_s: float, out_dir: Path) -> list[Path]:
    """Write the four plots of one run into `out_dir`; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r.ok]
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    _cdf(ax, [r.ttft_s for r in done if r.ttft_s is not None], "TTFT")
    paths.append(_save(fig, out_dir / "ttft_cdf.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    _cdf(ax, [gap for r in done for gap in r.itl_s], "TBT")
    paths.append(_save(fig, out_dir / "tbt_cdf.png"))
    paths.append(_plot_latency_over_time(records, out_dir / "latency_over_time.png"))
    paths.append(_plot_load_over_time(records, duration_s, out_dir / "load.png"))
    return paths


def _plot_latency_over_time(records: Sequence[RequestRecord], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    done = [r for r in records if r.ok]
    ax.scatter([r.send_s for r in done], [(r.ttft_s or 0) * 1000 for r in done], s=4, label="TTFT")
    ax.scatter([r.send_s for r in done], [(r.e2e_s or 0) * 1000 for r in done], s=4, label="E2E")
    failed = [r.send_s for r in records if not r.ok]
    if failed:
        ax.scatter(failed, [0.0] * len(failed), s=12, marker="x", color="red", label="failed")
    ax.set_xlabel("send time (s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("symlog")
    ax.legend()
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def _plot_load_over_time(records: Sequence[RequestRecord], duration_s: float, path: Path) -> Path:
    bin_s = max(duration_s / 60.0, 1.0)
    edges = np.arange(0.0, max(duration_s, bin_s) + bin_s, bin_s)
    arrivals = np.histogram([r.scheduled_s for r in records], bins=edges)[0] / bin_s
    finish = [r.send_s + r.e2e_s for r in records if r.ok and r.e2e_s is not None]
    completions = np.histogram(finish, bins=edges)[0] / bin_s
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step(
        edges[:-1], arrivals, where="post", linewidth=3, alpha=0.5, label="offered (arrivals/s)"
    )
    ax.step(edges[:-1], completions, where="post", label="achieved (completions/s)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests/s")
    ax.legend()
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def plot_sweep(points: Sequence[dict[str, Any]], out_dir: Path) -> Path:
    """Achieved vs offered load, and p50/p99 TTFT and TBT vs offered load, for a rate sweep."""
    rates = [p["rate"] for p in points]
    fig, (load_ax, lat_ax) = plt.subplots(1, 2, figsize=(11, 4))
    load_ax.plot(rates, [p["request_throughput"] for p in points], "o-", label="achieved")
    load_ax.plot(rates, rates, "--", color="gray", label="offered = achieved")
    load_ax.set_xlabel("offered load (req/s)")
    load_ax.set_ylabel("achieved throughput (req/s)")
    load_ax.legend()
    for key, label in (("p50_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99")):
        lat_ax.plot(rates, [p[key] for p in points], "o-", label=label)
    for key, label in (("p50_itl_ms", "TBT p50"), ("p99_itl_ms", "TBT p99")):
        lat_ax.plot(rates, [p[key] for p in points], "s--", label=label)
    lat_ax.set_xlabel("offered load (req/s)")
    lat_ax.set_ylabel("latency (ms)")
    lat_ax.set_yscale("log")
    lat_ax.legend()
    for ax in (load_ax, lat_ax):
        ax.grid(True, alpha=0.3)
    out_dir.mkdir(parents=True, exist_ok=True)
    return _save(fig, out_dir / "sweep.png")
