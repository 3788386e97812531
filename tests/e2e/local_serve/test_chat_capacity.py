"""End to end: eight concurrent streamed chats with no `max_tokens` (the official client's default:
each may use the rest of the context) on deploy/local.yaml's sizes, where the shard group holds
four such requests at their whole length. Every chat ends with `finish_reason` `length` or `stop`,
or is refused (429/503) before its first chunk; none fails mid-stream. Before KV admission, the
ones past the group's room got a few tokens and then an in-band error."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.serve_process import ServeRun

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny"
NUM_CHATS = 8


def chat(server: ServeRun, i: int, ignore_eos: bool) -> str:
    """How one chat ended: its finish reason, or `refused <status>` before any chunk."""
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0,
                       timeout=600) as client:  # fmt: skip
        try:
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Tell me a story, {i}."}],
                temperature=0, stream=True, extra_body={"ignore_eos": ignore_eos},
            )  # fmt: skip
        except openai.APIStatusError as exc:  # before the first byte of the stream
            return f"refused {exc.status_code}"
        reason = ""
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        return reason


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["until-eos", "whole-context"])
def test_chats_without_max_tokens_finish_or_are_refused_before_streaming(
    server: ServeRun, ignore_eos: bool
) -> None:
    with ThreadPoolExecutor(NUM_CHATS) as pool:
        ends = list(pool.map(lambda i: chat(server, i, ignore_eos), range(NUM_CHATS)))
    allowed = {"length", "stop", "refused 429", "refused 503"}
    assert set(ends) <= allowed, ends
    assert ends.count("length") + ends.count("stop") >= 4, ends  # the group's room was used
