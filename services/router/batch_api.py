"""The OpenAI Batch API on the router: `/v1/files` and `/v1/batches`, and the runner that works
through a batch's lines.

A batch's lines run through this router's own `/v1/completions` / `/v1/chat/completions`, in
process (`asgi_caller`: the same ASGI app, key, limits and admission as a client's request), so a
batch's greedy output equals the online API's for the same bodies. At most `concurrency` lines
are in flight per runner, and a line refused for capacity (429/503) waits and runs again rather
than failing: offline work takes what online traffic leaves.

Faults: state lives in `BatchStore` (SQLite; on a cluster, the head's store actor:
`ray_batch_store.py`, which says what its own death costs). A router that dies mid-batch leaves its
lease to run out; the next runner to look (a restarted replica, or another one sharing the store)
claims the batch and runs the lines with no recorded outcome. A line's outcome is recorded once. A
body that fails validation is refused at upload with every bad line named; a line that fails at run
time (a 400 for its body) goes to the error file with its status and error, and the batch goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog
from fastapi import APIRouter, File, Form, UploadFile
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import ASGIApp, Message

from services.router.api_errors import RETRY_AFTER_S, APIError, error_responses, param_path
from services.router.batch_store import BatchError, BatchStorage, Line
from services.router.openai_api import ChatCompletionRequest, CompletionRequest

log = structlog.get_logger(__name__)

# (status, JSON body, Retry-After seconds or None) of one request to the router's own API.
Call = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any], float | None]]]
CAPACITY = (429, 503)  # refused for now, not for what it asked: run it again later
# Runs lines, each (url, body), as one offline job named by its batch's id: each line's
# (status, body), or None for a line it left to the online API or a cancel cut short.
# `Router.offline_completions`.
OfflineJob = Callable[
    [list[tuple[str, dict[str, Any]]], str], Awaitable[list[tuple[int, dict[str, Any]] | None]]
]
# The fields a greedy completion or chat may carry to go offline (anything else: the online API).
OFFLINE_FIELDS = {
    "/v1/completions": frozenset({"model", "prompt", "max_tokens", "temperature", "n", "stream",
                                  "user", "seed"}),
    "/v1/chat/completions": frozenset({"model", "messages", "max_tokens", "max_completion_tokens",
                                       "temperature", "n", "stream", "user", "seed"}),
}  # fmt: skip


class OfflineBackend(Protocol):
    """Seesaw's offline group as the router sees it (`services/offline/service.py`)."""

    max_len: int  # prompt + output of one request

    async def generate(
        self, prompts: list[list[int]], max_tokens: list[int], job_id: str
    ) -> list[list[int] | None]:
        """Each prompt's greedy output ids; None for one a cancel of `job_id` cut short."""
        ...

    async def cancel(self, job_id: str) -> None:
        """End `job_id`'s job at its next step."""
        ...


BODY_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def body_problem(url: str, body: dict[str, Any]) -> str:
    """What the endpoint's request model refuses in `body` (its first bad field), or "". Checked
    as the JSON the endpoint would get; what only the engine knows (a prompt's length in tokens,
    the model's name) is left to run time, where it is that line's error."""
    try:
        BODY_MODELS[url].model_validate_json(json.dumps(body))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = param_path(("body", *first.get("loc", ())))
        return f"`body{'.' + param if param else ''}`: {first.get('msg', 'invalid')}"
    return ""


def offline_eligible(line: Line) -> bool:
    """A plain greedy completion or chat, one choice, nothing the offline group does not do."""
    body = line.body
    return (
        line.url in OFFLINE_FIELDS
        and set(body) <= OFFLINE_FIELDS[line.url]
        and body.get("temperature", 1.0) == 0
        and body.get("n", 1) == 1
        and not body.get("stream", False)
    )


def asgi_caller(app: ASGIApp, api_key: str | None) -> Call:
    """POST a JSON body to `app` in process, as a client would over HTTP (same middleware)."""

    async def call(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], float | None]:
        raw = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(raw)).encode())]  # fmt: skip
        if api_key:
            headers.append((b"authorization", b"Bearer " + api_key.encode()))
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "headers": headers,
                 "client": ("batch", 0), "server": ("batch", 0), "state": {}}  # fmt: skip
        done = asyncio.Event()
        delivered = False
        status, chunks, retry_after = 500, [], None

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await done.wait()  # the client stays connected until the response is complete
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal status, retry_after
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", []):
                    if name.lower() == b"retry-after":
                        retry_after = float(value)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    done.set()

        await app(scope, receive, send)
        done.set()
        try:
            parsed = json.loads(b"".join(chunks) or b"{}")
        except json.JSONDecodeError:
            parsed = {"error": {"message": "the response was not JSON", "code": status}}
        return status, parsed, retry_after

    return call


class BatchRunner:
    """Claims unfinished batches from the store, one at a time, and runs their lines."""

    def __init__(
        self, store: BatchStorage, call: Call, owner: str | None = None, concurrency: int = 8,
        lease_s: float = 30.0, poll_s: float = 1.0, offline: OfflineJob | None = None,
        offline_cancel: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:  # fmt: skip
        """`offline`: where a batch of plain greedy completions runs as one job (Seesaw's
        group), `offline_cancel` what ends it when the batch is cancelled; None: every batch
        runs line by line through `call`."""
        self.store, self.call, self.offline = store, call, offline
        self.offline_cancel = offline_cancel
        self.owner = owner or f"runner-{secrets.token_hex(6)}"
        self.concurrency, self.lease_s, self.poll_s = concurrency, lease_s, poll_s
        self.num_lines_run = 0  # lines this runner recorded (tests, stats)
        self.num_offline_lines = 0  # of which the offline group answered

    async def run_forever(self) -> None:
        while True:
            try:
                batch_id = await asyncio.to_thread(self.store.claim, self.owner, self.lease_s)
                if batch_id is None:
                    await asyncio.sleep(self.poll_s)
                    continue
                await self.run_batch(batch_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the runner outlives one batch's trouble
                log.exception("batch runner error; retrying", error=repr(exc))
                await asyncio.sleep(self.poll_s)

    async def run_batch(self, batch_id: str) -> None:
        lines = await asyncio.to_thread(self.store.pending, batch_id)
        log.info("batch running", batch_id=batch_id, pending=len(lines), owner=self.owner)
        stop = asyncio.Event()
        keeper = asyncio.create_task(self._keep_lease(batch_id, stop))
        slots = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task[None]] = set()
        try:
            lines = await self._run_offline(batch_id, lines, stop)
            for line in lines:
                await slots.acquire()
                if stop.is_set():
                    slots.release()
                    break
                task = asyncio.create_task(self._run_line(batch_id, line, stop))
                task.add_done_callback(lambda _: slots.release())
                tasks.add(task)
            await asyncio.gather(*tasks)
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        batch = await asyncio.to_thread(self.store.finish, batch_id)
        log.info("batch done", batch_id=batch_id, status=batch["status"],
                 counts=batch["request_counts"])  # fmt: skip

    async def _run_offline(self, batch_id: str, lines: list[Line],
                           stop: asyncio.Event) -> list[Line]:  # fmt: skip
        """The batch as one offline job when every line can go; the lines left to run online.
        A cancel (`stop`) ends the job at its next step: the lines that finished are kept."""
        if self.offline is None or not lines or not all(offline_eligible(x) for x in lines):
            return lines
        job = asyncio.ensure_future(self.offline([(x.url, x.body) for x in lines], batch_id))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait((job, stopped), return_when=asyncio.FIRST_COMPLETED)
            if not job.done() and self.offline_cancel is not None:
                await self.offline_cancel(batch_id)
            answers = await job
        except Exception as exc:  # noqa: BLE001 - the online API still runs the batch
            log.warning("offline job failed; the batch runs online", batch_id=batch_id,
                        error=repr(exc))  # fmt: skip
            return lines
        finally:
            stopped.cancel()
        left = []
        for line, answer in zip(lines, answers, strict=True):
            if answer is None:
                left.append(line)
            elif await asyncio.to_thread(self.store.record, batch_id, line.line_no, *answer):
                self.num_lines_run += 1
                self.num_offline_lines += 1
        return left

    async def _keep_lease(self, batch_id: str, stop: asyncio.Event) -> None:
        while True:
            status = await asyncio.to_thread(self.store.renew, batch_id, self.owner, self.lease_s)
            if status == "cancelling":
                stop.set()
            # A cancel is seen within `poll_s` (the lease renewed as often: one SQLite update).
            await asyncio.sleep(min(self.lease_s / 3, self.poll_s))

    async def _run_line(self, batch_id: str, line: Line, stop: asyncio.Event) -> None:
        while True:
            status, body, retry_after = await self.call(line.url, line.body)
            if status not in CAPACITY:
                break
            if stop.is_set():
                return  # cancelled while it waited for room: no outcome, not in the output
            await asyncio.sleep(min(retry_after or 1.0, 10.0))
        if await asyncio.to_thread(self.store.record, batch_id, line.line_no, status, body):
            self.num_lines_run += 1


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


class BatchApi:
    """The endpoints over one store; `runner` works through its batches on the router's loop."""

    def __init__(self, store: BatchStorage, runner: BatchRunner) -> None:
        self.store, self.runner = store, runner
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the runner on the running loop (the app's startup)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.runner.run_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def routes(self, dependencies: list[Any]) -> APIRouter:
        api = APIRouter(dependencies=dependencies)
        for path, endpoint, method, statuses in (
            ("/v1/files", self.create_file, "POST", (400, 401, 413, 503)),
            ("/v1/files/{file_id}", self.get_file, "GET", (400, 401, 404, 503)),
            ("/v1/files/{file_id}/content", self.file_content, "GET", (400, 401, 404, 503)),
            ("/v1/batches", self.create_batch, "POST", (400, 401, 404, 413, 503)),
            ("/v1/batches", self.list_batches, "GET", (400, 401, 503)),
            ("/v1/batches/{batch_id}", self.get_batch, "GET", (400, 401, 404, 503)),
            ("/v1/batches/{batch_id}/cancel", self.cancel, "POST", (400, 401, 404, 503)),
        ):
            api.add_api_route(path, endpoint, methods=[method],
                              responses=error_responses(*statuses))  # fmt: skip
        return api

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except BatchError as exc:
            retry_after = RETRY_AFTER_S if exc.status == 503 else None
            raise APIError(exc.status, exc.message, exc.param, retry_after) from None

    async def create_file(self, file: UploadFile = File(...),  # noqa: B008 - FastAPI's idiom
                          purpose: str = Form(...)) -> JSONResponse:  # fmt: skip
        if purpose not in ("batch",):
            raise APIError(400, "`purpose` must be `batch`", "purpose")
        content = await file.read()
        return JSONResponse(await self._run(self.store.create_file, purpose,
                                            file.filename or "upload.jsonl", content))  # fmt: skip

    async def get_file(self, file_id: str) -> JSONResponse:
        return JSONResponse(await self._run(self.store.get_file, file_id))

    async def file_content(self, file_id: str) -> Response:
        content = await self._run(self.store.file_content, file_id)
        return Response(content, media_type="application/jsonl")

    async def create_batch(self, request: BatchCreate) -> JSONResponse:
        return JSONResponse(await self._run(self.store.create_batch, request.input_file_id,
                                            request.endpoint, request.completion_window,
                                            request.metadata))  # fmt: skip

    async def list_batches(self, after: str | None = None, limit: int = 20) -> JSONResponse:
        if not 1 <= limit <= 100:
            raise APIError(400, "`limit` must be between 1 and 100", "limit")
        return JSONResponse(await self._run(self.store.list_batches, after, limit))

    async def get_batch(self, batch_id: str) -> JSONResponse:
        return JSONResponse(await self._run(self.store.get_batch, batch_id))

    async def cancel(self, batch_id: str) -> JSONResponse:
        return JSONResponse(await self._run(self.store.cancel, batch_id))
