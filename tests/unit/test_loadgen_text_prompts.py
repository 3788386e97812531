"""Text prompts the server counts as the trace says, and `usage` checked against the request.

The counts come from PhaseMesh's router itself (served with uvicorn on a real socket over an
in-process engine): the replay's records carry the server's `usage`, and the summary counts every
request whose usage differs from what was asked.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from common.engine.core import LLMEngine
from common.tokenizer import Tokenizer
from loadgen.http_target import OpenAIStreamingTarget
from loadgen.replay import ReplayResult, RequestRecord, replay
from loadgen.report import format_summary, summarize, usage_mismatches
from loadgen.target import RequestSpec
from loadgen.text_prompts import TextPromptBuilder, load_tokenizer, text_prompt_builder
from services.router.engine_client import InProcessEngineClient
from services.router.server import Router


@pytest.fixture(scope="module")
def builder(tiny_model_path: Path) -> TextPromptBuilder:
    return TextPromptBuilder(load_tokenizer(str(tiny_model_path)), seed=7)


@pytest.mark.parametrize("input_len", [2, 3, 17, 64, 511, 2000])
def test_text_prompts_encode_to_the_requested_length(builder, tiny_model_path, input_len) -> None:
    server_side = Tokenizer(tiny_model_path)  # the router's own encoder, BOS included
    for index, hash_ids in enumerate([(), (4,), (4, 5, 6)]):
        text = builder.prompt(RequestSpec(index, 0.0, input_len, 1, hash_ids, 64))
        assert len(server_side.encode(text)) == input_len


def test_equal_hash_ids_give_equal_text_prefixes(builder) -> None:
    a = builder.prompt(RequestSpec(0, 0.0, 300, 1, (1, 2), 64))
    b = builder.prompt(RequestSpec(1, 0.0, 300, 1, (1, 3), 64))
    first_block = "".join(builder.words[i] for i in builder._indices._block(1, 64))
    assert a.startswith(first_block) and b.startswith(first_block)
    assert a[: len(first_block) + 40] != b[: len(first_block) + 40]


@pytest.fixture(scope="module")
def live_router(tiny_model_path: Path) -> Iterator[str]:
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=256)
    router = Router(InProcessEngineClient(engine), tiny_model_path, "tiny")
    config = uvicorn.Config(router.app, host="127.0.0.1", port=0, log_level="warning",
                            lifespan="off")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)  # uvicorn has no started event to wait on
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    router.client.shutdown()  # type: ignore[attr-defined]


def run_text_replay(
    url: str, builder: TextPromptBuilder, specs: list[RequestSpec], endpoint: str = "completions"
) -> ReplayResult:
    async def go() -> ReplayResult:
        target = OpenAIStreamingTarget(
            url, "tiny", endpoint=endpoint, prompts=builder, read_timeout_s=60
        )
        try:
            return await replay(specs, target, progress=False)
        finally:
            await target.aclose()

    return asyncio.run(go())


def test_text_replay_matches_the_servers_usage(live_router, builder) -> None:
    lengths = [(2, 3), (40, 5), (130, 2), (257, 4)]
    specs = [RequestSpec(i, 0.05 * i, n, m, (0,), 64) for i, (n, m) in enumerate(lengths)]
    specs.append(RequestSpec(9, 0.3, 1, 2))  # BOS + one word: the server counts 2, not 1
    result = run_text_replay(live_router, builder, specs)
    assert all(r.ok for r in result.records), [r.error for r in result.records]
    summary = summarize(result)
    assert summary["usage_mismatches"] == {"prompt_tokens": 1, "completion_tokens": 0,
                                           "no_usage": 0}  # fmt: skip
    assert "Usage mismatches (prompt_tokens):" in format_summary(summary)
    by_index = {r.req_index: r for r in result.records}
    assert [by_index[i].prompt_tokens for i in range(4)] == [n for n, _ in lengths]
    assert [by_index[i].output_tokens for i in range(4)] == [m for _, m in lengths]


def test_chat_replay_counts_the_template_as_the_server_does(live_router, tiny_model_path) -> None:
    builder = text_prompt_builder(str(tiny_model_path), seed=5, chat=True)
    lengths = [(24, 3), (90, 2), (300, 4)]  # each above the template's own tokens
    specs = [RequestSpec(i, 0.05 * i, n, m, (1,), 64) for i, (n, m) in enumerate(lengths)]
    result = run_text_replay(live_router, builder, specs, endpoint="chat")
    assert all(r.ok for r in result.records), [r.error for r in result.records]
    by_index = {r.req_index: r for r in result.records}
    assert [by_index[i].prompt_tokens for i in range(3)] == [n for n, _ in lengths]
    assert [by_index[i].output_tokens for i in range(3)] == [m for _, m in lengths]
    assert builder.num_added > 2  # the template's scaffolding was counted in


def test_usage_mismatches_count_each_kind() -> None:
    def record(input_len: int, prompt: int | None, output: int) -> RequestRecord:
        return RequestRecord(0, 0.0, input_len, 5, prompt_tokens=prompt, output_tokens=output)

    records = [record(10, 10, 5), record(10, 11, 5), record(10, 10, 4), record(10, None, 5)]
    assert usage_mismatches(records) == {"prompt_tokens": 1, "completion_tokens": 1,
                                         "no_usage": 1}  # fmt: skip
