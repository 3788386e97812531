"""A request's life inside an engine: its tokens, its text so far, and when it finishes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import overload

from common.protocol import TokenLogprobs
from common.sampling_params import SamplingParams
from common.structured.grammar import GrammarMatcher
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
    error: str = ""  # the request failed (its finish reason is `abort`): why
    # With `logprobs`: one per new token. With `prompt_logprobs`, on the first output: one per
    # prompt token after the first.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the same request's `later` one as one output (several decode
        iterations of one call: their tokens, text and logprobs in order, the later end)."""
        self.new_token_ids += later.new_token_ids
        self.new_text += later.new_text
        self.logprobs += later.logprobs
        self.finish_reason, self.error = later.finish_reason, later.error
        self.num_output_tokens = later.num_output_tokens
        return self


def check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """The one check of a prompt's token ids (router, mesh engines, `LLMEngine`): `ValueError`
    naming what the model cannot take."""
    if not prompt_token_ids:
        raise ValueError("prompt must contain at least one token")
    if not all(0 <= t < vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_token_ids)} tokens; the model's context is {max_model_len}"
        )


@dataclass(eq=False)
class OutputText:
    """A request's output text: incremental detokenization, stop strings and hold-back.

    The one finish it decides is a stop string (it needs text); the token-level finishes (EOS,
    stop token ids, lengths) are `Request`'s alone. The engine's `Request` owns one when it has a
    tokenizer (the single-process engine); the mesh's router owns one per request, for the text
    of the token ids the engines stream, and takes their finish reason as it comes.
    """

    stop: list[str]
    include_stop: bool = False  # vLLM's include_stop_str_in_output: a matched stop string stays
    skip_special_tokens: bool = True  # decode special tokens as nothing (vLLM's default)
    text: str = ""
    num_emitted_chars: int = 0
    stopped: bool = False  # a stop string matched: `text` ends before it
    # Incremental detokenization (vLLM's scheme): the text of output tokens [0, _read_offset) is
    # `_committed`; tokens [_prefix_offset, _read_offset) are decoded again only as context for
    # the ones after them, so a step costs a few tokens' decode, not the whole output's.
    _committed: str = ""
    _prefix_offset: int = 0
    _read_offset: int = 0

    def update(self, token_ids: list[int], tokenizer: Tokenizer, finished: bool) -> str:
        """The output is now `token_ids`: decode, cut at a stop string, and return the new text
        that is safe to stream (all of it once `finished` or stopped)."""
        pending = self._decode_new(token_ids, tokenizer)  # first: it may commit text
        full = self._committed + pending
        stop_at = self._find_stop_string(full)
        if stop_at is not None:
            full, self.stopped = full[:stop_at], True
        self.text = full
        end = len(full)
        if not (finished or self.stopped):
            # NOTE: hold back what could still become a stop string (vLLM does the same), and a
            # multi-byte character split across tokens, which decodes to U+FFFD until complete.
            end -= max(map(len, self.stop), default=1) - 1
            end = min(end, len(full.rstrip("\ufffd")))
        delta = full[self.num_emitted_chars : max(end, self.num_emitted_chars)]
        self.num_emitted_chars += len(delta)
        return delta

    def _decode_new(self, tokens: list[int], tokenizer: Tokenizer) -> str:
        """Text of the tokens not yet committed; complete characters are committed.

        A multi-byte character split across tokens decodes to U+FFFD until it is complete: such
        text is returned (the caller holds it back) but not committed.
        """
        skip = self.skip_special_tokens
        context = tokenizer.decode(tokens[self._prefix_offset : self._read_offset], skip)
        window = tokenizer.decode(tokens[self._prefix_offset :], skip)
        # Decoding with the context, then cutting it off, keeps tokenizers that treat a leading
        # space specially (SentencePiece) right at the window's start.
        new = window[len(context) :]
        if new and not new.endswith("\ufffd"):
            self._committed += new
            self._prefix_offset, self._read_offset = self._read_offset, len(tokens)
            return ""
        return new

    @classmethod
    def of(cls, params: SamplingParams) -> OutputText:
        """The text maker a request's parameters ask for."""
        return cls(list(params.stop), params.include_stop_str_in_output,
                   params.skip_special_tokens)  # fmt: skip

    def _find_stop_string(self, text: str) -> int | None:
        """Where the text ends at the first stop string (after it with `include_stop`)."""
        if not self.stop:
            return None
        # Only new text can hold a new match: start one stop-length before what was emitted.
        start = max(0, self.num_emitted_chars - max(map(len, self.stop)))
        hits = [(i, len(s)) for s in self.stop if (i := text.find(s, start)) >= 0]
        if not hits:
            return None
        at, length = min(hits)
        return at + length if self.include_stop else at


class TokenIds(Sequence[int]):
    """A prompt's and its output's token ids read as one sequence (prompt first), not copied: a
    view of both lists as they are now, so a token appended later is in it."""

    __slots__ = ("_output", "_prompt")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self._prompt, self._output = prompt, output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        prompt, output = self._prompt, self._output
        split = len(prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(split + len(output))
            if step == 1 and stop <= split:
                return prompt[start:stop]
            if step == 1 and start >= split:
                return output[start - split : stop - split]
            return (prompt + output)[index]
        if index < 0:
            index += split + len(output)
        if not 0 <= index < split + len(output):
            raise IndexError("token index out of range")
        return prompt[index] if index < split else output[index - split]


@dataclass(eq=False)
class Request:
    """Tokens and finish rules of one request. Text is tracked only when a tokenizer is given."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    output_text: OutputText | None = None  # made on the first append with a tokenizer
    # Its structured-output state (`common.engine.grammars`), advanced by the sampler.
    grammar: GrammarMatcher | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def token_ids(self) -> TokenIds:
        """`all_token_ids` without the copy: what a step reads of it (a decode step: one token)
        costs that much, not the whole context's length every step."""
        return TokenIds(self.prompt_token_ids, self.output_token_ids)

    @property
    def tokens_left(self) -> int:
        """Tokens it may still generate before its length ends it (max_tokens or the context)."""
        generated = len(self.output_token_ids)
        return min(
            self.params.max_tokens - generated,
            self.max_model_len - len(self.prompt_token_ids) - generated,
        )

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """How many top logprobs its prompt tokens want from this prefill (None: none). A
        recompute or a migrated re-run (output already out) never reports them again."""
        return None if self.output_token_ids else self.params.prompt_logprobs

    @property
    def text(self) -> str:
        return self.output_text.text if self.output_text else ""

    def append(self, token_id: int, tokenizer: Tokenizer | None) -> RequestOutput:
        """Add one sampled token, update the text, and decide whether the request is done."""
        self.output_token_ids.append(token_id)
        self.finish_reason = self._finish_by_token(token_id) or self._finish_by_length()
        new_text = ""
        if tokenizer is not None:
            self.output_text = self.output_text or OutputText.of(self.params)
            finished = self.finish_reason is not None
            new_text = self.output_text.update(self.output_token_ids, tokenizer, finished)
            if self.output_text.stopped:
                self.finish_reason = FinishReason.STOP
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
