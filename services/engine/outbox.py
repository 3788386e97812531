"""What an engine input or step sends, each message with its endpoint, sorted by the socket it
leaves on: `Engine` owns no sockets, its worker sends an `Outbox` as it is."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from common.protocol import (
    DecodeHandoff,
    FetchKv,
    FreeRequest,
    KvRebuilt,
    RebuildKv,
    TokenBatch,
    TokenOutput,
)


@dataclass
class Outbox:
    """Messages to send, by channel.

    - `outputs`: tokens and errors, to the request's router inbox (`reply_to`);
    - `handoffs`: prefilled requests, to their token engine's command socket;
    - `frees`: to a KV-ingress socket (a shard's, or a token engine's own). They travel there, and
      not on a command socket, so that a free can never overtake the KV pages it frees. A
      swap-in's `FetchKv` goes the same way, so a later free cannot overtake it either;
    - `rebuilds`: a lost shard's heads recomputed (Lamina §5): a token engine's `RebuildKv` to a
      prompt engine, and its `KvRebuilt` answer, each to the other's command socket.
    """

    outputs: list[tuple[str, TokenOutput]] = field(default_factory=list)
    handoffs: list[tuple[str, DecodeHandoff]] = field(default_factory=list)
    frees: list[tuple[str, FreeRequest | FetchKv]] = field(default_factory=list)
    rebuilds: list[tuple[str, RebuildKv | KvRebuilt]] = field(default_factory=list)

    @classmethod
    def output(cls, reply_to: str, message: TokenOutput) -> Outbox:
        return cls(outputs=[(reply_to, message)])

    @classmethod
    def free(
        cls, req_id: str, kv_endpoints: Iterable[str], kv_generation: int | None = None
    ) -> Outbox:
        """Free a request's KV where it is (`kv_generation`: a preemption's, `FreeRequest`)."""
        message = FreeRequest(req_id, kv_generation)
        return cls(frees=[(endpoint, message) for endpoint in kv_endpoints])

    @classmethod
    def refusal(cls, handoff: DecodeHandoff, error: str, retryable: bool = True) -> Outbox:
        """A hand-off that will not decode here: its router re-runs the request (a retryable
        error, unless the request itself is at fault), and its shards' KV is freed (a token
        engine's own lease frees local KV)."""
        message = TokenOutput(handoff.req_id, [], "error", handoff.num_prompt_tokens, error=error,
                              retryable=retryable)  # fmt: skip
        frees = cls.free(handoff.req_id, [s.kv_endpoint for s in handoff.shards])
        return cls.output(handoff.reply_to, message) + frees

    def wire_outputs(self) -> list[tuple[str, TokenOutput | TokenBatch]]:
        """`outputs` as they go on the wire: each router's plain ones (one token, no error, no
        logprobs) in one `TokenBatch`, sent where the first of them was; the rest as they are."""
        wire: list[tuple[str, TokenOutput | TokenBatch]] = []
        batches: dict[str, TokenBatch] = {}
        for endpoint, out in self.outputs:
            if not _plain(out):
                wire.append((endpoint, out))
                continue
            batch = batches.get(endpoint)
            if batch is None:
                batch = batches[endpoint] = TokenBatch([], [], [], [], [])
                wire.append((endpoint, batch))
            batch.req_ids.append(out.req_id)
            batch.token_ids.append(out.token_ids[0])
            batch.indexes.append(out.index)
            batch.finish_reasons.append(out.finish_reason)
            batch.num_prompt_tokens.append(out.num_prompt_tokens)
        return wire

    def __iadd__(self, other: Outbox) -> Outbox:
        self.outputs += other.outputs
        self.handoffs += other.handoffs
        self.frees += other.frees
        self.rebuilds += other.rebuilds
        return self

    def __add__(self, other: Outbox) -> Outbox:
        return Outbox(
            self.outputs + other.outputs, self.handoffs + other.handoffs,
            self.frees + other.frees, self.rebuilds + other.rebuilds,
        )  # fmt: skip

    def __bool__(self) -> bool:
        return bool(self.outputs or self.handoffs or self.frees or self.rebuilds)


def _plain(out: TokenOutput) -> bool:
    return (
        len(out.token_ids) == 1 and not out.error and not out.logprobs
        and not out.prompt_logprobs and not out.retryable
    )  # fmt: skip


__all__ = ["Outbox"]
