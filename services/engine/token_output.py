"""What becomes of a sampled token: it is appended to its request (finish rules, grammar), streamed
to the request's router as a `TokenOutput`, and a finished request is released (its state here,
its shards' KV freed). A token that failed (sampling, finish rules, or a shard that could not
attend for it: `ShardRowFailed`) ends its request alone, with its error; only a shard's failure
is retryable (the mesh's fault, not the request's), and its batch-mates go on.

A mixin of `Engine` (engine.py); the state it acts on is the engine's (declared here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from common.engine.request import Request
from common.protocol import TokenOutput
from common.sampling import SampledRow
from services.engine.admission import DecodeAdmission
from services.engine.outbox import Outbox
from services.engine.routing import RequestRoute, kv_endpoints
from services.engine.telemetry import EngineTelemetry

log = structlog.get_logger(__name__)


class ShardRowFailed(RuntimeError):
    """A shard could not attend for one request (its KV there was refused or lost): that request
    is re-run elsewhere, its batch-mates go on."""


class EngineTokenOutput:
    """`Engine`'s per-token bookkeeping; the state it acts on is the engine's (declared here)."""

    telemetry: EngineTelemetry
    admission: DecodeAdmission
    requests: dict[str, Request]
    routing: dict[str, RequestRoute]

    if TYPE_CHECKING:  # EngineFaults' (no runtime stub: it would shadow theirs in the MRO)

        def _end(self, req_id: str, error: str, retryable: bool = False) -> Outbox: ...

    def _emit(self, req_id: str, sampled: SampledRow) -> Outbox:
        """Record a token, stream it, and release everything if the request is done. A request
        whose token failed (sampling, finish rules) ends alone, with its error."""
        req, route = self.requests[req_id], self.routing[req_id]
        token = sampled.token
        try:
            if isinstance(token, Exception):
                raise token
            result = req.append(token, tokenizer=None)
        except Exception as exc:  # noqa: BLE001 - this request's fault: its batch-mates go on
            log.warning("request failed", req_id=req_id, error=repr(exc))
            retryable = isinstance(exc, ShardRowFailed)  # the mesh's fault, not the request's
            return self._end(req_id, f"request failed: {exc!r}", retryable=retryable)
        reason = result.finish_reason.value if result.finish_reason else ""
        self.telemetry.token(req_id)
        index = len(req.output_token_ids) - 1
        output = TokenOutput(
            req_id, [token], reason, route.num_prompt_tokens, index=index,
            logprobs=[] if sampled.logprobs is None else [sampled.logprobs],
            prompt_logprobs=sampled.prompt_logprobs or [],
        )  # fmt: skip
        out = Outbox.output(route.reply_to, output)
        if reason:
            self.telemetry.finished(req_id, reason)
            out += self._release(req_id)
        return out

    def _release(self, req_id: str) -> Outbox:
        route = self.routing.pop(req_id)
        self.requests.pop(req_id)
        self.admission.remove(req_id)
        return Outbox.free(req_id, kv_endpoints(route.shards))


__all__ = ["EngineTokenOutput", "ShardRowFailed"]
