"""Neo's two KV tiers: the pure tier policies (fabricated state in, decisions out) and `KvSwaps`
moving one request's KV out to two in-process attention shards and back, checked against the KV
it started with; a refused swap, pages that do not match, a stalled swap and a shard that lost
the request each fail that request alone."""

from __future__ import annotations

import pytest
import torch

from common.attention.torch_ref import TorchPagedAttention
from common.block_manager import BlockManager
from common.kv_cache import KVCache
from common.kv_ingress import Landed
from common.protocol import FetchKv, KvPages, KvSwapAck, ShardAddress
from common.scheduling.batching import Sequence
from common.scheduling.tiers import (
    AlternateTiers,
    FillLocalFirst,
    Tier,
    TierRequest,
    TierState,
    tier_policy,
)
from services.engine.kv_swaps import SWAP_TIMEOUT_S, KvSwaps, SwapFailed
from services.shard.shard import AttentionShard, ShardSpec
from tests.unit.test_host_staging import CountingStaging

LAYERS, HEADS, DIM, BLOCK = 2, 4, 8, 4
SHARDS = [
    ShardAddress("tcp://s0", 0, 2, kv_address="s0"),
    ShardAddress("tcp://s1", 2, 4, kv_address="s1"),
]


def req(req_id: str, tier: Tier, max_len: int, num_out: int = 1) -> TierRequest:
    return TierRequest(req_id, tier, max_len // 2, num_out, max_len)


# -- policies ---------------------------------------------------------------------------------


def test_fill_local_first_swaps_in_oldest_first_within_the_budget_and_never_out():
    state = TierState(
        [req("local", Tier.LOCAL, 16), req("moving", Tier.MOVING, 16),
         req("a", Tier.OFFLOADED, 16), req("big", Tier.OFFLOADED, 40),
         req("b", Tier.OFFLOADED, 12)],
        local_budget_blocks=12, block_size=BLOCK,
    )  # fmt: skip
    # 4 + 4 blocks promised (a moving request counts: it may be coming in); 4 left: a fits,
    # then nothing (big needs 10, b 3 after a took the 4).
    plan = FillLocalFirst().plan(state)
    assert (plan.swap_in, plan.swap_out) == (["a"], [])
    assert plan.two_batch  # "local" steps locally, "big" and "b" on the shards: two sub-batches
    only_local = TierState([req("local", Tier.LOCAL, 16)], 12, BLOCK)
    assert not FillLocalFirst().plan(only_local).two_batch
    # A request whose prefill KV may still be landing on the shards is neither swapped in nor
    # counted against the local budget; it steps on the shards beside the local ones.
    arriving = TierState([req("local", Tier.LOCAL, 16), req("new", Tier.ARRIVING, 16),
                          req("c", Tier.OFFLOADED, 32)], 12, BLOCK)  # fmt: skip
    plan = FillLocalFirst().plan(arriving)
    assert plan.swap_in == ["c"] and plan.two_batch


def test_alternate_tiers_flips_each_period_of_output_tokens_room_permitting():
    state = TierState(
        [req("stay", Tier.LOCAL, 16, num_out=5), req("out", Tier.LOCAL, 16, num_out=8),
         req("in", Tier.OFFLOADED, 16, num_out=4), req("no_room", Tier.OFFLOADED, 16, num_out=4)],
        local_budget_blocks=12, block_size=BLOCK,
    )  # fmt: skip
    plan = AlternateTiers(4).plan(state)
    assert plan.swap_out == ["out"] and plan.swap_in == ["in"]
    assert plan.two_batch  # "stay" is local, "no_room" offloaded: both step


def test_tier_policy_by_name():
    assert isinstance(tier_policy(""), FillLocalFirst)
    assert isinstance(tier_policy("alternate:3"), AlternateTiers)
    for bad in ("neo", "alternate", "alternate:0", "alternate:x"):
        with pytest.raises(ValueError):
            tier_policy(bad)


# -- swaps ------------------------------------------------------------------------------------


def make_shard(shard_id: str, head_start: int, head_end: int) -> AttentionShard:
    spec = ShardSpec(LAYERS, head_start, head_end, 1, DIM, 16, BLOCK, torch.float32, DIM**-0.5)
    return AttentionShard(shard_id, spec, TorchPagedAttention())


class Mesh:
    """An engine's local tier and two shards, KV sent by direct calls; the acks are collected."""

    def __init__(self) -> None:
        self.blocks = BlockManager(16, BLOCK)
        self.cache = KVCache(LAYERS, 16, BLOCK, HEADS, DIM, torch.float32)
        self.shards = {"s0": make_shard("s0", 0, 2), "s1": make_shard("s1", 2, 4)}
        self.acks: list[KvSwapAck] = []
        self.swaps = KvSwaps(self.blocks, self.cache, self.send, reply_to="engine")

    def send(self, dest: ShardAddress, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> None:
        landed = self.shards[dest.kv_address].receive_kv(pages, k, v)
        if landed is not Landed.PARTIAL:  # as the shard worker answers `ack_to`
            error = "" if landed is Landed.COMPLETE else landed.value
            self.acks.append(KvSwapAck(pages.req_id, dest.head_start, dest.head_end, error))

    def local_kv(self, req_id: str, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        table = self.blocks.block_table(req_id)
        return [self.cache.gather(layer, table, num_tokens) for layer in range(LAYERS)]


def seeded_request(mesh: Mesh, req_id: str, num_tokens: int) -> Sequence:
    """A local decode request holding KV for all but its last token."""
    mesh.blocks.allocate(req_id, num_tokens)
    slots = torch.tensor(mesh.blocks.slots(req_id, 0, num_tokens - 1))
    for layer in range(LAYERS):
        k = torch.randn(num_tokens - 1, HEADS, DIM)
        mesh.cache.write(layer, k, -k, slots)
    return Sequence(req_id, num_tokens, num_computed=num_tokens - 1)


@pytest.mark.parametrize("staged", [False, True], ids=["cpu", "device_staging"])
def test_kv_swapped_out_and_back_in_is_the_kv_it_started_with(staged: bool):
    """Also as a GPU engine's local tier swaps: each layer leaves through the host staging (a
    counting stand-in for the pinned copies) once, both shards' heads sliced from that copy."""
    mesh = Mesh()
    staging = CountingStaging()
    if staged:
        mesh.swaps.staging = staging
    seq = seeded_request(mesh, "r", 11)
    before = mesh.local_kv("r", 10)
    mesh.swaps.swap_out(seq, SHARDS, reserve_tokens=20, now=0.0)
    assert mesh.blocks.has("r"), "the local copy stays until every shard acknowledged"
    assert mesh.swaps.on_ack(mesh.acks[0]) is None and mesh.blocks.has("r")
    move = mesh.swaps.on_ack(mesh.acks[1])
    assert move is not None and move.seq is seq and not mesh.blocks.has("r")
    mesh.cache.key.zero_(), mesh.cache.value.zero_()  # nothing local is left to read back
    out = mesh.swaps.swap_in(seq, SHARDS, now=1.0)
    fetches = [(endpoint, m) for endpoint, m in out.frees if isinstance(m, FetchKv)]
    assert [e for e, _ in fetches] == ["tcp://s0", "tcp://s1"]
    done = []
    for (_, fetch), shard in zip(fetches, mesh.shards.values(), strict=True):
        assert fetch.num_tokens == 10 and fetch.reply_to == "engine"
        k, v = shard.read_kv("r", fetch.num_tokens)  # what the shard worker sends, per layer
        for layer in range(LAYERS):
            h0, h1 = shard.spec.head_start, shard.spec.head_end
            pages = KvPages("r", layer, 1, 10, h0, h1, LAYERS)
            done.append(mesh.swaps.on_pages(pages, k[layer : layer + 1], v[layer : layer + 1]))
    assert done[:-1] == [None] * (len(done) - 1) and done[-1] is not None
    for (k0, v0), (k1, v1) in zip(before, mesh.local_kv("r", 10), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert mesh.swaps.num_swaps == {Tier.LOCAL: 1, Tier.OFFLOADED: 1}
    assert staging.to_host_calls == ([2] * LAYERS if staged else [])


def test_a_request_swapped_in_then_out_again_lands_on_shards_that_freed_it():
    mesh = Mesh()
    seq = seeded_request(mesh, "r", 6)
    for shard in mesh.shards.values():  # it was there before, swapped in and freed: a tombstone
        shard.free("r")
    mesh.swaps.swap_out(seq, SHARDS, reserve_tokens=10, now=0.0)
    assert [a.error for a in mesh.acks] == ["", ""]


def test_a_refused_swap_out_fails_its_request_and_keeps_nothing_on_that_shard():
    mesh = Mesh()
    seq = seeded_request(mesh, "r", 6)
    mesh.swaps.swap_out(seq, SHARDS, reserve_tokens=16 * BLOCK + 1, now=0.0)  # fits no shard
    assert {a.error for a in mesh.acks} == {"refused"}
    with pytest.raises(SwapFailed):
        mesh.swaps.on_ack(mesh.acks[0])
    mesh.swaps.drop("r")  # the engine ends it: both copies go
    assert not mesh.blocks.has("r") and "r" not in mesh.swaps.moving
    assert all(not s.blocks.has("r") for s in mesh.shards.values())


def test_swap_in_pages_that_do_not_match_the_fetch_are_refused_before_any_write():
    mesh = Mesh()
    seq = Sequence("r", 9, num_computed=8)
    mesh.swaps.swap_in(seq, SHARDS, now=0.0)
    good = torch.ones(1, 8, 2, DIM)
    for pages, k in [
        (KvPages("r", 0, 1, 7, 0, 2, LAYERS), torch.ones(1, 7, 2, DIM)),  # too few tokens
        (KvPages("r", 0, 1, 8, 1, 3, LAYERS), good),  # heads no shard of the fetch holds
        (KvPages("r", 5, 1, 8, 0, 2, LAYERS), good),  # a layer it does not have
    ]:
        with pytest.raises(ValueError):
            mesh.swaps.on_pages(pages, k, k)
    assert mesh.cache.key.abs().sum() == 0


def test_a_stalled_swap_expires_and_a_shard_without_the_request_cannot_serve_it():
    mesh = Mesh()
    mesh.swaps.swap_in(Sequence("r", 9, num_computed=8), SHARDS, now=0.0)
    assert mesh.swaps.expired(SWAP_TIMEOUT_S / 2) == []
    assert mesh.swaps.expired(SWAP_TIMEOUT_S + 1) == ["r"]
    with pytest.raises(KeyError):  # the shard worker answers KvSwapAck(error=...) for this
        mesh.shards["s0"].read_kv("r", 8)
    with pytest.raises(SwapFailed):
        mesh.swaps.on_ack(KvSwapAck("r", 0, 2, "no KV here"))
    mesh.swaps.drop("r")
    assert mesh.blocks.num_used_blocks == 0
