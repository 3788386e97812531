"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them, and the chat prompt both the
chat endpoint and `/tokenize` build.

`/tokenize` takes a completion prompt (`{"prompt", "add_special_tokens": true}`) or a chat
(`{"messages", "add_generation_prompt": true, ...}`, with `tools` and `tool_choice` as chat takes
them) and answers `{count, max_model_len, tokens}`
(and `token_strs` with `return_token_strs`): exactly the ids `/v1/completions` and
`/v1/chat/completions` would run, so a client can count a prompt before sending it.
`/detokenize` takes `{"tokens"}` and answers `{"prompt"}` (special tokens included); an id the
tokenizer does not have is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Request
from pydantic import BaseModel, Discriminator, Tag

from services.router.api_errors import APIError
from services.router.chat_options import ChatTemplateFields
from services.router.openai_api import ChatMessage, Messages, TokenId, _Request
from services.router.prompt_work import ChatOptions, PromptWork
from services.router.tools import ToolChoice, ToolPrompt, Tools, template_tool_calls


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's BOS, as /v1/completions adds it
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields, _Request):
    model: str | None = None
    messages: Messages
    tools: Tools | None = None  # as the chat endpoint renders them (`ToolPrompt`)
    tool_choice: ToolChoice | None = None
    add_special_tokens: bool = False  # the chat template writes BOS itself
    return_token_strs: bool = False


def _tokenize_kind(body: Any) -> str:
    return "kind:chat" if isinstance(body, dict) and "messages" in body else "kind:completion"


# A body with messages is a chat: its errors name the chat's fields, not a missing prompt.
TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("kind:chat")]
    | Annotated[TokenizeCompletionRequest, Tag("kind:completion")],
    Discriminator(_tokenize_kind),
]


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


def chat_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """A chat as the template takes it: a part list is its text parts joined; past tool calls
    (their arguments as objects) and a tool result's call id kept."""
    # NOTE: one pass, a dict literal per plain message: a chat may hold a hundred thousand.
    return [
        {"role": m.role, "content": m.text()}
        if m.tool_calls is None and m.tool_call_id is None
        else _turn_with_tools(m)
        for m in messages
    ]


def _turn_with_tools(message: ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        turn["tool_calls"] = template_tool_calls(message.tool_calls)
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def chat_options(
    fields: ChatTemplateFields, tools: list[dict[str, Any]] | None = None
) -> ChatOptions:
    return ChatOptions(
        fields.add_generation_prompt,
        fields.continue_final_message,
        fields.chat_template_kwargs,
        tools,
    )


def body_bytes(http: Request) -> int | None:
    """The request body's declared size (None: not declared, a chunked body)."""
    declared = http.headers.get("content-length", "")
    return int(declared) if declared.isdigit() else None


class Tokenization:
    """The two endpoints for one served model's tokenizer (the router checks the API key)."""

    def __init__(
        self, prompt_work: PromptWork, model_name: str, max_model_len: int, tool_prompt: ToolPrompt
    ) -> None:
        self.prompt_work = prompt_work
        self.tool_prompt = tool_prompt
        self.tokenizer = prompt_work.tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len

    async def tokenize(self, request: TokenizeRequest, http: Request) -> TokenizeResponse:
        self._check_model(request.model)
        if isinstance(request, TokenizeCompletionRequest):
            ids = await self.prompt_work.text_ids(request.prompt, request.add_special_tokens)
        elif request.add_special_tokens:
            raise APIError(400, "add_special_tokens is not supported for chats: the chat "
                           "template writes the special tokens", "add_special_tokens")  # fmt: skip
        else:
            chat, tools = self.tool_prompt.chat(
                chat_of(request.messages), request.tools, request.tool_choice
            )
            options = chat_options(request, tools)
            ids = await self.prompt_work.chat_ids(chat, options, body_bytes(http))
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
        text = await self.prompt_work.text_pool.run(self.tokenizer.decode, request.tokens, False)
        return DetokenizeResponse(prompt=text)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
