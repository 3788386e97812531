"""The router's requests in flight, shared by both engine clients: one `StreamTable`.

Each admitted request gets a `Stream`: an asyncio queue its coroutine awaits, fed from a
background thread (the in-process engine's loop, or the mesh client's IO thread) with
`call_soon_threadsafe`. A stream's tokens may be held back and handed on together
(`StreamInterval`: one wake-up, hence one SSE chunk, per `tokens` tokens). The table owns
admission (the bounds of `AdmissionLimits`, refused with `Overloaded`, which the router turns
into a 429; a duplicate request id is a `ValueError`) and the pending-prompt-token count: a
request's prompt counts from admission until its first token, or until it is released without
one.
"""

from __future__ import annotations

import asyncio
import threading
import time
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
    # KV admission (the mesh): requests waiting at the router for KV room, at most this many,
    # each at most this long (services/router/kv_queue.py).
    max_waiting_requests: int = 256
    kv_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if (
            min(self.max_num_requests, self.max_pending_prompt_tokens, self.max_waiting_requests)
            < 1
        ):
            raise ValueError("admission limits must be >= 1")
        if self.kv_wait_s < 0:
            raise ValueError("kv_wait_s must be >= 0")


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


@dataclass(frozen=True)
class StreamInterval:
    """How many tokens a stream's outputs carry per wake-up of its coroutine, hence per SSE chunk
    (vLLM's and SGLang's `stream_interval`). Each chunk costs the router, the Ray proxy and the
    client about the same whatever it carries, so `tokens` > 1 cuts the front end's cost per
    token by up to that factor, at the price of a burstier stream.

    The first token always goes at once (TTFT is never delayed), and so does a request's end, an
    error or anything without tokens, with every token held before it. `seconds` > 0 caps how
    long a token is held: the held ones go with the first output that arrives after it passed,
    or at the latest at the next tick of the stream's window timer (every `seconds`, on its event
    loop), so a request whose engine stalls still gets what it was sent. Without `seconds`, such a
    request's held tokens (at most `tokens` - 1) wait for its next output, its end or an error.
    """

    tokens: int = 1  # 1: every output goes at once (one chunk per engine step)
    seconds: float = 0.0  # 0: no time cap

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.seconds < 0:
            raise ValueError("stream interval: tokens must be >= 1 and seconds >= 0")

    def due(self, held_tokens: int, held_since: float, now: float) -> bool:
        """True when tokens held since `held_since` must go now."""
        if held_tokens >= self.tokens:
            return True
        return self.seconds > 0 and now - held_since >= self.seconds


@dataclass(kw_only=True)
class Stream:
    """One admitted request: where its outputs go. Clients subclass it for their own fields."""

    req_id: str
    num_prompt_tokens: int
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    outputs: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    first_token_out: bool = False
    # The client takes nothing before the end (a non-streaming request the router need not read
    # as it goes: no stop strings): every output after the first is held until the request's
    # last, so its coroutine wakes twice, not once per engine step.
    hold_to_end: bool = False
    # Outputs held back by the table's `StreamInterval` (under its lock), and their tokens.
    held: list[Any] = field(default_factory=list)
    held_tokens: int = 0
    held_since: float = 0.0
    num_delivered: int = 0  # outputs delivered, held ones included: its progress

    def take_held(self, item: object) -> list[Any]:
        """The held outputs then `item`, in order; nothing is held after."""
        if not self.held:
            return [item]
        items, self.held, self.held_tokens = [*self.held, item], [], 0
        return items


S = TypeVar("S", bound=Stream)


class StreamTable(Generic[S]):
    """Streams by request id and the admission counters, behind one lock. `lock` is reentrant:
    clients hold it around their own bookkeeping and the table's calls together."""

    def __init__(
        self, limits: AdmissionLimits | None = None, interval: StreamInterval | None = None
    ) -> None:
        self.limits = limits or AdmissionLimits()
        self.interval = interval or StreamInterval()  # replaced in place by the deployment
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
        if self.interval.tokens > 1 and self.interval.seconds > 0 and not stream.hold_to_end:
            # NOTE: on the request's loop: `admit` runs in its coroutine (`build` made the stream).
            stream.loop.call_later(self.interval.seconds, self._window_tick, stream)
        return stream

    def _window_tick(self, stream: S) -> None:
        """On the stream's event loop every `interval.seconds` while it lives: what it holds goes
        now (a stalled engine's tokens are not held longer)."""
        with self.lock:
            if self._streams.get(stream.req_id) is not stream:
                return  # released: the timer stops
            held, stream.held, stream.held_tokens = stream.held, [], 0
        for item in held:
            stream.outputs.put_nowait(item)
        stream.loop.call_later(self.interval.seconds, self._window_tick, stream)

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

    def deliver_many(self, items: Sequence[tuple[str, object, int, bool]]) -> list[S | None]:
        """`deliver` for one engine step's outputs: `(req_id, item, num_tokens, final)` each
        (`final`: the request's last output, or an error), under one lock, and one wake-up of
        each event loop for them all (not one per token: each wake-up is a write to the loop's
        self-pipe and a turn of the loop), none for the loop it is called on. Outputs the
        `interval` or a stream's `hold_to_end` holds back wake nothing."""
        streams: list[S | None] = []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], object]]] = {}
        interval = self.interval
        now = time.monotonic() if interval.tokens > 1 else 0.0
        with self.lock:
            for req_id, item, num_tokens, final in items:
                stream = self._streams.get(req_id)
                streams.append(stream)
                if stream is None:
                    continue  # the client went away: the output is dropped
                stream.num_delivered += 1
                if num_tokens and not stream.first_token_out:
                    stream.first_token_out = True
                    self.num_pending_prompt_tokens -= stream.num_prompt_tokens
                elif num_tokens and not final and stream.hold_to_end:
                    stream.held.append(item)
                    continue
                elif num_tokens and not final and interval.tokens > 1:
                    if not stream.held:
                        stream.held_since = now
                    stream.held_tokens += num_tokens
                    if not interval.due(stream.held_tokens, stream.held_since, now):
                        stream.held.append(item)
                        continue
                puts = by_loop.setdefault(stream.loop, [])
                puts.extend((stream.outputs, i) for i in stream.take_held(item))
        running = running_loop()
        for loop, puts in by_loop.items():
            if loop is running:
                _put_all(puts)  # called on the streams' own loop (the mesh's inbox): no wake-up
                continue
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:
                pass  # that event loop is closed: nobody is listening
        return streams

    def deliver(self, req_id: str, item: object, has_tokens: bool) -> S | None:
        """Hand an output (or an exception) to a request's coroutine at once, after any it holds,
        from any thread; returns its stream, or None when it is gone (the client went away: the
        output is dropped)."""
        with self.lock:
            stream = self._streams.get(req_id)
            if stream is None:
                return None
            if has_tokens and not stream.first_token_out:
                stream.first_token_out = True
                self.num_pending_prompt_tokens -= stream.num_prompt_tokens
            puts = [(stream.outputs, i) for i in stream.take_held(item)]
        try:
            stream.loop.call_soon_threadsafe(_put_all, puts)
        except RuntimeError:
            pass  # the request's event loop is closed: nobody is listening
        return stream


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running on this thread, or None on a thread without one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None  # an engine's or the inbox's thread


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
