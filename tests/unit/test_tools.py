"""Tool calling's parts without a server: the grammar a tool choice compiles to (walked by a real
llguidance matcher over the tiny model's tokenizer), the spec's refusals, the output parser
(whole and streamed deltas, which must agree), and the prompt a template without tools gets."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

import common.structured.spec as spec
from common.structured.grammar import GrammarCompiler
from common.structured.tool_calls import call_text, tool_call_spec
from common.tokenizer import Tokenizer
from services.router.tools import (
    ChatTool,
    NamedToolChoice,
    ToolCallParser,
    ToolPrompt,
    finish_reason,
    tool_spec,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
FUNCTIONS = [("get_weather", WEATHER), ("ping", {})]
CALL = call_text("get_weather", '{"city": "Paris", "days": 3}')
PING = call_text("ping", "{}")


@pytest.fixture(scope="module")
def grammars(tiny_model_path: Path) -> tuple[GrammarCompiler, Tokenizer]:
    tokenizer = Tokenizer(tiny_model_path)
    config = json.loads((tiny_model_path / "config.json").read_text())
    compiler = GrammarCompiler.from_model_folder(
        tiny_model_path, config["vocab_size"], config["eos_token_id"]
    )
    return compiler, tokenizer


def follows(grammars: tuple[GrammarCompiler, Tokenizer], spec_text: str, text: str) -> bool:
    """Whether `text` is a complete output of the grammar (every token taken, EOS allowed)."""
    compiler, tokenizer = grammars
    matcher = compiler.matcher(spec_text)
    return matcher.replay(tokenizer.encode(text, add_special_tokens=False)) and (
        matcher.is_accepting()
    )


@pytest.mark.parametrize(
    "allow_text, parallel, text, ok",
    [
        (True, True, "just words, no call", True),
        (True, True, CALL, True),
        (True, True, "Let me look. " + CALL, True),
        (True, True, CALL + "\n" + PING, True),
        (True, True, CALL + " and more words", False),  # nothing after the calls
        (True, True, "a <tool_call> that is not one", False),  # the tag starts a call
        (True, False, CALL + "\n" + PING, False),  # one call at most
        (False, True, "just words, no call", False),  # required: calls only
        (False, True, "Let me look. " + CALL, False),
        (False, True, PING + "\n" + CALL, True),
        (False, False, PING, True),
        (False, False, PING + "\n" + PING, False),
        (False, True, call_text("get_weather", '{"city": "Paris", "days": 9}'), False),
        (False, True, call_text("get_weather", '{"city": "Paris"}'), False),  # days required
        (False, True, call_text("get_weather", '{"city":"Paris","days":3}'), False),  # style
        (False, True, call_text("nope", "{}"), False),
    ],
)
def test_the_tool_call_grammar_takes_calls_that_validate_and_nothing_else(
    grammars: tuple[GrammarCompiler, Tokenizer], allow_text: bool, parallel: bool, text: str,
    ok: bool,
) -> None:  # fmt: skip
    checked = spec.checked_spec(tool_call_spec(FUNCTIONS, allow_text, parallel), "tools")
    assert follows(grammars, checked, text) is ok


def tools(*functions: tuple[str, dict]) -> list[ChatTool]:
    return [
        ChatTool.model_validate({"type": "function", "function": {"name": n, "parameters": s}})
        for n, s in functions
    ]


def test_a_named_choice_holds_the_output_to_that_function_alone(
    grammars: tuple[GrammarCompiler, Tokenizer],
) -> None:
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "ping"}})
    checked = tool_spec(tools(*FUNCTIONS), named, parallel=False)
    assert follows(grammars, checked, PING)
    assert not follows(grammars, checked, CALL)
    assert not follows(grammars, checked, "words")


def test_a_schema_the_grammar_engine_refuses_names_its_tool() -> None:
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    with pytest.raises(ValueError, match=r"invalid sampling parameter tools: tool 'broken'"):
        tool_spec(tools(("ok", {}), ("broken", bad)), "auto", parallel=True)


def test_tools_whose_grammar_is_past_the_bounds_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each tool alone fits; together they pass the symbol bound the other specs have."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(8)}}
    many = tools(*((f"f{i}", schema) for i in range(12)))
    tool_spec(many[:1], "required", parallel=True)
    monkeypatch.setattr(spec, "MAX_GRAMMAR_SYMBOLS", 400)
    with pytest.raises(ValueError, match="tools: the grammar is too large"):
        tool_spec(many, "required", parallel=True)


def parse_streamed(pieces: list[str]) -> tuple[str, dict[int, dict], list[dict]]:
    """Feed `pieces` one by one: the content, each call rebuilt from its deltas (as a client
    accumulates them), and the deltas as sent."""
    parser = ToolCallParser()
    content, calls, sent = "", {}, []
    for piece in [*pieces, None]:
        text, deltas = parser.feed(piece) if piece is not None else parser.finish()
        content += text
        for delta in deltas:
            wire = delta.model_dump()  # what the chunk carries (None fields left out)
            sent.append(wire)
            call = calls.setdefault(wire["index"], {"arguments": ""})
            call |= {k: wire[k] for k in ("id", "type") if k in wire}
            call |= {k: v for k, v in wire["function"].items() if k == "name"}
            call["arguments"] += wire["function"].get("arguments", "")
    return content, calls, sent


@pytest.mark.parametrize("piece_len", [1, 3, 1000])
def test_streamed_deltas_rebuild_the_calls_the_whole_text_parses_to(piece_len: int) -> None:
    text = "Checking. " + CALL + "\n" + PING
    pieces = [text[i : i + piece_len] for i in range(0, len(text), piece_len)]
    content, calls, sent = parse_streamed(pieces)
    whole = ToolCallParser()
    whole.feed(text)
    whole.finish()
    assert content == whole.content == "Checking. "
    assert [(c.function.name, c.function.arguments) for c in whole.calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}'), ("ping", "{}"),
    ]  # fmt: skip
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in (0, 1)] == [
        (c.function.name, c.function.arguments) for c in whole.calls
    ]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    # OpenAI's shape: a call's first delta carries index, id, type and name (arguments ""), the
    # rest only index and argument fragments.
    firsts = [d for d in sent if "id" in d]
    assert [d["function"] for d in firsts] == [
        {"name": "get_weather", "arguments": ""}, {"name": "ping", "arguments": ""},
    ]  # fmt: skip
    assert all(d["type"] == "function" and d["id"].startswith("call_") for d in firsts)
    rest = [d for d in sent if "id" not in d]
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
               for d in rest)  # fmt: skip


def test_text_that_only_looks_like_a_tag_is_content_once_it_is_not() -> None:
    content, calls, _ = parse_streamed(["a <tool", "_c", "x> b"])
    assert (content, calls) == ("a <tool_cx> b", {})
    parser = ToolCallParser()
    assert parser.feed("a <tool_ca")[0] == "a "  # the possible tag is held back
    assert parser.finish()[0] == "<tool_ca"  # and handed out at the end


def test_a_call_cut_short_keeps_its_arguments_so_far() -> None:
    content, calls, _ = parse_streamed([CALL[:-25]])
    assert content == ""
    assert calls[0]["name"] == "get_weather"
    assert CALL.index(calls[0]["arguments"]) > 0  # a prefix of the arguments, not JSON
    assert finish_reason("length", called=True, named=False) == "length"


def test_finish_reasons_are_openais() -> None:
    assert finish_reason("stop", called=True, named=False) == "tool_calls"
    assert finish_reason("stop", called=True, named=True) == "stop"  # a named tool_choice
    assert finish_reason("stop", called=False, named=False) == "stop"
    assert finish_reason(None, called=True, named=False) is None


QWEN_LIKE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments | tojson }})]"
    "{% endfor %}{% endfor %}"
)
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m['content'] }}{% endfor %}"


def test_a_template_that_reads_tools_gets_them_and_the_history_as_is() -> None:
    given = tools(*FUNCTIONS)
    ping = {"id": "1", "type": "function", "function": {"name": "ping", "arguments": {}}}
    chat = [{"role": "assistant", "content": "", "tool_calls": [ping]}]
    prompt = ToolPrompt(QWEN_LIKE)
    assert prompt.chat(chat, given, "auto") == (
        chat,
        [t.model_dump(exclude_none=True) for t in given],
    )


def test_a_template_without_tools_is_told_them_in_the_format_it_is_held_to() -> None:
    chat = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "1"},
    ]  # fmt: skip
    prompt = ToolPrompt(PLAIN)
    rendered, template_tools = prompt.chat(chat, tools(*FUNCTIONS), "auto")
    assert template_tools is None
    assert rendered[0]["role"] == "system" and "<tools>" in rendered[0]["content"]
    assert '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant", "content": CALL}
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    # tool_choice "none": the history is still text, the tools are not offered.
    rendered, _ = prompt.chat(chat, tools(*FUNCTIONS), "none")
    assert rendered[0] == chat[0]
