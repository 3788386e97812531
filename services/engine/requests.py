"""The requests an engine holds: each one's tokens and finish rules (`Request`), and where its
tokens, KV and decode go (`RequestRoute`). Wire messages become this state in one named
constructor each (`add_prompt`, `add_handoff`); a sampled token becomes a `TokenOutput` for the
request's router here (`emit`), and a token that failed says why instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from common.config import ModelConfig
from common.engine.grammars import EngineGrammars
from common.engine.request import Request, TokenIds, check_prompt
from common.protocol import DecodeHandoff, GenerateRequest, RebuildKv, TokenOutput
from common.sampling import SampledRow
from common.sampling_params import SamplingParams
from common.scheduling.batching import Sequence
from common.structured.grammar import GrammarMatcher
from services.engine.routing import RequestRoute

log = structlog.get_logger(__name__)


class ShardRowFailed(RuntimeError):
    """A shard could not attend for one request (its KV there was refused or lost): that request
    is re-run elsewhere, its batch-mates go on."""


@dataclass(frozen=True, slots=True)
class Emitted:
    """What one sampled token became: the output to stream (None when the token failed), its
    finish reason ("" while the request runs), or the error that ends the request alone
    (`retryable` when the mesh is at fault, not the request)."""

    output: TokenOutput | None
    finish_reason: str = ""
    error: str = ""
    retryable: bool = False


class RequestTable:
    """Requests by id, with their routes; every other part reads requests here."""

    def __init__(self, model: ModelConfig, grammars: EngineGrammars) -> None:
        self.vocab_size, self.eos_token_ids = model.vocab_size, model.eos_token_ids
        self.max_model_len = model.max_position_embeddings
        self.grammars = grammars
        self.requests: dict[str, Request] = {}
        self.routes: dict[str, RequestRoute] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.requests

    def add_prompt(self, msg: GenerateRequest) -> Request:
        """A new prompt; ValueError when the request itself is wrong. A migrated request brings
        the tokens it already streamed: they are output (finish rules count them), its grammar
        replays them, and the prefill covers them, so the next token continues the stream."""
        params = SamplingParams.from_spec(msg.sampling)
        params.check_vocab(self.vocab_size)
        tokens = msg.prompt_token_ids + msg.output_token_ids
        check_prompt(tokens, self.vocab_size, self.max_model_len)
        grammar = self.grammars.matcher(params, msg.output_token_ids)
        route = RequestRoute(
            msg.reply_to, msg.token_engine, msg.token_kv_endpoint, msg.token_kv_address,
            tuple(msg.shards), len(msg.prompt_token_ids),
        )  # fmt: skip
        return self._add(msg.req_id, msg.prompt_token_ids, msg.output_token_ids, params, grammar,
                         route)  # fmt: skip

    def add_handoff(self, msg: DecodeHandoff) -> Request:
        """A prefilled request to decode; ValueError when its grammar cannot replay its tokens
        (the request's fault: re-running it elsewhere would not help)."""
        output_token_ids = msg.token_ids[msg.num_prompt_tokens :]
        params = SamplingParams.from_spec(msg.sampling)
        grammar = self.grammars.matcher(params, output_token_ids)
        route = RequestRoute(
            msg.reply_to, shards=tuple(msg.shards), num_prompt_tokens=msg.num_prompt_tokens
        )
        prompt = msg.token_ids[: msg.num_prompt_tokens]
        return self._add(msg.req_id, prompt, output_token_ids, params, grammar, route)

    def add_rebuild(self, msg: RebuildKv) -> Request:
        """A running request's KV to recompute for its token engine (a lost shard's heads): its
        tokens as prompt and output, answered to the token engine, never to a client.
        ValueError when its tokens cannot be a prompt."""
        params = SamplingParams.from_spec(msg.sampling)
        check_prompt(msg.token_ids, self.vocab_size, self.max_model_len)
        route = RequestRoute("", shards=tuple(msg.shards), num_prompt_tokens=msg.num_prompt_tokens,
                             rebuild_for=msg.reply_to)  # fmt: skip
        n = msg.num_prompt_tokens
        return self._add(msg.req_id, msg.token_ids[:n], msg.token_ids[n:], params, None, route)

    def _add(
        self,
        req_id: str,
        prompt: list[int],
        output: list[int],
        params: SamplingParams,
        grammar: GrammarMatcher | None,
        route: RequestRoute,
    ) -> Request:
        req = Request(req_id, list(prompt), params, self.eos_token_ids, self.max_model_len,
                      output_token_ids=list(output), grammar=grammar)  # fmt: skip
        self.requests[req_id], self.routes[req_id] = req, route
        return req

    def emit(self, req_id: str, sampled: SampledRow) -> Emitted:
        """Record a sampled token (finish rules, grammar) and the output that streams it."""
        req, route = self.requests[req_id], self.routes[req_id]
        token = sampled.token
        try:
            if isinstance(token, Exception):
                raise token
            result = req.append(token, tokenizer=None)
        except Exception as exc:  # noqa: BLE001 - this request's fault: its batch-mates go on
            log.warning("request failed", req_id=req_id, error=repr(exc))
            return Emitted(None, error=f"request failed: {exc!r}",
                           retryable=isinstance(exc, ShardRowFailed))  # fmt: skip
        reason = result.finish_reason.value if result.finish_reason else ""
        output = TokenOutput(
            req_id, [token], reason, route.num_prompt_tokens,
            index=len(req.output_token_ids) - 1,
            logprobs=[] if sampled.logprobs is None else [sampled.logprobs],
            prompt_logprobs=sampled.prompt_logprobs or [],
        )  # fmt: skip
        return Emitted(output, reason)

    def pop(self, req_id: str) -> tuple[Request, RequestRoute] | None:
        if req_id not in self.requests:
            return None
        return self.requests.pop(req_id), self.routes.pop(req_id)

    def of_router(self, reply_to: str) -> list[str]:
        """The requests whose tokens go to router `reply_to`."""
        return [req_id for req_id, route in self.routes.items() if route.reply_to == reply_to]

    def whole_len(self, req_id: str) -> int:
        """The most tokens `req_id` may hold (prompt + max_tokens, within the context); 0 for a
        request that is not here."""
        req = self.requests.get(req_id)
        if req is None:
            return 0
        return min(len(req.prompt_token_ids) + req.params.max_tokens, self.max_model_len)

    def token_ids(self, seqs: list[Sequence]) -> dict[str, TokenIds]:
        """Each sequence's prompt and output tokens, read in place (`Request.token_ids`): a step
        reads a few of them, and copying every context each step would cost its length."""
        return {s.req_id: self.requests[s.req_id].token_ids for s in seqs}


__all__ = ["Emitted", "RequestTable", "ShardRowFailed"]
