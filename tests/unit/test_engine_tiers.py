"""A token engine's swaps fail their request alone, retryably, and free both tiers' copies: a
shard that refuses a swap-out, a swap that stalls (a shard died mid-swap), and the shard group
lost mid-swap. In-process `Engine`, its KV sends and the shards' answers carried by hand."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from common.mesh_options import MeshOptions
from common.protocol import (
    DecodeHandoff,
    FreeRequest,
    KvPages,
    KvSwapAck,
    SamplingSpec,
    ShardAddress,
)
from common.roles import Role
from services.engine.engine import Engine
from services.engine.faults import EngineFaults
from services.engine.kv_swaps import SWAP_TIMEOUT_S
from services.engine.outbox import Outbox

SHARDS = [ShardAddress("s0-kv", 0, 1, "s0-link", "s0", "s0-ucx"),
          ShardAddress("s1-kv", 1, 2, "s1-link", "s1", "s1-ucx")]  # fmt: skip


class Sent:
    def __init__(self) -> None:
        self.pages: list[tuple[ShardAddress, KvPages]] = []

    def __call__(
        self, dest: ShardAddress, pages: KvPages, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        self.pages.append((dest, pages))


def swapping_out(model_path: Path) -> tuple[Engine, Sent]:
    """A token engine whose one request (local KV) has just started swapping out."""
    sent = Sent()
    options = MeshOptions(num_blocks=1024, local_kv_blocks=64, tier_policy="alternate:1")
    engine = Engine.build(
        "t",
        Role.TOKEN,
        options,
        str(model_path),
        sent,
        command_endpoint="t-cmd",
        kv_address="t-ucx",
        shard_links=[object(), object()],
        shards=SHARDS,
    )
    mc = engine.runner.model.config
    layers, heads = mc.num_hidden_layers, mc.num_key_value_heads
    greedy = SamplingSpec(max_tokens=8, temperature=0.0)
    handoff = DecodeHandoff("r", list(range(10, 30)), 19, greedy, "router", num_kv_layers=layers)
    engine.on_handoff(handoff)
    k = torch.randn(layers, 20, heads, mc.head_dim)
    engine.on_kv(KvPages("r", 0, layers, 20, 0, heads, layers), k, -k)
    out = engine.step()  # local decode: its 2nd token; alternate:1 wants it offloaded next
    assert [o.token_ids for _, o in out.outputs] and not sent.pages
    engine.step()  # the swap-out starts; the request sits this step out
    assert {p.ack_to for _, p in sent.pages} == {"t-ucx"} and len(sent.pages) == 2 * layers
    assert engine.blocks.has("r"), "the local copy stays until the shards acknowledge"
    return engine, sent


def assert_ended_retryably_and_freed(engine: Engine, out: Outbox) -> None:
    [(_, error)] = out.outputs
    assert error.error and error.retryable and error.finish_reason == "error"
    frees = {endpoint for endpoint, m in out.frees if isinstance(m, FreeRequest)}
    assert frees == {"s0-kv", "s1-kv"}  # the shards may hold some of it
    assert engine.blocks.num_used_blocks == 0 and not engine.table.requests
    assert not engine.has_work()


def test_a_swap_out_completes_only_when_every_shard_acknowledged(tiny_model_path):
    engine, _ = swapping_out(tiny_model_path)
    assert engine.on_swap_ack(KvSwapAck("r", 0, 1)) == Outbox()
    assert engine.blocks.has("r") and not engine.admission.sharded
    engine.on_swap_ack(KvSwapAck("r", 1, 2))
    assert not engine.blocks.has("r") and [s.req_id for s in engine.admission.sharded] == ["r"]
    assert [e.what for e in engine.stats().kv_events][-1] == "swapped_out"


def test_a_refused_swap_out_ends_its_request_retryably(tiny_model_path):
    engine, _ = swapping_out(tiny_model_path)
    engine.on_swap_ack(KvSwapAck("r", 0, 1))
    out = engine.on_swap_ack(KvSwapAck("r", 1, 2, error="its KV was refused here"))
    assert_ended_retryably_and_freed(engine, out)
    assert engine.on_swap_ack(KvSwapAck("r", 0, 1)) == Outbox()  # a late answer: nothing waits


@pytest.mark.parametrize("fault", ["stalled", "group_lost"])
def test_a_swap_cut_off_by_a_lost_shard_ends_its_request_retryably(tiny_model_path, fault):
    engine, _ = swapping_out(tiny_model_path)
    if fault == "stalled":  # a shard died before acknowledging: no answer ever comes
        out = EngineFaults(engine).expire(time.monotonic() + SWAP_TIMEOUT_S + 1)
    else:  # the registry dropped a shard: the worker relinks to no group
        out = EngineFaults(engine).relink([], [], "a shard of its group stopped answering")
    assert_ended_retryably_and_freed(engine, out)
