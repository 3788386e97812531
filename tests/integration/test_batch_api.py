"""The OpenAI Batch API (`/v1/files`, `/v1/batches`) with the official `openai` client over real
HTTP: a router (uvicorn, in a child process) over the tiny model's in-process engine.

Greedy outputs in a batch's output file equal the online API's for the same bodies; a bad input
file is refused with its bad lines named; a cancelled batch keeps its finished lines; and a router
SIGKILLed mid-batch leaves a batch that the next router on the same store finishes, each line in
the output exactly once.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from common.model.default import default_model_path
from tests.e2e.serve_process import free_port

LEASE_S = 2.0


def serve_router(port: int, store: str, delay_s: float) -> None:
    """A child process: the router app on `port`; each engine step slowed by `delay_s` so a
    batch is still running when the test acts on it."""
    import uvicorn

    from common.engine.core import LLMEngine
    from services.router.engine_client import InProcessEngineClient
    from services.router.server import Router

    engine = LLMEngine.from_path(default_model_path("tiny"), num_blocks=256)
    if delay_s:
        step = engine.step

        def slow_step() -> Any:
            time.sleep(delay_s)
            return step()

        engine.step = slow_step  # type: ignore[method-assign]
    router = Router(InProcessEngineClient(engine), default_model_path("tiny"), "tiny",
                    batch_store=store, batch_lease_s=LEASE_S)  # fmt: skip
    uvicorn.run(router.app, host="127.0.0.1", port=port, log_level="warning")


class RouterProcess:
    def __init__(self, store: Path, delay_s: float = 0.0) -> None:
        self.port = free_port()
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=serve_router, args=(self.port, str(store), delay_s))
        self.proc.start()
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x",
                                    max_retries=0, timeout=30)  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            try:
                self.client.models.list()
                return
            except openai.APIConnectionError:
                if time.monotonic() > deadline or not self.proc.is_alive():
                    raise RuntimeError("the router process did not come up") from None
                time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "batches.sqlite"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """One router for the tests that need no kill; its steps slowed so a batch can be caught
    running (a process start costs seconds: the suite starts as few as it can)."""
    proc = RouterProcess(tmp_path_factory.mktemp("batches") / "batches.sqlite", delay_s=0.03)
    yield proc
    proc.kill()


def bodies(n: int) -> list[dict[str, Any]]:
    return [{"model": "tiny", "prompt": f"batch line {i} says", "max_tokens": 6 + i % 3,
             "temperature": 0} for i in range(n)]  # fmt: skip


def jsonl(lines: list[dict[str, Any]], url: str = "/v1/completions") -> bytes:
    rows = [{"custom_id": f"req-{i}", "method": "POST", "url": url, "body": b}
            for i, b in enumerate(lines)]  # fmt: skip
    return "\n".join(json.dumps(r) for r in rows).encode()


def wait_final(client: openai.OpenAI, batch_id: str, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)


def output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_batch_gives_the_online_apis_greedy_outputs(router: RouterProcess) -> None:
    client = router.client
    lines = [*bodies(5), {"model": "tiny", "prompt": "too long", "max_tokens": 10**6}]
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                  completion_window="24h", metadata={"job": "eval"})  # fmt: skip
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "eval"}
    done = wait_final(client, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (6, 5, 1)  # fmt: skip
    outputs = {r["custom_id"]: r for r in output_lines(client, done.output_file_id)}
    assert sorted(outputs) == [f"req-{i}" for i in range(5)]
    for i, body in enumerate(bodies(5)):
        online = client.completions.create(**body)
        assert (
            outputs[f"req-{i}"]["response"]["body"]["choices"][0]["text"] == online.choices[0].text
        )
    [error] = output_lines(client, done.error_file_id)
    assert error["custom_id"] == "req-5" and error["response"]["status_code"] == 400
    listed = client.batches.list(limit=10)
    assert done.id in [b.id for b in listed.data]


def test_a_bad_input_file_is_refused_with_its_lines_named(router: RouterProcess) -> None:
    ok = b'"body": {"prompt": "x", "max_tokens": 2}}'
    rows = [b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", ' + ok,
            b"not json",
            b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", ' + ok,
            b'{"custom_id": "b", "method": "GET", "url": "/v1/embeddings", "body": {}}',
            b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", '
            b'"body": {"prompt": "x", "max_tokens": "many"}}',
            b'{"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", '
            b'"body": {"messages": "hi"}}',
            ]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as refused:
        router.client.files.create(file=("bad.jsonl", io.BytesIO(b"\n".join(rows))),
                                   purpose="batch")  # fmt: skip
    message = str(refused.value)
    assert "5 invalid line(s)" in message and "line 1" not in message
    assert "line 2: not JSON" in message and "line 3" in message and "not unique" in message
    assert "line 4: `method` must be POST" in message
    # Each body checked against its endpoint's request model, the bad field named.
    assert "line 5: `body.max_tokens`: Input should be a valid integer" in message
    assert "line 6: `body.messages`" in message
    with pytest.raises(openai.NotFoundError):
        router.client.batches.retrieve("batch-none")


def test_a_cancelled_batch_keeps_its_finished_lines(router: RouterProcess) -> None:
    client = router.client
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(bodies(40)))),
                                   purpose="batch")  # fmt: skip
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                  completion_window="24h")  # fmt: skip
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        time.sleep(0.1)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_final(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    kept = output_lines(client, done.output_file_id)
    assert 2 <= len(kept) < 40 == done.request_counts.total
    assert len({r["custom_id"] for r in kept}) == len(kept)


def test_a_router_killed_mid_batch_leaves_it_to_the_next_one(store: Path) -> None:
    first = RouterProcess(store, delay_s=0.05)
    try:
        uploaded = first.client.files.create(file=("in.jsonl", io.BytesIO(jsonl(bodies(30)))),
                                             purpose="batch")  # fmt: skip
        batch = first.client.batches.create(input_file_id=uploaded.id,
                                            endpoint="/v1/completions",
                                            completion_window="24h")  # fmt: skip
        while first.client.batches.retrieve(batch.id).request_counts.completed < 3:
            time.sleep(0.1)
    finally:
        first.kill()  # SIGKILL: no clean-up ran; its lease runs out
    with sqlite3.connect(store) as db:
        (recorded,) = db.execute("SELECT count(*) FROM lines WHERE status_code IS NOT NULL"
                                 ).fetchone()  # fmt: skip
    assert 3 <= recorded < 30
    second = RouterProcess(store)
    try:
        done = wait_final(second.client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 30
        outputs = output_lines(second.client, done.output_file_id)
        assert [r["custom_id"] for r in outputs] == [f"req-{i}" for i in range(30)]
        for i, body in enumerate(bodies(30)[:4]):
            online = second.client.completions.create(**body)
            assert outputs[i]["response"]["body"]["choices"][0]["text"] == online.choices[0].text
    finally:
        second.kill()
