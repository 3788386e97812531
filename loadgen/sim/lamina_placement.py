"""Where running requests' KV sits in an attention group (Lamina §4.4, Fig. 9).

Head-level partitioning gives every device the same slice of every request's KV heads: one pool,
perfectly balanced, so attention time is the group's KV over the group's bandwidth. Request-level
partitioning puts each request's whole KV on one device (here the least loaded one with room):
any device can serve any head count, but devices fill unevenly, so a new request may wait while
the group as a whole has room, and the group's attention takes as long as its busiest device.
Both count KV in tokens, reserved for a request's whole final context at admission.
"""

from __future__ import annotations

from enum import StrEnum


class Partition(StrEnum):
    """How the attention group splits the work (Fig. 9)."""

    HEAD = "head"
    REQUEST = "request"


class KVPlacement:
    """Reserved KV and current contexts per device (one pool for head-level)."""

    def __init__(self, capacity_tokens: int, num_devices: int, partition: Partition) -> None:
        if capacity_tokens <= 0 or num_devices < 1:
            raise ValueError("kv placement: need a positive capacity and at least one device")
        self.num_pools = num_devices if partition is Partition.REQUEST else 1
        self.pool_capacity = capacity_tokens // self.num_pools
        self.reserved = [0] * self.num_pools
        self.context = [0.0] * self.num_pools  # tokens attended to, grows one per request a step
        self.count = [0] * self.num_pools

    def fits_alone(self, tokens: int) -> bool:
        return tokens <= self.pool_capacity

    def place(self, tokens: int, context: int) -> int | None:
        """Reserve `tokens` for a request now at `context`; its pool, or None if none has room."""
        pool = min(range(self.num_pools), key=lambda i: self.reserved[i])
        if self.reserved[pool] + tokens > self.pool_capacity:
            return None
        self.reserved[pool] += tokens
        self.context[pool] += context
        self.count[pool] += 1
        return pool

    def free(self, pool: int, tokens: int) -> None:
        """A request whose final context is `tokens` finished."""
        self.reserved[pool] -= tokens
        self.context[pool] -= tokens
        self.count[pool] -= 1

    def advance(self, num_steps: int) -> None:
        for i in range(self.num_pools):
            self.context[i] += self.count[i] * num_steps

    def total_context(self, steps_ahead: float = 0.0) -> float:
        return sum(self.context) + sum(self.count) * steps_ahead

    def imbalance(self, steps_ahead: float = 0.0) -> float:
        """Busiest pool's context over the mean pool's: how much longer request-level attention
        takes than a balanced split of the same KV (1 for head-level)."""
        contexts = [c + n * steps_ahead for c, n in zip(self.context, self.count, strict=True)]
        total = sum(contexts)
        return max(contexts) * self.num_pools / total if total > 0 else 1.0
