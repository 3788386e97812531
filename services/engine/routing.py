"""Where an engine's requests go: its role's knobs, and each request's destinations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.protocol import ShardAddress


@dataclass(frozen=True)
class EngineRole:
    """Role plus the knobs that differ between roles."""

    name: str  # prompt | token | mixed
    command_endpoint: str  # how others address this engine (handoffs, self-detection)
    layer_wise_min_tokens: int = 256  # prompts this long ship KV layer by layer (§IV-C)
    shard_num_blocks: int = 0  # KV capacity of the shard group this engine decodes against
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
