"""`BigBodyGate`: large request bodies are parsed one at a time on the router's event loop.

FastAPI parses and validates a body in the step that receives it, on the event loop: tens of
milliseconds for a body of megabytes (a chat of many small messages is the worst). Requests
whose bodies arrive together would run those steps back to back in one turn of the loop, and
every stream would wait for their sum. The gate lets one large body at a time through, the next
only after the loop has turned: each stall is one body's, never a pile-up.

A large body with more `"role":` keys than a chat may hold messages is refused before it is
parsed at all: counting bytes is a scan in C, while parsing a chat of many small messages is the
longest parse a body under the size limit can cost.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.router.api_errors import error_body
from services.router.openai_api import MAX_MESSAGES

BIG_BODY_BYTES = 1 << 20
# Every chat message has a role, so a body with more of these keys than `MAX_MESSAGES` is a chat
# pydantic would refuse anyway. (Another key ending in `\"role` would count too: a valid request
# has nowhere near this many.)
_ROLE_KEY = b'"role":'


class BigBodyGate:
    """ASGI middleware (inside the body limit, which hands on the whole body as one message): a
    body over `min_bytes` is handed to the app only while no other one is being parsed."""

    def __init__(self, app: ASGIApp, min_bytes: int = BIG_BODY_BYTES) -> None:
        self.app, self.min_bytes = app, min_bytes
        # One gate per event loop (a test may serve the app from several in turn).
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        received: Message = dict(await receive())
        body = received.get("body", b"") if received["type"] == "http.request" else b""
        first: Message | None = received
        big = len(body) >= self.min_bytes
        if big and body.count(_ROLE_KEY) > MAX_MESSAGES:
            message = f"a chat holds at most {MAX_MESSAGES} messages"
            response = JSONResponse(error_body(400, message, "messages"), status_code=400)
            return await response(scope, receive, send)

        async def replay() -> Any:  # the body once, then the client's own messages (disconnect)
            nonlocal first
            if first is None:
                return await receive()
            message, first = first, None
            if big:
                loop = asyncio.get_running_loop()
                gate = self._gates.setdefault(loop, asyncio.Semaphore(1))
                await gate.acquire()
                # NOTE: released by a callback, so after the step that parses this body (it
                # runs on from here to the endpoint's first wait), not inside it.
                loop.call_soon(gate.release)
            return message

        await self.app(scope, replay, send)
