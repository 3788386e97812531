"""vLLM's current request fields over HTTP, single-process topology (the real FastAPI app and a
real `InProcessEngineClient`): `structured_outputs` and `guided_grammar`, unknown fields (logged
once, listed back, refused under `strict_fields`), the cheap extras each against its vLLM
meaning, `X-Request-Id` and batched completion prompts. Greedy text is checked against a
separate `LLMEngine`."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
import structlog

from common.engine.core import LLMEngine
from common.engine.request import OutputText
from common.protocol import TokenOutput
from common.sampling_params import SamplingParams
from services.app_args import AppArgs
from services.router.cluster_scheduler import NoKvRoom
from services.router.kv_queue import KvWaitQueue
from services.router.request_fields import IGNORED_FIELDS_HEADER
from services.router.server import Router
from services.router.streams import AdmissionLimits
from services.router.token_text import StreamedText
from tests.unit.test_openai_api import (
    MODEL,
    call,
    greedy_text,
    post,
    router_with,
    serving_router,
    sse_events,
)


@pytest.fixture(scope="module")
def router(tiny_model_path: Path) -> Iterator[Router]:
    yield from serving_router(tiny_model_path)


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> LLMEngine:
    return LLMEngine.from_path(tiny_model_path, num_blocks=128)


def complete(router: Router, **fields) -> dict:
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 24, "seed": 3} | fields
    response = post(router, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def greedy_ids(reference: LLMEngine, prompt_ids: list[int], n: int) -> list[int]:
    [ids] = reference.generate([prompt_ids], SamplingParams(max_tokens=n, temperature=0.0))
    return ids


# ---- structured outputs ----


def test_structured_outputs_each_constraint(router: Router) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    text = complete(router, structured_outputs={"json": schema}, max_tokens=60)
    choice = text["choices"][0]
    if choice["finish_reason"] == "stop":  # random weights may run out of budget mid-number
        jsonschema.validate(json.loads(choice["text"]), schema)
    else:
        assert choice["text"].startswith('{"a":')
    text = complete(router, structured_outputs={"regex": "[xy]{3}-[0-9]{2}"})["choices"][0]
    assert re.fullmatch("[xy]{3}-[0-9]{2}", text["text"])
    choices = ["red", "green", "blue"]
    assert complete(router, structured_outputs={"choice": choices})["choices"][0]["text"] in choices
    lark = 'start: "ok " NUM\nNUM: /[0-9]{2}/'
    assert re.fullmatch("ok [0-9]{2}", complete(router, structured_outputs={"grammar": lark})[
        "choices"][0]["text"])  # fmt: skip
    gbnf = 'root ::= "go" [a-c]+ "!"'
    assert re.fullmatch("go[a-c]+!", complete(router, guided_grammar=gbnf)["choices"][0]["text"])
    structured = {"json_object": True, "disable_any_whitespace": True}  # vLLM's switch: ignored
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 30,
            "structured_outputs": structured}  # fmt: skip
    content = post(router, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert content["content"].startswith("{")
    tag = {"structures": [{"begin": "<f=a>", "schema": {"type": "integer"}, "end": "</f>"}],
           "triggers": ["<f="]}  # fmt: skip
    text = complete(router, structured_outputs={"structural_tag": json.dumps(tag)}, max_tokens=8)
    assert text["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"structured_outputs": {"regex": "a+", "choice": ["b"]}}, "structured_outputs",
         ["structured_outputs.regex", "structured_outputs.choice"]),
        ({"guided_grammar": "start: x", "structured_outputs": {"json": {}}}, "guided_grammar",
         ["guided_grammar", "structured_outputs.json"]),
        ({"structured_outputs": {"grammar": "start: (((("}}, "structured_outputs", ["grammar"]),
        ({"structured_outputs": {"structural_tag": {"structures": []}}}, "structured_outputs",
         ["structural tag"]),
        # The grammar's mask and a token list could leave no token at all (found by the fuzzer).
        ({"guided_choice": ["0"], "allowed_token_ids": [5]}, "allowed_token_ids", ["structured"]),
        ({"structured_outputs": {"regex": "a"}, "bad_words": ["b"]}, "bad_words", ["structured"]),
    ],
)  # fmt: skip
def test_structured_outputs_conflicts_and_bad_grammars_are_400s(
    router: Router, fields: dict, param: str, words: list[str]
) -> None:
    response = post(router, "/v1/completions", {"model": MODEL, "prompt": "x"} | fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert all(w in error["message"] for w in words), error["message"]


# ---- unknown fields ----


def test_unknown_fields_are_logged_once_and_listed_back(router: Router) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "no_such_field": 1, "zz_other": 2}
    with structlog.testing.capture_logs() as logs:
        first = post(router, "/v1/completions", body)
        again = post(router, "/v1/completions", body)
    assert first.status_code == again.status_code == 200
    assert first.headers[IGNORED_FIELDS_HEADER] == "no_such_field, zz_other"
    assert again.headers[IGNORED_FIELDS_HEADER] == "no_such_field, zz_other"
    logged = [e for e in logs if e["event"] == "request fields ignored"]
    assert len(logged) == 1 and logged[0]["fields"] == "no_such_field, zz_other"
    known = post(router, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert IGNORED_FIELDS_HEADER not in known.headers


def test_strict_fields_refuses_unknown_fields(tiny_model_path: Path) -> None:
    assert AppArgs.model_validate({"strict_fields": True}).strict_fields
    assert not AppArgs().strict_fields
    with router_with(tiny_model_path, strict_fields=True) as strict:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        response = post(strict, "/v1/chat/completions", body | {"guided_typo": "a+"})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "guided_typo" and "guided_typo" in error["message"]
        assert post(strict, "/v1/chat/completions", body).status_code == 200


# ---- the cheap extras ----


def test_include_stop_str_in_output(router: Router, reference: LLMEngine) -> None:
    ids = router.tokenizer.encode("The stop test")
    plain = greedy_text(reference, ids, 12)
    stop = plain[4:7]  # a stop string the greedy text holds
    cut = plain[: plain.index(stop)]
    for include, expected in ((False, cut), (True, cut + stop)):
        text = complete(router, prompt=ids, max_tokens=12, temperature=0, stop=[stop],
                        include_stop_str_in_output=include)["choices"][0]  # fmt: skip
        assert (text["text"], text["finish_reason"]) == (expected, "stop")
    # The mesh's router makes the text from streamed ids: the same rule there.
    tokens = greedy_ids(reference, ids, 12)
    msg = TokenOutput("r", tokens, "length", len(ids))
    for include, expected in ((False, cut), (True, cut + stop)):
        streamed = StreamedText("r", len(ids), OutputText([stop], include), router.tokenizer)
        assert "".join(o.new_text for o in streamed.on_tokens(msg)) == expected


def test_allowed_token_ids_skip_special_tokens_and_token_id_logprobs(router: Router) -> None:
    bos = router.tokenizer.token_to_id(router.tokenizer.bos_token)
    assert bos is not None
    allowed = [bos, 40, 41]
    fields = {"prompt": "hi", "max_tokens": 12, "allowed_token_ids": allowed, "logprobs": 1,
              "return_tokens_as_token_ids": True, "seed": 5}  # fmt: skip
    skipped = complete(router, **fields)["choices"][0]
    kept = complete(router, **fields, skip_special_tokens=False)["choices"][0]
    tokens = skipped["logprobs"]["tokens"]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens)
    ids = [int(t.split(":")[1]) for t in tokens]
    assert set(ids) <= set(allowed) and len(ids) == 12
    assert kept["logprobs"]["tokens"] == tokens  # same seed, same tokens
    assert skipped["text"] == router.tokenizer.decode(ids, skip_special_tokens=True)
    assert kept["text"] == router.tokenizer.decode(ids, skip_special_tokens=False)
    # Only the special token allowed: vLLM's default drops it from the text, False keeps it.
    only_bos = {"prompt": "hi", "max_tokens": 3, "allowed_token_ids": [bos], "ignore_eos": True}
    assert complete(router, **only_bos)["choices"][0]["text"] == ""
    kept_bos = complete(router, **only_bos, skip_special_tokens=False)["choices"][0]["text"]
    assert kept_bos == router.tokenizer.bos_token * 3


def test_bad_words_ban_their_token_sequences(router: Router, reference: LLMEngine) -> None:
    ids = router.tokenizer.encode("Tell me more")
    plain = greedy_ids(reference, ids, 16)
    word = router.tokenizer.decode(plain[:2]).strip()
    banned = router._bad_words([word])
    assert banned and all(seq for seq in banned)
    text = complete(router, prompt=ids, max_tokens=16, temperature=0, bad_words=[word],
                    logprobs=0, return_tokens_as_token_ids=True)["choices"][0]  # fmt: skip
    out = [int(t.split(":")[1]) for t in text["logprobs"]["tokens"]]
    for seq in banned:
        windows = [tuple(out[i : i + len(seq)]) for i in range(len(out) - len(seq) + 1)]
        assert seq not in windows
    assert out != plain


def test_continuous_usage_stats(router: Router) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        body = body | {
            "model": MODEL,
            "max_tokens": 6,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        events = [json.loads(e) for e in sse_events(post(router, path, body))[:-1]]
        usages = [e["usage"] for e in events]
        assert all(u is not None for u in usages)
        completion = [u["completion_tokens"] for u in usages]
        assert completion == sorted(completion) and completion[-1] == 6
        assert len({u["prompt_tokens"] for u in usages}) == 1


def test_prompt_logprobs(router: Router) -> None:
    ids = router.tokenizer.encode("Count the prompt")
    echoed = complete(router, prompt=ids, max_tokens=1, echo=True, logprobs=2)["choices"][0]
    choice = complete(router, prompt=ids, max_tokens=1, prompt_logprobs=2)["choices"][0]
    shaped = choice["prompt_logprobs"]
    assert len(shaped) == len(ids) and shaped[0] is None
    for token_id, entries, echo_lp in zip(
        ids[1:], shaped[1:], echoed["logprobs"]["token_logprobs"][1:], strict=False
    ):
        own = entries[str(token_id)]
        assert own["logprob"] == pytest.approx(echo_lp, abs=1e-4) and own["rank"] >= 1
        top = sorted((e for k, e in entries.items() if e["rank"] <= 2), key=lambda e: e["rank"])
        assert top[0]["rank"] == 1 and top[0]["logprob"] >= own["logprob"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "prompt_logprobs": 0}  # fmt: skip
    chat = post(router, "/v1/chat/completions", body).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_logprobs"])


def test_truncate_prompt_tokens_keeps_the_last_tokens(router: Router, reference: LLMEngine) -> None:
    ids = router.tokenizer.encode("one two three four five six seven")
    text = complete(router, prompt=ids, max_tokens=5, temperature=0, truncate_prompt_tokens=4)
    assert text["usage"]["prompt_tokens"] == 4
    assert text["choices"][0]["text"] == greedy_text(reference, ids[-4:], 5)
    whole = complete(router, prompt=ids, max_tokens=5, temperature=0, truncate_prompt_tokens=-1)
    assert whole["usage"]["prompt_tokens"] == len(ids)


def test_priority_orders_the_kv_wait_queue() -> None:
    free = [0]
    placed: list[str] = []

    def place(name: str):
        def attempt() -> str:
            if free[0] <= 0:
                raise NoKvRoom(80, 0, ever=True)
            free[0] -= 1
            placed.append(name)
            return name

        return attempt

    async def scenario() -> None:
        queue = KvWaitQueue(lambda: AdmissionLimits(kv_wait_s=10), retry_s=0.001)
        tasks = [asyncio.ensure_future(queue.admit(place("late"), lambda: None, priority=5))]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.ensure_future(queue.admit(place("urgent"), lambda: None, -1)))
        tasks.append(asyncio.ensure_future(queue.admit(place("plain"), lambda: None)))
        await asyncio.sleep(0.01)
        free[0] = 3
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert placed == ["urgent", "plain", "late"]


def test_priority_orders_the_engines_prompts(tiny_model_path: Path) -> None:
    """An engine prefills the waiting prompt of the lowest priority first (FCFS within one): a
    batch holds one prompt here, so the order of first tokens is the order of prefills."""
    assert SamplingParams.from_spec(SamplingParams(priority=-3).to_spec()).priority == -3
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=64, max_num_batched_tokens=40)
    for k, (name, priority) in enumerate((("first", 0), ("late", 5), ("urgent", -1),
                                          ("second", 0))):  # fmt: skip
        params = SamplingParams(max_tokens=1, temperature=0.0, priority=priority)
        engine.add_request(name, list(range(5 + 40 * k, 35 + 40 * k)), params)  # no shared prefix
    order = [out.req_id for _ in range(4) for out in engine.step()]
    assert order == ["urgent", "first", "second", "late"]


def test_request_id_header_is_the_id_and_echoed(router: Router) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}

    async def both(_: object, http: httpx.AsyncClient) -> list[httpx.Response]:
        headers = {"X-Request-Id": "client-42"}
        plain = http.post("/v1/completions", json=body, headers=headers)
        streamed = http.post("/v1/completions", json=body | {"stream": True}, headers=headers)
        return list(await asyncio.gather(plain, streamed))  # the same id at once: both served

    plain, streamed = call(router, both)
    assert plain.json()["id"] == "cmpl-client-42"
    assert plain.headers["X-Request-Id"] == streamed.headers["X-Request-Id"] == "client-42"
    assert json.loads(sse_events(streamed)[0])["id"] == "cmpl-client-42"
    bad = call(router, lambda _, http: http.post("/v1/completions", json=body,
                                                 headers={"X-Request-Id": "a b"}))  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


# ---- batched prompts ----


def test_batched_prompts_index_choices_as_openai(router: Router, reference: LLMEngine) -> None:
    prompts = ["first prompt", "the second one"]
    ids = [router.tokenizer.encode(p) for p in prompts]
    for prompt in (prompts, ids):
        text = complete(router, prompt=prompt, n=2, max_tokens=4, temperature=0)
        choices = text["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        for k, c in enumerate(choices):
            assert c["text"] == greedy_text(reference, ids[k // 2], 4)
        assert text["usage"]["prompt_tokens"] == sum(map(len, ids))
        assert text["usage"]["completion_tokens"] == 16
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "temperature": 0, "stream": True,
            "echo": True}  # fmt: skip
    texts: dict[int, str] = {}
    for event in sse_events(post(router, "/v1/completions", body))[:-1]:
        for c in json.loads(event)["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    for i in range(len(prompts)):
        assert texts[i] == router.tokenizer.decode(ids[i]) + greedy_text(reference, ids[i], 3)
