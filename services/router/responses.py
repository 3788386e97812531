"""OpenAI response bodies from the choices' outputs: whole responses and streamed chunks.

`CompletionShapes` and `ChatShapes` hold what a request's bodies share (id, model, which
logprobs it asked for) and build the response from every choice's `Collected` output, or the
chunks from the choices' merged stream (each chunk names its choice's `index`). Usage counts the
prompt once and sums the completion tokens of the choices returned. A stream's chunks share one
`created` (as OpenAI's do); those with text only (no logprobs, no per-chunk usage) are written from
a `ChunkTemplate` instead of a model each.

A batched completions request (several prompts) has `n` choices per prompt: choice `i * n + j`
is prompt i's choice j (OpenAI's numbering), and usage counts each prompt once. With vLLM's
`continuous_usage_stats` every chunk carries its choice's usage so far.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from pydantic import BaseModel

from common.engine.request import RequestOutput
from common.protocol import TokenLogprobs
from services.router.choices import Collected
from services.router.chunk_json import ChunkTemplate
from services.router.logprobs_format import (
    ChatLogprobs,
    CompletionLogprobs,
    LogprobsFormatter,
    PromptLogprobs,
    TokenIdLogprobsFormatter,
)
from services.router.openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
    unix_now,
)
from services.router.tools import NamedToolChoice, ToolCallParser, active, finish_reason

Merged = AsyncGenerator[tuple[int, RequestOutput], None]
# A chunk: its model, or (text only) its JSON already written.
Chunks = AsyncGenerator[BaseModel | bytes, None]


def usage(num_prompt_tokens: int, lasts: list[RequestOutput]) -> UsageInfo:
    return UsageInfo.of(num_prompt_tokens, sum(out.num_output_tokens for out in lasts))


def formatter_for(formatter: LogprobsFormatter, token_ids: bool) -> LogprobsFormatter:
    """The request's logprobs formatter: tokens as `token_id:<id>` with vLLM's
    `return_tokens_as_token_ids`."""
    return TokenIdLogprobsFormatter(formatter.tokenizer) if token_ids else formatter


class CompletionShapes:
    """`/v1/completions` bodies of one request: `prompts[i]` is prompt i's ids, `echoes[i]` its
    text when echoed (else "")."""

    def __init__(
        self,
        req_id: str,
        model: str,
        formatter: LogprobsFormatter,
        request: CompletionRequest,
        prompts: list[list[int]],
        echoes: list[str],
    ) -> None:
        self.req_id, self.model = req_id, model
        self.formatter = formatter_for(formatter, request.return_tokens_as_token_ids)
        self.num_top = request.logprobs  # None: no logprobs in the response
        self.num_prompt_top = request.prompt_logprobs  # None: no prompt_logprobs
        self.include_usage = request.include_usage
        self.continuous_usage = request.continuous_usage
        self.n = request.n
        self.prompts, self.echoes = prompts, echoes
        self.created = unix_now()
        self.template = ChunkTemplate(self._text_chunk)

    def _prompt_of(self, index: int) -> int:
        """The prompt of choice `index` (`n` choices per prompt)."""
        return index // self.n

    def _text_chunk(self, index: int, text: str, finish_reason: str | None) -> BaseModel:
        choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason)
        return self._chunk([choice])

    def _chunk(
        self, choices: list[CompletionChoice], usage: UsageInfo | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self.req_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _usage(self, lasts: dict[int, RequestOutput]) -> UsageInfo:
        """Usage of the choices' outputs so far: each prompt once, every choice's tokens."""
        prompt_tokens = sum(map(len, self.prompts))
        return UsageInfo.of(prompt_tokens, sum(out.num_output_tokens for out in lasts.values()))

    def response(self, collected: list[Collected]) -> CompletionResponse:
        """`collected[k]`: choice k's output (prompt k // n's)."""
        choices = []
        for k, c in enumerate(collected):
            p = self._prompt_of(k)
            choices.append(CompletionChoice(
                index=k, text=self.echoes[p] + c.text, finish_reason=c.last.finish_reason,
                logprobs=self._logprobs(p, c.token_ids, c.logprobs, c.prompt_logprobs, 0),
                prompt_logprobs=self._prompt_logprobs(p, c.prompt_logprobs),
            ))  # fmt: skip
        return CompletionResponse(
            id=self.req_id, model=self.model, choices=choices,
            usage=self._usage({k: c.last for k, c in enumerate(collected)}),
        )  # fmt: skip

    def _prompt_logprobs(
        self, prompt: int, logprobs: list[TokenLogprobs] | None
    ) -> PromptLogprobs | None:
        if self.num_prompt_top is None or logprobs is None:
            return None
        return self.formatter.prompt(self.prompts[prompt], logprobs, self.num_prompt_top)

    def _logprobs(
        self,
        prompt: int,
        token_ids: list[int],
        logprobs: list[TokenLogprobs],
        prompt_logprobs: list[TokenLogprobs] | None,
        text_offset: int,
    ) -> CompletionLogprobs | None:
        """The choice's (or chunk's) logprobs; with echo, the prompt's first (when given)."""
        if self.num_top is None:
            return None
        ids: list[int] = list(token_ids)
        lps: list[TokenLogprobs | None] = list(logprobs)
        if self.echoes[prompt] and prompt_logprobs is not None:
            ids = self.prompts[prompt] + ids
            lps = [None, *prompt_logprobs, *lps]
        return self.formatter.completion(ids, lps, self.num_top, text_offset)

    async def chunks(self, merged: Merged) -> Chunks:
        lasts: dict[int, RequestOutput] = {}
        offsets: dict[int, int] = {}  # per choice: where its next token's text starts
        async with aclosing(merged):
            async for index, out in merged:
                first = index not in lasts
                lasts[index] = out
                p = self._prompt_of(index)
                text = (self.echoes[p] if first else "") + out.new_text
                logprobs = self._logprobs(p, out.new_token_ids, out.logprobs,
                                          out.prompt_logprobs if first else None,
                                          offsets.get(index, 0))  # fmt: skip
                if logprobs is None and not self.continuous_usage:
                    yield self.template.encode(index, text, out.finish_reason)
                    continue
                if logprobs is not None:
                    offsets[index] = offsets.get(index, 0) + sum(map(len, logprobs.tokens))
                running = None
                if self.continuous_usage:
                    running = UsageInfo.of(len(self.prompts[p]), out.num_output_tokens)
                yield self._chunk([CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                    finish_reason=out.finish_reason)],
                                  usage=running)  # fmt: skip
        if self.include_usage and lasts:
            yield self._chunk([], usage=self._usage(lasts))


class ChatShapes:
    """`/v1/chat/completions` bodies of one request."""

    def __init__(
        self,
        req_id: str,
        model: str,
        formatter: LogprobsFormatter,
        request: ChatCompletionRequest,
        prompt_ids: list[int],
    ) -> None:
        self.req_id, self.model = req_id, model
        self.formatter = formatter_for(formatter, request.return_tokens_as_token_ids)
        self.num_top = (request.top_logprobs or 0) if request.logprobs else None
        self.num_prompt_top = request.prompt_logprobs
        self.prompt_ids = prompt_ids
        self.include_usage = request.include_usage
        self.continuous_usage = request.continuous_usage
        self.n = request.n
        self.num_prompt_tokens = len(prompt_ids)
        self.created = unix_now()
        self.template = ChunkTemplate(self._text_chunk)
        # With tools, each choice's text is read for calls (`services.router.tools`).
        self.tool_calls = active(request.tools, request.tool_choice)
        self.named_tool = isinstance(request.tool_choice, NamedToolChoice)

    def _text_chunk(self, index: int, text: str, finish_reason: str | None) -> BaseModel:
        return self._chunk(ChatChunkChoice(
            index=index, delta=DeltaMessage(content=text), finish_reason=finish_reason
        ))  # fmt: skip

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> ChatLogprobs | None:
        if self.num_top is None:
            return None
        return self.formatter.chat(token_ids, logprobs, self.num_top)

    def response(self, collected: list[Collected]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i, message=self._message(c.text), finish_reason=self._finish_reason(c),
                logprobs=self._logprobs(c.token_ids, c.logprobs),
            )
            for i, c in enumerate(collected)
        ]  # fmt: skip
        prompt_logprobs = collected[0].prompt_logprobs if collected else None
        return ChatCompletionResponse(
            id=self.req_id, model=self.model, choices=choices,
            usage=usage(self.num_prompt_tokens, [c.last for c in collected]),
            prompt_logprobs=None if self.num_prompt_top is None or prompt_logprobs is None
            else self.formatter.prompt(self.prompt_ids, prompt_logprobs, self.num_prompt_top),
        )  # fmt: skip

    def _message(self, text: str) -> AssistantMessage:
        if not self.tool_calls:
            return AssistantMessage(content=text)
        parser = self._parsed(text)
        if not parser.calls:
            return AssistantMessage(content=text)
        return AssistantMessage(content=parser.content or None, tool_calls=parser.calls)

    def _finish_reason(self, collected: Collected) -> str | None:
        reason = collected.last.finish_reason
        if not self.tool_calls:
            return reason
        return finish_reason(reason, bool(self._parsed(collected.text).calls), self.named_tool)

    @staticmethod
    def _parsed(text: str) -> ToolCallParser:
        parser = ToolCallParser()
        parser.feed(text)
        parser.finish()
        return parser

    def _tool_chunk(
        self, parser: ToolCallParser, index: int, out: RequestOutput
    ) -> ChatCompletionChunk | None:
        """A chunk of a choice read for tool calls, or None when it adds nothing yet."""
        content, deltas = parser.feed(out.new_text)
        if out.finish_reason is not None:
            content += parser.finish()[0]
        reason = finish_reason(out.finish_reason, bool(parser.calls), self.named_tool)
        logprobs = self._logprobs(out.new_token_ids, out.logprobs)
        if not content and not deltas and reason is None and logprobs is None:
            return None
        delta = DeltaMessage(content=content or None, tool_calls=deltas or None)
        return self._chunk(ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                           finish_reason=reason))  # fmt: skip

    def _chunk(
        self, *choices: ChatChunkChoice, usage: UsageInfo | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.req_id, created=self.created, model=self.model, choices=list(choices),
            usage=usage,
        )  # fmt: skip

    async def chunks(self, merged: Merged) -> Chunks:
        opening = UsageInfo.of(self.num_prompt_tokens, 0) if self.continuous_usage else None
        for index in range(self.n):
            yield self._chunk(
                ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content="")),
                usage=opening,
            )
        lasts: dict[int, RequestOutput] = {}
        parsers = [ToolCallParser() for _ in range(self.n)] if self.tool_calls else None
        async with aclosing(merged):
            async for index, out in merged:
                lasts[index] = out
                if parsers is not None:
                    if chunk := self._tool_chunk(parsers[index], index, out):
                        yield chunk
                    continue
                logprobs = self._logprobs(out.new_token_ids, out.logprobs)
                if logprobs is None and not self.continuous_usage:
                    yield self.template.encode(index, out.new_text, out.finish_reason)
                    continue
                running = None
                if self.continuous_usage:
                    running = UsageInfo.of(self.num_prompt_tokens, out.num_output_tokens)
                yield self._chunk(ChatChunkChoice(
                    index=index, delta=DeltaMessage(content=out.new_text), logprobs=logprobs,
                    finish_reason=out.finish_reason,
                ), usage=running)  # fmt: skip
        if self.include_usage and lasts:
            yield self._chunk(usage=usage(self.num_prompt_tokens, list(lasts.values())))
