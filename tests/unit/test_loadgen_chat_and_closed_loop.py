"""Chat bodies, the closed loop, warm-up, extra body and headers, waiting for `/v1/models`, and the
run's settings and CSV, against a real HTTP server in a subprocess.

`tests.sse_stub_server` stands in for the transport only (it streams "tok" chunks, no model): it
records every request it was sent and the most streams it had open at once, so the tests check
what the load generator put on the wire, not what it believes it sent.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadgen.cli import parse_header
from loadgen.commands import wait_for_model
from loadgen.http_target import OpenAIStreamingTarget, chunk_token_count
from loadgen.replay import ReplayResult, replay, warmup_specs
from loadgen.report import CSV_COLUMNS
from loadgen.target import RequestSpec
from loadgen.text_prompts import text_prompt_builder
from tests.sse_stub_server import REPO, running_stub

pytestmark = pytest.mark.timeout(120)


def stub_stats(url: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(url + "/stub/stats", timeout=10).json()
    return stats


def run(url: str, specs: list[RequestSpec], **kwargs: Any) -> ReplayResult:
    """Replay `specs` with token-id prompts (`endpoint`/`prompts` in kwargs change that)."""
    replay_args = {k: kwargs.pop(k) for k in ("max_concurrency", "warmup") if k in kwargs}

    async def go() -> ReplayResult:
        target = OpenAIStreamingTarget(url, "stub", **kwargs)
        try:
            # The bound is a hang detector, far above any healthy run here.
            return await asyncio.wait_for(replay(specs, target, progress=False, **replay_args), 60)
        finally:
            await target.aclose()

    return asyncio.run(go())


def specs(count: int, output_len: int = 6, input_len: int = 24) -> list[RequestSpec]:
    return [RequestSpec(i, 0.0, input_len, output_len) for i in range(count)]


def test_chat_sends_messages_and_times_tokens_not_the_role_chunk(tiny_model_path: Path) -> None:
    builder = text_prompt_builder(str(tiny_model_path), seed=3, chat=True)
    with running_stub("--token-delay-s", "0.01") as (_, url):
        result = run(url, specs(3), endpoint="chat", prompts=builder)
        sent = stub_stats(url)["requests"]
    assert [r.ok for r in result.records] == [True] * 3, [r.error for r in result.records]
    for record in result.records:
        assert record.output_tokens == 6
        # The role chunk comes before any token: counting it would add a gap and cut TTFT.
        assert len(record.itl_s) == 5
    for request in sent:
        body = request["body"]
        assert request["path"] == "/v1/chat/completions" and "prompt" not in body
        [message] = body["messages"]
        assert message["role"] == "user" and isinstance(message["content"], str)
        assert body["max_completion_tokens"] == body["min_tokens"] == 6
        assert body["stream"] is True and body["ignore_eos"] is True
    assert chunk_token_count({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == 0


def test_closed_loop_never_has_more_than_n_in_flight() -> None:
    # Every request is due at once; each streams 10 tokens 10 ms apart.
    with running_stub("--token-delay-s", "0.01") as (_, url):
        closed = run(url, specs(12, output_len=10), max_concurrency=3)
        closed_peak = stub_stats(url)["max_in_flight"]
    with running_stub("--token-delay-s", "0.01") as (_, url):
        run(url, specs(12, output_len=10))
        open_peak = stub_stats(url)["max_in_flight"]
    assert all(r.ok for r in closed.records)
    assert closed_peak == closed.peak_in_flight == 3
    assert open_peak > 3  # the same schedule open loop: the limit is what held it to 3
    # A request waited for a slot: sent later than scheduled, and its TTFT starts at the send.
    assert max(r.send_s - r.scheduled_s for r in closed.records) > 0.05


def test_warmup_goes_first_with_its_own_prompts_and_is_left_out() -> None:
    run_specs = [RequestSpec(i, 0.0, 24, 4, hash_ids=(7,), block_len=8) for i in range(4)]
    with running_stub() as (_, url):
        result = run(url, run_specs, warmup=warmup_specs(run_specs, 2), prompts=None)
        sent = stub_stats(url)["requests"]
    assert [r.req_index for r in result.records] == [0, 1, 2, 3]
    assert [r.ok for r in result.warmup_records] == [True, True]
    ids = [request["headers"]["x-request-id"] for request in sent]
    assert sorted(ids[:2]) == ["loadgen-warmup-0", "loadgen-warmup-1"]
    assert sorted(ids[2:]) == [f"loadgen-{i}" for i in range(4)]
    prompts = [request["body"]["prompt"] for request in sent]
    # No shared prefix block, no shared tail: the warm-up cached nothing the run reuses.
    assert all(p[0] != q[0] for p in prompts[:2] for q in prompts[2:])


def test_wait_for_model_gives_up_with_a_clear_message() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago, now closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ValueError, match="did not list a model within 1.5 s.*ConnectError"):
        asyncio.run(wait_for_model(url, {}, timeout_s=1.5))


def test_header_flags_take_either_separator() -> None:
    assert parse_header("X-Team: lab") == ("X-Team", "lab")
    assert parse_header("X-Trace=a=b") == ("X-Trace", "a=b")  # vLLM's form; '=' in the value
    assert parse_header("Authorization:Bearer k:v") == ("Authorization", "Bearer k:v")
    for bad in ("novalue", ":v", "=v"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_header(bad)


def test_cli_chat_closed_loop_waits_for_the_server_and_writes_settings_and_csv(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    out = tmp_path / "run"
    with running_stub("--models-after-s", "1.0", "--token-delay-s", "0.005") as (_, url):
        proc = subprocess.run(
            [sys.executable, "-m", "loadgen", "replay", "--dataset-name", "random",
             "--random-input-len", "40", "--random-output-len", "5", "--num-prompts", "7",
             "--request-rate", "inf", "--max-concurrency", "2", "--warmup", "1",
             "--endpoint", "chat", "--tokenizer", str(tiny_model_path), "--seed", "4",
             "--extra-body", '{"temperature": 0.5, "top_k": 3}', "--header", "X-Team: lab",
             "--header", "X-Trace=a=b", "--url", url, "--out", str(out), "--no-plots",
             "--disable-tqdm"],
            capture_output=True, text=True, cwd=REPO, timeout=120,
        )  # fmt: skip
        stats = stub_stats(url)
    assert proc.returncode == 0, proc.stderr
    assert "waiting for" in proc.stderr  # the server was not up at first
    results = json.loads((out / "results.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == results
    assert (results["completed"], results["failed"], results["errors"]) == (7, 0, [""] * 7)
    assert results["model_id"] == "stub"  # from /v1/models, never guessed
    assert results["endpoint"] == "/v1/chat/completions" and results["backend"] == "openai-chat"
    assert results["request_rate"] == "inf" and results["max_concurrency"] == 2
    assert results["seed"] == 4 and results["base_url"] == url
    assert results["dataset_name"] == "random" and results["num_warmups"] == 1
    assert results["header_names"] == ["X-Team", "X-Trace"] and len(results["date"]) == 15
    assert results["max_concurrent_requests"] <= 2 and stats["max_in_flight"] <= 2
    for request in stats["requests"]:  # the warm-up's and the run's
        assert request["headers"]["x-team"] == "lab" and request["headers"]["x-trace"] == "a=b"
        assert request["body"]["temperature"] == 0.5 and request["body"]["top_k"] == 3
    assert len(stats["requests"]) == 8
    with open(out / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert [int(row["req_index"]) for row in rows] == list(range(7))
    assert all(row["output_tokens"] == "5" and row["error"] == "" for row in rows)
    assert all(float(row["ttft_ms"]) > 0 and float(row["e2el_ms"]) >= float(row["ttft_ms"])
               for row in rows)  # fmt: skip
