"""Neo's cost tables (T_l, T_ga, T_ca) for this engine, measured in-process at start-up or read
from `bench/profile.py --attention`'s CSV (`tier_policy: neo:<csv>`).

The probe is short (well under a second for the tiny model): the dense part of a decode step by
batch tokens (every layer's pre- and post-attention, the LM head and greedy sampling, on random
hidden states), local decode attention by context tokens (the engine's attention backend), and
offloaded attention by context tokens (the shards' CPU kernel at one thread, the group splitting
the KV heads S ways, plus a per-layer round trip the probe cannot see from here: `round_trip_s`).
Times are whole-model seconds, as `NeoCostModel` wants.

NOTE: on a machine whose cores the shards share with the engine (CI, this 2-core box) the
"hidden" offload attention is not free; the tables say what each part costs alone, and the bench
reports how far the sum lands from the measured step.
"""

from __future__ import annotations

import csv
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common.attention import AttentionBackend
from common.config import ModelConfig
from common.model.llama import LlamaForCausalLM
from common.perf_model import NeoCostTables, PiecewiseLinear, read_attention_tables

PROBE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
PROBE_CONTEXTS = (64, 512, 2048, 8192)
PROBE_BATCH = 4  # requests per attention call: the context is split among them
ROUND_TRIP_S = 150e-6  # one layer's loopback round trip to the shards (ZeroMQ + UCX), measured
BLOCK = 16


def median_s(run: Callable[[], object], repeats: int) -> float:
    """The median wall time of `run` over `repeats` calls, after one warm-up call."""
    run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def attention_s(
    backend: AttentionBackend,
    mc: ModelConfig,
    batch: int,
    context: int,
    repeats: int,
    num_kv_heads: int | None = None,
) -> tuple[int, float]:
    """(context tokens actually held, seconds for all layers) of one decode-attention call over
    `batch` requests holding `context` tokens in all, on `num_kv_heads` of the model's heads."""
    heads = num_kv_heads or mc.num_key_value_heads
    group = mc.num_attention_heads // mc.num_key_value_heads
    per_seq = -(-context // batch)
    num_blocks = batch * -(-per_seq // BLOCK)
    k = torch.randn(num_blocks, heads, mc.head_dim, BLOCK)  # the paged cache's key layout
    v = torch.randn(num_blocks, heads, BLOCK, mc.head_dim)
    q = torch.randn(batch, heads * group, mc.head_dim)
    tables = torch.arange(num_blocks, dtype=torch.int32).reshape(batch, -1)
    lens = torch.full((batch,), per_seq, dtype=torch.int32)
    seconds = median_s(lambda: backend.decode(q, k, v, tables, lens, mc.head_dim**-0.5), repeats)
    return per_seq * batch, seconds * mc.num_hidden_layers


@torch.inference_mode()
def dense_s(model: LlamaForCausalLM, num_tokens: int, repeats: int) -> float:
    """T_l at `num_tokens` batch tokens: embeddings, every layer but its attention, LM head and
    greedy sampling (what a decode step does besides attention)."""
    mc = model.config
    ids = torch.randint(8, mc.vocab_size, (num_tokens,))
    positions = torch.arange(num_tokens) + 100

    def step() -> None:
        x = model.embed(ids)
        rope = model.rotary_at(positions)
        for layer in model.layers:
            q, _, _ = layer.pre_attention(x, rope)  # [N, H, D]
            x = layer.post_attention(x, q)  # attention's output has q's shape
        model.compute_logits(x).argmax(dim=-1).tolist()

    return median_s(step, repeats)


def probe_costs(
    model: LlamaForCausalLM,
    local: AttentionBackend,
    num_shards: int,
    repeats: int = 5,
    round_trip_s: float = ROUND_TRIP_S,
) -> NeoCostTables:
    """The three tables, measured now (see the module docstring)."""
    from common.attention.cpu_kernel import CpuKernelAttention, kernel_available

    mc = model.config
    linear = {float(n): [dense_s(model, n, repeats)] for n in PROBE_TOKENS}
    local_s: dict[float, list[float]] = {}
    offload_s: dict[float, list[float]] = {}
    shards = max(num_shards, 1)
    # A head-partitioned group: each shard attends its 1/S of the KV heads, all at once.
    shard_heads = max(mc.num_key_value_heads // shards, 1)
    offload = CpuKernelAttention(num_threads=1) if kernel_available() else local
    for context in PROBE_CONTEXTS:
        held, s = attention_s(local, mc, PROBE_BATCH, context, repeats)
        local_s[float(held)] = [s]
        held, s = attention_s(offload, mc, PROBE_BATCH, context, repeats, shard_heads)
        offload_s[float(held)] = [s + round_trip_s * mc.num_hidden_layers]
    return NeoCostTables(
        PiecewiseLinear.fit(linear), PiecewiseLinear.fit(local_s), PiecewiseLinear.fit(offload_s)
    )


def read_costs(path: str | Path, model: LlamaForCausalLM, repeats: int = 5) -> NeoCostTables:
    """T_ga and T_ca from an attention CSV (its first model and hardware), T_l probed."""
    with open(path, encoding="utf-8", newline="") as rows:
        first = next(csv.DictReader(rows), None)
    if first is None:
        raise ValueError(f"{path}: an empty attention table")
    local, offload = read_attention_tables(path, first["model"], first["hardware"])
    linear = {float(n): [dense_s(model, n, repeats)] for n in PROBE_TOKENS}
    return NeoCostTables(PiecewiseLinear.fit(linear), local, offload)


__all__ = ["attention_s", "dense_s", "probe_costs", "read_costs"]
