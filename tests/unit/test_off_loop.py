"""Which request work leaves the Router's event loop (services/router/prompt_work.py): a long
prompt's tokenization goes to a thread through the tokenizer's GIL-releasing call, a long chat's
template to a worker process, a structured-output request's grammar to a pool of its own; a
short prompt and free-text parameters stay on the loop, where they cost less than the hop. Each
pool holds a bounded amount of work: past it, a 429 with Retry-After."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest

from common.tokenizer import Tokenizer
from services.router.api_errors import APIError
from services.router.openai_api import ChatCompletionRequest, CompletionRequest
from services.router.prompt_work import (
    INLINE_PROMPT_LIMIT,
    BoundedPool,
    ChatOptions,
    PromptWork,
    chat_prompt_ids,
)


@pytest.fixture(scope="module")
def work(tiny_model_path: Path):
    work = PromptWork(Tokenizer(tiny_model_path), tiny_model_path, max_model_len=1 << 20)
    yield work
    work.shutdown()


def test_a_long_prompt_is_tokenized_on_a_worker_thread_and_a_short_one_on_the_loop(work) -> None:
    seen: list[tuple[str, int]] = []
    tokenizer = work.tokenizer
    encode, encode_long = tokenizer.encode, tokenizer.encode_long

    async def scenario() -> int:
        tokenizer.encode = lambda *a: seen.append(("short", threading.get_ident())) or encode(*a)
        tokenizer.encode_long = lambda *a: (
            seen.append(("long", threading.get_ident())) or encode_long(*a)
        )
        short = await work.text_ids("x" * INLINE_PROMPT_LIMIT)
        long = await work.text_ids("é" * (INLINE_PROMPT_LIMIT + 1))
        assert long == encode("é" * (INLINE_PROMPT_LIMIT + 1))  # the same ids either way
        assert short == encode("x" * INLINE_PROMPT_LIMIT)
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(scenario())
    finally:
        del tokenizer.encode, tokenizer.encode_long  # back to the class's methods
    assert [kind for kind, _ in seen] == ["short", "long"]
    assert seen[0][1] == loop_thread and seen[1][1] != loop_thread


def test_a_long_chat_renders_in_a_worker_process_with_the_same_ids_and_errors(work) -> None:
    chat = [{"role": "user", "content": "hi <|eot_id|> " * 2000}]

    async def scenario() -> tuple[list[int], APIError]:
        ids = await work.chat_ids(chat, ChatOptions(), body_bytes=None)
        with pytest.raises(APIError) as refused:
            await work.chat_ids(chat, ChatOptions(template_kwargs={"messages": []}), None)
        return ids, refused.value

    ids, refused = asyncio.run(scenario())
    assert ids == chat_prompt_ids(work.tokenizer, chat, ChatOptions())
    # The worker's error crosses the process boundary whole: status and the field it names.
    assert (refused.status, refused.param) == (400, "chat_template_kwargs")
    processes = work.chat_pool._executor._processes  # type: ignore[union-attr]
    assert processes and os.getpid() not in processes


def test_a_pool_past_its_capacity_is_a_429_with_retry_after() -> None:
    release = threading.Event()
    pool = BoundedPool("test", lambda: ThreadPoolExecutor(1), capacity=2)

    async def scenario() -> APIError:
        held = [asyncio.ensure_future(pool.run(release.wait)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(APIError) as refused:
            await pool.run(release.wait)
        release.set()
        await asyncio.gather(*held)
        assert await pool.run(lambda: 7) == 7  # room again once the calls are done
        return refused.value

    refused = asyncio.run(scenario())
    pool.shutdown()
    assert (refused.status, refused.retry_after_s) == (429, 1)


def test_a_broken_process_pool_is_a_503_and_is_replaced() -> None:
    pool = BoundedPool("test", lambda: ProcessPoolExecutor(1), capacity=2)

    async def scenario() -> APIError:
        with pytest.raises(APIError) as refused:
            await pool.run(os._exit, 1)  # the worker dies mid-call
        assert await pool.run(abs, -3) == 3
        return refused.value

    refused = asyncio.run(scenario())
    pool.shutdown()
    assert (refused.status, refused.retry_after_s) == (503, 1)


def test_only_a_request_with_a_structured_output_field_asks_for_one() -> None:
    free = CompletionRequest(prompt="Hi")
    regex = CompletionRequest(prompt="Hi", guided_regex="[ab]+")
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}],
                                 response_format={"type": "json_object"})  # fmt: skip
    assert not free.asks_structured_output
    assert regex.asks_structured_output and chat.asks_structured_output
