"""`bench/serve_server.py`'s `serving` and `measure` (`served`, behind `bench/serve.py`'s served
paths): a real `serve run deploy/single.yaml` (tiny) measured, then a batch through it failing
after killing a process of its own. The bench must not leave a Ray behind on the machine it
measures, whatever happened meanwhile."""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from typing import Any

import pytest

from bench import serve, serve_server
from bench.host_cpu import process_tree
from bench.serve_server import ray_pid
from tests.e2e.serve_process import REPO, alive

APP_ARGS = {"model": "tiny", "served_model_name": "tiny"}
# The idle server's window here: long enough for its processes' clock ticks to add up (Ray's
# runtime never sleeps a whole window), not the bench's, which would cost each test its length.
IDLE_S = 2.0


@pytest.fixture(autouse=True)
def short_idle_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_server, "IDLE_S", IDLE_S)


def wait_gone(pids: set[int], timeout_s: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_served_path_records_each_mode_and_a_failed_batch_leaves_no_served_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One real server (`serving`, what `served` starts). Every batch of each mode is measured
    (`measure`) with the server up, each run right after the in-process engine beside it
    generated the same prompts (its `ratio` the median of the pairs'), beside the idle server's
    busy cores. Then a batch on the same server kills a process of its own that it started (as a
    client dying mid-run would) and fails: the failure reaches the caller, and no process of that
    `serve run` is left, the measured runs' included."""
    trees: list[set[int]] = []
    timed_batch = serve_server.timed_batch

    def recorded_batch(*args: Any) -> dict[str, float]:
        trees.append(process_tree(server.pid))
        # The first streamed run through the official `openai` client, the rest through the
        # bench's default (aiohttp): both readers measure the same server.
        url, preset, prompts, tokens, mode, router_pid, client = args
        assert router_pid == server.router_pid
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
    with pytest.raises(RuntimeError, match="the batch failed"):
        with serve_server.serving(REPO / "deploy" / "single.yaml", APP_ARGS, "tiny") as server:
            assert ray_pid(server.pid, serve_server.ROUTER_TITLE) == server.router_pid
            by_mode = serve_server.measure(server, [1], 8, ("stream", "plain"),
                                           beside=engine_beside)  # fmt: skip
            trees.append(process_tree(server.pid))
            pid = os.fork()  # a process of the batch's own, killed mid-run
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise RuntimeError("the batch failed")
    assert set(by_mode) == {"stream", "plain"} and len(trees) == 2 * serve_server.PAIRS + 1
    assert len(trees[-1]) > 3  # serve run, its Ray and the replicas were found
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
        # Its own processes' cores. NOTE: not bounded by the box's: the box is /proc/stat,
        # sampled at the scheduler's tick (CONFIG_TICK_CPU_ACCOUNTING), the tree each process's
        # exact run time, and an idle Ray runtime is thousands of runs a second shorter than a
        # tick, on cores that stop ticking when idle: the tick sees less of them than ran, and
        # the tree can read above the box (as 40 processes waking every 2 ms for 10 us do).
        assert 0 < figures["server_idle_tree_cores"] <= (os.cpu_count() or 1)
    assert "tbt_ms_p50" in by_mode["stream"][1] and "latency_ms_p50" in by_mode["plain"][1]
    assert wait_gone(set().union(*trees)) == set()
