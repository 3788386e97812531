"""The mesh client's requests in flight and their current attempts, under one lock.

A request has a stream (`StreamTable`: admission, the outputs its coroutine awaits), a ledger
(`MigrationBook`: the wire id of its current attempt, what a re-run needs) and the engines its
current attempt runs on (`MeshStream`). `MeshRequests` keeps the three together under the table's
(reentrant) lock, so an output reaches its request only while it belongs to the current attempt:
outputs of a superseded attempt are dropped. Sockets and threads are the client's.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.trace import Span

from common.protocol import SamplingSpec, TokenOutput
from services.mesh.registry import ServiceEntry
from services.router.migration import MigrationBook, Replay
from services.router.streams import AdmissionLimits, Stream, StreamTable


class EngineLost(RuntimeError):
    """An engine of the request's attempt `wire_id` left the registry: re-run it elsewhere."""

    def __init__(self, message: str, wire_id: str) -> None:
        super().__init__(message)
        self.wire_id = wire_id


@dataclass(kw_only=True)
class MeshStream(Stream):
    """A request in the mesh: where its current attempt runs, and its trace."""

    prompt_engine: ServiceEntry
    token_engine: ServiceEntry
    traceparent: str = ""  # the request's trace, carried to the engines
    span: Span | None = None  # the request's `router.request` span, for migration events
    num_attempt_tokens: int = 0  # tokens of the current attempt (> 1: the token engine has it)
    # No loss of the current attempt is to be told: one is on its way (an EngineLost), or the
    # attempt is a re-run still waiting in the router (its engines do not have it yet).
    lost: bool = False
    # The progress deadline's next look (`MeshEngineClient._watch_progress`); None while a
    # re-run waits in the router: that time is the router's own, not its engines'.
    watch: asyncio.TimerHandle | None = None


class MeshRequests:
    """Streams, ledgers and the requests each engine was given (a running count)."""

    def __init__(self, limits: AdmissionLimits | None, max_migrations: int) -> None:
        self.streams: StreamTable[MeshStream] = StreamTable(limits)
        # Under `streams.lock`, with the streams: the ledgers and the counts.
        self.lock = self.streams.lock
        self.book = MigrationBook(max_migrations)
        self.by_engine: Counter[str] = Counter()

    def open(
        self,
        req_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingSpec,
        engines: tuple[ServiceEntry, ServiceEntry],
    ) -> None:
        """Keep a request placed on (prompt engine, token engine); the caller holds the lock."""
        self.book.open(req_id, list(prompt_ids), sampling)
        for engine in engines:
            self.by_engine[engine.service_id] += 1

    def wire_id(self, req_id: str) -> str:
        """The id the engines know the request's current attempt by."""
        with self.lock:
            ledger = self.book.ledgers.get(req_id)
        return req_id if ledger is None else ledger.wire_id

    def next_attempt(self, req_id: str, output_token_ids: list[int]) -> tuple[str, Replay | None]:
        """The wire id of the attempt that was lost, and the next one (None: out of migrations).
        Until the next one is sent, no loss is told of it (`MeshStream.lost`): an engine of
        the lost attempt leaving the registry meanwhile is not a loss of the re-run."""
        with self.lock:
            old_wire_id = self.book.ledgers[req_id].wire_id
            stream = self.streams.get(req_id)
            if stream is not None:
                stream.lost = True  # the re-run clears it once sent
            return old_wire_id, self.book.migrate(req_id, output_token_ids)

    def release(self, req_id: str) -> tuple[MeshStream | None, str]:
        """Forget a request; returns its stream (None: already gone) and its last wire id."""
        with self.lock:
            stream = self.streams.release(req_id)
            ledger = self.book.ledgers.get(req_id)
            self.book.close(req_id)
        return stream, req_id if ledger is None else ledger.wire_id

    # ---- from the inbox and watch threads ----

    def deliver_outputs(self, outputs: list[TokenOutput]) -> None:
        """`deliver` for everything one drain of the inbox made ready: one lock, one wake-up of
        the event loop."""
        with self.lock:
            owners = [self.book.owner(out.req_id) for out in outputs]
            items = [
                (ledger.req_id, out, len(out.token_ids), bool(out.finish_reason or out.error))
                for ledger, out in zip(owners, outputs, strict=True)
                if ledger is not None
            ]
            streams = self.streams.deliver_many(items)
            for stream, (_, out, _, _) in zip(streams, items, strict=True):
                if stream is not None:
                    stream.num_attempt_tokens += len(out.token_ids)

    def deliver(self, wire_id: str, item: TokenOutput | Exception) -> None:
        """Hand an output to its request's stream; outputs of a superseded attempt are dropped."""
        has_tokens = isinstance(item, TokenOutput) and bool(item.token_ids)
        with self.lock:  # the attempt cannot change between the check and the delivery
            ledger = self.book.owner(wire_id)
            stream = None if ledger is None else self.streams.deliver(ledger.req_id, item,
                                                                      has_tokens)  # fmt: skip
            if stream is not None and isinstance(item, TokenOutput):
                stream.num_attempt_tokens += len(item.token_ids)

    def engine_ids(self) -> set[str]:
        """The engines some request's current attempt runs on."""
        return {e.service_id for s in self.streams.snapshot()
                for e in (s.prompt_engine, s.token_engine) if e is not None}  # fmt: skip

    def lose_attempts(self, gone: set[str]) -> list[tuple[str, str, str]]:
        """Mark lost the attempts whose token engine is in `gone`, or whose prompt engine is
        before the token engine took over; once per attempt. Returns (req_id, engine, trace)."""
        orphans = []
        with self.lock:
            for s in self.streams.snapshot():
                handed_off = s.num_attempt_tokens > 1
                for dead in (s.token_engine, None if handed_off else s.prompt_engine):
                    if dead is not None and dead.service_id in gone and not s.lost:
                        s.lost = True
                        orphans.append((s.req_id, dead.service_id, s.traceparent))
        return orphans
