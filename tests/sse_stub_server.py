"""For tests only: a tiny OpenAI-style SSE server standing in for the HTTP transport of the client.

It is NOT a model server: it answers `POST /v1/completions` with `max_tokens` chunks of the text
"tok", paced by `--token-delay-s`, then a usage chunk and `data: [DONE]`, over HTTP/1.1 chunked
transfer encoding (as uvicorn sends streams), so a server killed mid-stream leaves the client a
truncated chunked body, exactly as a dying real server would. Flags inject the other failures the
client must survive: an HTTP error status with an OpenAI error body, an in-band error event, a
stall (for read timeouts), and no usage chunk.

Run: `python -m tests.sse_stub_server --port 0`; it prints `LISTENING <port>` once ready, and
with `--announce-tokens` one `TOKEN <req_index> <n>` line per chunk sent, so a test can kill it
at a known point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any


class StubBehaviour(argparse.Namespace):
    token_delay_s: float = 0.005
    status: int = 200
    error_after: int | None = None
    stall_after: int | None = None
    no_usage: bool = False
    announce_tokens: bool = False


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


async def _stream_completion(
    writer: asyncio.StreamWriter, request: dict[str, Any], req_id: str, behaviour: StubBehaviour
) -> None:
    num_tokens = int(request.get("max_tokens", 16))
    prompt = request.get("prompt", [])
    writer.write(_response_head(200, "text/event-stream", chunked=True))
    for index in range(num_tokens):
        if behaviour.stall_after is not None and index >= behaviour.stall_after:
            await asyncio.sleep(3600)  # hold the connection open, send nothing
        if behaviour.error_after is not None and index >= behaviour.error_after:
            writer.write(_chunk({"error": {"message": "stub in-band error", "code": 500}}))
            break
        await asyncio.sleep(behaviour.token_delay_s)
        writer.write(
            _chunk({"object": "text_completion", "choices": [{"index": 0, "text": "tok"}]})
        )
        await writer.drain()
        if behaviour.announce_tokens:
            _say(f"TOKEN {req_id} {index + 1}")
    if not behaviour.no_usage and behaviour.error_after is None:
        usage = {"prompt_tokens": len(prompt), "completion_tokens": num_tokens}
        writer.write(_chunk({"choices": [], "usage": usage}))
    writer.write(_chunk("[DONE]") + b"0\r\n\r\n")
    await writer.drain()


async def _serve_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, behaviour: StubBehaviour
) -> None:
    try:
        while True:
            method, path, headers, body = await _read_request(reader)
            if method == "GET" and path == "/v1/models":
                await _send_json(writer, 200, {"object": "list", "data": [{"id": "stub"}]})
            elif behaviour.status != 200:
                error = {"message": f"stub status {behaviour.status}", "type": "Stub", "code": 0}
                await _send_json(writer, behaviour.status, {"error": error})
            else:
                request = json.loads(body or b"{}")
                req_id = headers.get("x-request-id", "-")
                await _stream_completion(writer, request, req_id, behaviour)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # client closed the connection
    finally:
        writer.close()


async def serve(port: int, behaviour: StubBehaviour) -> None:
    """Serve until killed; announce the bound port on stdout."""
    server = await asyncio.start_server(
        lambda r, w: _serve_connection(r, w, behaviour), "127.0.0.1", port
    )
    _say(f"LISTENING {server.sockets[0].getsockname()[1]}")
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token-delay-s", type=float, default=0.005)
    parser.add_argument("--status", type=int, default=200, help="answer completions with this")
    parser.add_argument("--error-after", type=int, default=None, help="in-band error after N")
    parser.add_argument("--stall-after", type=int, default=None, help="go silent after N tokens")
    parser.add_argument("--no-usage", action="store_true")
    parser.add_argument("--announce-tokens", action="store_true")
    args = parser.parse_args(namespace=StubBehaviour())
    asyncio.run(serve(args.port, args))


if __name__ == "__main__":
    main()
