"""Outputs of one request that reached the router together, as one: one SSE chunk, one trace
record and one pass through the response shapes for all of them, not one per token."""

from __future__ import annotations

from common.engine.request import RequestOutput


def coalesce(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request (in token order) as one: their tokens, text and
    logprobs joined; the last one's counts and finish; the first one's prompt logprobs."""
    if len(outputs) == 1:
        return outputs[0]
    first, last = outputs[0], outputs[-1]
    return RequestOutput(
        first.req_id,
        [t for o in outputs for t in o.new_token_ids],
        "".join(o.new_text for o in outputs),
        last.finish_reason,
        last.num_prompt_tokens,
        last.num_output_tokens,
        last.error,
        [lp for o in outputs for lp in o.logprobs],
        first.prompt_logprobs,
    )
