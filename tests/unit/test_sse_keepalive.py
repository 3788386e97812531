"""A stream that goes silent (a request preempted for KV and waiting to be recomputed, or re-run
after a fault) gets `: keep-alive` comments, so no client's or proxy's read timeout cuts it; the
official client's SSE decoder skips them and sees exactly the events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from openai._streaming import SSEDecoder
from starlette.requests import ClientDisconnect

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


def test_a_client_gone_during_the_silence_ends_the_stream_and_its_pinger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client's socket fails at a keep-alive: the response ends (its event generator closed,
    which aborts the request) and no keep-alive task is left running."""
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.05)
    closed = []

    async def events() -> AsyncGenerator[bytes, None]:
        try:
            yield b'{"n": 1}'
            await asyncio.sleep(30)  # preempted: silent until the client gives up
            yield b'{"n": 2}'
        finally:
            closed.append(True)

    async def send(message: dict) -> None:
        if message.get("body") == sse.KEEPALIVE:
            raise OSError("connection reset by peer")

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    async def scenario() -> set:
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        with pytest.raises(ClientDisconnect):  # at the keep-alive, not at the events' next one
            await asyncio.wait_for(sse.sse_response(events())(scope, receive, send), 10)  # type: ignore[arg-type]
        await asyncio.sleep(0.2)  # a pinger left behind would send (and fail) again
        return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    assert asyncio.run(scenario()) == set()
    assert closed == [True]
