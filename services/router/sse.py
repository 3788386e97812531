"""Server-sent events for streamed responses.

`sse_response` turns response chunks into `data: <json>` events, reports a failure after the
first byte in-band, ends with `data: [DONE]`, and always closes its event generator so that a
client that goes away aborts its request at once.

A stream silent for `KEEPALIVE_S` gets an SSE comment (`: keep-alive`, which SSE clients such as
the official `openai` one skip): a request preempted for KV, waiting for room to be recomputed,
or re-run after a fault can stream nothing for minutes under load, and a client's or a proxy's
read timeout would otherwise cut a stream that is still on its way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing

import structlog
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from common.engine.request import RequestOutput
from services.router.api_errors import error_body

log = structlog.get_logger(__name__)

KEEPALIVE_S = 15.0  # below common proxies' read timeouts (60 s) and the official client's (600 s)
KEEPALIVE = b": keep-alive\n\n"


async def prepend(
    first: RequestOutput, rest: AsyncGenerator[RequestOutput, None]
) -> AsyncGenerator[RequestOutput, None]:
    """`first` then `rest`; closing this closes `rest` (which aborts an unfinished request)."""
    async with aclosing(rest):
        yield first
        if not first.finished:
            async for out in rest:
                yield out


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its event generator, so a client that goes away
    aborts its request at once (Starlette leaves the iterator to the garbage collector)."""

    def __init__(
        self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None
    ) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()

    async def stream_response(self, send: Send) -> None:
        """Starlette's, with a `KEEPALIVE` comment whenever nothing was sent for `KEEPALIVE_S`
        (from a task of its own: nothing is added per event but a clock read)."""
        loop, lock = asyncio.get_running_loop(), asyncio.Lock()
        sent_at = loop.time()

        async def body(chunk: bytes, more: bool = True) -> None:
            nonlocal sent_at
            async with lock:
                await send({"type": "http.response.body", "body": chunk, "more_body": more})
                sent_at = loop.time()

        streaming, gone = asyncio.current_task(), []

        async def keep_alive() -> None:
            try:
                while True:
                    await asyncio.sleep(max(sent_at + KEEPALIVE_S - loop.time(), 0.0))
                    if loop.time() - sent_at >= KEEPALIVE_S:
                        await body(KEEPALIVE)
            except OSError as exc:  # the client went away while the stream was silent
                gone.append(exc)
                if streaming is not None:
                    streaming.cancel()  # end the stream now, not at its next event

        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})  # fmt: skip
        pinger = asyncio.ensure_future(keep_alive())
        try:
            async for chunk in self.body_iterator:
                await body(chunk.encode(self.charset) if isinstance(chunk, str) else bytes(chunk))
        except asyncio.CancelledError:
            if gone:
                raise gone[0] from None
            raise
        finally:
            pinger.cancel()
        await body(b"", more=False)


def sse_response(
    events: AsyncGenerator[BaseModel | bytes, None], headers: dict[str, str] | None = None
) -> StreamingResponse:
    """Events are models, or their JSON already written (responses.ChunkTemplate); `headers`
    go with the response's own."""
    return _SSEResponse(_sse(events), headers)


async def _sse(events: AsyncGenerator[BaseModel | bytes, None]) -> AsyncGenerator[bytes, None]:
    """`data: <json>` per event, an in-band error if generation fails, then `data: [DONE]`."""
    try:
        async with aclosing(events):
            async for event in events:
                body = event if isinstance(event, bytes) else event.model_dump_json().encode()
                yield b"data: " + body + b"\n\n"
    except Exception as exc:  # after the first byte the status is sent: report in-band
        log.exception("stream failed")
        yield f"data: {json.dumps(error_body(500, f'generation failed: {exc}'))}\n\n".encode()
    yield b"data: [DONE]\n\n"
