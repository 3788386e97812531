"""The router's side of a request's output: the token ids its engine streams, as text.

Mesh engines know token ids only and decide every token-level finish (EOS, stop token ids,
lengths; `common.engine.request.Request`). The router turns their `TokenOutput`s into
`RequestOutput`s: incremental detokenization, hold-back and stop strings (`OutputText`). A stop
string is the one finish decided here, because only text can show it; the caller then aborts the
engines. The in-process engine's outputs get their text here too when no stop string needs it
in the engine (`TokenText`): off the engine's thread, and once per batch of outputs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from common.engine.request import FinishReason, OutputText, RequestOutput
from common.protocol import TokenOutput
from common.tokenizer import Tokenizer


class TokenText:
    """One request's output token ids so far and their text (`OutputText`: incremental
    detokenization, hold-back, stop strings): the one text maker of both router clients. The
    in-process client makes it on its loop, from each batch of outputs it takes at once, when no
    stop string needs the text in the engine: a plain response's tokens all come together at
    its end (one decode, not two per token on the engine's thread: docs/serving.md)."""

    def __init__(self, tokenizer: Tokenizer, output: OutputText | None = None) -> None:
        """`output`: the request's text maker (`OutputText.of(params)`); none: plain text."""
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.output = output or OutputText([])

    def add(self, token_ids: list[int], finished: bool) -> str:
        """The new text safe to send once `token_ids` follow the ones so far (all of it when
        `finished` or a stop string matched)."""
        self.token_ids += token_ids
        return self.output.update(self.token_ids, self.tokenizer, finished)


class StreamedText:
    """One request's streamed token ids and their text."""

    def __init__(
        self, req_id: str, num_prompt_tokens: int, output: OutputText, tokenizer: Tokenizer
    ) -> None:
        self.req_id = req_id
        self.num_prompt_tokens = num_prompt_tokens
        self.text = TokenText(tokenizer, output)

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens streamed so far (a migrated request goes on after them)."""
        return self.text.token_ids

    def on_tokens(self, msg: TokenOutput) -> list[RequestOutput]:
        """The outputs for one engine message, in order; the last one is finished if either the
        engine finished the request or a stop string did (later tokens are then dropped)."""
        if msg.error or msg.finish_reason == "error":
            raise RuntimeError(f"generation failed: {msg.error or 'engine error'}")
        if not self.text.output.stop and msg.token_ids:
            return [self._at_once(msg)]
        outs: list[RequestOutput] = []
        for i, token_id in enumerate(msg.token_ids):
            last = i == len(msg.token_ids) - 1
            engine_done = bool(msg.finish_reason) and last
            delta = self.text.add([token_id], engine_done)
            reason = FinishReason.STOP if self.text.output.stopped else None
            if engine_done and reason is None:
                reason = _reason(msg.finish_reason)
            out = self._output([token_id], delta, reason)
            out.logprobs = msg.logprobs[i : i + 1]
            if i == 0 and msg.index == 0 and msg.prompt_logprobs:
                out.prompt_logprobs = msg.prompt_logprobs
            outs.append(out)
            if reason is not None:
                return outs
        if msg.finish_reason:  # an end with no token (an engine that stopped on its own)
            delta = self.text.add([], finished=True)
            outs.append(self._output([], delta, _reason(msg.finish_reason)))
        return outs

    def _at_once(self, msg: TokenOutput) -> RequestOutput:
        """All of a message's tokens in one decode: without stop strings no token's text can end
        the request early, and the text is the same as token by token's."""
        engine_done = bool(msg.finish_reason)
        delta = self.text.add(list(msg.token_ids), engine_done)
        out = self._output(list(msg.token_ids), delta,
                           _reason(msg.finish_reason) if engine_done else None)  # fmt: skip
        out.logprobs = list(msg.logprobs)
        if msg.index == 0 and msg.prompt_logprobs:
            out.prompt_logprobs = msg.prompt_logprobs
        return out

    def _output(
        self, token_ids: list[int], delta: str, reason: FinishReason | None
    ) -> RequestOutput:
        return RequestOutput(
            self.req_id, token_ids, delta, reason, self.num_prompt_tokens,
            len(self.output_token_ids),
        )  # fmt: skip


def _reason(engine_reason: str) -> FinishReason:
    return FinishReason(engine_reason) if engine_reason in set(FinishReason) else FinishReason.ABORT


def join_token_outputs(items: list[Any]) -> list[Any]:
    """`items` with each run of consecutive plain `TokenOutput`s of one attempt (same wire id,
    contiguous indexes, no error, only the last finished) as one message: one decode and one
    output for the run, not one per engine step."""
    joined: list[Any] = []
    for item in items:
        last = joined[-1] if joined else None
        if (
            isinstance(item, TokenOutput) and isinstance(last, TokenOutput)
            and not item.error and not last.error and not last.finish_reason
            and item.req_id == last.req_id and item.index == last.index + len(last.token_ids)
            and bool(item.logprobs) == bool(last.logprobs) and not item.prompt_logprobs
        ):  # fmt: skip
            joined[-1] = msgspec.structs.replace(
                last, token_ids=last.token_ids + item.token_ids,
                finish_reason=item.finish_reason, logprobs=last.logprobs + item.logprobs,
            )  # fmt: skip
        else:
            joined.append(item)
    return joined
