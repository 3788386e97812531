"""What an engine's config and shard group build before any request arrives: the model, its paged
KV (the cache and the block manager over it), the runner that steps it against local KV and the
shard group, the grammar compiler its requests' matchers come from, and Neo's tier policy and KV
swaps (when the engine has a local tier beside its shards). `Engine.__init__` (engine.py) takes
these and adds the per-request state, which starts empty.

A config error (an unreadable model, unknown attention backend or tier policy, a Neo cost table
that cannot be read or probed) raises here, so the engine never starts half-built.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from common.attention import select_backend
from common.block_manager import BlockManager
from common.config import EngineConfig
from common.engine.grammars import EngineGrammars
from common.kv_cache import KVCache
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.protocol import ShardAddress
from common.scheduling.tiers import TierPolicy
from services.engine.kv_shipper import KvSend
from services.engine.routing import EngineRole
from services.engine.runner import MeshModelRunner, ShardLink
from services.engine.tiering import build_tier_policy
from services.engine.tiers import KvSwaps


@dataclass(frozen=True)
class EngineParts:
    model: LlamaForCausalLM
    blocks: BlockManager
    kv: KVCache
    runner: MeshModelRunner
    grammars: EngineGrammars  # matchers live on each `Request`, rebuilt from its tokens
    tier_policy: TierPolicy
    swaps: KvSwaps | None  # None: one tier (no local budget, or no KV listener for replies)


def build_engine_parts(
    config: EngineConfig,
    role: EngineRole,
    kv_send: KvSend,
    shard_links: Seq[ShardLink],
    shards: Seq[ShardAddress],
) -> EngineParts:
    """The parts of an engine in `role` whose runner reaches `shards` through `shard_links`."""
    model = load_model(config.model_path, config.dtype)
    mc, c = model.config, config.cache
    blocks = BlockManager(
        c.num_blocks, c.block_size, c.enable_prefix_caching, Path(config.model_path).name
    )
    kv = KVCache(
        mc.num_hidden_layers, c.num_blocks, c.block_size, mc.num_key_value_heads,
        mc.head_dim, getattr(torch, mc.dtype),
    )  # fmt: skip
    runner = MeshModelRunner(
        model, kv, blocks, select_backend(config.attention_backend),
        shard_links=shard_links, shards=shards,
    )  # fmt: skip
    grammars = EngineGrammars(config.model_path, mc.vocab_size, mc.eos_token_ids)
    # Neo's local tier beside the shard group: swaps need a budget and a KV listener.
    tier_policy = build_tier_policy(role.tier_policy, runner, len(shards))
    swaps = (
        KvSwaps(blocks, kv, kv_send, role.kv_address)
        if role.local_kv_blocks and role.kv_address
        else None
    )
    return EngineParts(model, blocks, kv, runner, grammars, tier_policy, swaps)


__all__ = ["EngineParts", "build_engine_parts"]
