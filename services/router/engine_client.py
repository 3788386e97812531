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
import ctypes
import dataclasses
import os
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from common.engine.request import OutputText, RequestOutput
from common.protocol import LoadReport
from common.sampling_params import SamplingParams
from services.router.coalesce import coalesce
from services.router.streams import AdmissionLimits, Stream, StreamTable, next_items
from services.router.token_text import TokenText

if TYPE_CHECKING:  # the in-process engine's alone: a mesh Router never imports torch
    from common.engine.core import LLMEngine

log = structlog.get_logger(__name__)


ENGINE_THREAD_NAME = "engine-loop"


def name_os_thread(name: str) -> None:
    """Name the calling thread for the OS (`/proc/<pid>/task/<tid>/comm`; Linux, else nothing)."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # not Linux: only profiles lose the name


def machine_threads() -> int:
    """The local engine's default torch threads: every core this process may run on but one,
    which the router's event loop and Ray's HTTP proxy need. (Given every core, the engine's
    threads and the front end fight over them, and a served batch streams fewer tokens:
    `bench/serve.py` shows it.)"""
    return max(usable_cores() - 1, 1)


def usable_cores() -> int:
    """The cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


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
    `__anext__`, before any output) and yields one `RequestOutput` per engine step (or per
    several: `StreamInterval`); the last one has `finish_reason` set. With `hold_to_end` it
    yields the first output, then everything else together at the end (`Stream.hold_to_end`).
    Closing the iterator early aborts the request and frees its KV.
    """

    def generate(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hold_to_end: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]: ...

    def abort(self, req_id: str) -> None: ...

    def stats(self) -> EngineClientStats: ...

    def engine_reports(self) -> list[LoadReport]:
        """Each engine's latest load report, with its `EngineCounters` (`/metrics`)."""
        ...

    # Requests in flight and admission (`limits` replaced in place by the deployment's
    # `reconfigure`).
    streams: StreamTable[Any]
    # The longest context (prompt + output) the engines can hold; None: the model's.
    max_context: int | None

    def ready(self) -> bool:
        """True when a request sent now can be served (engines up): `/health` says 200."""
        ...

    def alive(self) -> bool:
        """True while the client's own threads run (engines may still be starting): a false
        answer gets the router replica restarted."""
        ...

    def shutdown(self) -> None: ...


@dataclass
class _Add:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class _Abort:
    req_id: str


_STOP = object()  # the command that ends the engine thread


def _already_built(engine: LLMEngine) -> Callable[[], LLMEngine]:
    return lambda: engine


class InProcessEngineClient:
    """An `LLMEngine` stepped on its own thread, behind the `EngineClient` protocol.

    Give it `build` (a function that makes the engine) rather than an engine where it serves:
    the engine is then made on its thread, so that every torch op of the engine runs on that
    one thread. libgomp keeps an OpenMP team per thread that ever ran a parallel region, and
    once its teams hold more threads than there are cores it stops spinning between regions
    (throttled wait): a model loaded and packed on the caller's thread and stepped on another
    runs its small GEMMs far slower (docs/serving.md).
    """

    def __init__(
        self,
        engine: LLMEngine | None = None,
        limits: AdmissionLimits | None = None,
        num_threads: int | None = None,
        *,
        build: Callable[[], LLMEngine] | None = None,
        engine_id: str = "local",
    ) -> None:
        """`engine`, or `build` to make it on the engine thread (raises what `build` raised);
        `num_threads`: torch threads the engine thread decodes on; None: leave torch's;
        `engine_id`: the engine's name in `/metrics` (the router replica's)."""
        if (engine is None) == (build is None):
            raise ValueError("give an engine or a function that builds one, not both")
        if engine is not None:
            build = _already_built(engine)  # the caller's thread made it (tests, fakes)
        assert build is not None
        self.num_threads = num_threads
        self.engine_id = engine_id
        self.streams: StreamTable[Stream] = StreamTable(limits)
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._built: queue.SimpleQueue[LLMEngine | BaseException] = queue.SimpleQueue()
        self._build = build
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)
        self._thread.start()
        built = self._built.get()
        if isinstance(built, BaseException):
            self._thread.join()  # it returns right after handing the error over
            raise built
        self.engine = built
        self.max_context: int | None = built.max_model_len
        self._engine_stats = self._snapshot_engine()

    # ---- asyncio side ----

    async def generate(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hold_to_end: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        stream = self.streams.admit(
            req_id, len(prompt_token_ids), lambda: Stream(
                req_id=req_id, num_prompt_tokens=len(prompt_token_ids), hold_to_end=hold_to_end
            ),
        )  # fmt: skip
        text: TokenText | None = None
        if params.detokenize and not params.stop and self.engine.tokenizer is not None:
            # A stop string is the one finish that needs text in the engine; otherwise the text
            # is made here, from what each wake-up brings (`TokenText`), not on the engine thread.
            text = TokenText(self.engine.tokenizer, OutputText.of(params))
            params = dataclasses.replace(params, detokenize=False)
        finished = False
        try:
            spec = params.structured_output
            if spec is not None and not self.engine.grammars.is_ready(spec):
                # Compiled on the grammars' pool: the engine thread steps its batch-mates.
                await asyncio.wrap_future(self.engine.grammars.compile_async(spec))
            self._commands.put(_Add(req_id, list(prompt_token_ids), params))
            while not finished:
                items = await next_items(stream.outputs)
                outputs = [i for i in items if not isinstance(i, Exception)]
                if outputs:  # NOTE: nothing follows a finished output or an exception
                    out = coalesce(outputs)
                    if text is not None:
                        out.new_text = text.add(out.new_token_ids, out.finished)
                    finished = out.finished
                    yield out
                if len(outputs) < len(items):
                    raise next(i for i in items if isinstance(i, Exception))
        finally:
            if not finished:
                log.info("request aborted before it finished", req_id=req_id)
                self.abort(req_id)
            self.streams.release(req_id)

    def abort(self, req_id: str) -> None:
        """Stop a request and free its KV; outputs already in flight are dropped."""
        if self.streams.release(req_id) is not None:
            self._commands.put(_Abort(req_id))

    def stats(self) -> EngineClientStats:
        engine = self._engine_stats
        return EngineClientStats(
            len(self.streams),
            self.streams.num_pending_prompt_tokens,
            engine.num_engine_requests,
            engine.kv_blocks_used,
            engine.kv_blocks_total,
        )

    def engine_reports(self) -> list[LoadReport]:
        return [self.engine.load_report(self.engine_id)]

    def ready(self) -> bool:
        return self._thread.is_alive()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        """Stop the engine thread (requests still running get no more outputs)."""
        self._commands.put(_STOP)
        self._thread.join(timeout=10)

    # ---- engine thread ----

    def _run(self) -> None:
        # The OS name too (Python's names are its own): the torch threads this thread starts
        # inherit it, so that a profile of the Router process can tell the engine's CPU apart.
        name_os_thread(ENGINE_THREAD_NAME)
        if self.num_threads is not None:
            # Set on this thread: OpenMP's thread count is per calling thread, and Ray sets
            # OMP_NUM_THREADS to the actor's num_cpus (1), which a new thread starts with.
            import torch  # the engine's (its build imports it too); not the mesh Router's

            torch.set_num_threads(self.num_threads)
        try:
            engine = self._build()
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor, which raises it
            self._built.put(exc)
            return
        self.engine = engine
        self._built.put(engine)
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
        self.streams.deliver_many([
            (out.req_id, RuntimeError(out.error), 0, True) if out.error
            else (out.req_id, out, len(out.new_token_ids), out.finished)
            for out in outputs
        ])  # fmt: skip
        return bool(outputs)

    def _fail_all(self, exc: Exception) -> None:
        for req_id in list(self.engine.requests):
            self.engine.abort(req_id)
            self._deliver(req_id, RuntimeError(f"engine step failed: {exc}"))

    def _deliver(self, req_id: str, item: RequestOutput | Exception) -> None:
        self.streams.deliver(req_id, item, isinstance(item, RequestOutput))

    def _snapshot_engine(self) -> EngineClientStats:
        blocks = self.engine.blocks
        return EngineClientStats(
            num_engine_requests=len(self.engine.requests),
            kv_blocks_used=blocks.num_used_blocks,
            kv_blocks_total=blocks.num_blocks,
        )
