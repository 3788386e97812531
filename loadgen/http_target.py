"""Streaming OpenAI client: the HTTP implementation of `loadgen.target.Target`.

Sends `POST {base_url}/v1/completions` with a token-id prompt (or text of the same token count,
`loadgen.text_prompts`), or `POST {base_url}/v1/chat/completions` with that text as one user
message, with `stream: true`, `stream_options.include_usage`, `ignore_eos` and `max_tokens`
(chat: `max_completion_tokens`; + `min_tokens`) equal to the requested output length, the
`--extra-body` fields merged last, then parses the SSE stream. Every failure raises, so the
driver records it against the request: HTTP error statuses (with the server's error message),
in-band `data: {"error": ...}` events, connect errors, reset or truncated connections, read
timeouts, and a stream that ends without `data: [DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx
import msgspec

from loadgen.prompts import PromptBuilder
from loadgen.target import RequestSpec, StreamEvent, Usage, WallClock

_MAX_ERROR_BODY = 2000  # characters of an error body kept in a record


class Prompts(Protocol):
    """Builds a request's `prompt`: token ids (`PromptBuilder`) or text (`TextPromptBuilder`)."""

    def prompt(self, spec: RequestSpec) -> list[int] | str: ...


ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def endpoint_path(endpoint: str) -> str:
    """`completions`, `chat` or a path (`/v1/chat/completions`) as the path to POST to."""
    path = ENDPOINTS.get(endpoint, endpoint)
    if not path.startswith("/"):
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)} or a path: {endpoint!r}")
    return path


def is_chat(path: str) -> bool:
    return path.rstrip("/").endswith("chat/completions")


def request_id(spec: RequestSpec) -> str:
    """The `X-Request-Id` of a request; warm-ups (negative index) are named apart."""
    index = spec.req_index
    return f"loadgen-{index}" if index >= 0 else f"loadgen-warmup-{-index - 1}"


class ServerError(Exception):
    """The server answered with an HTTP error status or an in-band error event."""


class StreamProtocolError(Exception):
    """The stream broke the SSE contract (bad JSON, missing `[DONE]`)."""


def error_message(body: str) -> str:
    """The message of an OpenAI error body (nested `{"error": {...}}` or vLLM's old flat form),
    else the raw body, cut short."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body[:_MAX_ERROR_BODY]
    if isinstance(payload, dict):
        inner = payload.get("error", payload)
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])[:_MAX_ERROR_BODY]
        if isinstance(inner, str):
            return inner[:_MAX_ERROR_BODY]
    return body[:_MAX_ERROR_BODY]


def chunk_token_count(chunk: dict[str, Any]) -> int:
    """Tokens a completions chunk carries, for servers that send no usage: one per chunk with a
    choice, except an empty closing chunk that only carries `finish_reason`."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    choice = choices[0]
    text = choice.get("text")
    if text is None and "delta" in choice:  # chat-style chunk
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if not text and "role" in delta:
            return 0  # the opening chunk names the role, before any token (PhaseMesh sends it
            # as soon as the request is accepted): TTFT must not stop there
        text = text or delta.get("reasoning_content") or delta.get("tool_calls")
    if not text and choice.get("finish_reason") is not None:
        return 0
    return 1


def usage_of(chunk: dict[str, Any]) -> Usage | None:
    usage = chunk.get("usage")
    if not isinstance(usage, dict) or "completion_tokens" not in usage:
        return None
    return Usage(int(usage.get("prompt_tokens") or 0), int(usage["completion_tokens"]))


class OpenAIStreamingTarget:
    """Streams completions or chat completions from an OpenAI-compatible server over one pooled
    httpx client. `headers` go with every request (after the API key's, so they may replace it);
    `extra_body` is merged into every body last (so it may replace any field)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        endpoint: str = "/v1/completions",
        prompts: Prompts | None = None,
        api_key: str | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        max_connections: int | None = None,
        send_min_tokens: bool = True,
        extra_body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.clock = WallClock()
        self.model = model
        self.endpoint = endpoint_path(endpoint)
        self.chat = is_chat(self.endpoint)
        self.prompts: Prompts = prompts or PromptBuilder()
        self.send_min_tokens = send_min_tokens
        self.extra_body = dict(extra_body or {})
        headers = ({"Authorization": f"Bearer {api_key}"} if api_key else {}) | (headers or {})
        # NOTE: pool=None: in an open loop a request waiting for a connection is queueing, which
        # TTFT should show, not an error. Connect and read timeouts bound a dead server.
        timeout = httpx.Timeout(
            connect=connect_timeout_s, read=read_timeout_s, write=30.0, pool=None
        )
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, limits=limits
        )

    def request_body(self, spec: RequestSpec) -> dict[str, Any]:
        """The JSON body for `spec`: exact prompt length, output length forced by ignore_eos."""
        prompt = spec.prompt_text if spec.prompt_text is not None else self.prompts.prompt(spec)
        body: dict[str, Any] = {"model": self.model}
        if self.chat:
            if not isinstance(prompt, str):
                raise TypeError("the chat endpoint takes text: build prompts with a tokenizer")
            body["messages"] = [{"role": "user", "content": prompt}]
            body["max_completion_tokens"] = spec.output_len
        else:
            body["prompt"] = prompt
            body["max_tokens"] = spec.output_len
        body |= {
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.send_min_tokens:
            body["min_tokens"] = spec.output_len
        body.update(self.extra_body)
        return body

    async def generate(self, spec: RequestSpec) -> AsyncIterator[StreamEvent]:
        """Send `spec` and yield one event per streamed chunk (see `loadgen.target`)."""
        content = msgspec.json.encode(self.request_body(spec))
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id(spec)}
        async with self._client.stream(
            "POST", self.endpoint, content=content, headers=headers
        ) as response:
            if response.status_code >= 400:
                body = (await response.aread()).decode("utf-8", errors="replace")
                raise ServerError(f"HTTP {response.status_code}: {error_message(body)}")
            async for event in self._parse_stream(response):
                yield event

    async def _parse_stream(self, response: httpx.Response) -> AsyncIterator[StreamEvent]:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments (": ping"), event:/id: fields
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return
            now = self.clock.now()
            try:
                chunk = json.loads(data)
            except ValueError:
                raise StreamProtocolError(f"bad JSON in stream: {data[:200]!r}") from None
            if isinstance(chunk, dict) and "error" in chunk:
                raise ServerError(f"in-band error: {error_message(data)}")
            yield StreamEvent(now, chunk_token_count(chunk), usage_of(chunk))
        raise StreamProtocolError("stream ended without data: [DONE]")

    async def aclose(self) -> None:
        await self._client.aclose()
