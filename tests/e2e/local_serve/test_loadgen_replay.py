"""The load generator against the real server: `python -m loadgen replay` on `serve run`.

The package's `serve run deploy/local.yaml` (`conftest.py`: Ray start-up is the slow part), started
the way `tests/e2e/serve_process.py` starts it, so whatever topology local.yaml names is what is
tested.
The first test replays the first 60 s of the Azure conversation trace, scaled to the tiny model;
the last one SIGKILLs that same server halfway through a replay, so `conftest.py` runs it last.

The expected requests come from this file's own reader of the trace (the `csv` module and exact
decimal timestamps), not from `loadgen.traces`, so the report is checked against the trace itself.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.model.default import PRESETS, default_model_path
from loadgen.traces import shared_dir
from tests.e2e.serve_process import REPO, ServeRun

pytestmark = pytest.mark.timeout(600)

TRACE = shared_dir() / "traces" / "AzureLLMInferenceTrace_conv.csv"
WINDOW_S = 60
TOKEN_SCALE = Fraction(1, 16)  # prompts up to ~4.1 K tokens become <= 257: fits a 4096 context
TIME_SCALE = Fraction(1, 4)  # the 60 s window arrives in 15 s: a few seconds of queueing on 2 CPUs
KILL_TIME_SCALE = Fraction(1, 8)  # the replay the server dies in: shorter, and more in flight
READ_TIMEOUT_S = 20  # a stalled stream fails after this long instead of hanging the replay


@dataclass(frozen=True)
class TraceRequest:
    """One row of the trace window, lengths already scaled as the replay should send them."""

    arrival_s: Fraction  # from the trace's first row, in trace time (exact)
    input_len: int
    output_len: int


def stamp_seconds(stamp: str) -> Fraction:
    """`2023-11-16 18:15:46.6805900` as exact epoch seconds (all 7 fractional digits kept)."""
    whole, _, fraction = stamp.strip().partition(".")
    moment = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    return int(moment.timestamp()) + Fraction("0." + (fraction or "0"))


def scaled(num_tokens: int) -> int:
    """The documented `--token-scale` rule: rounded to nearest, never below 1."""
    return max(1, round(num_tokens * TOKEN_SCALE))


def read_window(path: Path, window_s: int) -> list[TraceRequest]:
    """Rows of an Azure CSV whose arrival is in `[0, window_s)` of the first row, in file order."""
    requests = []
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        origin: Fraction | None = None
        for row in rows:
            stamp = stamp_seconds(row["TIMESTAMP"])
            origin = stamp if origin is None else origin
            if 0 <= stamp - origin < window_s:
                inputs, outputs = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                requests.append(TraceRequest(stamp - origin, scaled(inputs), scaled(outputs)))
    return requests


@pytest.fixture(scope="module")
def window() -> list[TraceRequest]:
    if not TRACE.exists():
        pytest.skip(f"trace not found: {TRACE} (set PHASEMESH_SHARED)")
    return read_window(TRACE, WINDOW_S)


# ---- the package's server (tests/e2e/local_serve/conftest.py) and what its model accepts ----


@dataclass
class Server:
    run: ServeRun
    vocab_size: int
    max_model_len: int


def model_limits(config: dict[str, Any]) -> tuple[int, int]:
    """(vocab size, context length) of the model the serve config names (a preset or a folder)."""
    model = config["applications"][0]["args"].get("model", "tiny")
    folder = default_model_path(model) if model in PRESETS else Path(model)
    hf = json.loads((folder / "config.json").read_text())
    return int(hf["vocab_size"]), int(hf["max_position_embeddings"])


@pytest.fixture(scope="module")
def target(server: ServeRun) -> Server:
    return Server(server, *model_limits(server.config))


def require_healthy(server: Server, timeout_s: float = 120.0) -> None:
    """Until `/health` says 200: `test_self_healing.py` runs just before the kill test, and the
    replicas it SIGKILLed may still be rejoining the mesh (503 until every role is back)."""
    deadline = time.monotonic() + timeout_s
    while (status := httpx.get(server.run.base_url + "/health", timeout=10).status_code) != 200:
        assert time.monotonic() < deadline, f"the server is down ({status} for {timeout_s} s)"
        time.sleep(1)  # waiting on Serve to restart replicas: nothing to block on


# ---- running the load generator ----


def replay_command(server: Server, out_dir: Path, time_scale: Fraction) -> list[str]:
    """`python -m loadgen replay` of the scaled 60 s window against `server`, results in out_dir."""
    return [
        sys.executable, "-m", "loadgen", "replay",
        "--trace", str(TRACE), "--url", server.run.base_url,
        "--duration", str(WINDOW_S), "--time-scale", str(time_scale),
        # No --vocab-size: the prompts' ids come from the served model's vocabulary, which the
        # load generator reads off /v1/models (before, every request was a 400 without it).
        "--token-scale", str(TOKEN_SCALE),
        "--read-timeout", str(READ_TIMEOUT_S), "--out", str(out_dir),
        "--no-plots", "--disable-tqdm",
    ]  # fmt: skip


def loadgen_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@dataclass
class ReplayOutput:
    """What one `loadgen replay` process left: its output, results.json and requests.jsonl."""

    returncode: int
    stdout: str
    stderr: str
    summary: dict[str, Any]
    records: list[dict[str, Any]]

    @classmethod
    def of(
        cls, proc: subprocess.Popen[str], stdout: str, stderr: str, out_dir: Path
    ) -> ReplayOutput:
        assert proc.returncode == 0, f"loadgen exited {proc.returncode}:\n{stdout}\n{stderr}"
        summary = json.loads((out_dir / "results.json").read_text())
        assert json.loads(stdout.strip().splitlines()[-1]) == summary  # the last line is the JSON
        lines = (out_dir / "requests.jsonl").read_text().splitlines()
        records = sorted((json.loads(line) for line in lines), key=lambda r: r["req_index"])
        return cls(proc.returncode, stdout, stderr, summary, records)


def run_replay(
    command: list[str], out_dir: Path, timeout_s: float, during: Callable[[], None] | None = None
) -> ReplayOutput:
    """Run the replay to its end (at most `timeout_s`), calling `during()` while it runs."""
    proc = subprocess.Popen(
        command, cwd=REPO, env=loadgen_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        if during is not None:
            during()
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"loadgen replay still running after {timeout_s}s:\n{stdout}\n{stderr}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(stdout, f"stderr:\n{stderr}", sep="\n")  # the terminal summary, for `pytest -rP`
    return ReplayOutput.of(proc, stdout, stderr, out_dir)


def schedule_span_s(window: list[TraceRequest], time_scale: Fraction) -> float:
    return float(max(r.arrival_s for r in window) * time_scale)


def check_completed_records(
    records: list[dict[str, Any]], window: list[TraceRequest], time_scale: Fraction
) -> None:
    """Each request was sent as the trace says, and each completed one streamed exactly its
    requested output: by the server's usage and by the token chunks it sent (one per token)."""
    assert [r["req_index"] for r in records] == list(range(len(window)))
    for record, expected in zip(records, window, strict=True):
        assert (record["input_len"], record["output_len"]) == (
            expected.input_len,
            expected.output_len,
        )
        assert record["scheduled_s"] == pytest.approx(float(expected.arrival_s * time_scale))
        if record["error"] is None:
            assert record["prompt_tokens"] == expected.input_len, record
            assert record["output_tokens"] == expected.output_len, record
            # One gap per streamed chunk: tokens that reach the router together leave as one
            # chunk (vLLM's benchmark counts its inter-token latencies per chunk too).
            assert 1 <= len(record["itl_s"]) + 1 <= expected.output_len, record


# ---- the tests ----


def test_replay_60s_of_azure_conversations(
    window: list[TraceRequest], target: Server, tmp_path: Path
) -> None:
    require_healthy(target)
    assert max(r.input_len + r.output_len for r in window) <= target.max_model_len
    timeout_s = schedule_span_s(window, TIME_SCALE) + 120  # the schedule, then the queue drains
    result = run_replay(replay_command(target, tmp_path, TIME_SCALE), tmp_path, timeout_s)

    summary = result.summary
    assert summary["num_requests"] == len(window) > 0
    assert (summary["completed"], summary["failed"], summary["error_kinds"]) == (len(window), 0, {})
    assert summary["total_input_tokens"] == sum(r.input_len for r in window)
    assert summary["total_output_tokens"] == sum(r.output_len for r in window)
    check_completed_records(result.records, window, TIME_SCALE)
    assert "Traceback" not in result.stdout + result.stderr


def test_chat_closed_loop_of_20_requests(
    window: list[TraceRequest], target: Server, tmp_path: Path
) -> None:
    """The issue's acceptance, as docs/loadgen.md prints it: `--endpoint chat --max-concurrency 4
    --num-requests 20`, all due at once; the tokenizer found from the served name (a preset);
    the settings, and a CSV row per request."""
    require_healthy(target)
    command = [
        sys.executable, "-m", "loadgen", "replay", "--trace", str(TRACE),
        "--url", target.run.base_url, "--endpoint", "chat", "--max-concurrency", "4",
        "--num-requests", "20", "--request-rate", "inf", "--token-scale", "1/2",
        "--output-token-scale", str(TOKEN_SCALE), "--warmup", "2",
        "--read-timeout", str(READ_TIMEOUT_S), "--out", str(tmp_path), "--no-plots",
        "--disable-tqdm",
    ]  # fmt: skip
    result = run_replay(command, tmp_path, timeout_s=300)
    summary = result.summary
    assert (summary["completed"], summary["failed"], summary["errors"]) == (20, 0, [""] * 20)
    assert summary["endpoint"] == "/v1/chat/completions" and summary["max_concurrency"] == 4
    served_name = target.run.config["applications"][0]["args"]["served_model_name"]
    assert summary["model_id"] == summary["tokenizer_id"] == served_name
    assert summary["base_url"] == target.run.base_url and summary["trace"] == str(TRACE)
    assert summary["max_concurrent_requests"] == 4  # 20 due at once, 4 slots
    # The chat template's own tokens are part of each length, and the server counts what was asked.
    assert summary["usage_mismatches"] == {"prompt_tokens": 0, "completion_tokens": 0,
                                           "no_usage": 0}  # fmt: skip
    with open(tmp_path / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["req_index"]) for row in rows] == list(range(20))
    for row, expected in zip(rows, window[:20], strict=True):
        assert int(row["output_tokens"]) == expected.output_len
        assert float(row["e2el_ms"]) >= float(row["ttft_ms"]) > 0


def summary_value(stdout: str, label: str) -> str:
    """The value printed after `label` in the terminal summary."""
    [line] = [line for line in stdout.splitlines() if line.startswith(label)]
    return line[len(label) :].strip()


def wait_for_requests_in_flight(base_url: str, timeout_s: float) -> None:
    """Until the server's `/stats` shows the replay's requests arriving."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(base_url + "/stats", timeout=5).json()["num_requests"] > 0:
            return
        time.sleep(0.05)  # polling another process's counters: nothing to block on
    pytest.fail(f"no request reached the server within {timeout_s}s")


def test_server_killed_mid_replay_ends_with_an_error_report(
    window: list[TraceRequest], target: Server, tmp_path: Path
) -> None:
    """Runs last (`conftest.py`): it kills the package's server."""
    require_healthy(target)
    span_s = schedule_span_s(window, KILL_TIME_SCALE)

    def kill_halfway() -> None:
        wait_for_requests_in_flight(target.run.base_url, timeout_s=span_s + 60)
        # Open loop: the second half of the schedule is sent after the kill whatever the server's
        # speed, so some requests must fail; those in flight are cut mid-stream.
        time.sleep(span_s / 2)
        target.run.kill()

    # Bounded: the rest of the schedule, then at most one read timeout for a stalled stream.
    timeout_s = span_s + READ_TIMEOUT_S + 60
    command = replay_command(target, tmp_path, KILL_TIME_SCALE)
    result = run_replay(command, tmp_path, timeout_s, kill_halfway)

    assert "Traceback" not in result.stdout + result.stderr
    summary = result.summary
    assert summary["num_requests"] == len(window)  # every request of the schedule was sent
    assert summary["failed"] > 0
    assert summary["completed"] + summary["failed"] == len(window)
    assert sum(summary["error_kinds"].values()) == summary["failed"]
    failed_records = [r for r in result.records if r["error"] is not None]
    assert len(failed_records) == summary["failed"]
    check_completed_records(result.records, window, KILL_TIME_SCALE)
    completed_failed = f"{summary['completed']} / {summary['failed']}"
    assert summary_value(result.stdout, "Requests (completed / failed):") == completed_failed
    for kind, count in summary["error_kinds"].items():
        assert summary_value(result.stdout, f"Errors {kind}:") == str(count)
