"""What an engine input or step sends, each message with its endpoint, sorted by the socket it
leaves on: `Engine` owns no sockets, its worker sends an `Outbox` as it is."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from common.protocol import DecodeHandoff, FreeRequest, TokenOutput


@dataclass
class Outbox:
    """Messages to send, by channel.

    - `outputs`: tokens and errors, to the request's router inbox (`reply_to`);
    - `handoffs`: prefilled requests, to their token engine's command socket;
    - `frees`: to a KV-ingress socket (a shard's, or a token engine's own). They travel there, and
      not on a command socket, so that a free can never overtake the KV pages it frees.
    """

    outputs: list[tuple[str, TokenOutput]] = field(default_factory=list)
    handoffs: list[tuple[str, DecodeHandoff]] = field(default_factory=list)
    frees: list[tuple[str, FreeRequest]] = field(default_factory=list)

    @classmethod
    def output(cls, reply_to: str, message: TokenOutput) -> Outbox:
        return cls(outputs=[(reply_to, message)])

    @classmethod
    def free(cls, req_id: str, kv_endpoints: Iterable[str]) -> Outbox:
        return cls(frees=[(endpoint, FreeRequest(req_id)) for endpoint in kv_endpoints])

    def __iadd__(self, other: Outbox) -> Outbox:
        self.outputs += other.outputs
        self.handoffs += other.handoffs
        self.frees += other.frees
        return self

    def __add__(self, other: Outbox) -> Outbox:
        return Outbox(
            self.outputs + other.outputs, self.handoffs + other.handoffs, self.frees + other.frees
        )

    def __bool__(self) -> bool:
        return bool(self.outputs or self.handoffs or self.frees)


__all__ = ["Outbox"]
