"""The streaming client and replay driver against a real HTTP server in a subprocess.

`tests.sse_stub_server` is a stand-in for the HTTP transport only (PhaseMesh's router does not
exist yet): it streams OpenAI-style SSE chunks and can fail on demand. The tests kill it
mid-stream, make it stall, answer errors, and check that every failure becomes a counted
per-request error and that the run returns.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from loadgen.http_target import OpenAIStreamingTarget, chunk_token_count, error_message
from loadgen.prompts import PromptBuilder
from loadgen.replay import ReplayResult, replay, run_one
from loadgen.report import summarize
from loadgen.target import RequestSpec, StreamEvent, Usage
from tests.sse_stub_server import running_stub as sse_stub_server

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO))
pytestmark = pytest.mark.timeout(120)


def specs(count: int, output_len: int = 5, gap_s: float = 0.0, input_len: int = 9):
    return [RequestSpec(i, i * gap_s, input_len, output_len) for i in range(count)]


def run(url: str, request_specs: list[RequestSpec], **target_kwargs) -> ReplayResult:
    async def go() -> ReplayResult:
        target = OpenAIStreamingTarget(url, "stub", prompts=PromptBuilder(100), **target_kwargs)
        try:
            # The bound is a hang detector, far above any healthy run here.
            return await asyncio.wait_for(replay(request_specs, target, progress=False), 60)
        finally:
            await target.aclose()

    return asyncio.run(go())


def test_streams_record_ttft_gaps_and_usage_tokens() -> None:
    with sse_stub_server() as (_, url):
        result = run(url, specs(6, output_len=7))
    summary = summarize(result)
    assert summary["completed"] == 6 and summary["failed"] == 0
    for record in result.records:
        assert record.output_tokens == 7 and record.prompt_tokens == 9  # from usage
        assert len(record.itl_s) == 6  # 7 chunks, 6 gaps
        assert record.ttft_s is not None and record.e2e_s is not None
        assert record.e2e_s == pytest.approx(record.ttft_s + sum(record.itl_s))
    assert summary["total_output_tokens"] == 42


def test_output_tokens_counted_from_chunks_without_usage() -> None:
    with sse_stub_server("--no-usage") as (_, url):
        result = run(url, specs(2, output_len=4))
    assert [(r.output_tokens, r.prompt_tokens, r.ok) for r in result.records] == [
        (4, None, True)
    ] * 2


def test_http_error_status_becomes_a_request_error_with_the_message() -> None:
    with sse_stub_server("--status", "503") as (_, url):
        result = run(url, specs(3))
    summary = summarize(result)
    assert summary["failed"] == 3 and summary["error_kinds"] == {"ServerError: HTTP 503": 3}
    assert "stub status 503" in (result.records[0].error or "")


def test_in_band_error_event_fails_the_request() -> None:
    with sse_stub_server("--error-after", "2") as (_, url):
        result = run(url, specs(2, output_len=6))
    for record in result.records:
        assert record.error is not None and "in-band error: stub in-band error" in record.error
        assert record.ttft_s is not None  # it failed after streaming had started


def test_stalled_stream_hits_the_read_timeout() -> None:
    with sse_stub_server("--stall-after", "2") as (_, url):
        result = run(url, specs(2, output_len=6), read_timeout_s=0.5)
    assert summarize(result)["error_kinds"] == {"ReadTimeout": 2}


def test_nothing_listening_gives_connect_errors() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago, now closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = run(f"http://127.0.0.1:{port}", specs(3), connect_timeout_s=2.0)
    assert summarize(result)["error_kinds"] == {"ConnectError": 3}


def kill_after_tokens(proc: subprocess.Popen[str], num_tokens: int) -> threading.Thread:
    """Kill `proc` (SIGKILL) once it has announced `num_tokens` streamed chunks."""

    def watch() -> None:
        assert proc.stdout is not None
        seen = 0
        for line in proc.stdout:
            seen += line.startswith("TOKEN ")
            if seen >= num_tokens:
                proc.kill()
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_server_killed_mid_stream_gives_counted_errors_and_returns() -> None:
    # 20 requests, 0.05 s apart, each 200 tokens at 10 ms: the kill lands while several stream.
    with sse_stub_server("--announce-tokens", "--token-delay-s", "0.01") as (proc, url):
        watcher = kill_after_tokens(proc, 30)
        result = run(url, specs(20, output_len=200, gap_s=0.05), connect_timeout_s=2.0)
        watcher.join(timeout=10)
    summary = summarize(result)
    assert proc.poll() is not None  # it really died
    assert summary["num_requests"] == 20
    assert summary["failed"] >= 1 and summary["completed"] + summary["failed"] == 20
    assert sum(summary["error_kinds"].values()) == summary["failed"]
    mid_stream = [r for r in result.records if r.error and r.ttft_s is not None]
    assert mid_stream, "some request must have been cut off after its first token"
    assert all(r.e2e_s is None for r in result.records if r.error)


def test_chunk_counting_and_error_bodies() -> None:
    assert chunk_token_count({"choices": [{"text": "a"}]}) == 1
    assert chunk_token_count({"choices": [{"text": "", "finish_reason": "length"}]}) == 0
    assert chunk_token_count({"choices": [], "usage": {"completion_tokens": 3}}) == 0
    assert chunk_token_count({"choices": [{"delta": {"content": "hi"}}]}) == 1
    assert error_message('{"error": {"message": "busy", "code": 503}}') == "busy"
    assert error_message('{"object": "error", "message": "old vllm"}') == "old vllm"
    assert error_message("<html>bad gateway</html>") == "<html>bad gateway</html>"


def test_request_body_forces_lengths_and_usage() -> None:
    target = OpenAIStreamingTarget("http://unused", "m", prompts=PromptBuilder(100))
    body = target.request_body(RequestSpec(0, 0.0, 33, 17))
    asyncio.run(target.aclose())
    assert len(body["prompt"]) == 33 and all(isinstance(t, int) for t in body["prompt"])
    assert body["max_tokens"] == body["min_tokens"] == 17 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_cli_replay_writes_results_and_plots(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {"timestamp": 100 * i, "input_length": 700, "output_length": 40, "hash_ids": [0, i]}
            )
            + "\n"
            for i in range(8)
        )  # fmt: skip
    )
    out = tmp_path / "run"
    with sse_stub_server() as (_, url):
        proc = subprocess.run(
            [sys.executable, "-m", "loadgen", "replay", "--trace", str(trace), "--url", url,
             "--token-scale", "1/8", "--num-requests", "6", "--slo", "ttft:p99:5s,e2e:10s",
             "--out", str(out), "--disable-tqdm"],
            capture_output=True, text=True, cwd=REPO, env=ENV, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["completed"] == 6 and last["total_output_tokens"] == 6 * 5
    assert last["total_input_tokens"] == 6 * 88  # usage echoes the prompt length we sent
    assert json.loads((out / "results.json").read_text())["completed"] == 6
    for name in ("ttft_cdf.png", "tbt_cdf.png", "latency_over_time.png", "load.png"):
        assert (out / name).stat().st_size > 1000


def test_cli_sweep_writes_one_point_per_rate(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:{10 + i:02d}.5000000,{64 + i},{3 + i}\n" for i in range(10))
    )
    out = tmp_path / "sweep"
    with sse_stub_server() as (_, url):
        proc = subprocess.run(
            [sys.executable, "-m", "loadgen", "sweep", "--trace", str(trace), "--url", url,
             "--rates", "20,40", "--num-requests", "5", "--seed", "1", "--out", str(out),
             "--disable-tqdm"],
            capture_output=True, text=True, cwd=REPO, env=ENV, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    table = json.loads(proc.stdout.strip().splitlines()[-1])["sweep"]
    assert [point["rate"] for point in table] == [20.0, 40.0]
    assert [point["completed"] for point in table] == [5, 5]
    assert json.loads((out / "sweep.json").read_text()) == table
    assert (out / "sweep.png").stat().st_size > 1000
    assert (out / "rate_40" / "results.json").exists()


class TextlessTokenTarget:
    """A target whose one token streams no text (a special token): the closing chunk carries
    only the finish and usage saying `completion_tokens`. No transport: only the accounting."""

    def __init__(self, completion_tokens: int) -> None:
        self.completion_tokens = completion_tokens

    async def generate(self, spec: RequestSpec):  # type: ignore[no-untyped-def]
        yield StreamEvent(10.25, 0, Usage(spec.input_len, self.completion_tokens))


def test_a_token_without_text_still_counts_when_usage_says_so() -> None:
    spec = RequestSpec(0, 0.0, 9, 1)
    record = asyncio.run(run_one(TextlessTokenTarget(1), spec, run_start_s=10.0, sent=10.0))  # type: ignore[arg-type]
    assert record.ok and record.output_tokens == 1
    assert record.ttft_s == pytest.approx(0.25) and record.e2e_s == pytest.approx(0.25)
    none = asyncio.run(run_one(TextlessTokenTarget(0), spec, run_start_s=10.0, sent=10.0))  # type: ignore[arg-type]
    assert not none.ok and "without any token" in (none.error or "")
