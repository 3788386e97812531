"""Where an engine's requests go: each request's destinations, and its shard group's shape."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.protocol import ShardAddress
from common.scheduling.batching import Sequence as Seq
from common.scheduling.shard_choice import holds_whole_requests


@dataclass
class RequestRoute:
    """Where a request's tokens, KV and decode go (from GenerateRequest or DecodeHandoff)."""

    reply_to: str
    token_engine: str = ""
    token_kv_endpoint: str = ""
    token_kv_address: str = ""
    shards: tuple[ShardAddress, ...] = ()
    num_prompt_tokens: int = 0
    # A `RebuildKv` (a lost shard's heads recomputed): the token engine to answer; no client here.
    rebuild_for: str = ""


def kv_endpoints(shards: Sequence[ShardAddress]) -> list[str]:
    return [s.kv_endpoint for s in shards]


def placed_in(placed: Sequence[ShardAddress], group: Sequence[ShardAddress]) -> bool:
    """A hand-off's shards are this engine's group still: all of it (heads split), or one member
    of a group that holds whole requests (`shard_partition: request`)."""
    if holds_whole_requests(group):
        return len(placed) == 1 and placed[0].kv_endpoint in kv_endpoints(group)
    return kv_endpoints(placed) == kv_endpoints(group)


def shard_of_rows(
    group: Sequence[ShardAddress], routes: dict[str, RequestRoute], sharded: list[Seq]
) -> list[int] | None:
    """A request-partitioned group: the shard (index in `group`) each sharded row's KV is on;
    None for a head-partitioned one (every shard has a slice of every row)."""
    if not holds_whole_requests(group):
        return None
    index = {s.kv_endpoint: i for i, s in enumerate(group)}
    return [index[routes[s.req_id].shards[0].kv_endpoint] for s in sharded]


def shard_kv_tokens(group: Sequence[ShardAddress], reserved: dict[str, int]) -> list[int]:
    """A request-partitioned group: KV tokens reserved on each shard (the router balances new
    requests by them); empty otherwise."""
    if not holds_whole_requests(group):
        return []
    return [reserved.get(s.kv_endpoint, 0) for s in group]
