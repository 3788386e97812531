"""Health means progress: a replica whose worker loop stops making passes (a deadlock, a wait
with no deadline) fails `check_health`, so Serve replaces it, although its thread is alive and its
registry heartbeat (another thread) goes on. A real `EngineWorker` on a `WorkerThread`; its loop
is frozen on purpose by a test hook in its periodic tick."""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.mesh_options import MeshOptions
from common.roles import Role
from common.worker_config import WorkerConfig
from services.engine.worker import EngineWorker
from services.mesh import replica
from services.mesh.replica import MeshReplica, WorkerThread


def test_a_frozen_loop_fails_health_while_its_thread_lives(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replica, "STALL_S", 1.0)
    cfg = WorkerConfig(service_id="mixed-0", role=Role.MIXED, model_path=str(tiny_model_path),
                       ready_endpoint="", options=MeshOptions(num_blocks=64),
                       mesh_key=secrets.token_hex(16))  # fmt: skip
    thread = WorkerThread(lambda: EngineWorker(cfg), "engine", cfg.num_threads)
    registry_says_healthy = SimpleNamespace(
        healthy=lambda: True, entry=SimpleNamespace(service_id="mixed-0")
    )  # the heartbeat thread's view: fine
    health = MeshReplica(thread, registry_says_healthy)  # type: ignore[arg-type]
    assert thread.worker is not None
    time.sleep(1.5)  # idle, the loop still passes every 0.2 s
    health.check_health()

    release = threading.Event()
    thread.worker._tick = lambda: release.wait(30)  # type: ignore[method-assign]
    deadline = time.monotonic() + 10
    while thread.stalled_s() < 1.5:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert thread.alive()
    with pytest.raises(RuntimeError, match="has not moved"):
        health.check_health()
    release.set()
    thread.worker._tick = lambda: None  # type: ignore[method-assign]
    time.sleep(0.5)
    health.check_health()  # moving again
    thread.stop()
