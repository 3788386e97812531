"""Tool calling over HTTP, single-process topology: the official `openai` client against the real
FastAPI app and a real `InProcessEngineClient` on the tiny (random) model. The grammar holds even
random weights to calls whose arguments validate; refusals are 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from services.router.server import Router
from tests.unit.test_openai_api import MODEL, call, post, serving_router
from tests.unit.test_tools import WEATHER

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "ping": {"type": "object"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def router(tiny_model_path: Path) -> Iterator[Router]:
    yield from serving_router(tiny_model_path)


def create(router: Router, **fields) -> openai.types.chat.ChatCompletion:
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 120} | fields
    return call(router, lambda client, _: client.chat.completions.create(**body))


def streamed(router: Router, **fields) -> tuple[dict[int, dict], list[str | None]]:
    """Each choice's calls rebuilt from the stream's deltas, and the choices' finish reasons."""
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 120} | fields

    async def run(client: openai.AsyncOpenAI, _) -> list:
        return [chunk async for chunk in await client.chat.completions.create(**body, stream=True)]

    calls: dict[int, dict] = {}
    reasons: list[str | None] = []
    for chunk in call(router, run):
        for choice in chunk.choices:
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(choice.index * 100 + delta.index, {"arguments": ""})
                if delta.id:
                    assert delta.type == "function" and delta.function.arguments == ""
                    entry |= {"id": delta.id, "name": delta.function.name}
                else:
                    assert delta.function.name is None
                entry["arguments"] += delta.function.arguments or ""
    return calls, reasons


def check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_required_and_named_choices_return_calls_that_validate(
    router: Router, tool_choice: str | dict
) -> None:
    response = create(router, tool_choice=tool_choice, seed=5)
    choice = response.choices[0]
    assert choice.message.content is None
    assert choice.finish_reason == ("stop" if tool_choice == NAMED else "tool_calls")
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    check_calls(calls)
    if tool_choice == NAMED:
        assert [name for name, _ in calls] == ["get_weather"]
    # Streamed, the same seed: the same calls, rebuilt from OpenAI-shaped deltas.
    deltas, reasons = streamed(router, tool_choice=tool_choice, seed=5)
    assert [(c["name"], c["arguments"]) for c in deltas.values()] == calls
    assert reasons == [choice.finish_reason]


def test_parallel_tool_calls_false_is_one_call_per_choice(router: Router) -> None:
    response = create(router, tool_choice="required", parallel_tool_calls=False, n=3, seed=7)
    for choice in response.choices:
        assert len(choice.message.tool_calls) == 1
        check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])
    calls, reasons = streamed(router, tool_choice="required", parallel_tool_calls=False, n=2,
                              seed=7)  # fmt: skip
    assert sorted(calls) == [0, 100] and reasons == ["tool_calls", "tool_calls"]


def test_auto_text_is_content_and_none_never_calls(router: Router) -> None:
    """Random weights write text, not the tag (`test_tools.py` walks auto's calls)."""
    for tool_choice in ("auto", "none"):
        choice = create(router, tool_choice=tool_choice, max_tokens=12, seed=3).choices[0]
        assert choice.message.tool_calls is None
        assert choice.message.content and "<tool_call>" not in choice.message.content
        assert choice.finish_reason == "length"


def test_a_history_of_calls_and_results_is_served(router: Router) -> None:
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]  # fmt: skip
    choice = create(router, messages=messages, tool_choice="required", seed=1).choices[0]
    check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])


def test_tokenize_counts_the_prompt_a_chat_with_tools_runs(router: Router) -> None:
    counts = {}
    for tool_choice in ("required", "none"):
        usage = create(router, tool_choice=tool_choice, max_tokens=1).usage
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice}
        counts[tool_choice] = post(router, "/tokenize", body).json()["count"]
        assert counts[tool_choice] == usage.prompt_tokens
    # The tiny template reads no tools: they are offered in a system message, unless "none".
    assert counts["required"] > counts["none"]


def bad(name: str = "get_weather", parameters: object = None) -> list[dict]:
    function = {"name": name} | ({} if parameters is None else {"parameters": parameters})
    return [{"type": "function", "function": function}]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": bad(parameters={"type": "object", "properties": {"a": {"type": "x"}}})},
         "tools"),
        ({"tools": bad(parameters={"type": "string"})}, "tools"),
        ({"tools": bad(name="has space")}, "tools"),
        ({"tools": bad() + bad()}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
        ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [{"id": "1",
          "function": {"name": "ping", "arguments": '{"a": "\\ud800"}'}}]}]},
         "messages"),  # a past call's arguments, not Unicode
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(
    router: Router, fields: dict, param: str
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 8} | fields
    response = post(router, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param), response.text  # a path in it


def test_tool_choice_none_with_response_format_is_served(router: Router) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none",
            "max_tokens": 8, "response_format": {"type": "json_object"}}  # fmt: skip
    assert post(router, "/v1/chat/completions", body).status_code == 200
