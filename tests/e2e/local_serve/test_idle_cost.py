"""`bench/idle_cost.py --server-pid` over this package's served mesh, as a user runs it: every
process of the server is found below `serve run` and named (Ray's, Serve's, the registry actor,
the mesh's replicas), an idle server's cost is read from /proc, and the last line is the bench's
JSON with its verdict on the mesh's target. What it costs is the bench's to report, never
asserted. And the timers `QUIET_RUNTIME_ENV` slows leave what users run on a `serve run` working:
`serve status`, through the dashboard's REST API."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.bench_runs import assert_figures_and_targets, run_bench
from tests.e2e.serve_process import (
    OFFLINE_TITLE,
    PRESET_SHARDS,
    SERVE_CLI,
    ServeRun,
    descendants,
    listening_ports,
    maps_torch_and_ucxx,
)

NAMED = ("gcs_server", "raylet", "ray::ServeController", "ray::ProxyActor", "ray::Registry",
         "ray::ServeReplica:phasemesh:Router", "ray::ServeReplica:phasemesh:PromptEngine",
         "ray::ServeReplica:phasemesh:TokenEngine", "ray-dashboard-ServeHead", "serve")  # fmt: skip
DASHBOARD_PORTS = range(8265, 8265 + 51)  # Ray's default port and its 50 retries


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_idle_window_names_every_process_of_the_served_mesh(server: ServeRun) -> None:
    assert server.pid is not None
    result = run_bench(["bench/idle_cost.py", "--paths", "mesh", "--server-pid", str(server.pid),
                        "--window", "1", "--settle", "0"])  # fmt: skip
    assert_figures_and_targets(result)
    assert set(result["targets_met"]) == {"mesh_idle_cores_max"}
    assert {"vendor", "family", "model", "isa"} <= set(result["cpu"])  # the variant judged
    figures = result["mesh"]
    by_process = figures["by_process"]
    for name in NAMED:
        assert any(p.startswith(name) for p in by_process), (name, sorted(by_process))
    shards = by_process["ray::ServeReplica:phasemesh:AttentionShard"]
    assert shards["num_processes"] == PRESET_SHARDS
    # Ray's runtime is never fully asleep, nor busier than the machine.
    assert 0 < figures["idle_cores"] <= (os.cpu_count() or 1)
    assert figures["wakeups_per_s"] > 0 and figures["top_threads"]
    # The Ray workers' task loops (a 10 ms signal check each): a part of the whole.
    assert 0 <= figures["ray_workers_main_thread_cores"] <= figures["idle_cores"]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_serve_status_answers_from_the_quiet_runtimes_dashboard(server: ServeRun) -> None:
    assert server.pid is not None
    [port] = [p for p in listening_ports(dashboard_pid(server.pid)) if p in DASHBOARD_PORTS]
    # As the server's own processes run (tests/e2e/serve_process.py): Ray's token auth, said.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("RAY_AUTH_MODE", "token")
    done = subprocess.run([str(SERVE_CLI), "status", "-a", f"http://127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "phasemesh:" in done.stdout and "status: RUNNING" in done.stdout, done.stdout


def dashboard_pid(root: int) -> int:
    """The dashboard head's process below `serve run` (Ray's `dashboard/dashboard.py`)."""
    for pid in descendants(root):
        try:
            if b"dashboard/dashboard.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue  # exited meanwhile
    raise LookupError(f"no dashboard below serve run {root}")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_mesh_router_runs_without_torch_or_ucxx(server: ServeRun) -> None:
    """The served mesh's Router replica, having served requests, never loaded torch or UCX: it
    does not need them (services/app.py imports each role's modules in its own replica), and its
    start and memory are the lighter for it. The engines did load them. (The offline group's
    replica, which runs only with a batch job, is checked after one: test_openai_e2e.py.)"""
    from bench.serve_server import ROUTER_TITLE, ray_pid

    assert server.pid is not None
    router = ray_pid(server.pid, ROUTER_TITLE)
    engine = ray_pid(server.pid, "ray::ServeReplica:phasemesh:TokenEngine")
    assert router is not None and engine is not None
    assert maps_torch_and_ucxx(engine) == (True, True)  # the probe works
    assert maps_torch_and_ucxx(router) == (False, False)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_offline_group_holds_no_replica_before_a_batch_job(server: ServeRun) -> None:
    """deploy/local.yaml's offline group scales to zero (services/app.py, `OFFLINE_AUTOSCALING`):
    a served mesh that has run no batch job yet holds no process for it. (This package's batch
    tests run after this module; test_openai_e2e.py sees the replica start with a job.)"""
    from bench.serve_server import ray_pid

    assert server.pid is not None
    batches = httpx.get(f"{server.base_url}/v1/batches", timeout=30).json()["data"]
    if batches:
        pytest.skip("a batch job ran before this test (the package's order changed)")
    assert ray_pid(server.pid, OFFLINE_TITLE) is None
