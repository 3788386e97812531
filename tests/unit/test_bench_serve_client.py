"""`bench/serve_server.py`'s aiohttp reader against a server that misbehaves: an in-band error,
a stream cut short, a line that is not JSON, an error status, a connection dropped mid-stream.
Each fails the batch (a bench must not print figures for tokens it did not get), and a whole
stream gives its figures. A real aiohttp server on a loopback port, in this process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp
import msgspec
import pytest
from aiohttp import web

from bench.serve_server import aiohttp_plain, aiohttp_stream

TOKENS = 3


def chunk(text: str = "", usage: int | None = None) -> bytes:
    body: dict = {"choices": [{"index": 0, "text": text}] if text else []}
    if usage is not None:
        body["usage"] = {"completion_tokens": usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


WHOLE = [chunk("a"), chunk("b"), chunk("c"), chunk(usage=TOKENS), b"data: [DONE]\n\n"]
STREAMS = {
    "whole": WHOLE,
    "in_band_error": [chunk("a"), b'data: {"error": {"message": "engine failed"}}\n\n'],
    "cut_short": [chunk("a"), chunk(usage=1), b"data: [DONE]\n\n"],
    "not_json": [chunk("a"), b"data: {not json\n\n"],
}


async def sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    case = request.headers["X-Case"]
    if case == "dropped":
        await response.write(chunk("a"))
        assert request.transport is not None
        request.transport.close()  # the server goes away mid-stream
        return response
    for event in STREAMS[case]:
        await response.write(event)
    return response


async def status_500(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "boom"}}, status=500)


async def short_plain(request: web.Request) -> web.Response:
    return web.json_response({"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}})


HANDLERS = {"status": status_500, "short_plain": short_plain}


async def with_server(run: Callable[[aiohttp.ClientSession], Awaitable[object]], case: str):
    app = web.Application()
    app.router.add_post("/v1/completions", HANDLERS.get(case, sse))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        headers = {"X-Case": case}
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", headers=headers) as session:
            return await run(session)
    finally:
        await runner.cleanup()


def stream(case: str) -> dict:
    return asyncio.run(with_server(lambda s: aiohttp_stream(s, "m", [1, 2], TOKENS), case))


def test_a_whole_stream_gives_its_figures() -> None:
    figures = stream("whole")
    assert figures["chunks"] == TOKENS and len(figures["gaps"]) == TOKENS - 1
    assert figures["ttft"] > 0


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [
        ("in_band_error", RuntimeError, "in-band error"),
        ("cut_short", RuntimeError, "asked 3 tokens, got 1"),
        ("not_json", msgspec.DecodeError, "JSON"),
        ("status", aiohttp.ClientResponseError, "500"),
        ("dropped", aiohttp.ClientPayloadError, "not completed"),
    ],
)
def test_a_misbehaving_server_fails_the_batch(
    case: str, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        stream(case)


@pytest.mark.parametrize(("case", "match"), [("status", "500"), ("short_plain", "asked 3")])
def test_a_plain_request_that_fails_or_comes_back_short_fails_the_batch(
    case: str, match: str
) -> None:
    with pytest.raises(Exception, match=match):
        asyncio.run(with_server(lambda s: aiohttp_plain(s, "m", [1], TOKENS), case))
