"""KV leases on an attention shard (`AttentionShard.expire_leases`): KV that no decode step claims
within the lease is freed (its hand-off never came, so no free would); claimed KV is the token
engine's to free and is never expired. A fake clock stands in for time."""

from __future__ import annotations

import torch

from common.attention.torch_ref import TorchPagedAttention
from common.protocol import AttendBatch, KvPages
from services.shard.shard import AttentionShard, ShardSpec

SPEC = ShardSpec(num_layers=2, head_start=0, head_end=1, num_queries_per_kv=2, head_dim=8,
                 num_blocks=16, block_size=4, dtype=torch.float32, scale=8**-0.5)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def land(shard: AttentionShard, req_id: str, num_tokens: int) -> None:
    pages = KvPages(req_id, 0, 2, num_tokens, 0, 1, total_layers=2)
    kv = torch.randn(2, num_tokens, 1, 8)
    shard.receive_kv(pages, kv, kv.clone())


def decode_once(shard: AttentionShard, req_id: str, context_len: int) -> None:
    q, kv = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    shard.attend(AttendBatch(0, 0, [req_id], [context_len]), q, kv, kv.clone())


def test_unclaimed_kv_is_freed_after_its_lease_and_claimed_kv_never() -> None:
    clock = Clock()
    shard = AttentionShard("s0", SPEC, TorchPagedAttention(), lease_s=60, clock=clock)
    land(shard, "orphan", 6)  # its prompt engine died before the hand-off
    land(shard, "decoding", 5)
    decode_once(shard, "decoding", 6)
    clock.now = 59
    assert shard.expire_leases() == []
    clock.now = 61
    assert shard.expire_leases() == ["orphan"]
    assert shard.blocks.req_ids() == ["decoding"]
    land(shard, "orphan", 6)  # a late page of the expired request: dropped, not re-allocated
    assert shard.blocks.req_ids() == ["decoding"]
    clock.now = 1000
    assert shard.expire_leases() == [] and shard.blocks.req_ids() == ["decoding"]
