"""Structured outputs over HTTP, single-process topology: `response_format` and vLLM's `guided_*`
through the real FastAPI app and a real `InProcessEngineClient`; outputs checked with `json`,
`jsonschema` and `re`, refusals as 400s naming the field."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

import common.structured.grammar as grammar_module
import common.structured.spec as spec
from common.tokenizer import Tokenizer
from services.router.engine_client import ENGINE_THREAD_NAME
from services.router.server import Router
from tests.unit.json_schemas import SCHEMAS, json_ending_bias
from tests.unit.test_openai_api import MODEL, post, serving_router


@pytest.fixture(scope="module")
def router(tiny_model_path: Path) -> Iterator[Router]:
    yield from serving_router(tiny_model_path)


@pytest.fixture(scope="module")
def ending_bias(tiny_model_path: Path) -> dict[str, float]:
    eos = json.loads((tiny_model_path / "config.json").read_text())["eos_token_id"]
    bias = json_ending_bias(Tokenizer(tiny_model_path), eos)
    return {str(token_id): b for token_id, b in bias.items()}


def chat(router: Router, **fields) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "JSON please"}]}
    response = post(router, "/v1/chat/completions", body | {"max_tokens": 200} | fields)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_chat_json_schema_and_json_object(router: Router, ending_bias: dict) -> None:
    schema = SCHEMAS["nested_object"]
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    choice = chat(router, response_format=response_format, logit_bias=ending_bias, seed=1)
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    choice = chat(router, response_format={"type": "json_object"}, logit_bias=ending_bias)
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_completions_guided_regex_choice_and_json(router: Router, ending_bias: dict) -> None:
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 64, "seed": 2}
    text = post(router, "/v1/completions", body | {"guided_regex": "[a-c]{2,5}-[0-9]{3}"}).json()
    assert re.fullmatch("[a-c]{2,5}-[0-9]{3}", text["choices"][0]["text"])
    choices = ["yes", "no", "maybe so"]
    text = post(router, "/v1/completions", body | {"guided_choice": choices}).json()
    assert text["choices"][0]["text"] in choices
    schema = SCHEMAS["string_pattern"]
    fields = {"guided_json": json.dumps(schema), "logit_bias": ending_bias}
    text = post(router, "/v1/completions", body | fields).json()
    jsonschema.validate(json.loads(text["choices"][0]["text"]), schema)


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                }
            },
            "response_format",
        ),  # fmt: skip
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
        ({"guided_choice": ["a"], "min_tokens": 1}, "min_tokens"),
    ],
)
def test_bad_structured_requests_are_400s_naming_the_field(
    router: Router, fields: dict, param: str
) -> None:
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 8} | fields
    response = post(router, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def many_properties(n: int) -> dict:
    """A schema of `n` patterned string properties: well under the spec's size limit, past the
    grammar's symbol limit when `n` is in the hundreds."""
    props = {f"f{i}": {"type": "string", "pattern": "^[a-z]{2,9}$"} for i in range(n)}
    return {"type": "object", "properties": props, "additionalProperties": False}


def test_a_grammar_past_the_size_limit_is_a_400_naming_it(router: Router) -> None:
    schema = many_properties(600)
    assert len(json.dumps(schema)) < spec.MAX_SPEC_CHARS
    response_format = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 8}
    response = post(router, "/v1/completions", body | {"response_format": response_format})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format"
    assert f"limit of {spec.MAX_GRAMMAR_SYMBOLS} grammar symbols" in error["message"]
    # A schema of the same kind, smaller, is served.
    small = {"type": "json_schema", "json_schema": {"name": "ok", "schema": many_properties(3)}}
    response = post(router, "/v1/completions", body | {"response_format": small})
    assert response.status_code == 200, response.text


def test_a_grammar_past_the_lexer_limit_is_a_400_naming_it(
    router: Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short regex whose lexer is costly to build (a wide alternation): the spec's size does
    not bound it, the lexer fuel does."""
    monkeypatch.setattr(spec, "MAX_LEXER_FUEL", 1000, raising=False)
    regex = "(" + "|".join(f"w{i}[a-z]{{{i % 9 + 1},40}}" for i in range(200)) + ")+"
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 8, "guided_regex": regex}
    response = post(router, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_regex"
    assert "limit of 1000 units of lexer fuel" in error["message"]


def test_the_in_process_engine_thread_never_compiles_a_grammar(
    router: Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spec new to the engine compiles on its grammars' pool while the request waits; the
    engine thread, which steps every other request, only builds the matcher."""
    compiled_on: list[str] = []
    build = grammar_module.grammar_for_spec

    def recording(spec_text: str) -> str:
        compiled_on.append(threading.current_thread().name)
        return build(spec_text)

    monkeypatch.setattr(grammar_module, "grammar_for_spec", recording)
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 8, "seed": 4}
    response = post(router, "/v1/completions", body | {"guided_regex": "[d-f]{2,6}-[0-9]{4}z"})
    assert response.status_code == 200, response.text
    assert compiled_on and ENGINE_THREAD_NAME not in compiled_on
