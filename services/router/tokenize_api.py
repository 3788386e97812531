"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them, and the chat prompt both the
chat endpoint and `/tokenize` build.

`/tokenize` takes a completion prompt (`{"prompt", "add_special_tokens": true}`) or a chat
(`{"messages", "add_generation_prompt": true, ...}`) and answers `{count, max_model_len, tokens}`
(and `token_strs` with `return_token_strs`): exactly the ids `/v1/completions` and
`/v1/chat/completions` would run, so a client can count a prompt before sending it.
`/detokenize` takes `{"tokens"}` and answers `{"prompt"}` (special tokens included); an id the
tokenizer does not have is a 400.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, Field

from common.chat_template import ChatTemplateError
from common.tokenizer import Tokenizer
from services.router.api_errors import APIError
from services.router.chat_options import ChatTemplateFields
from services.router.http_edge import check_unicode
from services.router.openai_api import ChatMessage, TokenId, _Request


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's BOS, as /v1/completions adds it
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields, _Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False  # the chat template writes BOS itself
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


def chat_prompt_ids(
    tokenizer: Tokenizer, messages: list[ChatMessage], options: ChatTemplateFields
) -> list[int]:
    """The prompt ids of a chat: its messages through the model's chat template (a part list is
    its text parts joined); a template that refuses them is a 400 with the template's message."""
    chat = [{"role": m.role, "content": m.text()} for m in messages]
    check_unicode("messages", (m["content"] for m in chat))
    check_unicode("chat_template_kwargs", _strings(options.chat_template_kwargs))
    try:
        return tokenizer.apply_chat_template(
            chat, options.add_generation_prompt, options.continue_final_message,
            options.chat_template_kwargs,
        )  # fmt: skip
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), exc.param) from exc


def _strings(obj: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _strings(value)


class Tokenization:
    """The two endpoints for one served model's tokenizer (the router checks the API key)."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len

    async def tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        self._check_model(request.model)
        # A long prompt or chat takes long to encode: off the event loop, like generation's.
        ids = await asyncio.to_thread(self._ids, request)
        strs = [self.tokenizer.id_to_token(i) for i in ids] if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(request.model)
        unknown = [i for i in request.tokens if i >= self.tokenizer.vocab_size]
        if unknown:
            raise APIError(400, f"token id {unknown[0]} is out of range: the tokenizer has "
                           f"{self.tokenizer.vocab_size} tokens", "tokens")  # fmt: skip
        text = await asyncio.to_thread(
            self.tokenizer.decode, request.tokens, skip_special_tokens=False
        )
        return DetokenizeResponse(prompt=text)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def _ids(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        if isinstance(request, TokenizeCompletionRequest):
            check_unicode("prompt", [request.prompt])
            return self.tokenizer.encode(request.prompt, request.add_special_tokens)
        if request.add_special_tokens:
            raise APIError(400, "add_special_tokens is not supported for chats: the chat "
                           "template writes the special tokens", "add_special_tokens")  # fmt: skip
        return chat_prompt_ids(self.tokenizer, request.messages, request)
