"""The structured-output request fields, shared by `/v1/completions` and `/v1/chat/completions`.

OpenAI's `response_format`, vLLM's `structured_outputs` object and its older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar` (docs/structured_outputs.md). Their shapes
and sizes are bounded here, for the OpenAPI schema (and the fuzzer that generates from it); what
they mean is checked by `common.structured.parse_structured_output`, which turns them into the
one spec the engines compile (a ValueError naming the field, which the caller makes a 400).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.structured.spec import MAX_CHOICES, MAX_SPEC_CHARS, parse_structured_output

MAX_REGEX_CHARS = 4096  # a regex compiles to an automaton per engine: kept small
MAX_CHOICE_CHARS = 1024  # per choice (up to MAX_CHOICES of them)


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`; `json_schema` holds `name`, `schema`, `strict` and
    `description`, checked by the spec parser (a 400 naming `response_format`)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_SPEC_CHARS)]
Choices = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]],
    Field(min_length=1, max_length=MAX_CHOICES),
]
JsonSchema = dict[str, Any] | Annotated[str, Field(max_length=MAX_SPEC_CHARS)]


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` (`StructuredOutputsParams`): one constraint of `json` (a
    schema), `regex`, `choice`, `grammar` (Lark or GBNF), `json_object` or `structural_tag`.
    vLLM's backend switches (`disable_any_whitespace`, ...) are accepted and ignored: the grammar
    engine is llguidance and JSON is always compact."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    json_: JsonSchema | None = Field(default=None, alias="json")
    regex: Annotated[str, Field(min_length=1, max_length=MAX_REGEX_CHARS)] | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | GrammarText | None = None

    def constraints(self) -> dict[str, Any]:
        """The constraint keys as vLLM names them (unset ones as None)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class StructuredOutputFields(BaseModel):
    """At most one of these per request; none means free text."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    response_format: ResponseFormat | None = None
    guided_json: JsonSchema | None = None
    guided_regex: Annotated[str, Field(min_length=1, max_length=MAX_REGEX_CHARS)] | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def asks_structured_output(self) -> bool:
        """Whether any field is set (cheap: nothing parsed; `structured_output` says what)."""
        fields = (self.response_format, self.guided_json, self.guided_regex, self.guided_choice,
                  self.guided_grammar, self.structured_outputs)  # fmt: skip
        return any(f is not None for f in fields)

    def structured_output(self) -> str | None:
        """The canonical spec for the engines, or None for free text. Raises ValueError
        ("invalid sampling parameter <field>: ...") for a malformed or unenforceable request."""
        response_format = (
            None if self.response_format is None
            else self.response_format.model_dump(exclude_none=True)
        )  # fmt: skip
        structured = self.structured_outputs
        return parse_structured_output(
            response_format, self.guided_json, self.guided_regex, self.guided_choice,
            guided_grammar=self.guided_grammar,
            structured_outputs=None if structured is None else structured.constraints(),
        )  # fmt: skip
