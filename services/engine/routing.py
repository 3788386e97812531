"""Where an engine's requests go: its role's knobs, and each request's destinations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.protocol import ShardAddress
from common.scheduling.batching import Sequence as Seq
from common.scheduling.shard_choice import holds_whole_requests


@dataclass(frozen=True)
class EngineRole:
    """Role plus the knobs that differ between roles."""

    name: str  # prompt | token | mixed
    command_endpoint: str  # how others address this engine (handoffs, self-detection)
    layer_wise_min_tokens: int = 256  # prompts this long ship KV layer by layer (§IV-C)
    shard_num_blocks: int = 0  # KV capacity of the shard group this engine decodes against
    # "pull": a sharded hand-off joins decode steps only once every shard said its KV landed
    # (`DecodeAdmission`); "push": at once (a shard's step then waits for KV still in flight).
    kv_transfer: str = "push"
    # Neo's two tiers (token engines with a shard group): the local tier's budget in blocks (0:
    # no local tier, every hand-off with shards decodes there), the `TierPolicy` by config name
    # (common/scheduling/tiers.py), and this engine's UCX KV listener (swaps need it).
    local_kv_blocks: int = 0
    tier_policy: str = ""
    kv_address: str = ""

    def __post_init__(self) -> None:
        if self.name not in ("prompt", "token", "mixed"):
            raise ValueError(f"engine role must be prompt, token or mixed, got {self.name!r}")


@dataclass
class RequestRoute:
    """Where a request's tokens, KV and decode go (from GenerateRequest or DecodeHandoff)."""

    reply_to: str
    token_engine: str = ""
    token_kv_endpoint: str = ""
    token_kv_address: str = ""
    shards: tuple[ShardAddress, ...] = ()
    num_prompt_tokens: int = 0


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
