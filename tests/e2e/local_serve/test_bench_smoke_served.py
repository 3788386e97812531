"""The benches that measure a served mesh, run at smoke sizes on this package's one `serve run`
(`--url`/`--server-pid`: no Ray of their own), as tests/integration/test_bench_smoke.py runs the
rest: the last line is one JSON object with figures, `targets` and a `targets_met` map. Speed is
never asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e.serve_process import ServeRun
from tests.integration.test_bench_smoke import assert_figures_and_targets, last_json

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(sys.platform != "linux", reason="the benches read /proc"),
]


def test_sim_validation_compares_the_simulator_with_the_served_mesh(
    server: ServeRun, tmp_path: Path
) -> None:
    """Profile, host model, a few seconds of the Azure slice simulated and replayed: each check
    a verdict, and both sides completed requests."""
    assert server.pid is not None
    result = last_json([
        "bench/sim_validation.py", "--url", server.base_url, "--server-pid", str(server.pid),
        "--duration", "4", "--repeats", "1", "--prompt-sizes", "16", "64", "--batch-sizes", "1",
        "2", "--probe-requests", "4", "--decode-batches", "1", "--idle-s", "0.5",
        "--out", str(tmp_path),
    ], timeout_s=400)  # fmt: skip
    assert_figures_and_targets(result)
    completed = result["time_scales"]["1"]["completed"]
    assert completed["real"] > 0 and completed["sim"] > 0
    assert (tmp_path / "profile.csv").is_file() and (tmp_path / "host.json").is_file()


def test_idle_cost_measures_a_running_server(server: ServeRun) -> None:
    """`--server-pid`: the window over the served mesh's processes, its verdict on the mesh's
    target only."""
    assert server.pid is not None
    command = ["bench/idle_cost.py", "--paths", "mesh", "--server-pid", str(server.pid),
               "--window", "1", "--settle", "0"]  # fmt: skip
    result = last_json(command)
    assert_figures_and_targets(result)
    assert set(result["targets_met"]) == {"mesh_idle_cores_max"}
    assert result["mesh"]["by_process"]
