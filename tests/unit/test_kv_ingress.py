"""`KvIngress`: where shipped KV lands, for token engines and shards alike. Layer-wise and
all-at-once pages land at the right slots; tombstones drop late pages; leases free unclaimed KV;
KV that does not fit is refused without touching anyone else's blocks. A fake clock stands in
for time."""

from __future__ import annotations

import pytest
import torch

from common.block_manager import BlockManager
from common.kv_cache import KVCache
from common.kv_ingress import KvIngress, Landed
from common.protocol import KvPages

LAYERS, BLOCK, HEADS, DIM = 3, 4, 2, 8


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ingress(num_blocks: int = 16, clock: Clock | None = None) -> KvIngress:
    cache = KVCache(LAYERS, num_blocks, BLOCK, HEADS, DIM, torch.float32)
    return KvIngress(BlockManager(num_blocks, BLOCK), cache, lease_s=60, clock=clock or Clock())


def pages(req_id: str, num_tokens: int, layer: int = 0, num_layers: int = LAYERS) -> KvPages:
    return KvPages(req_id, layer, num_layers, num_tokens, 0, HEADS, total_layers=LAYERS)


def test_layer_wise_pages_land_where_the_block_table_says_and_complete_at_the_last_layer():
    kv = ingress()
    k = torch.randn(LAYERS, 7, HEADS, DIM)
    v = torch.randn(LAYERS, 7, HEADS, DIM)
    for layer in range(LAYERS):
        landed = kv.receive(pages("a", 7, layer, 1), k[layer : layer + 1], v[layer : layer + 1])
        assert landed is (Landed.COMPLETE if layer == LAYERS - 1 else Landed.PARTIAL)
        assert kv.is_complete("a") is (layer == LAYERS - 1)
    table = kv.blocks.block_table("a")
    for layer in range(LAYERS):
        got_k, got_v = kv.cache.gather(layer, table, 7)
        assert torch.equal(got_k, k[layer]) and torch.equal(got_v, v[layer])


def test_pages_after_a_free_are_dropped_and_allocate_nothing():
    kv = ingress()
    kv.receive(pages("a", 5, 0, 1), torch.randn(1, 5, HEADS, DIM), torch.randn(1, 5, HEADS, DIM))
    kv.free("a")  # aborted mid-transfer
    late = kv.receive(
        pages("a", 5, 1, 2), torch.randn(2, 5, HEADS, DIM), torch.randn(2, 5, HEADS, DIM)
    )
    assert late is Landed.DROPPED and kv.has_ended("a")
    assert kv.blocks.num_used_blocks == 0 and not kv.is_complete("a")


def test_kv_that_does_not_fit_is_refused_alone():
    kv = ingress(num_blocks=4)  # 16 tokens
    x = torch.randn(LAYERS, 12, HEADS, DIM)
    assert kv.receive(pages("fits", 12), x, x) is Landed.COMPLETE
    big = torch.randn(LAYERS, 9, HEADS, DIM)
    assert kv.receive(pages("big", 9), big, big) is Landed.REFUSED
    assert kv.was_refused("big") and kv.receive(pages("big", 9), big, big) is Landed.REFUSED
    assert kv.blocks.req_ids() == ["fits"] and kv.blocks.num_used_blocks == 3


def test_a_shard_holds_the_whole_reserved_length_from_the_first_page_or_refuses_it():
    """A shard cannot preempt: `reserve_tokens` (prompt + max_tokens) is held from the first page
    on, so the request then grows to its whole length without failing; one whose whole length
    does not fit is refused at once, while it can still be re-run elsewhere."""
    kv = ingress(num_blocks=6)  # 24 tokens
    x = torch.randn(LAYERS, 5, HEADS, DIM)
    held = KvPages("a", 0, LAYERS, 5, 0, HEADS, total_layers=LAYERS, reserve_tokens=15)
    assert kv.receive(held, x, x) is Landed.COMPLETE
    assert kv.blocks.num_used_blocks == 4  # 15 tokens, not 5
    too_long = KvPages("b", 0, LAYERS, 5, 0, HEADS, total_layers=LAYERS, reserve_tokens=12)
    assert kv.receive(too_long, x, x) is Landed.REFUSED  # its prompt fits, its length does not
    kv.blocks.grow("a", 15)  # decoding to its last token takes no new block
    assert kv.blocks.num_used_blocks == 4 and kv.blocks.num_free_blocks == 2


def test_unclaimed_kv_expires_and_claimed_or_forgotten_kv_never():
    clock = Clock()
    kv = ingress(clock=clock)
    for req_id in ("orphan", "claimed", "forgotten"):
        x = torch.randn(LAYERS, 3, HEADS, DIM)
        kv.receive(pages(req_id, 3), x, x)
    kv.claim("claimed")
    kv.claim("forgotten")
    kv.forget("forgotten")  # a token engine's scheduler owns these blocks now
    clock.now = 59
    assert kv.expire_leases() == []
    clock.now = 61
    assert kv.expire_leases() == ["orphan"]
    assert sorted(kv.blocks.req_ids()) == ["claimed", "forgotten"]
    assert kv.claimed() == ["claimed"]


def test_a_claim_before_the_kv_arrives_keeps_it_off_the_lease():
    clock = Clock()
    kv = ingress(clock=clock)
    kv.claim("early")  # the hand-off beat its KV
    x = torch.randn(LAYERS, 3, HEADS, DIM)
    kv.receive(pages("early", 3), x, x)
    clock.now = 1000
    assert kv.expire_leases() == [] and kv.blocks.req_ids() == ["early"]


def test_pages_that_do_not_fit_the_cache_raise_before_anything_is_kept():
    kv = ingress()
    good = torch.randn(LAYERS, 5, HEADS, DIM)
    bad = [
        (pages("a", 5), torch.randn(LAYERS, 5, HEADS + 1, DIM)),  # another head count
        (pages("a", 5), torch.randn(LAYERS, 4, HEADS, DIM)),  # fewer tokens than announced
        (pages("a", 5, layer=2, num_layers=2), good[:2]),  # past the last layer
        (KvPages("a", 0, LAYERS, 5, 0, HEADS, total_layers=LAYERS + 1), good),
        (pages("a", 5), good.to(torch.int64)),
    ]
    for header, k in bad:
        with pytest.raises(ValueError, match="do not fit"):
            kv.receive(header, k, k)
    assert kv.blocks.num_used_blocks == 0 and not kv.has_ended("a")
    assert kv.receive(pages("a", 5), good, good) is Landed.COMPLETE


def test_a_token_engine_keeps_its_running_requests_growth_free():
    """`keep_free`: the blocks a token engine's running requests may still grow into. KV landing
    for another request never takes them (it is refused alone instead), so no decode step of
    the running ones runs out of blocks."""
    reserved = [3]
    cache = KVCache(LAYERS, 6, BLOCK, HEADS, DIM, torch.float32)
    kv = KvIngress(BlockManager(6, BLOCK), cache, keep_free=lambda: reserved[0])
    x = torch.randn(LAYERS, 9, HEADS, DIM)  # 3 blocks: 6 free, 3 kept
    assert kv.receive(pages("a", 9), x, x) is Landed.COMPLETE
    assert kv.receive(pages("b", 9), x, x) is Landed.REFUSED  # 3 free, all kept
    reserved[0] = 0  # the running ones finished
    assert kv.receive(pages("c", 9), x, x) is Landed.COMPLETE
    assert kv.blocks.req_ids() == ["a", "c"]
