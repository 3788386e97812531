"""`bench/sim_validation.py` at smoke sizes on this package's one `serve run` (`--url` and
`--server-pid`: no Ray of its own), as tests/integration/test_bench_smoke.py runs the other
benches: the last line is one JSON object with figures, `targets` and a `targets_met` map. Speed
is never asserted. (`bench/idle_cost.py`'s run is tests/e2e/local_serve/test_idle_cost.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.bench_runs import assert_figures_and_targets, run_bench
from tests.e2e.serve_process import ServeRun

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(sys.platform != "linux", reason="the bench reads /proc"),
]


def test_sim_validation_compares_the_simulator_with_the_served_mesh(
    server: ServeRun, tmp_path: Path
) -> None:
    """Profile, host model, a few seconds of the Azure slice simulated and replayed: each check
    a verdict, and both sides completed requests."""
    assert server.pid is not None
    result = run_bench([
        "bench/sim_validation.py", "--url", server.base_url, "--server-pid", str(server.pid),
        "--duration", "4", "--repeats", "1", "--prompt-sizes", "16", "64", "--batch-sizes", "1",
        "2", "--probe-requests", "4", "--decode-batches", "1", "--idle-s", "0.5",
        "--out", str(tmp_path),
    ])  # fmt: skip
    assert_figures_and_targets(result)
    completed = result["time_scales"]["1"]["completed"]
    assert completed["real"] > 0 and completed["sim"] > 0
    assert (tmp_path / "profile.csv").is_file() and (tmp_path / "host.json").is_file()
