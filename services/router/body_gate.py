"""`BigBodyGate`: large request bodies are parsed one at a time on the router's event loop.

FastAPI parses and validates a body in the step that receives it, on the event loop: tens of
milliseconds for a body of megabytes (a chat of many small messages is the worst). Requests
whose bodies arrive together would run those steps back to back in one turn of the loop, and
every stream would wait for their sum. The gate lets one large body at a time through, the next
only after the loop has turned: each stall is one body's, never a pile-up.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

BIG_BODY_BYTES = 1 << 20


class BigBodyGate:
    """ASGI middleware (inside the body limit): a body over `min_bytes` is handed to the app
    only while no other one is being parsed."""

    def __init__(self, app: ASGIApp, min_bytes: int = BIG_BODY_BYTES) -> None:
        self.app, self.min_bytes = app, min_bytes
        # One gate per event loop (a test may serve the app from several in turn).
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def gated() -> Message:
            message: dict[str, Any] = dict(await receive())
            if len(message.get("body", b"")) >= self.min_bytes:
                loop = asyncio.get_running_loop()
                gate = self._gates.setdefault(loop, asyncio.Semaphore(1))
                await gate.acquire()
                # NOTE: released by a callback, so after the step that parses this body (it
                # runs on from here to the endpoint's first wait), not inside it.
                loop.call_soon(gate.release)
            return message

        await self.app(scope, gated, send)
