"""`bench/idle_cost.py`'s window over this package's served mesh: every process of the server is
found below `serve run` and named (Ray's, Serve's, the registry actor, the mesh's replicas), and an
idle server's cost is read from /proc. What it costs is the bench's to report, never asserted."""

from __future__ import annotations

import os
import sys

import pytest

from bench.idle_cost import idle_window
from tests.e2e.serve_process import PRESET_SHARDS, ServeRun

NAMED = ("gcs_server", "raylet", "ray::ServeController", "ray::ProxyActor", "ray::Registry",
         "ray::ServeReplica:phasemesh:Router", "ray::ServeReplica:phasemesh:PromptEngine",
         "ray::ServeReplica:phasemesh:TokenEngine")  # fmt: skip


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_idle_window_names_every_process_of_the_served_mesh(server: ServeRun) -> None:
    assert server.pid is not None
    figures = idle_window(server.pid, window_s=1.0)
    by_process = figures["by_process"]
    for name in NAMED:
        assert any(p.startswith(name) for p in by_process), (name, sorted(by_process))
    shards = by_process["ray::ServeReplica:phasemesh:AttentionShard"]
    assert shards["num_processes"] == PRESET_SHARDS
    # Ray's runtime is never fully asleep, nor busier than the machine.
    assert 0 < figures["idle_cores"] <= (os.cpu_count() or 1)
    assert figures["wakeups_per_s"] > 0 and figures["top_threads"]
