"""The router's requests in flight, shared by both engine clients: one `StreamTable`.

Each admitted request gets a `Stream`: an asyncio queue its coroutine awaits, fed from a
background thread (the in-process engine's loop, or the mesh client's IO thread) with
`call_soon_threadsafe`. The table owns admission (the bounds of `AdmissionLimits`, refused with
`Overloaded`, which the router turns into a 429; a duplicate request id is a `ValueError`) and the
pending-prompt-token count: a request's prompt counts from admission until its first token, or
until it is released without one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar


class Overloaded(Exception):
    """Admission refused: a bound on queued work would be passed. `reason` names the bound.
    The router answers 429 with Retry-After."""

    status = 429

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Unavailable(Overloaded):
    """Admission refused because no healthy replica can serve the request now (one may be
    restarting): 503 with Retry-After, which clients retry, never a 500."""

    status = 503


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds past which new requests get `Overloaded` (429) instead of queueing forever."""

    max_num_requests: int = 256
    max_pending_prompt_tokens: int = 65536

    def __post_init__(self) -> None:
        if self.max_num_requests < 1 or self.max_pending_prompt_tokens < 1:
            raise ValueError("admission limits must be >= 1")


def check_admission(
    limits: AdmissionLimits, num_requests: int, num_pending_prompt_tokens: int, num_tokens: int
) -> None:
    """Raise `Overloaded` if admitting a prompt of `num_tokens` would pass a bound."""
    if num_requests >= limits.max_num_requests:
        raise Overloaded(
            "max_num_requests",
            f"The server is busy: {num_requests} requests in flight "
            f"(limit {limits.max_num_requests}). Please retry later.",
        )
    pending = num_pending_prompt_tokens
    # A prompt larger than the whole bound is still admitted when nothing else is pending.
    if pending and pending + num_tokens > limits.max_pending_prompt_tokens:
        raise Overloaded(
            "max_pending_prompt_tokens",
            f"The server is busy: {pending} prompt tokens queued "
            f"(limit {limits.max_pending_prompt_tokens}). Please retry later.",
        )


@dataclass(kw_only=True)
class Stream:
    """One admitted request: where its outputs go. Clients subclass it for their own fields."""

    req_id: str
    num_prompt_tokens: int
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    outputs: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    first_token_out: bool = False


S = TypeVar("S", bound=Stream)


class StreamTable(Generic[S]):
    """Streams by request id and the admission counters, behind one lock. `lock` is reentrant:
    clients hold it around their own bookkeeping and the table's calls together."""

    def __init__(self, limits: AdmissionLimits | None = None) -> None:
        self.limits = limits or AdmissionLimits()
        self.lock = threading.RLock()
        self._streams: dict[str, S] = {}
        self.num_pending_prompt_tokens = 0

    def admit(self, req_id: str, num_prompt_tokens: int, build: Callable[[], S]) -> S:
        """Check the bounds and the id, then add the stream `build()` makes (under the lock, so
        a client can place the request atomically with its admission; `build` may raise)."""
        with self.lock:
            check_admission(self.limits, len(self._streams), self.num_pending_prompt_tokens,
                            num_prompt_tokens)  # fmt: skip
            if req_id in self._streams:
                raise ValueError(f"request id {req_id} is already in use")
            stream = build()
            self._streams[req_id] = stream
            self.num_pending_prompt_tokens += stream.num_prompt_tokens
        return stream

    def get(self, req_id: str) -> S | None:
        with self.lock:
            return self._streams.get(req_id)

    def snapshot(self) -> list[S]:
        with self.lock:
            return list(self._streams.values())

    def __len__(self) -> int:
        return len(self._streams)

    def release(self, req_id: str) -> S | None:
        """Forget a request (finished, failed or aborted); None if it was already gone."""
        with self.lock:
            stream = self._streams.pop(req_id, None)
            if stream is not None and not stream.first_token_out:
                self.num_pending_prompt_tokens -= stream.num_prompt_tokens
        return stream

    def deliver_many(self, items: Sequence[tuple[str, object, bool]]) -> list[S | None]:
        """`deliver` for one engine step's outputs: `(req_id, item, has_tokens)` each, under one
        lock, and one wake-up of each event loop for them all (not one per token: each wake-up
        is a write to the loop's self-pipe and a turn of the loop)."""
        streams: list[S | None] = []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], object]]] = {}
        with self.lock:
            for req_id, item, has_tokens in items:
                stream = self._streams.get(req_id)
                streams.append(stream)
                if stream is None:
                    continue  # the client went away: the output is dropped
                if has_tokens and not stream.first_token_out:
                    stream.first_token_out = True
                    self.num_pending_prompt_tokens -= stream.num_prompt_tokens
                by_loop.setdefault(stream.loop, []).append((stream.outputs, item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:
                pass  # that event loop is closed: nobody is listening
        return streams

    def deliver(self, req_id: str, item: object, has_tokens: bool) -> S | None:
        """Hand an output (or an exception) to a request's coroutine, from any thread; returns
        its stream, or None when it is gone (the client went away: the output is dropped)."""
        with self.lock:
            stream = self._streams.get(req_id)
            if stream is None:
                return None
            if has_tokens and not stream.first_token_out:
                stream.first_token_out = True
                self.num_pending_prompt_tokens -= stream.num_prompt_tokens
        try:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)
        except RuntimeError:
            pass  # the request's event loop is closed: nobody is listening
        return stream


def _put_all(puts: list[tuple[asyncio.Queue[Any], object]]) -> None:
    for outputs, item in puts:
        outputs.put_nowait(item)


async def next_items(outputs: asyncio.Queue[Any]) -> list[Any]:
    """Every item waiting in a stream's queue (at least one: waits for it). Whatever arrived
    together is handled together: a router behind its engines writes one SSE chunk for the
    tokens of several steps, and catches up, instead of one per token."""
    items = [await outputs.get()]
    while not outputs.empty():
        items.append(outputs.get_nowait())
    return items
