"""An idle engine is quiet: a real `EngineWorker` on a `WorkerThread` publishes its load report
every `IDLE_REPORT_INTERVAL_S` while nothing happens (each report is a decode for every router),
at the busy pace once a message or work came; between reports its loop sleeps. The worker
module's clock is a fake one the test moves; the loop itself runs on its own thread with its real
socket waits."""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.mesh_options import MeshOptions
from common.roles import Role
from common.worker_config import WorkerConfig
from services.engine import worker as worker_module
from services.engine.worker import IDLE_REPORT_INTERVAL_S, EngineWorker
from services.mesh.replica import WorkerThread
from tests.thread_wakeups import thread_wakeups


def wait_until(condition: object, timeout_s: float = 30.0) -> None:
    """A hang guard only: the condition is what the test checks."""
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_an_idle_engine_reports_its_load_at_the_idle_pace_and_at_once_after_work(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    fake_time = SimpleNamespace(monotonic=lambda: clock[0], time=time.time,
                                perf_counter=time.perf_counter)  # fmt: skip
    monkeypatch.setattr(worker_module, "time", fake_time)
    published: list[float] = []
    publish = EngineWorker._publish_load

    def counted(self: EngineWorker, now: float) -> None:
        published.append(now)
        publish(self, now)

    monkeypatch.setattr(EngineWorker, "_publish_load", counted)
    cfg = WorkerConfig(service_id="mixed-0", role=Role.MIXED, model_path=str(tiny_model_path),
                       ready_endpoint="", options=MeshOptions(num_blocks=64),
                       mesh_key=secrets.token_hex(16))  # fmt: skip
    thread = WorkerThread(lambda: EngineWorker(cfg), "engine", cfg.num_threads)
    try:
        assert thread.worker is not None
        wait_until(lambda: len(published) >= 1)  # the first report goes at once
        first = len(published)
        clock[0] += IDLE_REPORT_INTERVAL_S / 2
        before = thread_wakeups(thread.thread)
        time.sleep(1.0)  # idle passes of the loop (real waits), half an interval on
        assert len(published) == first  # the fake clock: nothing to report yet
        # It blocks until the idle report is due (half an interval here), not 5 times a second.
        assert thread_wakeups(thread.thread) - before <= 3
        clock[0] += IDLE_REPORT_INTERVAL_S
        wait_until(lambda: len(published) == first + 1)  # the idle pace
        thread.worker._worked = True  # what a message or a step sets (the loop's own thread)
        clock[0] += 0.1  # past the busy pace, far below the idle one
        wait_until(lambda: len(published) == first + 2)
    finally:
        thread.stop()
