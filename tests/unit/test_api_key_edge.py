"""The API key is checked at the router's ASGI edge, before anything reads a request's body.

The real router app (over an in-process engine): driven once through its ASGI interface with a
`receive` that records whether it was called, and once on a real socket (uvicorn) with a request
that declares a body it never sends, which any reader of the body would wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from common.engine.core import LLMEngine
from services.router.engine_client import InProcessEngineClient
from services.router.server import MAX_BODY_BYTES, Router

KEY = "edge-key"


@pytest.fixture(scope="module")
def router(tiny_model_path: Path) -> Iterator[Router]:
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=64)
    router = Router(InProcessEngineClient(engine), tiny_model_path, "tiny", api_key=KEY)
    yield router
    router.client.shutdown()  # type: ignore[attr-defined]


def asgi_call(router: Router, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> Any:
    """One request through the app's ASGI interface: (status, body, whether `receive` was
    called). The body `receive` would give is the largest the router accepts."""
    received: list[bool] = []
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        received.append(True)
        return {"type": "http.request", "body": b"x" * MAX_BODY_BYTES, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("router", 80),
    }  # fmt: skip
    asyncio.run(router.app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, bool(received)


@pytest.mark.parametrize("auth", [None, b"Bearer wrong", b"edge-key", b"Basic edge-key"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_request_without_the_key_is_401_before_its_body_is_read(
    router: Router, path: str, auth: bytes | None
) -> None:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(MAX_BODY_BYTES).encode())]  # fmt: skip
    if auth is not None:
        headers.append((b"authorization", auth))
    status, body, read = asgi_call(router, "POST", path, headers)
    assert status == 401
    assert json.loads(body)["error"]["type"] == "AuthenticationError"
    assert not read


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/v1/models", "/stats", "/nowhere"])
def test_every_path_but_health_needs_the_key(router: Router, path: str) -> None:
    status, _, _ = asgi_call(router, "GET", path, [])
    assert status == 401
    status, body, _ = asgi_call(router, "GET", path, [(b"authorization", f"Bearer {KEY}".encode())])
    assert status != 401
    if path == "/openapi.json":
        assert status == 200 and "/v1/completions" in json.loads(body)["paths"]
    assert asgi_call(router, "GET", "/health", [])[0] == 200  # probes carry no key


def test_with_the_key_the_body_is_read(router: Router) -> None:
    """The gate lets a keyed request through to the body (here: the largest the router takes,
    which is not JSON: a 400)."""
    headers = [(b"content-type", b"application/json"), (b"authorization", b"bearer edge-key")]
    status, body, read = asgi_call(router, "POST", "/v1/completions", headers)
    assert read and status == 400, body


@contextlib.contextmanager
def served(router: Router) -> Iterator[int]:
    server = uvicorn.Server(
        uvicorn.Config(router.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)  # uvicorn's own startup flag, in this process
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_on_a_socket_a_keyless_request_is_answered_without_its_body(router: Router) -> None:
    """Headers that announce the largest body the router takes, and no body: the 401 comes back
    all the same. A router that read the body first would wait for it (the read times out)."""
    with served(router) as port, socket.create_connection(("127.0.0.1", port)) as conn:
        conn.settimeout(30)
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {MAX_BODY_BYTES}\r\n\r\n".encode()
            + b'{"prompt": "'
        )
        head = conn.recv(65536)
    assert head.startswith(b"HTTP/1.1 401"), head[:200]
    assert b"www-authenticate: bearer" in head.lower()
