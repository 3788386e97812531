"""Request-level shard partitioning (Lamina Fig. 9a): which shard of a group holds a request.

With `shard_partition: head` every shard of a group holds a slice of KV heads of every request.
With `shard_partition: request` every shard holds all heads, and each request's whole KV lives on
one shard of its token engine's group, so a model with fewer KV heads than shards still spreads.
The shard is the one with the fewest KV tokens: its token engine's latest report
(`LoadReport.shard_kv_tokens`) plus what this router placed there since. All shards of a group
have one geometry, so KV tokens are KV bytes up to a constant.

Pure: plain state in, a decision out (the router and the simulator can both call it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class HeadRange(Protocol):
    @property
    def head_start(self) -> int: ...
    @property
    def head_end(self) -> int: ...
    @property
    def kv_endpoint(self) -> str: ...


def holds_whole_requests(group: Sequence[HeadRange]) -> bool:
    """A group of shards that each hold every head (so each holds whole requests): request
    partitioning. Head partitioning always gives its members different head ranges."""
    ranges = {(s.head_start, s.head_end) for s in group}
    return len(group) > 1 and len(ranges) == 1


class ShardKvLoads:
    """KV tokens per shard (by kv endpoint), as reported plus placed since."""

    def __init__(self) -> None:
        self._reported: dict[str, int] = {}
        self._placed: dict[str, int] = {}

    def on_report(self, endpoints: Sequence[str], kv_tokens: Sequence[int]) -> None:
        """A token engine's report: its shards' KV tokens now (what was placed is in them, or
        soon will be: the estimate keeps the larger)."""
        for endpoint, tokens in zip(endpoints, kv_tokens, strict=False):
            self._reported[endpoint] = tokens
            self._placed[endpoint] = 0

    def choose(self, group: Sequence[str], num_tokens: int) -> int:
        """The index in `group` of the shard with the fewest KV tokens (the first on a tie); the
        request's `num_tokens` are counted there from now on."""
        best = min(range(len(group)), key=lambda i: self.load(group[i]))
        self._placed[group[best]] = self._placed.get(group[best], 0) + num_tokens
        return best

    def load(self, endpoint: str) -> int:
        return self._reported.get(endpoint, 0) + self._placed.get(endpoint, 0)


__all__ = ["ShardKvLoads", "holds_whole_requests"]
