"""Server-sent events for streamed responses.

`sse_response` turns response chunks into `data: <json>` events, reports a failure after the
first byte in-band, ends with `data: [DONE]`, and always closes its event generator so that a
client that goes away aborts its request at once.
"""

from __future__ import annotations

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
