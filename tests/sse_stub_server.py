"""For tests only: a tiny OpenAI-style SSE server standing in for the HTTP transport of the client.

It is NOT a model server: it answers `POST /v1/completions` with `max_tokens` chunks of the text
"tok" (`POST /v1/chat/completions`: a role chunk, then `max_completion_tokens` content deltas),
paced by `--token-delay-s` (the first by `--first-token-delay-s`, if given), then a usage chunk
and `data: [DONE]`, over HTTP/1.1 chunked transfer encoding (as uvicorn sends streams), so a
server killed mid-stream leaves the client a truncated chunked body, exactly as a dying real
server would. Flags inject the other failures the client must survive: an HTTP error status with
an OpenAI error body, an in-band error event, a stall (for read timeouts), no usage chunk, and a
start-up during which `/v1/models` answers 503 (`--models-after-s`, counted from the first time
it is asked). A body without `prompt`
(completions) or `messages` (chat) is a 400, as a real server answers it.

`GET /stub/stats` returns what the stub saw: the most streams it had open at once
(`max_in_flight`) and every request's path, headers and JSON body, so a test can check what a
client sent.

Run: `python -m tests.sse_stub_server --port 0`; it prints `LISTENING <port>` once ready, and
with `--announce-tokens` one `TOKEN <req_index> <n>` line per chunk sent, so a test can kill it
at a known point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class StubBehaviour(argparse.Namespace):
    token_delay_s: float = 0.005
    first_token_delay_s: float | None = None  # a prefill's time; default: token_delay_s
    status: int = 200
    error_after: int | None = None
    stall_after: int | None = None
    no_usage: bool = False
    announce_tokens: bool = False
    models_after_s: float = 0.0


class StubState:
    """What the stub saw, for `GET /stub/stats`."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: list[dict[str, Any]] = []
        self.first_models_s: float | None = None  # the first GET /v1/models


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes]:
    """One HTTP/1.1 request: (method, path, headers, body); IncompleteReadError at the end."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {
        k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)
    }
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return method, path, headers, body


def _response_head(status: int, content_type: str, *, chunked: bool, length: int = 0) -> bytes:
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    return (
        f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n{framing}\r\n"
        "Connection: keep-alive\r\n\r\n"
    ).encode()


def _chunk(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    event = f"data: {data}\n\n".encode()
    return f"{len(event):x}\r\n".encode() + event + b"\r\n"


async def _send_json(writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    writer.write(_response_head(status, "application/json", chunked=False, length=len(body)))
    writer.write(body)
    await writer.drain()


def _token_chunk(chat: bool) -> dict[str, Any]:
    if chat:
        return {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": "tok"}}],
        }
    return {"object": "text_completion", "choices": [{"index": 0, "text": "tok"}]}


async def _stream_completion(
    writer: asyncio.StreamWriter, request: dict[str, Any], req_id: str, behaviour: StubBehaviour,
    chat: bool,
) -> None:  # fmt: skip
    num_tokens = int(request.get("max_completion_tokens" if chat else "max_tokens", 16))
    # The prompt's "tokens": ids, or (text) one per space-separated word.
    if chat:
        prompt = " ".join(m.get("content", "") for m in request["messages"]).split()
    else:
        prompt = (
            request["prompt"].split() if isinstance(request["prompt"], str) else request["prompt"]
        )
    writer.write(_response_head(200, "text/event-stream", chunked=True))
    if chat:  # the role comes first, before any token, as PhaseMesh sends it
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        writer.write(_chunk({"object": "chat.completion.chunk", "choices": [role]}))
    for index in range(num_tokens):
        if behaviour.stall_after is not None and index >= behaviour.stall_after:
            await asyncio.sleep(3600)  # hold the connection open, send nothing
        if behaviour.error_after is not None and index >= behaviour.error_after:
            writer.write(_chunk({"error": {"message": "stub in-band error", "code": 500}}))
            break
        delay = behaviour.token_delay_s
        if index == 0 and behaviour.first_token_delay_s is not None:
            delay = behaviour.first_token_delay_s
        await asyncio.sleep(delay)
        writer.write(_chunk(_token_chunk(chat)))
        await writer.drain()
        if behaviour.announce_tokens:
            _say(f"TOKEN {req_id} {index + 1}")
    if not behaviour.no_usage and behaviour.error_after is None:
        usage = {"prompt_tokens": len(prompt), "completion_tokens": num_tokens}
        writer.write(_chunk({"choices": [], "usage": usage}))
    writer.write(_chunk("[DONE]") + b"0\r\n\r\n")
    await writer.drain()


async def _serve_connection(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    behaviour: StubBehaviour,
    state: StubState,
) -> None:
    try:
        while True:
            method, path, headers, body = await _read_request(reader)
            if method == "GET" and path == "/v1/models":
                now = asyncio.get_running_loop().time()
                state.first_models_s = state.first_models_s or now
                if now - state.first_models_s < behaviour.models_after_s:
                    await _send_json(writer, 503, {"error": {"message": "starting", "code": 503}})
                else:
                    await _send_json(writer, 200, {"object": "list", "data": [{"id": "stub"}]})
            elif method == "GET" and path == "/stub/stats":
                stats = {"max_in_flight": state.max_in_flight, "requests": state.requests}
                await _send_json(writer, 200, stats)
            elif method == "GET":
                await _send_json(writer, 404, {"error": {"message": "not found", "code": 404}})
            else:
                request = json.loads(body or b"{}")
                state.requests.append({"path": path, "headers": headers, "body": request})
                await _answer(writer, path, request, headers, behaviour, state)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # client closed the connection
    finally:
        writer.close()


async def _answer(
    writer: asyncio.StreamWriter, path: str, request: dict[str, Any], headers: dict[str, str],
    behaviour: StubBehaviour, state: StubState,
) -> None:  # fmt: skip
    chat = path == "/v1/chat/completions"
    if behaviour.status != 200:
        error = {"message": f"stub status {behaviour.status}", "type": "Stub", "code": 0}
        await _send_json(writer, behaviour.status, {"error": error})
    elif ("messages" if chat else "prompt") not in request:
        missing = "messages" if chat else "prompt"
        await _send_json(writer, 400, {"error": {"message": f"{missing} is required", "code": 400}})
    else:
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            req_id = headers.get("x-request-id", "-")
            await _stream_completion(writer, request, req_id, behaviour, chat)
        finally:
            state.in_flight -= 1


async def serve(port: int, behaviour: StubBehaviour) -> None:
    """Serve until killed; announce the bound port on stdout."""
    state = StubState()
    server = await asyncio.start_server(
        lambda r, w: _serve_connection(r, w, behaviour, state), "127.0.0.1", port
    )
    _say(f"LISTENING {server.sockets[0].getsockname()[1]}")
    async with server:
        await server.serve_forever()


@contextmanager
def running_stub(*flags: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start this stub on a free port in a subprocess; yield (process, base URL); kill it after."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sse_stub_server", "--port", "0", *flags],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("LISTENING "), line
        yield proc, f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token-delay-s", type=float, default=0.005)
    parser.add_argument("--first-token-delay-s", type=float, default=None)
    parser.add_argument("--status", type=int, default=200, help="answer completions with this")
    parser.add_argument("--error-after", type=int, default=None, help="in-band error after N")
    parser.add_argument("--stall-after", type=int, default=None, help="go silent after N tokens")
    parser.add_argument("--no-usage", action="store_true")
    parser.add_argument("--announce-tokens", action="store_true")
    parser.add_argument(
        "--models-after-s",
        type=float,
        default=0.0,
        help="/v1/models 503 until S s after it is first asked",
    )
    args = parser.parse_args(namespace=StubBehaviour())
    asyncio.run(serve(args.port, args))


if __name__ == "__main__":
    main()
