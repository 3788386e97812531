"""The router's HTTP surface without Ray: the real FastAPI app and a real `InProcessEngineClient`.

Requests go through httpx's ASGI transport (and the official `openai` client on top of it);
the disconnect test serves the app with uvicorn on a real socket. Greedy outputs are checked
against a separate `LLMEngine` on the same model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from secrets import token_hex
from typing import Any, TypeVar

import httpx
import openai
import pytest
import uvicorn

from common.engine.core import LLMEngine
from common.sampling_params import SamplingParams
from common.transport.zmq_auth import CurveKeys
from services.router.engine_client import InProcessEngineClient
from services.router.server import Router
from services.router.streams import AdmissionLimits

MODEL = "tiny"
T = TypeVar("T")
Call = Callable[[openai.AsyncOpenAI, httpx.AsyncClient], Awaitable[T]]


def make_router(model_path: Path, limits: AdmissionLimits | None = None) -> Router:
    engine = LLMEngine.from_path(model_path, num_blocks=512)
    return Router(InProcessEngineClient(engine, limits), model_path, MODEL)


def serving_router(model_path: Path) -> Iterator[Router]:
    """A module's router over an in-process engine, shut down when the module is done."""
    router = make_router(model_path)
    yield router
    router.client.shutdown()  # type: ignore[attr-defined]


@contextlib.contextmanager
def router_with(model_path: Path, **options: Any) -> Iterator[Router]:
    """A router of its own, with `options` (api_key, max_body_bytes, ...), shut down after."""
    engine = LLMEngine.from_path(model_path, num_blocks=64)
    router = Router(InProcessEngineClient(engine), model_path, MODEL, **options)
    try:
        yield router
    finally:
        router.client.shutdown()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def router(tiny_model_path: Path) -> Iterator[Router]:
    yield from serving_router(tiny_model_path)


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> LLMEngine:
    return LLMEngine.from_path(tiny_model_path, num_blocks=256)


def call(router: Router, fn: Call[T]) -> T:
    """Run `fn` with an openai client and a raw httpx client, both wired to the app in-process."""

    async def main() -> T:
        transport = httpx.ASGITransport(app=router.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            client = openai.AsyncOpenAI(
                base_url="http://router/v1", api_key="unused", max_retries=0, http_client=http
            )
            return await fn(client, http)

    return asyncio.run(main())


def post(router: Router, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return call(router, lambda _, http: http.post(path, content=content, headers=headers))


def greedy_text(reference: LLMEngine, prompt_ids: list[int], n: int) -> str:
    [ids] = reference.generate([prompt_ids], SamplingParams(max_tokens=n, temperature=0.0))
    assert reference.tokenizer is not None
    return reference.tokenizer.decode(ids)


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing on the way."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == "", "every event ends with a blank line"
    assert all(b.startswith("data: ") for b in blocks[:-1])
    return [b[len("data: ") :] for b in blocks[:-1]]


# ---- outputs ----


@pytest.mark.parametrize("form", ["text", "ids", "list_of_text", "list_of_ids"])
def test_every_prompt_form_gives_the_engine_output(
    router: Router, reference: LLMEngine, form: str
) -> None:
    text = "Hello there, general"
    ids = router.tokenizer.encode(text)
    prompt = {"text": text, "ids": ids, "list_of_text": [text], "list_of_ids": [ids]}[form]
    expected = greedy_text(reference, ids, 10)
    response = call(
        router,
        lambda c, _: c.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0),
    )
    assert response.choices[0].text == expected
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 10)


def test_chat_uses_the_chat_template(router: Router, reference: LLMEngine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = greedy_text(reference, router.tokenizer.apply_chat_template(messages), 6)
    response = call(
        router,
        lambda c, _: c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0
        ),
    )
    assert response.choices[0].message.content == expected
    assert response.usage is not None and response.usage.completion_tokens == 6


# ---- SSE ----


@pytest.mark.parametrize("include_usage", [True, False])
def test_completion_stream_format(router: Router, include_usage: bool) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 7}
    body |= {"temperature": 0, "ignore_eos": True}
    whole = post(router, "/v1/completions", body).json()
    stream_body = body | {"stream": True, "stream_options": {"include_usage": include_usage}}
    events = sse_events(post(router, "/v1/completions", stream_body))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    token_chunks = [c for c in chunks if c["choices"]]
    # A chunk per generated token, unless several reached the router together (one chunk then).
    assert 1 <= len(token_chunks) <= 7
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == whole["choices"][0]["text"]
    reasons = [c["choices"][0]["finish_reason"] for c in token_chunks]
    assert reasons == [None] * (len(reasons) - 1) + ["length"]
    usage_chunks = [c for c in chunks if c["usage"]]
    if include_usage:
        assert usage_chunks == [chunks[-1]] and chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == whole["usage"]
    else:
        assert usage_chunks == []


def test_chat_stream_format(router: Router) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
    body |= {"temperature": 0, "stream": True}
    events = sse_events(post(router, "/v1/chat/completions", body))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["delta"]["role"] is None for c in chunks[1:])


# ---- sampling extras ----


def test_stop_string_ends_the_text_before_it(router: Router) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": [20, 21, 22], "max_tokens": 30}
    body |= {"temperature": 0, "ignore_eos": True}
    full = post(router, "/v1/completions", body).json()["choices"][0]["text"]
    stop = next(full[i : i + 3] for i in range(5, 20) if "\ufffd" not in full[i : i + 3])
    for stream in (False, True):
        response = post(router, "/v1/completions", body | {"stop": [stop], "stream": stream})
        if stream:
            chunks = [json.loads(e) for e in sse_events(response)[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            choice = response.json()["choices"][0]
            text, reason = choice["text"], choice["finish_reason"]
        assert (text, reason) == (full[: full.index(stop)], "stop")


def test_seed_makes_sampling_reproducible(router: Router) -> None:
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 12, "temperature": 1.0, "seed": 7}
    texts = [post(router, "/v1/completions", body).json()["choices"][0]["text"] for _ in range(2)]
    assert texts[0] == texts[1]


def test_min_tokens_and_ignore_eos_force_the_length(router: Router) -> None:
    body = {"model": MODEL, "prompt": [3], "max_tokens": 25, "min_tokens": 25, "top_k": 5}
    usage = post(router, "/v1/completions", body | {"ignore_eos": True}).json()["usage"]
    assert usage["completion_tokens"] == 25


# ---- errors ----

COMPLETION_ERRORS = [
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": "5"}, 400, "max_tokens"),
    ({"max_tokens": 4.5}, 400, "max_tokens"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_k": -2}, 400, "top_k"),
    ({"seed": -1}, 400, "seed"),
    # Integers msgpack cannot carry to the engines are refused at the edge, not after admission.
    ({"seed": 2**64}, 400, "seed"),
    ({"top_k": 2**64}, 400, "top_k"),
    ({"stop_token_ids": [2**64]}, 400, "stop_token_ids.0"),
    ({"min_tokens": 10, "max_tokens": 5}, 400, "min_tokens"),
    ({"stop": [""]}, 400, "stop"),
    ({"stream": "yes"}, 400, "stream"),
    ({"ignore_eos": 1}, 400, "ignore_eos"),
    ({"stream_options": {"include_usage": "no"}}, 400, "stream_options.include_usage"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [2048]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": ["a"] * 257}, 400, "prompt"),  # a batch of at most 256 prompts
    ({"prompt": ["a", [5]]}, 400, "prompt"),  # a batch is all text or all token ids
    # vLLM's extras, out of range
    ({"truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 5000}, 400, "truncate_prompt_tokens"),
    ({"prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"allowed_token_ids": [2048]}, 400, "allowed_token_ids"),  # past the vocabulary
    ({"allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"bad_words": [""]}, 400, "bad_words.0"),
    ({"priority": 2**31}, 400, "priority"),
    ({"skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ({"prompt": None}, 400, "prompt"),
    ({"prompt": [5] * 4096}, 400, "prompt"),
    ({"prompt": [5] * 4000, "max_tokens": 97}, 400, "max_tokens"),
    ({"n": 0}, 400, "n"),
    ({"n": 3, "best_of": 2}, 400, "best_of"),
    ({"best_of": 2, "stream": True}, 400, "best_of"),
    ({"suffix": "x"}, 400, "suffix"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"presence_penalty": -2.5}, 400, "presence_penalty"),
    ({"repetition_penalty": 0.0}, 400, "repetition_penalty"),
    ({"min_p": 1.5}, 400, "min_p"),
    ({"logit_bias": {"2048": 1.0}}, 400, "logit_bias"),  # past the tiny model's vocabulary
    ({"logit_bias": {"5": 100.5}}, 400, "logit_bias.5"),
    ({"logit_bias": {str(i): 1.0 for i in range(301)}}, 400, "logit_bias"),
    ({"model": "gpt-4"}, 404, "model"),
    # Edge values: not numbers, oversized lists, text that is not Unicode (JSON can carry a lone
    # surrogate), an echo of such text in the error itself.
    ({"temperature": float("nan")}, 400, "temperature"),
    ({"top_p": float("inf")}, 400, "top_p"),
    ({"frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ({"stop": ["x"] * 17}, 400, "stop"),
    ({"stop": "x" * 1025}, 400, "stop"),
    ({"stop_token_ids": [1] * 1025}, 400, "stop_token_ids"),
    ({"prompt": "\ud800 hi"}, 400, "prompt"),
    ({"stop": ["\udfff"]}, 400, "stop"),
    ({"model": "\ud800"}, 404, "model"),
]


@pytest.mark.parametrize(("change", "status", "param"), COMPLETION_ERRORS)
def test_bad_completion_requests(router: Router, change: dict, status: int, param: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4} | change
    response = post(router, "/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, status)
    assert error["type"] in ("BadRequestError", "NotFoundError") and error["message"]


CHAT_ERRORS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"tools": [{"type": "function"}]}, "tools.0"),  # a tool without its function
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ({"top_logprobs": 2}, "logprobs"),
]


@pytest.mark.parametrize(("change", "param"), CHAT_ERRORS)
def test_bad_chat_requests(router: Router, change: dict, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} | change
    response = post(router, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("content", [b"{not json", b"", b'"a string"', b"[1, 2]"])
def test_malformed_bodies_are_400(router: Router, content: bytes) -> None:
    response = post(router, "/v1/completions", content)
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_openai_client_sees_typed_errors(router: Router) -> None:
    async def bad(client: openai.AsyncOpenAI, _: httpx.AsyncClient) -> list[Exception]:
        errors: list[Exception] = []
        for kwargs in ({"model": "nope"}, {"max_tokens": -1}):
            try:
                await client.completions.create(**({"model": MODEL, "prompt": "x"} | kwargs))
            except openai.APIStatusError as exc:
                errors.append(exc)
        return errors

    not_found, bad_request = call(router, bad)
    assert isinstance(not_found, openai.NotFoundError)
    assert isinstance(bad_request, openai.BadRequestError)
    assert bad_request.body["param"] == "max_tokens"  # type: ignore[index]


def test_api_key_guards_everything_but_health(tiny_model_path: Path) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}

    async def scenario(_: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            response = await http.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"]["type"] == "AuthenticationError"
        assert (await http.get("/v1/models")).status_code == 401
        assert (await http.get("/stats")).status_code == 401
        assert (await http.get("/health")).status_code == 200  # probes carry no key
        good = {"Authorization": "Bearer sekret"}
        response = await http.post("/v1/completions", json=body, headers=good)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
        client = openai.AsyncOpenAI(base_url="http://router/v1", api_key="sekret",
                                    http_client=http, max_retries=0)  # fmt: skip
        assert [m.id for m in (await client.models.list()).data] == [MODEL]

    with router_with(tiny_model_path, api_key="sekret") as router:
        call(router, scenario)


def test_oversized_bodies_are_413_declared_or_streamed(tiny_model_path: Path) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * 2000}).encode()

    async def chunks() -> Any:  # no Content-Length: the limit must count what arrives
        for i in range(0, len(big), 256):
            yield big[i : i + 256]

    async def scenario(_: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
        for content in (big, chunks()):
            response = await http.post("/v1/completions", content=content,
                                       headers={"Content-Type": "application/json"})  # fmt: skip
            assert response.status_code == 413
            assert response.json()["error"]["type"] == "RequestTooLargeError"
        small = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert (await http.post("/v1/completions", json=small)).status_code == 200

    with router_with(tiny_model_path, max_body_bytes=1024) as router:
        call(router, scenario)


def test_max_model_len_caps_the_context(tiny_model_path: Path) -> None:
    with router_with(tiny_model_path, max_model_len=32) as router:
        too_long = post(router, "/v1/completions", {"prompt": [5] * 30, "max_tokens": 3})
        assert too_long.json()["error"]["param"] == "max_tokens"
        response = post(router, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        usage = response.json()["usage"]  # no max_tokens: the rest of the 32-token context
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= 32
        models = call(router, lambda _, h: h.get("/v1/models")).json()
        assert models["data"][0]["max_model_len"] == 32


def test_openapi_documents_every_error_status(router: Router) -> None:
    schema = call(router, lambda _, h: h.get("/openapi.json")).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "429", "503"}
        error = responses["400"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "422" not in json.dumps(schema["paths"])


def test_unknown_route_and_method_get_error_bodies(router: Router) -> None:
    assert call(router, lambda _, h: h.get("/v1/nothing")).json()["error"]["code"] == 404
    assert call(router, lambda _, h: h.get("/v1/completions")).json()["error"]["code"] == 405


# ---- admission, health, stats ----


def test_overload_is_429_and_clears(tiny_model_path: Path) -> None:
    router = make_router(tiny_model_path, AdmissionLimits(max_num_requests=1))
    long_body = {"model": MODEL, "prompt": [7], "max_tokens": 300, "ignore_eos": True}

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
        first = asyncio.create_task(http.post("/v1/completions", json=long_body))
        while router.client.stats().num_requests == 0:
            await asyncio.sleep(0.01)  # until the long request is admitted
        with pytest.raises(openai.RateLimitError) as info:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body["code"] == 429  # type: ignore[index]
        assert (await first).json()["usage"]["completion_tokens"] == 300
        again = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert again.usage is not None and again.usage.completion_tokens == 2

    try:
        call(router, scenario)
    finally:
        router.client.shutdown()  # type: ignore[attr-defined]


def test_health_models_and_idle_stats(router: Router) -> None:
    assert call(router, lambda _, h: h.get("/health")).status_code == 200
    models = call(router, lambda c, _: c.models.list())
    assert [(m.id, m.max_model_len) for m in models.data] == [(MODEL, 4096)]  # type: ignore[attr-defined]
    stats = call(router, lambda _, h: h.get("/stats")).json()
    assert stats["kv_blocks_used"] == 0 and stats["num_requests"] == 0


@pytest.fixture
def live_server(router: Router) -> Iterator[str]:
    """The app on a real socket (uvicorn in a thread): the only way to see a real disconnect."""
    server = uvicorn.Server(
        uvicorn.Config(router.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_client_disconnect_aborts_and_frees_kv(router: Router, live_server: str) -> None:
    body = {"model": MODEL, "prompt": [9] * 50, "max_tokens": 3000, "ignore_eos": True}
    with httpx.Client(base_url=live_server, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
            data_lines = (line for line in response.iter_lines() if line.startswith("data:"))
            for _ in range(5):
                next(data_lines)
            assert router.client.stats().kv_blocks_used > 0
    deadline = time.monotonic() + 10
    while router.client.stats().num_engine_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = router.client.stats()
    assert (stats.num_engine_requests, stats.kv_blocks_used, stats.num_requests) == (0, 0, 0)


def test_generate_closed_early_aborts_in_the_engine(router: Router) -> None:
    async def scenario() -> None:
        outputs = router.client.generate("early-close", [4, 5, 6], SamplingParams(max_tokens=500))
        await anext(outputs)
        await outputs.aclose()

    asyncio.run(scenario())
    deadline = time.monotonic() + 10
    while router.client.stats().num_engine_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert router.client.stats().kv_blocks_used == 0


def test_no_ready_engine_is_503_with_retry_after(tiny_model_path: Path) -> None:
    # A mesh whose registry lists nothing ready (engines restarting): a client can act on it.
    from services.router.mesh_client import MeshEngineClient

    client = MeshEngineClient(
        tiny_model_path, lambda: [], auth=CurveKeys.from_mesh_key(token_hex(16)), refresh_s=60
    )
    try:
        router = Router(client, tiny_model_path, MODEL)
        response = post(router, "/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert response.status_code == 503
        assert int(response.headers["Retry-After"]) >= 1
        error = response.json()["error"]
        assert error["code"] == 503 and "No engine is ready" in error["message"]
        assert call(router, lambda _, http: http.get("/health")).status_code == 503
    finally:
        client.shutdown()


def test_models_do_not_reveal_where_the_model_lies(router: Router) -> None:
    card = call(router, lambda _, h: h.get("/v1/models")).json()["data"][0]
    assert card["root"] == card["id"] == MODEL
    assert card["vocab_size"] == router.model_config.vocab_size  # what token-id prompts may use
    assert str(router.model_path) not in json.dumps(card)


def test_an_engine_whose_cache_holds_less_than_the_model_caps_the_context(
    tiny_model_path: Path,
) -> None:
    """`topology: local` with a small KV cache: the API's context is what the cache holds, so a
    request without `max_tokens` runs to that length and ends "length" (before: preempted forever,
    then a 500), and a prompt beyond it is a 400."""
    with router_with(tiny_model_path) as router:  # 64 blocks of 16: 1,024 tokens

        async def fn(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
            models = (await http.get("/v1/models")).json()
            assert models["data"][0]["max_model_len"] == 1024
            out = await client.chat.completions.create(  # chat: no max_tokens fills the context
                model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert out.choices[0].finish_reason == "length"
            assert out.usage is not None and out.usage.total_tokens == 1024
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(model=MODEL, prompt=[5] * 1100, max_tokens=1)

        call(router, fn)
