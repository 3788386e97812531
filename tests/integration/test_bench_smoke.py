"""Each bench of docs/benchmarks.md runs at tiny sizes, as a user runs it, and its last line is
one JSON object with figures, `targets` and a `targets_met` map: so that none rots unnoticed.
Speed is never asserted.

Run elsewhere: `bench/serve.py` (tests/integration/test_serve_bench_inprocess.py, and its
served paths in tests/e2e/test_bench_served.py), `bench/profile.py`
(tests/integration/test_profile_bench.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

SMOKE_RUNS = {
    "early_q": ["bench/early_q.py", "--model", "tiny", "--rows", "1", "--repeats", "1"],
    "attention": ["bench/attention.py", "--quick", "--repeats", "1"],
    "router_hotpath": ["bench/router_hotpath.py", "--batch", "1", "--tokens", "8"],
    "simulator": ["bench/simulator.py", "--duration", "10"],
    "device_profile": "bench/device_profile.py --device cpu --model tiny --repeats 1".split(),
    # The device check runs it with --device cuda; here the CPU version, two meshes of one rate.
    "neo": "bench/neo.py --device cpu --requests 4 --rates 8 --max-output 8".split(),
    "autoscale": (
        "bench/autoscale.py --rate 4 --duration 120 --step 3x@40s+40s --max-machines 8 "
        "--probe-s 20 --settle-s 60 --startup-s 10 --seeds 0"
    ).split(),
}


def last_json(command: list[str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("bench", sorted(SMOKE_RUNS) + ["engine"])
def test_the_bench_prints_figures_and_its_targets(bench: str, tiny_model_path: Path) -> None:
    command = SMOKE_RUNS.get(bench) or [
        "bench/engine.py", "--model", str(tiny_model_path), "--batches", "1", "--repeats", "1",
        "--no-unpacked", "--no-onednn",
    ]  # fmt: skip
    result = last_json(command)
    targets, met = result["targets"], result["targets_met"]
    assert targets and isinstance(met, dict) and met
    assert set(met) <= set(targets)  # every verdict is on a stated target
    assert all(verdict is None or isinstance(verdict, bool) for verdict in met.values())
    figures = {k: v for k, v in result.items() if k not in ("targets", "targets_met")}
    assert any(isinstance(v, int | float | dict) and v not in (0, {}) for v in figures.values())
