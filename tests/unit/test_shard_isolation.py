"""Per-request isolation on an attention shard: a request whose KV was refused (no room), never
came, or cannot grow fails alone. Its row reads the shard's scratch block, it is named in the
step's `failed`, and its batch-mates get exactly the attention they get without it."""

from __future__ import annotations

import torch

from common.attention.torch_ref import TorchPagedAttention
from common.kv_ingress import Landed
from common.protocol import AttendBatch, KvPages
from services.shard import shard as shard_module
from services.shard.shard import AttentionShard, ShardSpec

SPEC = ShardSpec(num_layers=1, head_start=0, head_end=2, num_queries_per_kv=2, head_dim=8,
                 num_blocks=4, block_size=4, dtype=torch.float32, scale=8**-0.5)  # fmt: skip


def land(shard: AttentionShard, req_id: str, num_tokens: int, seed: int) -> Landed:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(1, num_tokens, 2, 8, generator=g)
    return shard.receive_kv(KvPages(req_id, 0, 1, num_tokens, 0, 2, total_layers=1), kv, kv * 2)


def step(shard: AttentionShard, batch: AttendBatch, n: int) -> tuple[torch.Tensor, list[str]]:
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(n, 4, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    out, _, failed = shard.attend(batch, q, k, k.clone())
    return out, failed


def test_a_refused_request_fails_alone_and_harms_no_batch_mate(monkeypatch):
    monkeypatch.setattr(shard_module, "KV_WAIT_S", 0.1)  # "never came" need not wait 30 s here
    shard = AttentionShard("s0", SPEC, TorchPagedAttention())
    assert land(shard, "a", 9, seed=1) is Landed.COMPLETE  # 3 of 4 blocks
    assert land(shard, "big", 9, seed=2) is Landed.REFUSED
    alone, failed = step(shard, AttendBatch(1, 0, ["a"], [10]), 1)
    assert failed == []
    # The same row with a refused, a missing and an unknown request beside it.
    batch = AttendBatch(2, 0, ["big", "a", "never"], [10, 10, 5])
    g = torch.Generator().manual_seed(7)
    q_a, k_a = torch.randn(1, 4, 8, generator=g), torch.randn(1, 2, 8, generator=g)
    q = torch.cat([torch.randn(1, 4, 8), q_a, torch.randn(1, 4, 8)])
    k = torch.cat([torch.randn(1, 2, 8), k_a, torch.randn(1, 2, 8)])
    out, _, failed = shard.attend(batch, q, k, k.clone())
    assert failed == ["big", "never"]
    assert torch.allclose(out[1], alone[0])
    assert shard.blocks.req_ids() == ["a"]  # the failed ones hold nothing


def test_a_request_that_cannot_grow_fails_alone():
    shard = AttentionShard("s0", SPEC, TorchPagedAttention())
    assert land(shard, "a", 8, seed=1) is Landed.COMPLETE  # 2 blocks
    assert land(shard, "b", 8, seed=2) is Landed.COMPLETE  # 2 blocks: the shard is full
    _, failed = step(shard, AttendBatch(1, 0, ["a", "b"], [8, 9]), 2)  # b needs a 5th block
    assert failed == ["b"]
    assert sorted(shard.blocks.req_ids()) == ["a", "b"]
