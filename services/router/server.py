"""The router: OpenAI-compatible HTTP endpoints over a `EngineClient`.

A plain class that builds a FastAPI app; `services/app.py` wraps it as the Ray Serve ingress and
tests serve it directly. Every request is validated, tokenized and admitted *before* a response
starts, so bad input gets a real 4xx status with an OpenAI error body; an error after the first
streamed byte is sent in-band (`data: {"error": ...}`) followed by `data: [DONE]`.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`
(200 when the backend is ready, else 503), `GET /stats` (the backend's `EngineClientStats`),
`GET /metrics` (Prometheus text: the router's series and the engines', in vLLM's names or ours,
`common.telemetry.prometheus`, `services.router.metrics_endpoint`) and vLLM's `POST /tokenize`
and `POST /detokenize` (`services.router.tokenize_api`).
With an API key set, every endpoint but `/health` and `/metrics` wants `Authorization: Bearer
<key>` (401 otherwise; vLLM leaves both open too: a scraper carries no key, and neither says
more than counts); request bodies over `max_body_bytes` are a 413 before they are parsed.

A generation request's id is `cmpl-<X-Request-Id>` / `chatcmpl-<X-Request-Id>` when the client
sends that header (vLLM's), else a random one; the response echoes it in `X-Request-Id`. Unknown
body fields are logged once per name and listed back in `X-Ignored-Fields`, or refused with
`strict_fields` (`request_fields.py`).

Each generation request is one `router.request` span (continuing the caller's trace when it sends
a W3C `traceparent` header) and the TTFT, TBT and E2E metrics, recorded by
`services.router.telemetry` as the router hands each output on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer

from common.config import ModelConfig
from common.engine.request import check_prompt
from common.request_ids import random_hex
from common.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams
from common.telemetry import Metrics
from common.telemetry.prometheus import CONTENT_TYPE, PrometheusSink
from common.tokenizer import Tokenizer
from services.router.api_errors import (
    RETRY_AFTER_S,
    APIError,
    error_body,
    error_responses,
    install_error_handlers,
)
from services.router.batch_api import (
    BatchApi,
    BatchRunner,
    OfflineBackend,
    asgi_caller,
    body_problem,
)
from services.router.batch_store import open_batch_store
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
from services.router.metrics_endpoint import EngineSeries
from services.router.openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    UsageInfo,
    unix_now,
)
from services.router.prompt_work import BoundedPool, PromptWork
from services.router.request_fields import UnknownFields
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
from services.router.tools import ToolPrompt

log = structlog.get_logger(__name__)

# NOTE: recent FastAPI instruments every request natively with the global providers: an HTTP
# SERVER span with endpoint and dependency spans, request-duration and active-request metrics,
# exception logs, and a wrapper around every ASGI `send` (each streamed chunk). `router.request`
# is this service's SERVER span and the root of the request's trace, and the router records its
# own request metrics (TTFT, TBT, E2E, errors: common/telemetry/metrics.py), so all of FastAPI's
# is turned off where it has it: its wrapper would add a layer to the per-token path.
_NO_FASTAPI_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "operation_spans": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_BYTES = 8 << 20  # a request body larger than this is a 413, never parsed
OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without the API key
REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(rf"^[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}$")  # printable ASCII
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


@dataclasses.dataclass(frozen=True)
class _Ids:
    """A generation request's id in its body (`<prefix>-<base>`), the base the response's
    `X-Request-Id` header carries, and the prefix of its engine requests' ids (the body's id,
    made unique with a random suffix when the client chose it)."""

    req_id: str
    base: str
    engine_id: str

    @classmethod
    def of(cls, http: Request, prefix: str) -> _Ids:
        given = http.headers.get(REQUEST_ID_HEADER)
        if given is None:
            base = random_hex()
            return cls(f"{prefix}-{base}", base, f"{prefix}-{base}")
        if not _REQUEST_ID.match(given):
            raise APIError(400, f"{REQUEST_ID_HEADER} must be 1 to {MAX_REQUEST_ID_CHARS} "
                           "printable ASCII characters", REQUEST_ID_HEADER)  # fmt: skip
        # NOTE: two clients may send the same id; the engines need distinct ones.
        return cls(f"{prefix}-{given}", given, f"{prefix}-{given}-{random_hex(8)}")


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """A completion's `prompt` as a list of prompts: text or token ids, alone or several."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


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
        batch_store: str | Path | None = None,
        batch_lease_s: float = 30.0,
        offline: OfflineBackend | None = None,
        prometheus: PrometheusSink | None = None,
        strict_fields: bool = False,
    ) -> None:
        """`max_model_len`: the context a request may use (prompt + output), at most the model's;
        `api_key`: clients must send it as a Bearer token (None: the API is open);
        `num_chat_processes`: worker processes that render long chats (`PromptWork`);
        `batch_store`: the Batch API's SQLite file, or `ray:<path>` for the Ray head's store
        actor over that file (`open_batch_store`; None: no Batch API); `batch_lease_s`: how
        long a batch stays with a runner that stopped renewing it (a dead router's batches
        resume elsewhere after it); `offline`: Seesaw's group, which takes batches of plain
        greedy completions as one job (None: every batch runs through the online API);
        `prometheus`: what `/metrics` serves (shared with the client's `Metrics`); None: a new
        one in vLLM's names; `strict_fields`: an unknown body field is a 400 naming it (else
        ignored and listed back in `X-Ignored-Fields`)."""
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
        self.prometheus = prometheus or PrometheusSink()
        self.prometheus.registry.register(
            EngineSeries(self.prometheus.prefix, self.model_name, client.engine_reports)
        )
        self.telemetry = RouterTelemetry(self.model_name, replica_id, Metrics(
            model_name=self.model_name, engine=replica_id, prometheus=self.prometheus
        ))  # fmt: skip
        self.unknown_fields = UnknownFields(strict_fields)
        self.prompt_work = PromptWork(
            self.tokenizer, self.model_path, self.max_model_len, num_chat_processes
        )
        # Each kind of off-loop work has a bounded pool of its own: none waits behind another.
        self.grammar_pool = BoundedPool("grammar", _threads(2, "grammar"), capacity=16)
        self.stats_pool = BoundedPool("stats", _threads(1, "stats"), capacity=4)
        self.tool_prompt = ToolPrompt(self.tokenizer.chat_template)
        self.tokenization = Tokenization(
            self.prompt_work, self.model_name, self.max_model_len, self.tool_prompt
        )
        self.offline = offline
        self.app = self._build_app()
        self.batches = None if batch_store is None else self._batch_api(batch_store, batch_lease_s)

    def _batch_api(self, batch_store: str | Path, lease_s: float) -> BatchApi:
        """The Batch API on `self.app`: its lines run through the app itself (and plain greedy
        batches on the offline group, when there is one)."""
        store = open_batch_store(batch_store, body_problem)
        job = self.offline_completions if self.offline is not None else None
        cancel = self.offline.cancel if self.offline is not None else None
        runner = BatchRunner(store, asgi_caller(self.app, self.api_key), lease_s=lease_s,
                             offline=job, offline_cancel=cancel)  # fmt: skip
        batches = BatchApi(store, runner)
        self.app.include_router(batches.routes([Depends(_bearer)]))
        return batches

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="PhaseMesh", docs_url=None, redoc_url=None, lifespan=self._lifespan,
                      **_NO_FASTAPI_TELEMETRY)  # fmt: skip
        app.add_middleware(BigBodyGate)  # inside the body limit: sees the whole body at once
        app.add_middleware(BodyLimit, max_bytes=self.max_body_bytes)
        # Outside BodyLimit: before the body. /health and /metrics stay open (module docstring).
        app.add_middleware(ApiKeyGate, api_key=self.api_key, open_paths=OPEN_PATHS)
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
        app.add_api_route(
            "/metrics", self.metrics, methods=["GET"], response_class=Response,
            responses={200: {"description": "Prometheus text format",
                             "content": {CONTENT_TYPE: {}}}},
        )  # fmt: skip
        without_422(app)
        return app

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        """The app's life on its event loop: the Batch API's runner runs meanwhile."""
        if self.batches is not None:
            self.batches.start()
        try:
            yield
        finally:
            if self.batches is not None:
                await self.batches.stop()

    # ---- endpoints ----

    async def completions(self, request: CompletionRequest, http: Request) -> Response:
        headers = self._check_request(request, http, "/v1/completions")
        request.reject_unsupported()
        ids = _Ids.of(http, "cmpl")
        prompts = [await self._completion_prompt_ids(p, request.truncate_prompt_tokens)
                   for p in _prompts(request.prompt)]  # fmt: skip
        arrival = _Arrival.of(http, "text_completion")
        choices: list[Outputs] = []
        try:
            for i, prompt_ids in enumerate(prompts):
                max_tokens = self._max_tokens(request.max_tokens, len(prompt_ids), "prompt")
                engine_id = ids.engine_id if len(prompts) == 1 else f"{ids.engine_id}-p{i}"
                choices += await self._start(engine_id, prompt_ids, request, max_tokens, arrival)
        except BaseException:
            for outputs in choices:  # a later prompt refused: the started ones are aborted
                await outputs.aclose()
            raise
        echoes = [self.tokenizer.decode(p) if request.echo else "" for p in prompts]
        shapes = CompletionShapes(ids.req_id, self.model_name, self.logprobs_format, request,
                                  prompts, echoes)  # fmt: skip
        if request.stream:
            return sse_response(shapes.chunks(merge(choices)), headers)
        collected = await collect_all(choices)
        if request.num_engine_requests > request.n:  # best_of: each prompt's best n
            per = request.num_engine_requests
            collected = [c for i in range(0, len(collected), per)
                         for c in best(collected[i : i + per], request.n)]  # fmt: skip
        return JSONResponse(shapes.response(collected).model_dump(), headers=headers)

    async def chat_completions(self, request: ChatCompletionRequest, http: Request) -> Response:
        headers = self._check_request(request, http, "/v1/chat/completions")
        request.reject_unsupported()
        ids = _Ids.of(http, "chatcmpl")
        chat, tools = self.tool_prompt.chat(
            chat_of(request.messages), request.tools, request.tool_choice
        )
        prompt_ids = await self.prompt_work.chat_ids(
            chat, chat_options(request, tools), body_bytes(http)
        )
        prompt_ids = self._truncated(prompt_ids, request.truncate_prompt_tokens)
        requested = request.max_completion_tokens or request.max_tokens
        max_tokens = self._max_tokens(requested, len(prompt_ids), "messages", default=None)
        choices = await self._start(
            ids.engine_id, prompt_ids, request, max_tokens, _Arrival.of(http, "chat")
        )
        shapes = ChatShapes(ids.req_id, self.model_name, self.logprobs_format, request,
                            prompt_ids)  # fmt: skip
        if request.stream:
            return sse_response(shapes.chunks(merge(choices)), headers)
        response = shapes.response(await collect_all(choices))
        return JSONResponse(response.model_dump(), headers=headers)

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

    async def metrics(self) -> Response:
        return Response(self.prometheus.render(), media_type=CONTENT_TYPE)

    async def stats(self) -> dict[str, Any]:
        # Asking every service can take seconds: not on the event loop.
        return dataclasses.asdict(await self.stats_pool.run(self.client.stats))

    def shutdown(self) -> None:
        """Stop the router's worker threads and processes (the client is the caller's)."""
        for pool in (self.prompt_work, self.grammar_pool, self.stats_pool):
            pool.shutdown()

    async def offline_completions(
        self, lines: list[tuple[str, dict[str, Any]]], job_id: str
    ) -> list[tuple[int, dict[str, Any]] | None]:
        """Plain greedy completions and chats, each (url, body), as one offline job named
        `job_id`: each one's (status, response), as its endpoint answers it; None for one left to
        the online API (one it would refuse, or longer than the group's `max_len`: the online
        API says why, or runs it) or that a cancel of the job cut short."""
        assert self.offline is not None
        taken: list[tuple[int, str, list[int], int]] = []
        for i, (url, body) in enumerate(lines):
            try:
                prompt_ids, max_tokens = await self._offline_prompt(url, body)
            except (APIError, ValueError):
                continue
            if prompt_ids and len(prompt_ids) + max_tokens <= self.offline.max_len:
                taken.append((i, url, prompt_ids, max_tokens))
        answers: list[tuple[int, dict[str, Any]] | None] = [None] * len(lines)
        if not taken:
            return answers
        outputs = await self.offline.generate([t[2] for t in taken], [t[3] for t in taken],
                                              job_id)  # fmt: skip
        eos = set(self.model_config.eos_token_ids)
        for (i, url, prompt_ids, _), out in zip(taken, outputs, strict=True):
            if out is None:
                continue
            text = self.tokenizer.decode(out)
            finish = "stop" if out and out[-1] in eos else "length"
            used = UsageInfo.of(len(prompt_ids), len(out))
            response: CompletionResponse | ChatCompletionResponse
            if url == "/v1/completions":
                response = CompletionResponse(
                    id=f"cmpl-{random_hex()}", created=unix_now(), model=self.model_name,
                    choices=[CompletionChoice(index=0, text=text, finish_reason=finish)],
                    usage=used,
                )  # fmt: skip
            else:
                response = ChatCompletionResponse(
                    id=f"chatcmpl-{random_hex()}", created=unix_now(), model=self.model_name,
                    choices=[ChatChoice(message=AssistantMessage(content=text),
                                        finish_reason=finish)],
                    usage=used,
                )  # fmt: skip
            answers[i] = (200, response.model_dump())
        return answers

    async def _offline_prompt(self, url: str, body: dict[str, Any]) -> tuple[list[int], int]:
        """A body's prompt ids and max_tokens as its endpoint reads them; ([], 0) for one the
        offline group does not take (several prompts, another model: the online API answers)."""
        if url == "/v1/completions":
            request = CompletionRequest.model_validate(body)
            prompts = _prompts(request.prompt)
            if len(prompts) != 1 or request.model not in (None, self.model_name):
                return [], 0
            prompt_ids = await self._completion_prompt_ids(prompts[0])
            return prompt_ids, self._max_tokens(request.max_tokens, len(prompt_ids), "prompt")
        chat_request = ChatCompletionRequest.model_validate(body)
        if chat_request.model not in (None, self.model_name):
            return [], 0
        chat, tools = self.tool_prompt.chat(chat_of(chat_request.messages), None, None)
        prompt_ids = await self.prompt_work.chat_ids(chat, chat_options(chat_request, tools), None)
        requested = chat_request.max_completion_tokens or chat_request.max_tokens
        return prompt_ids, self._max_tokens(requested, len(prompt_ids), "messages", default=None)

    # ---- validation and admission ----

    def _check_request(
        self, request: SamplingFields, http: Request, endpoint: str
    ) -> dict[str, str]:
        """The checks every generation request gets; returns the response's headers (its
        `X-Request-Id` echo, any ignored fields)."""
        headers = self.unknown_fields.check(request.unknown_fields, endpoint)
        if request.model is not None and request.model != self.model_name:
            raise APIError(404, f"The model `{request.model}` does not exist.", "model")
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
        check_unicode("stop", stop)
        check_unicode("user", [request.user])
        check_unicode("bad_words", request.bad_words or [])
        given = http.headers.get(REQUEST_ID_HEADER)
        return headers | ({REQUEST_ID_HEADER: given} if given else {})

    def _truncated(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: the context's
        worth); None: the whole prompt."""
        if keep is None:
            return prompt_ids
        keep = self.max_model_len if keep == -1 else keep
        if not 0 < keep <= self.max_model_len:
            why = f"must be -1 or in [1, {self.max_model_len}] (max_model_len)"
            raise APIError(400, f"truncate_prompt_tokens {why}", "truncate_prompt_tokens")
        return prompt_ids[-keep:]

    def _bad_words(self, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        """vLLM's `bad_words` as token sequences: each word as tokenized alone, and with a
        leading space where that tokenizes differently (a word inside a sentence)."""
        sequences: list[tuple[int, ...]] = []
        for word in words or []:
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            for ids in (bare, spaced):
                if ids and ids not in sequences and len(ids) <= MAX_BAD_WORD_TOKENS:
                    sequences.append(ids)
                elif len(ids) > MAX_BAD_WORD_TOKENS:
                    raise APIError(400, f"a bad word may be at most {MAX_BAD_WORD_TOKENS} "
                                   "tokens", "bad_words")  # fmt: skip
        return tuple(sequences)

    async def _completion_prompt_ids(
        self, prompt: str | list[int], truncate: int | None = None
    ) -> list[int]:
        """One prompt's ids: text or token ids, truncated as `truncate_prompt_tokens` says."""
        if isinstance(prompt, str):
            ids = self._truncated(await self.prompt_work.text_ids(prompt), truncate)
            if not ids:
                raise APIError(400, "prompt must not be empty", "prompt")
            return ids
        prompt = self._truncated(prompt, truncate)
        if prompt and all(isinstance(t, int) for t in prompt):
            if len(prompt) >= self.max_model_len:  # before a scan of every id
                raise APIError(400, f"prompt has {len(prompt)} tokens; the model's context is "
                               f"{self.max_model_len}", "prompt")  # fmt: skip
            try:
                check_prompt(prompt, self.model_config.vocab_size, self.max_model_len)
            except ValueError as exc:
                raise APIError(400, str(exc), "prompt") from exc
            return list(prompt)
        raise APIError(400, "prompt must not be empty", "prompt")

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
        req_id: str,
        prompt_ids: list[int],
        request: SamplingFields,
        max_tokens: int,
        arrival: _Arrival,
    ) -> list[Outputs]:
        """Admit one prompt's choices (each an engine request: `req_id`, or `<req_id>-<index>`
        for several) and wait for each one's first output, so refusals get a real status."""
        bad_words = self._bad_words(request.bad_words)
        # Off the event loop: a structured-output request's grammar is built to validate it.
        if request.asks_structured_output:
            params = await self.grammar_pool.run(request.sampling_params, max_tokens, bad_words)
        else:
            params = request.sampling_params(max_tokens, bad_words)
        try:
            params.check_vocab(self.model_config.vocab_size)
        except ValueError as exc:
            named = re.search(r"parameter (\w+)", str(exc))
            raise APIError(400, str(exc), named.group(1) if named else None) from exc
        count = request.num_engine_requests
        # A plain response's client takes nothing before the end: unless the router must read
        # the text as it comes (stop strings), its tokens wait in the stream, not on this loop.
        hold_to_end = not request.stream and not params.stop

        async def start(index: int) -> Outputs:
            # NOTE: one choice keeps the request's id; more are `<id>-<index>` to the engines.
            choice_id = req_id if count == 1 else f"{req_id}-{index}"
            return await self._start_choice(choice_id, prompt_ids, choice_params(params, index),
                                            arrival, hold_to_end)  # fmt: skip

        return await start_all(start, count)

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
