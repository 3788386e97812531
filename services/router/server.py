"""The router: OpenAI-compatible HTTP endpoints over a `EngineClient`.

A plain class that builds a FastAPI app; `services/app.py` wraps it as the Ray Serve ingress and
tests serve it directly. Every request is validated, tokenized and admitted *before* a response
starts, so bad input gets a real 4xx status with an OpenAI error body; an error after the first
streamed byte is sent in-band (`data: {"error": ...}`) followed by `data: [DONE]`.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`
(200 when the backend is ready, else 503), `GET /stats` (the backend's `EngineClientStats`) and
vLLM's `POST /tokenize` and `POST /detokenize` (`services.router.tokenize_api`).
With an API key set, every endpoint but `/health` wants `Authorization: Bearer <key>` (401
otherwise); request bodies over `max_body_bytes` are a 413 before they are parsed.

Each generation request is one `router.request` span (continuing the caller's trace when it sends
a W3C `traceparent` header) and the TTFT, TBT and E2E metrics, recorded by
`services.router.telemetry` as the router hands each output on.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer

from common.config import ModelConfig
from common.engine.request import check_prompt
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from services.router.api_errors import (
    RETRY_AFTER_S,
    APIError,
    error_body,
    error_responses,
    install_error_handlers,
)
from services.router.body_gate import BigBodyGate
from services.router.choices import Outputs, best, choice_params, collect_all, merge, start_all
from services.router.engine_client import EngineClient
from services.router.http_edge import (
    ApiKeyGate,
    ArrivalStamp,
    BodyLimit,
    check_unicode,
    without_422,
)
from services.router.logprobs_format import LogprobsFormatter
from services.router.openai_api import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    SamplingFields,
)
from services.router.prompt_work import BoundedPool, PromptWork
from services.router.responses import ChatShapes, CompletionShapes
from services.router.sse import prepend, sse_response
from services.router.streams import Overloaded
from services.router.telemetry import RouterTelemetry
from services.router.tokenize_api import (
    DetokenizeResponse,
    Tokenization,
    TokenizeResponse,
    body_bytes,
    chat_of,
    chat_options,
)

log = structlog.get_logger(__name__)

# NOTE: recent FastAPI traces every request natively (an HTTP SERVER span, plus endpoint and
# dependency spans) with the global tracer. `router.request` is this service's SERVER span and
# the root of the request's trace, so FastAPI's spans are turned off where it has them.
_NO_HTTP_SPANS: dict[str, Any] = (
    {"telemetry": {"tracing": False, "operation_spans": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_BYTES = 8 << 20  # a request body larger than this is a 413, never parsed
# What each endpoint may answer besides 200 (documented in /openapi.json with the error body).
_GENERATE_ERRORS = error_responses(400, 401, 404, 413, 429, 503)
_TOKENIZE_ERRORS = error_responses(400, 401, 404, 413)
_bearer = HTTPBearer(auto_error=False, description="the API key, when the server sets one")


@dataclasses.dataclass(frozen=True)
class _Arrival:
    """How a generation request came in: its GenAI operation, when, and the caller's trace."""

    operation: str  # text_completion | chat
    start_ns: int  # time.time_ns() as the request reached the app (`ArrivalStamp`)
    traceparent: str = ""  # the caller's W3C header, if it sent one

    @classmethod
    def of(cls, http: Request, operation: str) -> _Arrival:
        arrived_ns = getattr(http.state, "arrived_ns", 0) or time.time_ns()
        return cls(operation, arrived_ns, http.headers.get("traceparent", ""))


@dataclasses.dataclass
class _Job:
    """One admitted request: its id, its prompt's size, and each choice's outputs (the first of
    each already received)."""

    req_id: str
    num_prompt_tokens: int
    choices: list[Outputs]


def _one_prompt(prompt: str | list[Any]) -> str | list[Any]:
    """A completion's `prompt`: text or token ids, alone or as a list of one of them."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    return prompt


def _threads(num_threads: int, name: str) -> Callable[[], ThreadPoolExecutor]:
    return lambda: ThreadPoolExecutor(num_threads, thread_name_prefix=name)


class Router:
    """OpenAI front end for one model; `app` is the FastAPI application to serve."""

    def __init__(
        self,
        client: EngineClient,
        model_path: str | Path,
        served_model_name: str | None = None,
        replica_id: str = "router",
        max_model_len: int | None = None,
        api_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        num_chat_processes: int = 1,
    ) -> None:
        """`max_model_len`: the context a request may use (prompt + output), at most the model's;
        `api_key`: clients must send it as a Bearer token (None: the API is open);
        `num_chat_processes`: worker processes that render long chats (`PromptWork`)."""
        self.client = client
        self.model_path = Path(model_path)
        self.tokenizer = Tokenizer(self.model_path)
        self.logprobs_format = LogprobsFormatter(self.tokenizer)
        self.model_config = ModelConfig.from_folder(self.model_path)
        self.model_name = served_model_name or self.model_path.name
        model_len = self.model_config.max_position_embeddings
        self.max_model_len = min(
            max_model_len or model_len, model_len, client.max_context or model_len
        )
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.telemetry = RouterTelemetry(self.model_name, replica_id)
        self.prompt_work = PromptWork(
            self.tokenizer, self.model_path, self.max_model_len, num_chat_processes
        )
        # Each kind of off-loop work has a bounded pool of its own: none waits behind another.
        self.grammar_pool = BoundedPool("grammar", _threads(2, "grammar"), capacity=16)
        self.stats_pool = BoundedPool("stats", _threads(1, "stats"), capacity=4)
        self.tokenization = Tokenization(self.prompt_work, self.model_name, self.max_model_len)
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="PhaseMesh", docs_url=None, redoc_url=None, **_NO_HTTP_SPANS)
        app.add_middleware(BigBodyGate)  # inside the body limit: sees the whole body at once
        app.add_middleware(BodyLimit, max_bytes=self.max_body_bytes)
        app.add_middleware(ApiKeyGate, api_key=self.api_key)  # outside BodyLimit: before the body
        app.add_middleware(ArrivalStamp)
        install_error_handlers(app)
        auth = [Depends(_bearer)]  # documents the key in /openapi.json; `ApiKeyGate` checks it
        for path, endpoint, model in (
            ("/v1/completions", self.completions, CompletionResponse),
            ("/v1/chat/completions", self.chat_completions, ChatCompletionResponse),
        ):
            ok: dict[int | str, dict[str, Any]] = {200: {
                "model": model, "content": {"text/event-stream": {}},
                "description": "the response, or with `stream` its SSE chunks",
            }}  # fmt: skip
            app.add_api_route(path, endpoint, methods=["POST"], dependencies=auth,
                              responses={**ok, **_GENERATE_ERRORS})  # fmt: skip
        tok = self.tokenization
        app.add_api_route("/tokenize", tok.tokenize, methods=["POST"], dependencies=auth,
                          response_model=TokenizeResponse, responses=_TOKENIZE_ERRORS)  # fmt: skip
        app.add_api_route("/detokenize", tok.detokenize, methods=["POST"], dependencies=auth,
                          response_model=DetokenizeResponse,
                          responses=_TOKENIZE_ERRORS)  # fmt: skip
        app.add_api_route("/v1/models", self.models, methods=["GET"], dependencies=auth,
                          response_model=ModelList, responses=error_responses(401))  # fmt: skip
        app.add_api_route(
            "/health",
            self.health,
            methods=["GET"],
            response_class=Response,
            responses={
                200: {"description": "ready (no body)", "content": {}},
                **error_responses(503),
            },  # fmt: skip
        )
        app.add_api_route("/stats", self.stats, methods=["GET"], dependencies=auth,
                          responses=error_responses(401))  # fmt: skip
        without_422(app)
        return app

    # ---- endpoints ----

    async def completions(self, request: CompletionRequest, http: Request) -> Response:
        self._check_request(request)
        request.reject_unsupported()
        prompt_ids = await self._completion_prompt_ids(request.prompt)
        max_tokens = self._max_tokens(request.max_tokens, len(prompt_ids), "prompt")
        arrival = _Arrival.of(http, "text_completion")
        job = await self._start("cmpl", prompt_ids, request, max_tokens, arrival)
        echo = self.tokenizer.decode(prompt_ids) if request.echo else ""
        shapes = CompletionShapes(job.req_id, self.model_name, self.logprobs_format, request,
                                  prompt_ids, echo)  # fmt: skip
        if request.stream:
            return sse_response(shapes.chunks(merge(job.choices)))
        collected = await collect_all(job.choices)
        if request.num_engine_requests > request.n:
            collected = best(collected, request.n)
        return JSONResponse(shapes.response(collected).model_dump())

    async def chat_completions(self, request: ChatCompletionRequest, http: Request) -> Response:
        self._check_request(request)
        request.reject_unsupported()
        prompt_ids = await self.prompt_work.chat_ids(
            chat_of(request.messages), chat_options(request), body_bytes(http)
        )
        requested = request.max_completion_tokens or request.max_tokens
        max_tokens = self._max_tokens(requested, len(prompt_ids), "messages", default=None)
        job = await self._start(
            "chatcmpl", prompt_ids, request, max_tokens, _Arrival.of(http, "chat")
        )
        shapes = ChatShapes(job.req_id, self.model_name, self.logprobs_format, request,
                            len(prompt_ids))  # fmt: skip
        if request.stream:
            return sse_response(shapes.chunks(merge(job.choices)))
        return JSONResponse(shapes.response(await collect_all(job.choices)).model_dump())

    async def models(self) -> dict[str, Any]:
        card = ModelCard(
            # `root` names the model, not where it lies on the server's disk.
            id=self.model_name,
            root=self.model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
        )
        return ModelList(data=[card]).model_dump()

    async def health(self) -> Response:
        if not self.client.ready():
            return JSONResponse(error_body(503, "the engines are not ready"), status_code=503)
        return Response(status_code=200)

    async def stats(self) -> dict[str, Any]:
        # Asking every service can take seconds: not on the event loop.
        return dataclasses.asdict(await self.stats_pool.run(self.client.stats))

    def shutdown(self) -> None:
        """Stop the router's worker threads and processes (the client is the caller's)."""
        for pool in (self.prompt_work, self.grammar_pool, self.stats_pool):
            pool.shutdown()

    # ---- validation and admission ----

    def _check_request(self, request: SamplingFields) -> None:
        if request.model is not None and request.model != self.model_name:
            raise APIError(404, f"The model `{request.model}` does not exist.", "model")
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
        check_unicode("stop", stop)
        check_unicode("user", [request.user])

    async def _completion_prompt_ids(self, prompt: str | list[Any]) -> list[int]:
        """Text or token ids, alone or as a list of one prompt."""
        prompt = _one_prompt(prompt)
        if isinstance(prompt, str):
            ids = await self.prompt_work.text_ids(prompt)
            if not ids:
                raise APIError(400, "prompt must not be empty", "prompt")
            return ids
        if prompt and all(isinstance(t, int) for t in prompt):
            if len(prompt) >= self.max_model_len:  # before a scan of every id
                raise APIError(400, f"prompt has {len(prompt)} tokens; the model's context is "
                               f"{self.max_model_len}", "prompt")  # fmt: skip
            try:
                check_prompt(prompt, self.model_config.vocab_size, self.max_model_len)
            except ValueError as exc:
                raise APIError(400, str(exc), "prompt") from exc
            return list(prompt)
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        raise APIError(
            400, "batched prompts are not supported: send one prompt per request", "prompt"
        )

    def _max_tokens(
        self,
        requested: int | None,
        num_prompt_tokens: int,
        prompt_param: str,
        default: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS,
    ) -> int:
        """The output budget; a request that cannot fit the context is a 400, never clamped."""
        room = self.max_model_len - num_prompt_tokens
        if room <= 0:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {num_prompt_tokens} tokens, which leaves no room for "
                "output. Please reduce the length of the prompt.",
                prompt_param,
            )
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in "
                f"the prompt, {requested} in the completion). Please reduce the length of the "
                "prompt or completion.",
                "max_tokens",
            )
        return requested

    async def _start(
        self,
        prefix: str,
        prompt_ids: list[int],
        request: SamplingFields,
        max_tokens: int,
        arrival: _Arrival,
    ) -> _Job:
        """Admit the request's choices (each an engine request) and wait for each one's first
        output, so refusals get a real status."""
        # Off the event loop: a structured-output request's grammar is built to validate it.
        if request.asks_structured_output:
            params = await self.grammar_pool.run(request.sampling_params, max_tokens)
        else:
            params = request.sampling_params(max_tokens)
        try:
            params.check_vocab(self.model_config.vocab_size)
        except ValueError as exc:
            raise APIError(400, str(exc), "logit_bias") from exc
        req_id = f"{prefix}-{uuid.uuid4().hex}"
        count = request.num_engine_requests
        # A plain response's client takes nothing before the end: unless the router must read
        # the text as it comes (stop strings), its tokens wait in the stream, not on this loop.
        hold_to_end = not request.stream and not params.stop

        async def start(index: int) -> Outputs:
            # NOTE: one choice keeps the request's id; more are `<id>-<index>` to the engines.
            choice_id = req_id if count == 1 else f"{req_id}-{index}"
            return await self._start_choice(choice_id, prompt_ids, choice_params(params, index),
                                            arrival, hold_to_end)  # fmt: skip

        return _Job(req_id, len(prompt_ids), await start_all(start, count))

    async def _start_choice(
        self,
        req_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: _Arrival,
        hold_to_end: bool,
    ) -> Outputs:
        trace = self.telemetry.start(
            req_id, operation=arrival.operation, num_prompt_tokens=len(prompt_ids),
            max_tokens=params.max_tokens, start_ns=arrival.start_ns,
            traceparent=arrival.traceparent, token_gaps=not hold_to_end,
        )  # fmt: skip
        stream = self.client.generate(req_id, prompt_ids, params, hold_to_end=hold_to_end)
        try:
            with trace.admission():  # the backend routes under the request's span
                first = await anext(stream)
        except Overloaded as exc:
            trace.fail(exc, exc.reason)
            raise APIError(exc.status, str(exc), None, retry_after_s=RETRY_AFTER_S) from exc
        except ValueError as exc:  # the prompt, or a spec the engine could not compile
            trace.fail(exc, "invalid_prompt")
            named = re.search(r"invalid sampling parameter (\w+)", str(exc))
            raise APIError(400, str(exc), named.group(1) if named else "prompt") from exc
        except BaseException as exc:
            trace.fail(exc, "generation")
            raise
        # Outputs are recorded as they leave for the client (the first one included).
        return trace.observe(prepend(first, stream))
