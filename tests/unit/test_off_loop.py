"""Which request work leaves the Router's event loop (services/router/server.py): a long prompt's
tokenization and a structured-output request's grammar go to a worker thread, because the loop
serves every stream meanwhile; a short prompt and free-text parameters stay on the loop, where
they cost less than the thread hop would."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.router.openai_api import ChatCompletionRequest, CompletionRequest
from services.router.server import INLINE_PROMPT_LIMIT, _long, off_loop_if


@pytest.mark.parametrize(
    "prompt, long",
    [
        ("Hello", False),
        ("x" * INLINE_PROMPT_LIMIT, False),
        ("x" * (INLINE_PROMPT_LIMIT + 1), True),
        ([1, 2, 3], False),
        (list(range(INLINE_PROMPT_LIMIT + 1)), True),
        (["x" * (INLINE_PROMPT_LIMIT + 1)], True),  # a list of one prompt: that prompt
        ([[7] * (INLINE_PROMPT_LIMIT + 1)], True),
    ],
)
def test_a_prompt_is_long_past_the_inline_limit(prompt: str | list, long: bool) -> None:
    assert _long(prompt) is long


def test_heavy_work_runs_on_a_worker_thread_and_light_work_on_the_loop() -> None:
    async def where(heavy: bool) -> int:
        return await off_loop_if(heavy, threading.get_ident)

    async def scenario() -> tuple[int, int, int]:
        return threading.get_ident(), await where(False), await where(True)

    loop_thread, light, heavy = asyncio.run(scenario())
    assert light == loop_thread and heavy != loop_thread


def test_only_a_request_with_a_structured_output_field_asks_for_one() -> None:
    free = CompletionRequest(prompt="Hi")
    regex = CompletionRequest(prompt="Hi", guided_regex="[ab]+")
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}],
                                 response_format={"type": "json_object"})  # fmt: skip
    assert not free.asks_structured_output
    assert regex.asks_structured_output and chat.asks_structured_output
