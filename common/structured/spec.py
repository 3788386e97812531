"""Structured-output requests -> one canonical spec string, and that spec -> an llguidance grammar.

A request asks for structure through OpenAI's `response_format`, vLLM's current
`structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`,
`structural_tag`) or its older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`
extras. `parse_structured_output` checks them (one constraint at most) and returns the spec:
compact, key-sorted JSON such as `{"schema":{...},"type":"json_schema"}`. The spec is what crosses
the wire and what keys the compiled-grammar cache, so two requests that ask for the same thing
share one compiled grammar whatever their key order. A chat's tool calls are
one more spec type, `tool_calls` (built in `tool_calls.py`, checked by `checked_spec`).

Validation compiles the grammar without a tokenizer: a schema that llguidance cannot enforce (an
unknown type, a bad pattern, an unimplemented keyword such as `not`) is rejected here, as a
`ValueError` naming the parameter, rather than failing the request inside an engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance

from common.structured.tool_calls import tool_call_grammar

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict only the stubs define

# A spec is compiled per engine and kept in a cache: bounded, so one request cannot make every
# engine build (and hold) an arbitrarily large grammar.
MAX_SPEC_CHARS = 64 * 1024
# What a grammar may cost, in llguidance's own deterministic units (not wall-clock, which varies
# with the machine and its load): the symbols of its productions, and the fuel spent building its
# lexer's regexes, which is the part of compiling that grows fastest. Both grow with each engine's
# compile time and per-token mask work; the spec's size alone does not bound them (an alternation
# or a counted repetition is short and costly). Past either, the router answers a 400 naming it.
MAX_GRAMMAR_SYMBOLS = 4096
MAX_LEXER_FUEL = 50_000
MAX_CHOICES = 256
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
# Compact JSON: "," and ":" with no whitespace around them. Flexible whitespace would let a model
# spend its whole token budget on spaces between two keys.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# Rust regex-syntax's meta characters (what `regex::escape` escapes).
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def parse_structured_output(
    response_format: dict[str, Any] | None = None,
    guided_json: dict[str, Any] | str | None = None,
    guided_regex: str | None = None,
    guided_choice: Sequence[str] | None = None,
    *,
    guided_grammar: str | None = None,
    structured_outputs: dict[str, Any] | None = None,
) -> str | None:
    """The canonical spec for a request's structure, or None for free text.

    `response_format` is OpenAI's: `{"type": "text" | "json_object"}` or `{"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}` (or vLLM's `{"type":
    "structural_tag", "structures", "triggers"}`). `structured_outputs` is vLLM's
    `StructuredOutputsParams` (its constraint keys; `json_object` counts when true). Raises
    `ValueError("invalid sampling parameter <name>: ...")` for a malformed or unenforceable
    request, or for two constraints at once (naming both)."""
    given: list[tuple[str, str, Any]] = [  # (parameter, kind, value)
        (name, kind, value)
        for name, kind, value in (
            ("response_format", "response_format", response_format),
            ("guided_json", "json", guided_json),
            ("guided_regex", "regex", guided_regex),
            ("guided_choice", "choice", guided_choice),
            ("guided_grammar", "grammar", guided_grammar),
        )  # fmt: skip
        if value is not None
    ]
    for kind, value in (structured_outputs or {}).items():
        if kind in _CONSTRAINTS and value is not None and value is not False:
            given.append((f"structured_outputs.{kind}", kind, value))
    if len(given) > 1:
        names = ", ".join(name for name, _, _ in given)
        raise _invalid(given[0][0], f"only one structured-output constraint at a time: {names}")
    if not given:
        return None
    name, kind, value = given[0]
    spec = _spec_of(name, kind, value)
    if spec is None:
        return None
    return checked_spec(spec, name)


def checked_spec(spec: dict[str, Any], name: str) -> str:
    """`spec` as canonical JSON once its grammar is known to compile within the bounds; else
    `ValueError("invalid sampling parameter <name>: ...")`."""
    text = canonical(spec)
    if len(text) > MAX_SPEC_CHARS:
        raise _invalid(name, f"must be at most {MAX_SPEC_CHARS} characters of JSON")
    try:
        grammar = grammar_for_spec(text)
    except (ValueError, AssertionError, TypeError) as exc:  # llguidance's own helpers' checks
        raise _invalid(name, _first_lines(str(exc) or type(exc).__name__)) from None
    error = grammar_error(grammar)
    if error:
        raise _invalid(name, error)
    return text


def grammar_error(grammar: str) -> str:
    """Why llguidance refuses `grammar` (or finds it past the bounds), in short; "" if it is
    fine."""
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=_limits())
    return error and (_too_costly(error) or _first_lines(error))


# `structured_outputs`' constraint keys (vLLM's `StructuredOutputsParams`).
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _spec_of(name: str, kind: str, value: Any) -> dict[str, Any] | None:
    """One constraint's spec (None: free text); a ValueError naming `name` if malformed."""
    if kind == "response_format":
        return _from_response_format(value)
    if kind == "json":
        return {"type": "json_schema", "schema": _load_schema(value, name)}
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise _invalid(name, "must be a non-empty string")
        return {"type": kind, "pattern" if kind == "regex" else "grammar": value}
    if kind == "choice":
        return {"type": "choice", "choices": _check_choices(value, name)}
    if kind == "json_object":
        if value is not True:
            raise _invalid(name, "must be a boolean")
        return {"type": "json_object"}
    return _structural_tag(value, name)


def canonical(spec: dict[str, Any]) -> str:
    """Compact, key-sorted JSON: equal specs are equal strings."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def grammar_for_spec(spec: str) -> str:
    """The llguidance grammar (its JSON form) that enforces a canonical spec."""
    fields = json.loads(spec)
    kind = fields["type"]
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS)
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(fields["schema"], _JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(fields["pattern"])
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("|".join(map(_escape, fields["choices"])))
    if kind == "tool_calls":
        return llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(fields))
    if kind == "grammar":  # Lark, or GBNF (which llguidance converts to Lark)
        return llguidance.grammar_from("grammar", fields["grammar"])
    if kind == "structural_tag":
        tags = [
            llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end)
            for trigger, begin, schema, end in fields["tags"]
        ]
        return llguidance.StructTag.to_grammar(tags)
    raise ValueError(f"unknown structured-output spec type {kind!r}")


def _from_response_format(response_format: Any) -> dict[str, Any] | None:
    if not isinstance(response_format, dict):
        raise _invalid("response_format", "must be an object with a type")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "structural_tag":
        return _structural_tag(response_format, "response_format")
    if kind != "json_schema":
        raise _invalid(
            "response_format", "type must be text, json_object, json_schema or structural_tag"
        )
    body = response_format.get("json_schema")
    if not isinstance(body, dict):
        raise _invalid("response_format", "json_schema must be an object with a name and schema")
    name = body.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise _invalid("response_format", "json_schema.name must match ^[A-Za-z0-9_-]{1,64}$")
    if not isinstance(body.get("strict", False), bool | None):
        raise _invalid("response_format", "json_schema.strict must be a boolean")
    # NOTE: `strict` changes nothing here: the grammar always enforces the whole schema, and a
    # schema with keywords it cannot enforce is rejected either way.
    return {
        "type": "json_schema",
        "schema": _load_schema(body.get("schema", {}), "response_format"),
    }


def _load_schema(schema: Any, name: str) -> dict[str, Any] | bool:
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise _invalid(name, f"must be at most {MAX_SPEC_CHARS} characters of JSON")
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise _invalid(name, f"the schema is not JSON ({exc.msg})") from None
    if not isinstance(schema, dict | bool):
        raise _invalid(name, "the schema must be a JSON object")
    return schema


def _structural_tag(value: Any, name: str) -> dict[str, Any]:
    """vLLM's structural tag (a JSON object, or its text): `structures` of `{begin, schema, end}`
    and `triggers`; free text until a trigger, then the structure whose `begin` starts with it,
    its arguments under its schema, then its `end`. Each structure becomes one llguidance
    `StructTag` (trigger, begin, schema, end)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _invalid(name, f"the structural tag is not JSON ({exc.msg})") from None
    structures = value.get("structures") if isinstance(value, dict) else None
    triggers = value.get("triggers") if isinstance(value, dict) else None
    if not (isinstance(structures, list) and structures and isinstance(triggers, list)
            and all(isinstance(t, str) and t for t in triggers)):  # fmt: skip
        raise _invalid(name, "a structural tag needs structures and non-empty trigger strings")
    tags: list[list[Any]] = []
    for structure in structures:
        if not isinstance(structure, dict):
            raise _invalid(name, "each structure must be an object with begin, schema and end")
        begin, end = structure.get("begin"), structure.get("end", "")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise _invalid(name, "a structure's begin and end must be strings")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise _invalid(name, f"no trigger starts the structure {begin[:40]!r}")
        tags.append([trigger, begin, _load_schema(structure.get("schema", {}), name), end])
    return {"type": "structural_tag", "tags": tags}


def _check_choices(choices: Any, name: str = "guided_choice") -> list[str]:
    ok = (
        isinstance(choices, list | tuple)
        and 0 < len(choices) <= MAX_CHOICES
        and all(isinstance(c, str) and c for c in choices)
    )
    if not ok:
        raise _invalid(name, f"must be 1 to {MAX_CHOICES} non-empty strings")
    return list(choices)


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _limits() -> llguidance.LLParserLimits:
    # Read at each call, so a test can lower the module's bounds.
    return llguidance.LLParserLimits(
        max_grammar_size=MAX_GRAMMAR_SYMBOLS, initial_lexer_fuel=MAX_LEXER_FUEL
    )


def _too_costly(error: str) -> str:
    """The limit a grammar is past, in words, or "" for any other error."""
    if "grammar size" in error and "too big" in error:
        return f"the grammar is too large: over the limit of {MAX_GRAMMAR_SYMBOLS} grammar symbols"
    if "initial lexer" in error and "too big" in error:
        return (
            f"the grammar's lexer is too costly to build: over the limit of {MAX_LEXER_FUEL} "
            "units of lexer fuel"
        )
    return ""


def _first_lines(error: str, limit: int = 300) -> str:
    """llguidance's message without its grammar dump, short enough for an error body."""
    text = " ".join(line.strip() for line in error.strip().splitlines()[:3])
    return text[:limit]


def _invalid(name: str, why: str) -> ValueError:
    return ValueError(f"invalid sampling parameter {name}: {why}")
