"""`bench/idle_cost.py --server-pid` over this package's served mesh, as a user runs it: every
process of the server is found below `serve run` and named (Ray's, Serve's, the registry actor,
the mesh's replicas), an idle server's cost is read from /proc, and the last line is the bench's
JSON with its verdict on the mesh's target. What it costs is the bench's to report, never
asserted."""

from __future__ import annotations

import os
import sys

import pytest

from tests.bench_runs import assert_figures_and_targets, run_bench
from tests.e2e.serve_process import PRESET_SHARDS, ServeRun

NAMED = ("gcs_server", "raylet", "ray::ServeController", "ray::ProxyActor", "ray::Registry",
         "ray::ServeReplica:phasemesh:Router", "ray::ServeReplica:phasemesh:PromptEngine",
         "ray::ServeReplica:phasemesh:TokenEngine")  # fmt: skip


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_idle_window_names_every_process_of_the_served_mesh(server: ServeRun) -> None:
    assert server.pid is not None
    result = run_bench(["bench/idle_cost.py", "--paths", "mesh", "--server-pid", str(server.pid),
                        "--window", "1", "--settle", "0"])  # fmt: skip
    assert_figures_and_targets(result)
    assert set(result["targets_met"]) == {"mesh_idle_cores_max"}
    figures = result["mesh"]
    by_process = figures["by_process"]
    for name in NAMED:
        assert any(p.startswith(name) for p in by_process), (name, sorted(by_process))
    shards = by_process["ray::ServeReplica:phasemesh:AttentionShard"]
    assert shards["num_processes"] == PRESET_SHARDS
    # Ray's runtime is never fully asleep, nor busier than the machine.
    assert 0 < figures["idle_cores"] <= (os.cpu_count() or 1)
    assert figures["wakeups_per_s"] > 0 and figures["top_threads"]
