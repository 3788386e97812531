"""OpenAI API shapes: request and response models (errors: `api_errors.py`).

The only pydantic in the serving path; everything behind the router takes plain dataclasses
(`SamplingParams`). Requests are strict (`"5"` is not an int, `1` is not a bool) because a
silently coerced parameter is worse than a 400. Unknown fields are ignored, as OpenAI-compatible
servers do, so newer clients keep working, but noted (`unknown_fields`: the router logs them, lists
them back or refuses them, `request_fields.py`); fields we cannot honour are rejected
(`reject_unsupported`, which the router calls), and `sampling_params` turns a request into the
engines' `SamplingParams` (a 400 naming an invalid value).
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

import structlog
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    model_validator,
)

from common.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_INT,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STOP,
    MAX_STOP_LENGTH,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from services.router.api_errors import APIError
from services.router.chat_options import ChatTemplateFields
from services.router.logprobs_format import ChatLogprobs, CompletionLogprobs, PromptLogprobs
from services.router.request_fields import unknown_names
from services.router.structured_fields import StructuredOutputFields
from services.router.tools import (
    DeltaToolCall,
    ToolCall,
    ToolCallIn,
    ToolChoice,
    Tools,
    active,
    check_tools,
    tool_spec,
)

log = structlog.get_logger(__name__)

# Every bound below is one the engines enforce too (`SamplingParams`): a value the API accepts
# always reaches an engine intact (integers fit the wire, lists are bounded).
TokenId = Annotated[int, Field(ge=0, lt=MAX_INT)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MAX_CHOICES = 128  # n and best_of
# A chat with more messages is refused before each one is validated (validation runs on the event
# loop, which every stream waits on); a chat this long is past any context the router serves.
MAX_MESSAGES = 16384
MAX_PROMPTS = 256  # prompts in one batched completions request (each takes n engine requests)
MAX_BAD_WORD_CHARS = 256


class _Request(BaseModel):
    # NaN and infinities are not numbers a sampler can use (Python's JSON parser accepts them).
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk (with include_usage)


class SamplingFields(_Request, StructuredOutputFields):
    """Parameters shared by completions and chat; the vLLM extras (`top_k`, `ignore_eos`, ...) too,
    and structured outputs (`response_format`, `guided_*`: `structured_fields.py`).

    Ranges are checked here so the error names the field; `SamplingParams` re-checks inside.
    """

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, lt=MAX_INT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, lt=MAX_INT)
    seed: int | None = Field(default=None, ge=0, lt=MAX_SEED)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, lt=MAX_INT)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # vLLM's extras
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                Annotated[float, Field(ge=-100, le=100)],
            ],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    user: str | None = Field(default=None, max_length=256)
    # vLLM's extras (docs/serving.md has what each does here).
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    allowed_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None
    ) = None
    bad_words: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]],
            Field(max_length=MAX_BAD_WORDS // 2),  # a word may make two token sequences
        ]
        | None
    ) = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, lt=MAX_INT)
    priority: int = Field(default=0, gt=-MAX_INT, lt=MAX_INT)  # lower: served first
    return_tokens_as_token_ids: bool = False
    _unknown_fields: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _note_unknown_fields(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        model = handler(data)
        if isinstance(model, SamplingFields):
            model._unknown_fields = unknown_names(type(model), data)
        return model

    @property
    def unknown_fields(self) -> tuple[str, ...]:
        """The body's top-level keys this API does not read (ignored unless `strict_fields`)."""
        return self._unknown_fields

    def reject_unsupported(self) -> None:
        """A 400 for fields we cannot honour (rather than silently ignoring them), or that
        contradict each other."""

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk (vLLM: `include_usage` and `continuous_usage_stats`)."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    @property
    def num_engine_requests(self) -> int:
        """How many engine requests the choices take (`best_of` for completions)."""
        return self.n

    def logprobs_wanted(self) -> tuple[int | None, int | None]:
        """(top logprobs per output token, per prompt token); None: not asked."""
        return None, self.prompt_logprobs

    def sampling_params(
        self, max_tokens: int, bad_words: tuple[tuple[int, ...], ...] = ()
    ) -> SamplingParams:
        """The engine's parameters; an invalid value is a 400 naming it."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if not self.top_k else self.top_k,  # 0 and -1 both mean off
                seed=self.seed,
                stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0
                if self.repetition_penalty is None
                else self.repetition_penalty,
                min_p=self.min_p or 0.0,
                logit_bias=tuple(sorted((int(t), b) for t, b in (self.logit_bias or {}).items())),
                logprobs=self.logprobs_wanted()[0],
                prompt_logprobs=self.logprobs_wanted()[1],
                structured_output=self.structured_output(),
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                allowed_token_ids=tuple(self.allowed_token_ids or ()),
                bad_words=bad_words,
                priority=self.priority,
            )
        except ValueError as exc:
            match = re.search(r"parameter (\w+)", str(exc))
            raise APIError(400, str(exc), match.group(1) if match else None) from exc


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`. The prompt is text or token ids, or a list of several (a batch:
    choice `i * n + j` is prompt i's choice j, as OpenAI numbers them)."""

    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, "best_of must be greater than or equal to n", "best_of")
        if self.stream and self.num_engine_requests > self.n:
            raise APIError(400, "best_of > n cannot be streamed", "best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")

    @property
    def num_engine_requests(self) -> int:
        return self.best_of or self.n

    def logprobs_wanted(self) -> tuple[int | None, int | None]:
        # best_of ranks its candidates by cumulative logprob: each one computes its tokens'.
        ranked = self.num_engine_requests > self.n
        output = 0 if ranked and self.logprobs is None else self.logprobs
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs)
                  if k is not None]  # fmt: skip
        return output, max(wanted, default=None)


class ChatContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ChatContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's past calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        # OpenAI's rule: only an assistant's turn that made tool calls may go without content.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


def _few_enough(messages: Any) -> Any:
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise ValueError(f"a chat holds at most {MAX_MESSAGES} messages, not {len(messages)}")
    return messages


# Counted before any message is validated (pydantic's own max_length counts after).
Messages = Annotated[list[ChatMessage], BeforeValidator(_few_enough), Field(min_length=1)]


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """`POST /v1/chat/completions`. `max_completion_tokens` is OpenAI's newer `max_tokens`."""

    messages: Messages
    max_completion_tokens: int | None = Field(default=None, ge=1, lt=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    # ---- tool calling (services/router/tools.py) ----
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True

    @property
    def asks_structured_output(self) -> bool:
        return super().asks_structured_output or active(self.tools, self.tool_choice)

    def structured_output(self) -> str | None:
        if self.tools and active(self.tools, self.tool_choice):
            return tool_spec(self.tools, self.tool_choice, self.parallel_tool_calls)
        return super().structured_output()

    # ---- end of tool calling ----

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "logprobs")
        check_tools(self.tools, self.tool_choice, super().asks_structured_output)

    def logprobs_wanted(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, num_prompt_tokens: int, num_output_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_output_tokens,
            total_tokens=num_prompt_tokens + num_output_tokens,
        )


def unix_now() -> int:
    """Whole seconds since the epoch, as the API's `created` fields carry them."""
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for


class CompletionResponse(BaseModel):
    """A non-streamed completion, and (with `object` unchanged) each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_now)
    owned_by: str = "phasemesh"
    root: str
    max_model_len: int
    vocab_size: int  # a PhaseMesh extension: the id range of token-id prompts (load generators)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
