"""OpenAI's logprobs shapes, built from the engines' `TokenLogprobs` and the tokenizer.

Chat: `choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}]}`. Completions (the legacy shape): `choices[].logprobs = {tokens, token_logprobs,
top_logprobs: [{token: logprob}], text_offset}`, with `null` for the first prompt token under
`echo` (nothing predicts it). A token's string is its own decode (a byte-level BPE piece that ends
inside a UTF-8 character reads as U+FFFD, as in vLLM); `bytes` are that string's UTF-8. vLLM's
`prompt_logprobs`: `[null, {"<id>": {logprob, rank, decoded_token}}, ...]`, one per prompt token,
the prompt's own token and its top ones. With vLLM's `return_tokens_as_token_ids`
(`TokenIdLogprobsFormatter`) a token's string is `token_id:<id>`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel

from common.protocol import TokenLogprobs
from common.tokenizer import Tokenizer

# JSON has no -inf: a token the model gives no probability at all reads as this (vLLM's value).
MIN_LOGPROB = -9999.0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None  # 1: the model's most likely token
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class LogprobsFormatter:
    """Turns token ids and their `TokenLogprobs` into the API's shapes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token(token_id)
        return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))

    def chat(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], num_top: int
    ) -> ChatLogprobs:
        content = []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            chosen = self._top(token_id, lp.logprob)
            top = [
                self._top(t, v)
                for t, v in zip(lp.top_ids[:num_top], lp.top_logprobs[:num_top], strict=True)
            ]
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def prompt(
        self, prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], num_top: int
    ) -> PromptLogprobs:
        """vLLM's `prompt_logprobs`: None for the first token (nothing predicts it), then each
        token's own entry and its `num_top` likeliest, keyed by token id."""
        shaped: PromptLogprobs = [None]
        for token_id, lp in zip(prompt_ids[1:], logprobs, strict=True):
            pairs = list(zip(lp.top_ids[:num_top], lp.top_logprobs[:num_top], strict=True))
            entries = {
                str(t): PromptLogprob(logprob=_finite(v), rank=rank, decoded_token=self.token(t))
                for rank, (t, v) in enumerate(pairs, start=1)
            }
            entries[str(token_id)] = PromptLogprob(
                logprob=_finite(lp.logprob), rank=lp.rank or None,
                decoded_token=self.token(token_id),
            )  # fmt: skip
            shaped.append(entries)
        return shaped

    def completion(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None],
        num_top: int,
        text_offset: int = 0,
    ) -> CompletionLogprobs:
        """`logprobs[i]` None: a token nothing predicts (the first prompt token under echo).
        `text_offset`: where the first token starts in the choice's text."""
        tokens = [self.token(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(text_offset)
            text_offset += len(text)
        top: list[dict[str, float] | None] = []
        for token, lp in zip(tokens, logprobs, strict=True):
            if lp is None:
                top.append(None)
                continue
            # The chosen token is always among them (OpenAI's and vLLM's shape).
            pairs = zip(lp.top_ids[:num_top], lp.top_logprobs[:num_top], strict=True)
            entries = {self.token(t): _finite(v) for t, v in pairs}
            top.append({**entries, token: _finite(lp.logprob)})
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[None if lp is None else _finite(lp.logprob) for lp in logprobs],
            top_logprobs=top,
            text_offset=offsets,
        )


class TokenIdLogprobsFormatter(LogprobsFormatter):
    """vLLM's `return_tokens_as_token_ids`: each token's string is `token_id:<id>`, which a
    client can map back to the id even where a token is not valid UTF-8 on its own."""

    def token(self, token_id: int) -> str:
        return f"token_id:{token_id}"
