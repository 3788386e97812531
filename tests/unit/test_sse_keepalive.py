"""A stream that goes silent (a request preempted for KV and waiting to be recomputed, or re-run
after a fault) gets `: keep-alive` comments, so no client's or proxy's read timeout cuts it; the
official client's SSE decoder skips them and sees exactly the events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from openai._streaming import SSEDecoder

from services.router import sse


async def silent_between(gap_s: float) -> AsyncGenerator[bytes, None]:
    yield b'{"n": 1}'
    await asyncio.sleep(gap_s)  # nothing comes from the engines meanwhile
    yield b'{"n": 2}'


def served(events: AsyncGenerator[bytes, None]) -> bytes:
    """The response's body as an ASGI server sends it."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never goes away
        return {}

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    asyncio.run(sse.sse_response(events)(scope, receive, send))  # type: ignore[arg-type]
    assert sent[0]["type"] == "http.response.start" and sent[-1]["more_body"] is False
    return b"".join(m["body"] for m in sent[1:])


def test_a_silent_stream_gets_keep_alive_comments_the_client_skips(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.05)
    body = served(silent_between(0.5))
    first, rest = body.split(b'data: {"n": 1}\n\n', 1)
    assert first == b"" and rest.startswith(sse.KEEPALIVE)  # the silence, then kept alive
    assert rest.count(sse.KEEPALIVE) >= 2 and rest.endswith(b"data: [DONE]\n\n")
    decoder = SSEDecoder()
    events = [e.data for line in body.decode().splitlines() if (e := decoder.decode(line))]
    assert events == ['{"n": 1}', '{"n": 2}', "[DONE]"]


def test_a_stream_that_keeps_streaming_gets_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "KEEPALIVE_S", 30.0)
    body = served(silent_between(0.0))
    assert sse.KEEPALIVE not in body
    assert body == b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
