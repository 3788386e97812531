"""Neo's asymmetric pipelining in the token engine's runner: a decode step run as batch-0 (local
KV) and batch-1 (KV on two attention shards) interleaved per layer gives the logits of the same
step run as one batch `[local rows | sharded rows]`. The shards are in-process `AttentionShard`s
behind in-memory links; the UCX round trip is the mesh tests' (test_neo_tiers.py)."""

from __future__ import annotations

from typing import Any

import torch

from common.attention import select_backend
from common.attention.torch_ref import TorchPagedAttention
from common.block_manager import BlockManager
from common.kv_cache import KVCache
from common.model.loader import load_model
from common.protocol import AttendBatch, AttendResult, KvPages, ShardAddress
from common.scheduling.batching import Sequence
from services.engine.runner import MeshModelRunner
from services.shard.shard import AttentionShard, ShardSpec

BLOCK = 16
LENGTHS = {"l0": 9, "l1": 30, "s0": 17, "s1": 40}  # tokens so far: all but the last have KV


class InProcessLink:
    """A shard link that attends on an in-process shard when its reply is read."""

    def __init__(self, shard: AttentionShard) -> None:
        self.shard = shard
        self.sent: list[tuple[AttendBatch, list[torch.Tensor]]] = []

    def send_async(self, header: AttendBatch, tensors: Any) -> None:
        self.sent.append((header, [t.contiguous() for t in tensors]))

    def wait(self, handle: Any, timeout: float | None = None) -> None:
        pass

    def recv(self, out: Any = None, timeout: float | None = None) -> tuple[AttendResult, list]:
        header, (q, k, v) = self.sent.pop(0)
        attn, _, failed = self.shard.attend(header, q, k, v)
        out[0].copy_(attn)
        return AttendResult(header.step, header.layer, failed=failed), out


def build(
    model_path, device: torch.device | None = None
) -> tuple[MeshModelRunner, list[Sequence], list[Sequence], dict]:
    """A runner with l0, l1 local and s0, s1 on two shards (heads split), KV seeded alike. On a
    `device` (tests/gpu), the runner's model, KV and attention there, the shards on the host."""
    model = load_model(model_path, device=device)
    mc = model.config
    dtype = getattr(torch, mc.dtype) if device is not None else torch.float32
    layers, heads, dim = mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim
    blocks = BlockManager(64, BLOCK)
    cache = KVCache(layers, 64, BLOCK, heads, dim, dtype, device)
    half = heads // 2
    shards = [
        AttentionShard(f"shard-{i}", ShardSpec(layers, h0, h1, mc.num_queries_per_kv, dim, 64,
                       BLOCK, dtype, dim**-0.5), TorchPagedAttention())
        for i, (h0, h1) in enumerate([(0, half), (half, heads)])
    ]  # fmt: skip
    g = torch.Generator().manual_seed(5)
    for req_id, n in LENGTHS.items():
        k, v = (
            torch.randn(layers, n - 1, heads, dim, generator=g).to(dtype),
            torch.randn(layers, n - 1, heads, dim, generator=g).to(dtype),
        )
        if req_id.startswith("l"):
            blocks.allocate(req_id, n)
            slots = torch.tensor(blocks.slots(req_id, 0, n - 1))
            for layer in range(layers):
                cache.write(layer, k[layer], v[layer], slots)
        for shard in shards if req_id.startswith("s") else []:
            h0, h1 = shard.spec.head_start, shard.spec.head_end
            pages = KvPages(req_id, 0, layers, n - 1, h0, h1, layers, reserve_tokens=n + 4)
            shard.receive_kv(pages, k[:, :, h0:h1].contiguous(), v[:, :, h0:h1].contiguous())
    addresses = [ShardAddress(f"tcp://s{i}", s.spec.head_start, s.spec.head_end)
                 for i, s in enumerate(shards)]  # fmt: skip
    backend = TorchPagedAttention() if device is None else select_backend("auto", device)
    runner = MeshModelRunner(
        model, cache, blocks, backend,
        shard_links=[InProcessLink(s) for s in shards], shards=addresses,
    )  # fmt: skip
    local = [Sequence(r, LENGTHS[r], LENGTHS[r] - 1) for r in ("l0", "l1")]
    sharded = [Sequence(r, LENGTHS[r], LENGTHS[r] - 1) for r in ("s0", "s1")]
    token_ids = {r: [(7 * i + 11) % mc.vocab_size for i in range(n)] for r, n in LENGTHS.items()}
    return runner, local, sharded, token_ids


def test_two_sub_batches_interleaved_per_layer_give_the_one_batch_logits(tiny_model_path):
    runner, local, sharded, token_ids = build(tiny_model_path)
    one = runner.run_decode(runner.plan_decode(local, sharded, token_ids, step=1)).logits
    runner, local, sharded, token_ids = build(tiny_model_path)  # the same state, afresh
    plan = runner.plan_decode(local, sharded, token_ids, step=1, two_batches=True)
    assert plan.batch_1 is not None and plan.num_local == len(local)
    two = runner.run_decode(plan).logits
    assert two.shape == one.shape == (4, runner.model.config.vocab_size)
    torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-4)
    assert torch.equal(two.argmax(-1), one.argmax(-1))
