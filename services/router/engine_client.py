"""What the router generates with: the `EngineClient` protocol and the in-process client.

Two clients implement the protocol, named for where generation runs:
- `InProcessEngineClient` (here) runs one `LLMEngine` (a mixed prompt+token engine) on a
  background thread. The asyncio side only touches a command queue and per-request asyncio
  queues; the engine thread owns the engine.
- `MeshEngineClient` (`mesh_client.py`) sends each request to prompt and token engines over
  ZeroMQ.
Both bound admission (requests in flight, prompt tokens not yet prefilled) with `check_admission`
and refuse with `Overloaded`, which the router turns into a 429.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from common.engine.core import LLMEngine
from common.engine.request import RequestOutput
from common.sampling import SamplingParams

log = structlog.get_logger(__name__)


class Overloaded(Exception):
    """Admission refused: a bound on queued work would be passed. `reason` names the bound."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class EngineClientStats:
    """A snapshot for `/stats`, tests and load reports."""

    num_requests: int = 0  # admitted and not finished
    num_pending_prompt_tokens: int = 0  # admitted, first token not out yet
    num_engine_requests: int = 0  # inside the engine (waiting or running)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # The mesh: requests placed on each engine (by service id) since the router started, and
    # what each live service holds now ({service id: {role, kv_blocks_used, num_requests}}).
    requests_by_engine: dict[str, int] = field(default_factory=dict)
    services: dict[str, dict[str, Any]] = field(default_factory=dict)


class EngineClient(Protocol):
    """The router's view of the engines.

    `generate` admits the request (or raises `Overloaded` / `ValueError` on the first
    `__anext__`, before any output) and yields one `RequestOutput` per engine step; the last one
    has `finish_reason` set. Closing the iterator early aborts the request and frees its KV.
    """

    def generate(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]: ...

    def abort(self, req_id: str) -> None: ...

    def stats(self) -> EngineClientStats: ...

    limits: AdmissionLimits  # replaced in place by the deployment's `reconfigure`

    def ready(self) -> bool:
        """True when a request sent now can be served (engines up): `/health` says 200."""
        ...

    def alive(self) -> bool:
        """True while the client's own threads run (engines may still be starting): a false
        answer gets the router replica restarted."""
        ...

    def shutdown(self) -> None: ...


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


@dataclass
class _Add:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class _Abort:
    req_id: str


_STOP = object()  # the command that ends the engine thread


@dataclass
class _Stream:
    """Where one request's outputs go: an asyncio queue fed from the engine thread."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | Exception] = field(default_factory=asyncio.Queue)
    num_prompt_tokens: int = 0
    first_token_out: bool = False


class InProcessEngineClient:
    """An `LLMEngine` stepped on its own thread, behind the `EngineClient` protocol."""

    def __init__(self, engine: LLMEngine, limits: AdmissionLimits | None = None) -> None:
        self.engine = engine
        self.limits = limits or AdmissionLimits()
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and the admission counters
        self._num_pending_prompt_tokens = 0
        self._engine_stats = self._snapshot_engine()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- asyncio side ----

    async def generate(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        stream = self._admit(req_id, prompt_token_ids, params)
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                log.info("request aborted before it finished", req_id=req_id)
                self.abort(req_id)
            self._release(req_id)

    def abort(self, req_id: str) -> None:
        """Stop a request and free its KV; outputs already in flight are dropped."""
        if self._release(req_id):
            self._commands.put(_Abort(req_id))

    def stats(self) -> EngineClientStats:
        engine = self._engine_stats
        with self._lock:
            return EngineClientStats(
                len(self._streams),
                self._num_pending_prompt_tokens,
                engine.num_engine_requests,
                engine.kv_blocks_used,
                engine.kv_blocks_total,
            )

    def ready(self) -> bool:
        return self._thread.is_alive()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        """Stop the engine thread (requests still running get no more outputs)."""
        self._commands.put(_STOP)
        self._thread.join(timeout=10)

    def _admit(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams) -> _Stream:
        num_tokens = len(prompt_token_ids)
        with self._lock:
            check_admission(
                self.limits, len(self._streams), self._num_pending_prompt_tokens, num_tokens
            )
            if req_id in self._streams:
                raise ValueError(f"request id {req_id} is already in use")
            stream = _Stream(asyncio.get_running_loop(), num_prompt_tokens=num_tokens)
            self._streams[req_id] = stream
            self._num_pending_prompt_tokens += num_tokens
        self._commands.put(_Add(req_id, list(prompt_token_ids), params))
        return stream

    def _release(self, req_id: str) -> bool:
        with self._lock:
            stream = self._streams.pop(req_id, None)
            if stream is not None and not stream.first_token_out:
                self._num_pending_prompt_tokens -= stream.num_prompt_tokens
        return stream is not None

    # ---- engine thread ----

    def _run(self) -> None:
        while True:
            # Block when idle; drain without blocking when there is work to step.
            if not self._apply(self._commands.get()):
                return
            while self.engine.has_unfinished():
                if not self._drain_commands():
                    return
                progressed = self._step()
                self._engine_stats = self._snapshot_engine()
                if not progressed:
                    break  # nothing schedulable: only a new command can change that
            self._engine_stats = self._snapshot_engine()

    def _drain_commands(self) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if not self._apply(command):
                return False

    def _apply(self, command: object) -> bool:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            self.engine.abort(command.req_id)
        return command is not _STOP

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.req_id, command.prompt_token_ids, command.params)
        except ValueError as exc:
            self._deliver(command.req_id, exc)

    def _step(self) -> bool:
        """One engine step, outputs handed to their streams; False if nothing ran."""
        try:
            outputs = self.engine.step()
        except Exception as exc:  # an engine bug must not hang every client
            log.exception("engine step failed; aborting its requests")
            self._fail_all(exc)
            return True
        for out in outputs:
            self._deliver(out.req_id, out)
        return bool(outputs)

    def _fail_all(self, exc: Exception) -> None:
        for req_id in list(self.engine.requests):
            self.engine.abort(req_id)
            self._deliver(req_id, RuntimeError(f"engine step failed: {exc}"))

    def _deliver(self, req_id: str, item: RequestOutput | Exception) -> None:
        with self._lock:
            stream = self._streams.get(req_id)
            if stream is None:
                return  # aborted: the client is gone
            if isinstance(item, RequestOutput) and not stream.first_token_out:
                stream.first_token_out = True
                self._num_pending_prompt_tokens -= stream.num_prompt_tokens
        try:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)
        except RuntimeError:
            pass  # the request's event loop is closed: nobody is listening

    def _snapshot_engine(self) -> EngineClientStats:
        blocks = self.engine.blocks
        return EngineClientStats(
            num_engine_requests=len(self.engine.requests),
            kv_blocks_used=blocks.num_used_blocks,
            kv_blocks_total=blocks.num_blocks,
        )
