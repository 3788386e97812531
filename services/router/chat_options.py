"""The chat template's request options, shared by `/v1/chat/completions` and `/tokenize`.

vLLM's names and defaults: `add_generation_prompt` (open an assistant turn after the messages),
`continue_final_message` (leave the last message open for the model to continue instead) and
`chat_template_kwargs` (extra variables the template reads, say Qwen3's `enable_thinking`).
A module of its own so that `openai_api.py` and `tokenize_api.py` can both use it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ChatTemplateFields(BaseModel):
    """How a chat request's messages become a prompt (`common.chat_template.render`)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
