"""Tool calling on `/v1/chat/completions`: OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls` (docs/structured_outputs.md, "Tool calls").

- **Request**: the tools' shapes (`ChatTool`, `NamedToolChoice`) and their checks
  (`check_tools`: names, duplicates, a choice naming no tool, a choice without tools; 400s naming
  the field), and the grammar spec (`tool_spec`, built on the router's grammar pool: a schema
  llguidance cannot enforce, or a grammar past the bounds, is a 400 naming `tools`).
- **Prompt**: `ToolPrompt` hands the tools to the chat template when it reads them; a template
  that does not gets them in a system message in the hermes format it is then held to, and its
  history's calls and results as hermes text (a template that reads neither would drop them).
- **Output**: `ToolCallParser` reads a choice's text as it streams: text before the first call
  is content, each call becomes OpenAI's `tool_calls` entry (streamed as deltas: the first with
  its index, id, type and name, then its arguments in string fragments). The non-streamed
  response reads the whole text with the same parser, so both agree.

What goes wrong, and where: bad tools or choices are 400s before tokenizing (the schemas' compile
on the grammar pool, like any structured output); an engine that dies mid-call is the stream's
error like any other (the router re-runs the request from its tokens, and the grammar replays);
`max_tokens` can cut a call short: its arguments so far are returned, with `finish_reason:
"length"`, as OpenAI does.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import jinja2.meta
import llguidance
from pydantic import BaseModel, ConfigDict, Field

from common.chat_template import compile_template
from common.request_ids import random_hex
from common.structured.spec import MAX_SPEC_CHARS, checked_spec, grammar_error
from common.structured.tool_calls import (
    ARGUMENTS_KEY,
    CALL_END,
    CALL_SEPARATOR,
    CALL_TAG,
    FUNCTION_NAME,
    arguments_schema,
    call_text,
    tool_call_spec,
)
from services.router.api_errors import APIError

MAX_TOOLS = 128  # one grammar alternative each; the grammar's own bounds apply on top


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; the schema is always enforced whole


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = list[ChatTool]


class FunctionCallIn(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    """A past call in an assistant message of the chat's history."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


# ---- the response's shapes (OpenAI's) ----


def _none(value: Any) -> bool:
    return value is None


def _sparse() -> Any:
    """A field left out of the JSON when None (OpenAI's deltas carry only what they change)."""
    return Field(default=None, exclude_if=_none)


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = _sparse()
    arguments: str | None = _sparse()


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = _sparse()
    type: Literal["function"] | None = _sparse()
    function: DeltaFunctionCall


def new_call_id() -> str:
    return f"call_{random_hex(24)}"


# ---- the request ----


def active(tools: Tools | None, tool_choice: ToolChoice | None) -> bool:
    """Whether the output is held to tool calls (text allowed or not): tools, and a choice
    other than "none" (OpenAI's default with tools is "auto")."""
    return bool(tools) and tool_choice != "none"


def check_tools(tools: Tools | None, tool_choice: ToolChoice | None, has_format: bool) -> None:
    """The cheap checks (no schema compiled): a 400 naming the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice is only allowed when tools are given", "tool_choice")
        return
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools may be given, not {len(tools)}", "tools")
    names = [tool.function.name for tool in tools]
    for name in names:
        if not FUNCTION_NAME.match(name):
            raise APIError(400, f"tool name {name[:64]!r} must match ^[A-Za-z0-9_-]{{1,64}}$",
                           "tools")  # fmt: skip
    if len(set(names)) < len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise APIError(400, f"tool {twice!r} is defined more than once", "tools")
    for tool in tools:
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise APIError(400, f"tool {tool.function.name!r}: parameters must be a JSON schema "
                           f"of type object, not {str(kind)[:64]!r}", "tools")  # fmt: skip
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise APIError(400, f"tool_choice names {tool_choice.function.name[:64]!r}, which is "
                       "not one of the tools", "tool_choice")  # fmt: skip
    if has_format and active(tools, tool_choice):
        raise APIError(400, "tools (with a tool_choice other than none) cannot be combined with "
                       "response_format or guided_* fields", "tool_choice")  # fmt: skip


def tool_spec(tools: Tools, tool_choice: ToolChoice | None, parallel: bool) -> str:
    """The checked spec the engines enforce (tools active). Raises `ValueError("invalid sampling
    parameter tools: ...")` for a schema the grammar engine refuses or one past its bounds."""
    functions = [(t.function.name, t.function.parameters or {}) for t in tools]
    if isinstance(tool_choice, NamedToolChoice):
        functions = [f for f in functions if f[0] == tool_choice.function.name]
    allow_text = tool_choice in (None, "auto")
    for name, schema in functions:  # each alone first: the error names the function
        if len(json.dumps(schema)) > MAX_SPEC_CHARS:
            raise ValueError(f"invalid sampling parameter tools: tool {name!r}: the schema must "
                             f"be at most {MAX_SPEC_CHARS} characters of JSON")  # fmt: skip
        grammar = llguidance.LLMatcher.grammar_from_json_schema(arguments_schema(schema))
        if error := grammar_error(grammar):
            raise ValueError(f"invalid sampling parameter tools: tool {name!r}: {error}")
    return checked_spec(tool_call_spec(functions, allow_text, parallel), "tools")


def _template_arguments(arguments: str) -> Any:
    """A past call's arguments as templates read them: the JSON object (vLLM's and
    transformers' convention), or the string if it is not JSON."""
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):  # not JSON, or nested past the parser's stack
        return arguments


def template_tool_calls(calls: list[ToolCallIn]) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": c.type,
         "function": {"name": c.function.name,
                      "arguments": _template_arguments(c.function.arguments)}}
        for c in calls
    ]  # fmt: skip


_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class ToolPrompt:
    """How a chat with tools reaches one model's chat template (module docstring)."""

    def __init__(self, template: str) -> None:
        names = jinja2.meta.find_undeclared_variables(compile_template(template).environment
                                                      .parse(template))  # fmt: skip
        self.reads_tools = "tools" in names
        self.reads_calls = "tool_calls" in template

    def chat(
        self, chat: list[dict[str, Any]], tools: Tools | None, tool_choice: ToolChoice | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and the template's `tools` for a chat request."""
        given = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
        if not self.reads_calls and any(m["role"] == "tool" or "tool_calls" in m for m in chat):
            chat = [self._as_text(message) for message in chat]
        if self.reads_tools:
            return chat, given
        if given and active(tools, tool_choice):
            chat = _with_system(chat, _TOOLS_PROMPT.format(tools="\n".join(
                json.dumps(tool, ensure_ascii=False) for tool in given)))  # fmt: skip
        return chat, None

    @staticmethod
    def _as_text(message: dict[str, Any]) -> dict[str, Any]:
        """A past call or a tool's result as the hermes text a model would have read."""
        if message["role"] == "tool":
            return {"role": "user", "content": f"<tool_response>\n{message['content']}\n"
                                               "</tool_response>"}  # fmt: skip
        calls = message.get("tool_calls")
        if not calls:
            return message
        texts = [message["content"]] if message["content"] else []
        for call in calls:
            arguments = call["function"]["arguments"]
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            texts.append(call_text(call["function"]["name"], arguments))
        return {"role": message["role"], "content": "\n".join(texts)}


def _with_system(chat: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if chat and chat[0]["role"] == "system":
        return [chat[0] | {"content": f"{chat[0]['content']}\n\n{text}"}, *chat[1:]]
    return [{"role": "system", "content": text}, *chat]


# ---- the output ----

_HEAD = re.compile(
    re.escape(CALL_TAG) + r'\n\{"name": "([A-Za-z0-9_-]{1,64})", "' + ARGUMENTS_KEY + '": '
)
_CLOSE = "}" + CALL_END
_NEXT = CALL_SEPARATOR + CALL_TAG


class ToolCallParser:
    """One choice's text -> content and tool calls, fed as it streams (module docstring).

    `feed(text)` returns what the text adds: a content delta and tool-call deltas; `finish()`
    what is left at the end. `content` and `calls` hold the whole so far."""

    def __init__(self) -> None:
        self.content = ""
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._state: Literal["text", "head", "arguments", "close", "next"] = "text"
        self._depth = 0  # the arguments' JSON nesting, strings skipped
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        self._buffer += text
        content: list[str] = []
        deltas: list[DeltaToolCall] = []
        while self._step(content, deltas):
            pass
        self.content += "".join(content)
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """The rest: held-back text (a partial tag) is content; a partial call is dropped
        (its arguments so far were already handed out)."""
        rest = self._buffer if self._state in ("text", "head") and not self.calls else ""
        self._buffer = ""
        self.content += rest
        return rest, []

    def _step(self, content: list[str], deltas: list[DeltaToolCall]) -> bool:
        """One move of the state machine; False when it needs more text."""
        buffer = self._buffer
        if self._state == "text":
            at = buffer.find(CALL_TAG)
            if at < 0:  # hand out all but a tail that may be the tag's start
                keep = _partial_suffix(buffer, CALL_TAG)
                content.append(buffer[: len(buffer) - keep])
                self._buffer = buffer[len(buffer) - keep :]
                return False
            content.append(buffer[:at])
            self._buffer, self._state = buffer[at:], "head"
            return True
        if self._state == "head":
            match = _HEAD.match(buffer)
            if match is None:
                return False
            call = ToolCall(id=new_call_id(), function=FunctionCall(name=match[1], arguments=""))
            self.calls.append(call)
            deltas.append(DeltaToolCall(index=len(self.calls) - 1, id=call.id, type="function",
                                        function=DeltaFunctionCall(name=call.function.name,
                                                                   arguments="")))  # fmt: skip
            self._buffer, self._state = buffer[match.end() :], "arguments"
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        if self._state == "arguments":
            end = self._scan(buffer)
            if end:
                self._add_arguments(buffer[:end], deltas)
                self._buffer = buffer[end:]
            return self._state != "arguments" and bool(self._buffer)
        expected = _CLOSE if self._state == "close" else _NEXT
        if not buffer.startswith(expected):
            return False
        self._buffer = buffer[len(expected) :]
        self._state = "next" if self._state == "close" else "head"
        if self._state == "head":
            self._buffer = CALL_TAG + self._buffer
        return True

    def _scan(self, buffer: str) -> int:
        """How much of `buffer` belongs to the arguments (all of it until the object closes);
        moves to "close" when it does."""
        for i, char in enumerate(buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "close"
                    return i + 1
        return len(buffer)

    def _add_arguments(self, text: str, deltas: list[DeltaToolCall]) -> None:
        call = self.calls[-1]
        call.function.arguments += text
        index = len(self.calls) - 1
        if deltas and deltas[-1].index == index and deltas[-1].id is None:
            # this feed's fragment of the same call grows (a call's first delta stays apart)
            last = deltas[-1].function
            last.arguments = (last.arguments or "") + text
            return
        deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=text)))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def finish_reason(engine_reason: str | None, called: bool, named: bool) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (not for a named tool_choice, whose
    finish is "stop"); a call cut by max_tokens stays "length"."""
    if engine_reason is None or engine_reason == "length" or not called or named:
        return engine_reason
    return "tool_calls"
