"""A preempted request's KV on an attention shard (services/engine/admission.py): its token engine
frees it (a `FreeRequest` with the KV's generation, on the control socket) and later ships it
again, recomputed, as the next generation (`KvPages.kv_generation`, on the KV path). The two
travel apart, so either may land first; either way the shard ends holding the new generation
only, and a step that names the request uses it, never the old one."""

from __future__ import annotations

import torch

from common.attention.torch_ref import TorchPagedAttention
from common.protocol import AttendBatch, KvPages
from services.shard.shard import AttentionShard, ShardSpec

SPEC = ShardSpec(num_layers=2, head_start=0, head_end=1, num_queries_per_kv=2, head_dim=8,
                 num_blocks=8, block_size=4, dtype=torch.float32, scale=8**-0.5)  # fmt: skip


def land(shard: AttentionShard, req_id: str, num_tokens: int, generation: int = 0) -> None:
    pages = KvPages(req_id, 0, 2, num_tokens, 0, 1, total_layers=2, reserve_tokens=num_tokens,
                    kv_generation=generation)  # fmt: skip
    kv = torch.full((2, num_tokens, 1, 8), float(generation + 1))
    shard.receive_kv(pages, kv, kv.clone())


def step_fails(shard: AttentionShard, req_id: str, context_len: int) -> bool:
    q, kv = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    _, _, failed = shard.attend(AttendBatch(0, 0, [req_id], [context_len]), q, kv, kv.clone())
    return req_id in failed


def test_the_new_generation_wins_whichever_lands_first() -> None:
    for free_first in (True, False):
        shard = AttentionShard("s0", SPEC, TorchPagedAttention())
        land(shard, "r", 6)
        assert not step_fails(shard, "r", 7)  # decoded: 7 tokens held
        if free_first:
            shard.free("r", kv_generation=0)  # preempted
            land(shard, "r", 8, generation=1)  # recomputed: its 8 tokens so far
        else:
            land(shard, "r", 8, generation=1)  # replaces generation 0 at once
            shard.free("r", kv_generation=0)  # the preemption's free, late: ignored
        assert shard.blocks.req_ids() == ["r"] and shard.blocks.num_tokens("r") == 8
        assert shard.kv.key[0][shard.blocks.block_table("r")[0]].unique().tolist() == [2.0]
        assert not step_fails(shard, "r", 9)
        land(shard, "r", 7, generation=0)  # a page of the old generation, late: dropped
        assert shard.blocks.num_tokens("r") == 9


def test_a_request_freed_for_good_drops_a_generation_still_in_flight() -> None:
    shard = AttentionShard("s0", SPEC, TorchPagedAttention())
    land(shard, "r", 6)
    shard.free("r", kv_generation=0)
    shard.free("r")  # it ended (aborted, or finished at the recompute's token)
    land(shard, "r", 8, generation=1)
    assert shard.blocks.req_ids() == [] and shard.blocks.num_free_blocks == SPEC.num_blocks


def test_a_step_waits_for_room_that_frees_make_and_fails_the_row_without_it() -> None:
    shard = AttentionShard("s0", SPEC, TorchPagedAttention())
    land(shard, "a", 16)  # 4 blocks
    land(shard, "b", 16)  # 4 blocks: the shard is full
    assert step_fails(shard, "a", 17)  # no room to grow, and no free comes (bounded wait)
    shard.free("b", kv_generation=0)  # preempted by the token engine
    assert not step_fails(shard, "a", 17)
