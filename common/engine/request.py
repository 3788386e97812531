"""A request's life inside an engine: its tokens, its text so far, and when it finishes."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from common.sampling import SamplingParams
from common.tokenizer import Tokenizer


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclass
class RequestOutput:
    """What one step produced for one request: the streamed delta and, at the end, the reason."""

    req_id: str
    new_token_ids: list[int]
    new_text: str = ""
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    """Tokens and finish rules of one request. Text is tracked only when a tokenizer is given."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def append(self, token_id: int, tokenizer: Tokenizer | None) -> RequestOutput:
        """Add one sampled token, update the text, and decide whether the request is done."""
        self.output_token_ids.append(token_id)
        self.finish_reason = self._finish_by_token(token_id) or self._finish_by_length()
        new_text = self._extend_text(tokenizer) if tokenizer else ""
        if tokenizer and self.params.stop and self.finish_reason is not FinishReason.STOP:
            new_text = self._apply_stop_strings(new_text)
        return RequestOutput(
            self.req_id,
            [token_id],
            new_text,
            self.finish_reason,
            len(self.prompt_token_ids),
            len(self.output_token_ids),
        )

    def _finish_by_token(self, token_id: int) -> FinishReason | None:
        if len(self.output_token_ids) < self.params.min_tokens:
            return None
        if token_id in self.params.stop_token_ids:
            return FinishReason.STOP
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        return None

    def _finish_by_length(self) -> FinishReason | None:
        if len(self.output_token_ids) >= self.params.max_tokens:
            return FinishReason.LENGTH
        if len(self.prompt_token_ids) + len(self.output_token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _extend_text(self, tokenizer: Tokenizer) -> str:
        full = tokenizer.decode(self.output_token_ids)
        # NOTE: a multi-byte character split across tokens decodes to U+FFFD until complete.
        if full.endswith("\ufffd") and not self.finish_reason:
            return ""
        delta, self.text = full[len(self.text) :], full
        return delta

    def _apply_stop_strings(self, delta: str) -> str:
        """Cut the text before the first stop string (OpenAI drops the stop string itself)."""
        search_from = max(0, len(self.text) - len(delta) - max(map(len, self.params.stop)))
        hits = [i for s in self.params.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return delta
        cut = min(hits)
        emitted_before = len(self.text) - len(delta)
        self.text = self.text[:cut]
        self.finish_reason = FinishReason.STOP
        return self.text[emitted_before:] if cut > emitted_before else ""
