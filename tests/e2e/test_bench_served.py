"""`bench/serve_server.py`'s `served`, behind `bench/serve.py`'s served paths: a real `serve run
deploy/single.yaml` (tiny), and what runs while it is up (`while_up`, the `*_beside_served`
paths) failing or being killed. The bench must not leave a Ray behind on the machine it
measures, whatever its side path did."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from bench import serve_server
from bench.host_cpu import process_tree
from bench.serve_clients import ray_pid
from tests.e2e.serve_process import REPO, ServeRun

APP_ARGS = {"model": "tiny", "served_model_name": "tiny"}


class RecordedServeRun(ServeRun):
    """The real `ServeRun`, remembered so that the test can find the processes it started."""

    started: list[RecordedServeRun] = []

    def start(self, timeout_s: float = 240.0) -> str:
        RecordedServeRun.started.append(self)
        return super().start(timeout_s)


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent (the test process, for `serve run`)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: set[int], timeout_s: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_side_path_that_fails_or_is_killed_leaves_no_served_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the served `local` is up, the side path (1) finds its Router replica, (2) kills a
    process of its own that it started (as a mesh worker or fresh process dying mid-run would),
    then (3) fails. The failure reaches the caller, and no process of that `serve run` is left."""
    monkeypatch.setattr(serve_server, "ServeRun", RecordedServeRun)
    RecordedServeRun.started.clear()
    seen: dict[str, set[int]] = {}

    def side_path() -> None:
        server = RecordedServeRun.started[-1]
        assert server.pid is not None
        assert ray_pid(server.pid, serve_server.ROUTER_TITLE) is not None  # still up and serving
        seen["tree"] = process_tree(server.pid)
        pid = os.fork()  # a process of the side path's own, killed mid-run
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise RuntimeError("the side path failed")

    with pytest.raises(RuntimeError, match="the side path failed"):
        serve_server.served(REPO / "deploy" / "single.yaml", APP_ARGS, "tiny", [1], 8, "direct",
                            ("plain",), while_up=side_path)  # fmt: skip
    assert len(seen["tree"]) > 3  # serve run, its Ray and the replicas were found
    assert wait_gone(seen["tree"]) == set()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_served_path_records_its_batches_and_then_runs_its_side_path_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The side path runs after every batch was measured (each mode's figures are there), once,
    with the server up; then the server is stopped."""
    monkeypatch.setattr(serve_server, "ServeRun", RecordedServeRun)
    RecordedServeRun.started.clear()
    calls: list[set[int]] = []

    def side_path() -> None:
        server = RecordedServeRun.started[-1]
        assert server.pid is not None and ray_pid(server.pid, serve_server.ROUTER_TITLE) is not None
        calls.append(process_tree(server.pid))

    by_mode = serve_server.served(REPO / "deploy" / "single.yaml", APP_ARGS, "tiny", [1], 8,
                                  "direct", ("stream", "plain"), while_up=side_path)  # fmt: skip
    assert set(by_mode) == {"stream", "plain"}
    assert all(by_mode[mode][1]["tok_s"] > 0 for mode in by_mode)
    # The idle server's whole machine: Ray's runtime is never fully asleep (nor more than the box).
    assert all(0 < by_mode[mode][1]["server_idle_box_cores"] <= os.cpu_count() for mode in by_mode)
    assert len(calls) == 1
    assert wait_gone(calls[0]) == set()
