"""Tool calls as a grammar: a chat's functions and its tool choice -> the grammar engines enforce.

Calls are written in the hermes format (Hermes 2/3, Qwen 2.5/3 and others write it; the default
for a chat template that writes none):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several calls one per block, a newline between blocks. The arguments are generated under the
function's `parameters` JSON schema, so they always validate (unless `max_tokens` cuts them).
`tool_call_spec` builds the structured-output spec (type `tool_calls`) the router validates and
the engines compile; `tool_call_grammar` turns it into llguidance's Lark:

- `text: true` (`tool_choice: "auto"`): free text, or text then calls. The text before the first
  `<tool_call>` is a lazy lexeme that ends at that tag, so once the model writes the tag it is in
  a call; text after the last call is not allowed (EOS only).
- `text: false` (`"required"`, or a named function: the spec then holds that function alone):
  calls only.
- `parallel: false`: exactly one call; true: one or more.
"""

from __future__ import annotations

import json
import re
from typing import Any

CALL_TAG = "<tool_call>"
CALL_END = "\n</tool_call>"
CALL_SEPARATOR = "\n"
ARGUMENTS_KEY = "arguments"
# OpenAI's rule for a function's name; it also keeps names out of the grammar's string escapes.
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# The JSON separators of the call and of its arguments: Python's `json.dumps` defaults, as chat
# templates render past calls (`tojson`). No other whitespace: a model cannot pad forever.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_head(name: str) -> str:
    """A call's text up to its arguments (the tag, the object's opening and the name)."""
    return f'{CALL_TAG}\n{{"name": {json.dumps(name)}, "{ARGUMENTS_KEY}": '


def call_text(name: str, arguments: str) -> str:
    """A whole call as the model writes it (history rendered for a template without tools)."""
    return f"{call_head(name)}{arguments}}}{CALL_END}"


def tool_call_spec(
    functions: list[tuple[str, dict[str, Any]]], allow_text: bool, parallel: bool
) -> dict[str, Any]:
    """The spec (before `canonical`) for calls of `functions` ((name, parameters schema))."""
    return {
        "type": "tool_calls",
        "functions": [{"name": name, "parameters": schema} for name, schema in functions],
        "text": allow_text,
        "parallel": parallel,
    }


def arguments_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """The schema arguments are generated under: the function's `parameters`, always an object
    (OpenAI's arguments are one), in the call's JSON style."""
    return {"type": "object", **parameters, "x-guidance": _JSON_STYLE}


def tool_call_grammar(spec: dict[str, Any]) -> str:
    """llguidance's Lark for a `tool_calls` spec (module docstring)."""
    bodies = []
    rules = []
    for i, function in enumerate(spec["functions"]):
        head = call_head(function["name"])[len(CALL_TAG) :]
        schema = json.dumps(arguments_schema(function["parameters"]), ensure_ascii=False)
        rules.append(f"body_{i}: {_lark(head)} %json {schema} {_lark('}' + CALL_END)}")
        bodies.append(f"body_{i}")
    more = f" ({_lark(CALL_SEPARATOR + CALL_TAG)} body)*" if spec["parallel"] else ""
    if spec["text"]:
        start = ["start: TEXT | head calls", f"head[lazy]: TEXT {_lark(CALL_TAG)}"]
    else:
        start = [f"start: {_lark(CALL_TAG)} calls"]
    return "\n".join([
        "%llguidance {}",
        *start,
        f"calls: body{more}",
        f"body: {' | '.join(bodies)}",
        *rules,
        r"TEXT: /(.|\n)*/",
    ])  # fmt: skip


def _lark(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)
