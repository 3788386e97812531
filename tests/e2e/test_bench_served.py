"""`bench/serve_server.py`'s `served`, behind `bench/serve.py`'s served paths: a real `serve run
deploy/single.yaml` (tiny) measured, and a batch through it failing or being killed. The bench
must not leave a Ray behind on the machine it measures, whatever happened meanwhile."""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import pytest

from bench import serve, serve_server
from bench.host_cpu import process_tree
from bench.serve_server import ray_pid
from tests.e2e.serve_process import REPO, ServeRun

APP_ARGS = {"model": "tiny", "served_model_name": "tiny"}
# The idle server's window here: long enough for its processes' clock ticks to add up (Ray's
# runtime never sleeps a whole window), not the bench's, which would cost each test its length.
IDLE_S = 2.0


@pytest.fixture(autouse=True)
def short_idle_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_server, "IDLE_S", IDLE_S)


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
def test_a_batch_that_fails_leaves_no_served_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the served `local` up, a batch (1) finds its Router replica, (2) kills a process of its
    own that it started (as a client dying mid-run would), then (3) fails. The failure reaches the
    caller, and no process of that `serve run` is left. The engine run beside a batch fails inside
    the same `try` (`served`'s `finally` stops the server), so one real server covers both."""
    monkeypatch.setattr(serve_server, "ServeRun", RecordedServeRun)
    RecordedServeRun.started.clear()
    seen: dict[str, set[int]] = {}

    def failing_batch(*args: object) -> NoReturn:
        server = RecordedServeRun.started[-1]
        assert server.pid is not None
        assert ray_pid(server.pid, serve_server.ROUTER_TITLE) is not None  # still up and serving
        seen["tree"] = process_tree(server.pid)
        pid = os.fork()  # a process of the batch's own, killed mid-run
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise RuntimeError("the batch failed")

    monkeypatch.setattr(serve_server, "timed_batch", failing_batch)
    with pytest.raises(RuntimeError, match="the batch failed"):
        serve_server.served(REPO / "deploy" / "single.yaml", APP_ARGS, "tiny", [1], 8, ("plain",))
    assert len(seen["tree"]) > 3  # serve run, its Ray and the replicas were found
    assert wait_gone(seen["tree"]) == set()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_served_path_records_each_mode_and_the_idle_machine_then_stops_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every batch of each mode is measured with the server up, each run right after the
    in-process engine beside it generated the same prompts (its `ratio` the median of the
    pairs'), beside the idle server's busy cores; then every process of the server is stopped."""
    monkeypatch.setattr(serve_server, "ServeRun", RecordedServeRun)
    RecordedServeRun.started.clear()
    trees: list[set[int]] = []
    timed_batch = serve_server.timed_batch

    def recorded_batch(*args: Any) -> dict[str, float]:
        server = RecordedServeRun.started[-1]
        assert server.pid is not None
        trees.append(process_tree(server.pid))
        # The first streamed run through the official `openai` client, the rest through the
        # bench's default (aiohttp): both readers measure the same server.
        url, preset, prompts, tokens, mode, router_pid, client = args
        if len(trees) == 1:
            assert mode == "stream" and client == serve_server.CLIENTS[0]
            client = "openai"
        figures = timed_batch(url, preset, prompts, tokens, mode, router_pid, client)
        runs.append(("served", prompts, figures["tok_s"]))
        return figures

    engine = serve.engine_runner("tiny", 8)

    def engine_beside(prompts: list[list[int]]) -> float:
        tok_s = engine(prompts)
        runs.append(("engine", prompts, tok_s))
        return tok_s

    runs: list[tuple[str, list[list[int]], float]] = []
    monkeypatch.setattr(serve_server, "timed_batch", recorded_batch)
    by_mode = serve_server.served(REPO / "deploy" / "single.yaml", APP_ARGS, "tiny", [1], 8,
                                  ("stream", "plain"), beside=engine_beside)  # fmt: skip
    assert set(by_mode) == {"stream", "plain"} and len(trees) == 2 * serve_server.PAIRS
    # Pairs: the engine on a run's prompts right before it.
    assert [r[0] for r in runs] == ["engine", "served"] * (2 * serve_server.PAIRS)
    assert all(e[1] == s[1] for e, s in zip(runs[::2], runs[1::2], strict=True))
    for i, mode in enumerate(("stream", "plain")):
        mine = runs[2 * i * serve_server.PAIRS : 2 * (i + 1) * serve_server.PAIRS]
        ratios = [s[2] / e[2] for e, s in zip(mine[::2], mine[1::2], strict=True)]
        assert by_mode[mode][1]["ratio"] == pytest.approx(statistics.median(ratios))
    for figures in (by_mode[mode][1] for mode in by_mode):
        assert figures["tok_s"] > 0 and figures["router_cpu_ms_per_token"] >= 0
        assert figures["client_cpu_ms_per_token"] > 0 and figures["engine_beside_tok_s"] > 0
        # The idle server's whole machine: Ray's runtime is never fully asleep (nor more than
        # the box).
        assert 0 < figures["server_idle_box_cores"] <= (os.cpu_count() or 1)
        # Its own processes' share of that (a clock tick's rounding apart).
        assert 0 < figures["server_idle_tree_cores"] <= figures["server_idle_box_cores"] + 0.05
    assert "tbt_ms_p50" in by_mode["stream"][1] and "latency_ms_p50" in by_mode["plain"][1]
    assert wait_gone(set().union(*trees)) == set()
