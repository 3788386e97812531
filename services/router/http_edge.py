"""The router's HTTP edge, before an endpoint runs: ASGI middleware (API key, arrival time, body
size) and what the OpenAPI schema says about errors.

`ApiKeyGate` answers a request without the API key with a 401 from its headers alone, before
anything reads its body (/openapi.json is behind the key too); `BodyLimit` answers a body over its
bound with a 413 (OpenAI error body) before anything parses it; `ArrivalStamp` notes when a
request reached the router (TTFT and `router.request` start there); `check_unicode` turns text
that is not valid Unicode into a 400 instead of a 500; `without_422` keeps FastAPI's 422s out of
/openapi.json (this API answers 400).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from services.router.api_errors import APIError, error_body

UNAUTHORIZED = "Incorrect or missing API key: send `Authorization: Bearer <key>`."


class ApiKeyGate:
    """ASGI middleware: with `api_key` set, an HTTP request to any path but `open_paths` (health
    probes carry no key) must send it as `Authorization: Bearer <key>`; one that does not is a
    401 (OpenAI error body) decided from its headers alone. Its body is never read: a client
    without the key costs the router no buffering or parsing, whatever it sends."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, open_paths: frozenset[str] = frozenset({"/health"})
    ) -> None:
        self.app, self.open_paths = app, open_paths
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key is None or scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        if hmac.compare_digest(_bearer_token(scope), self.api_key):
            return await self.app(scope, receive, send)
        response = JSONResponse(error_body(401, UNAUTHORIZED), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        await response(scope, receive, send)  # a Response sends; it never calls `receive`


def _bearer_token(scope: Scope) -> bytes:
    """The token of the request's first `Authorization: Bearer <token>` header (b"" if none)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` is a 413 (OpenAI error body) before anything
    parses it, whether or not the client declared its length."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body was complete
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._reject(scope, receive, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:  # the body once, then the client's own messages (disconnect)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body larger than {self.max_bytes} bytes"
        await JSONResponse(error_body(413, message), status_code=413)(scope, receive, send)


class ArrivalStamp:
    """ASGI middleware: when a request reached the router, before its body is read and
    validated (`request.state.arrived_ns`); `router.request` and TTFT start there."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrived_ns"] = time.time_ns()
        await self.app(scope, receive, send)


def check_unicode(param: str, texts: Iterable[str | None]) -> None:
    """Text that is not valid Unicode (a lone surrogate, which JSON can carry) is a 400 naming
    `param`, not a 500 when the tokenizer or an error body meets it."""
    for text in texts:
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(400, f"{param} is not valid Unicode text: {exc.reason}", param) from exc


def without_422(app: FastAPI) -> None:
    """This API answers invalid input with 400 (OpenAI's status), never FastAPI's 422: take the
    422s FastAPI documents for every route out of /openapi.json."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
