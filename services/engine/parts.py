"""What an engine is made of, built once from its options before any request arrives: the model
and its paged KV, the runner that steps it against local KV and the shard group, the request
table, the prefill, the two schedulers, decode admission, Neo's KV tiers, its pool lease,
telemetry and reports. `Engine` (engine.py) coordinates them; each owns its state.

A config error (an unreadable model, an unknown attention backend or tier policy, a Neo cost
table that cannot be read or probed, a CUDA device this process lacks) raises here, so the
engine never starts half-built.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from common.attention import select_backend
from common.block_manager import BlockManager
from common.config import SchedulerConfig, cache_dir
from common.device import resolve_device
from common.engine.grammars import EngineGrammars
from common.kv_cache import KVCache
from common.kv_ingress import KvIngress
from common.mesh_options import MeshOptions
from common.model.loader import load_model
from common.protocol import ShardAddress
from common.roles import Role
from common.sampling import Sampler
from common.scheduling.batching import EngineScheduler
from common.scheduling.role_lease import RoleLease
from common.scheduling.shard_choice import holds_whole_requests
from services.engine.admission import DecodeAdmission
from services.engine.kv_shipper import KvSend
from services.engine.kv_swaps import KvSwaps
from services.engine.kv_tiers import KvTiers, build_tier_policy
from services.engine.prefill_chunks import PrefillChunks
from services.engine.prefill_ship import Prefill
from services.engine.reports import EngineReports
from services.engine.requests import RequestTable
from services.engine.runner import MeshModelRunner, ShardLink
from services.engine.shard_rebuild import ShardRebuilds
from services.engine.telemetry import EngineTelemetry


@dataclass(frozen=True)
class EngineParts:
    engine_id: str
    role: Role
    options: MeshOptions  # whole: a part (or the engine) reads the switches of its concern
    command_endpoint: str  # how others address this engine: a mixed engine's own prompts
    runner: MeshModelRunner
    blocks: BlockManager
    sampler: Sampler
    table: RequestTable
    prefill: Prefill
    ship_queue: EngineScheduler  # prompts whose decode happens elsewhere (each leaves shipped)
    local: EngineScheduler  # requests decoding here with local KV (preempted and recomputed)
    kv_ingress: KvIngress  # KV shipped here by prompt engines (no shard group)
    admission: DecodeAdmission  # hand-offs waiting for their KV, and the sharded requests
    tiers: KvTiers
    pool: RoleLease  # the pool it serves in (home, or lent to mixed): what routers place by
    telemetry: EngineTelemetry
    reports: EngineReports
    rebuilds: ShardRebuilds  # a lost shard's heads recomputed (Lamina §5)
    chunks: PrefillChunks  # long prefills a chunk a step, decodes between


def build_engine_parts(
    engine_id: str,
    role: Role,
    options: MeshOptions,
    model_path: str,
    kv_send: KvSend,
    *,
    command_endpoint: str = "",
    kv_address: str = "",
    shard_links: Seq[ShardLink] = (),
    shards: Seq[ShardAddress] = (),
    telemetry: EngineTelemetry | None = None,
) -> EngineParts:
    """The parts of engine `engine_id` in `role`, whose runner reaches `shards` through
    `shard_links` (in head order), whose KV listener is `kv_address` (Neo's swaps need one)."""
    o = options
    device = resolve_device(o.device)
    if device.type != "cpu" and o.model_peers:
        # NOTE: their slices move tensors as host memory (not staged yet).
        raise ValueError(f"model_peers run beside CPU engines only, not {device}")
    model = load_model(model_path, None, device=device, weight_cache=cache_dir(o.weight_cache))
    mc = model.config
    num_blocks = o.blocks_of(role)
    blocks = BlockManager(num_blocks, o.block_size, o.enable_prefix_caching, Path(model_path).name)
    kv = KVCache(mc.num_hidden_layers, num_blocks, o.block_size, mc.num_key_value_heads,
                 mc.head_dim, getattr(torch, mc.dtype), device)  # fmt: skip
    runner = MeshModelRunner(
        model, kv, blocks, select_backend(o.attention_backend, device), shard_links=shard_links,
        shards=shards, reply_timeout_s=o.shard_reply_timeout_s,
        attention_overlap=o.attention_overlap, decode_lanes=o.decode_lanes,
    )  # fmt: skip
    telemetry = telemetry or EngineTelemetry(engine_id, Path(model_path).name)
    sampler = Sampler()
    table = RequestTable(mc, EngineGrammars(model_path, mc.vocab_size, mc.eos_token_ids))
    prefill = Prefill(runner, sampler, kv_send, telemetry, o.layer_wise_min_tokens)
    scheduler = SchedulerConfig(o.max_num_batched_tokens, o.max_num_seqs, o.max_preemptions,
                                o.starvation_s)  # fmt: skip
    ship_queue, local = EngineScheduler(blocks, scheduler), EngineScheduler(blocks, scheduler)
    # Landing KV leaves free what the local requests may still grow into, each up to its whole
    # length, so no local decode step runs out of blocks.
    kv_ingress = KvIngress(blocks, kv, keep_free=lambda: local.blocks_to_grow(table.whole_len))
    # A request-partitioned group holds each request on one shard: its room is the sum.
    group_blocks = o.shard_num_blocks * (len(shards) if holds_whole_requests(shards) else 1)
    admission = DecodeAdmission(group_blocks, o.block_size, o.kv_transfer == "pull",
                                o.max_preemptions, o.starvation_s)  # fmt: skip
    swaps = None
    if o.local_kv_blocks and kv_address and role in (Role.TOKEN, Role.MIXED):
        swaps = KvSwaps(blocks, kv, kv_send, kv_address)
    policy = build_tier_policy(o.tier_policy, runner, len(shards))
    tiers = KvTiers(policy, swaps, o.local_kv_blocks, runner)
    pool = RoleLease(role)
    reports = EngineReports(engine_id, pool, table, blocks, kv_ingress, (ship_queue, local),
                            admission, prefill, tiers, runner, telemetry)  # fmt: skip
    return EngineParts(engine_id, role, options, command_endpoint, runner, blocks, sampler, table,
                       prefill, ship_queue, local, kv_ingress, admission, tiers, pool, telemetry,
                       reports, ShardRebuilds(o.shard_rebuild_wait_s),
                       PrefillChunks(o.prefill_chunk_tokens))  # fmt: skip


__all__ = ["EngineParts", "build_engine_parts"]
