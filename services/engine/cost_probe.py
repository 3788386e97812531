"""Neo's cost tables (T_l, T_ga, T_ca) for this engine, measured in-process at start-up or read
from `bench/profile.py --attention`'s CSV (`tier_policy: neo:<csv>`).

The probe is short (a fraction of a second for a small model): the dense part of a decode step by
batch tokens (every layer's pre- and post-attention, the LM head and greedy sampling, on random
hidden states), local decode attention by context tokens (the engine's attention backend), and
offloaded attention by context tokens (the shards' CPU kernel at one thread, the group splitting
the KV heads S ways). The round trip to the shards, which the probe cannot see from here, is the
engine's own: `EngineNeoCosts` adds the mean of its recent sharded steps' round-trip overhead
(`DecodeTimes.network_s`, per step, all layers) to T_ca, starting from `ROUND_TRIP_S` per layer
until a sharded step has run. Times are whole-model seconds, as `NeoCostModel` wants.

NOTE: where the shards share the engine's cores, the "hidden" offload attention is not free; the
tables say what each part costs alone, and `bench/neo.py` reports how far their sum lands from
the step the engine timed.
"""

from __future__ import annotations

import csv
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from common.attention import AttentionBackend
from common.config import ModelConfig
from common.model.llama import LlamaForCausalLM
from common.perf_model import NeoCostTables, PiecewiseLinear, read_attention_tables

PROBE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
PROBE_CONTEXTS = (64, 512, 2048, 8192)
PROBE_BATCH = 4  # requests per attention call: the context is split among them
# One layer's round-trip overhead to the shards before the engine has timed one: a guess of
# the order of a loopback message pair; the engine's own steps replace it after one step.
ROUND_TRIP_S = 200e-6
RECENT_WEIGHT = 0.2  # of the latest sharded steps in the running round-trip estimate
BLOCK = 16
CPU = torch.device("cpu")


def median_s(run: Callable[[], object], repeats: int) -> float:
    """The median wall time of `run` over `repeats` calls, after one warm-up call."""
    return statistics.median(wall_times(run, repeats))


def least_s(run: Callable[[], object], repeats: int) -> float:
    """The least wall time of `run` over `repeats` calls, after one warm-up call: at a token
    engine's start its mesh's other processes load too, and the least is the part's own cost."""
    return min(wall_times(run, repeats))


def wall_times(run: Callable[[], object], repeats: int) -> list[float]:
    run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return samples


def synchronized(run: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """`run`, then a wait for `device` (its kernels are asynchronous): what a timer should time.
    `run` itself on the CPU."""
    if device.type == "cpu":
        return run

    def run_and_wait() -> None:
        run()
        torch.cuda.synchronize(device)

    return run_and_wait


def attention_s(
    backend: AttentionBackend,
    mc: ModelConfig,
    batch: int,
    context: int,
    repeats: int,
    num_kv_heads: int | None = None,
    timer: Callable[[Callable[[], object], int], float] = median_s,
    device: torch.device = CPU,
) -> tuple[int, float]:
    """(context tokens actually held, seconds for all layers) of one decode-attention call over
    `batch` requests holding `context` tokens in all, on `num_kv_heads` of the model's heads,
    its KV and q in `device` memory (the model's dtype there)."""
    heads = num_kv_heads or mc.num_key_value_heads
    group = mc.num_attention_heads // mc.num_key_value_heads
    per_seq = -(-context // batch)
    num_blocks = batch * -(-per_seq // BLOCK)
    dtype = getattr(torch, mc.dtype) if device.type != "cpu" else torch.float32
    k = torch.randn(num_blocks, heads, mc.head_dim, BLOCK, device=device, dtype=dtype)  # keys
    v = torch.randn(num_blocks, heads, BLOCK, mc.head_dim, device=device, dtype=dtype)
    q = torch.randn(batch, heads * group, mc.head_dim, device=device, dtype=dtype)
    tables = torch.arange(num_blocks, dtype=torch.int32, device=device).reshape(batch, -1)
    lens = torch.full((batch,), per_seq, dtype=torch.int32, device=device)
    run = synchronized(lambda: backend.decode(q, k, v, tables, lens, mc.head_dim**-0.5), device)
    seconds = timer(run, repeats)
    return per_seq * batch, seconds * mc.num_hidden_layers


@torch.inference_mode()
def dense_s(model: LlamaForCausalLM, num_tokens: int, repeats: int) -> float:
    """T_l at `num_tokens` batch tokens: embeddings, every layer but its attention, LM head and
    greedy sampling (what a decode step does besides attention)."""
    mc = model.config
    device = model_device(model)
    ids = torch.randint(8, mc.vocab_size, (num_tokens,), device=device)
    positions = torch.arange(num_tokens, device=device) + 100

    def step() -> None:
        x = model.embed(ids)
        rope = model.rotary_at(positions)
        for layer in model.layers:
            q, _, _ = layer.pre_attention(x, rope)  # [N, H, D]
            x = layer.post_attention(x, q)  # attention's output has q's shape
        model.compute_logits(x).argmax(dim=-1).tolist()

    return least_s(synchronized(step, device), repeats)


def model_device(model: LlamaForCausalLM) -> torch.device:
    """Where the model's weights are (an engine's device)."""
    return model.model.embed_tokens.weight.device


@dataclass
class EngineNeoCosts:
    """A `NeoCostModel`: the probed or read `tables`, with T_ca plus the round trip to the shards
    as this engine measures it (`observe`, before each plan)."""

    tables: NeoCostTables
    round_trip_s: float  # per step, all layers
    # What a whole decode step costs beyond the probed stages (the runner's and sampler's Python,
    # KV writes, the machine's load): learned from the steps this engine ran (`observe_step`),
    # like the round trip, so a prediction only ever uses steps that came before it.
    step_overhead_s: float = 0.0
    _seen_steps: int = 0
    _seen_network_s: float = 0.0

    def linear_s(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return max(self.tables.linear_s(num_tokens) + self.step_overhead_s, 0.0)

    def observe_step(self, predicted_s: float, measured_s: float) -> None:
        """A decode step ran: move the overhead toward what its prediction missed."""
        self.step_overhead_s += RECENT_WEIGHT * (measured_s - predicted_s)

    def local_attention_s(self, num_context_tokens: int) -> float:
        return self.tables.local_attention_s(num_context_tokens)

    def offload_attention_s(self, num_context_tokens: int) -> float:
        if num_context_tokens <= 0:
            return 0.0
        return self.tables.offload_attention_s(num_context_tokens) + self.round_trip_s

    def observe(self, num_steps: int, network_s: float, overlapped: bool = False) -> None:
        """The runner's sharded-step totals (`DecodeTimes`): fold the new steps' mean in, unless
        they ran as two sub-batches (their replies then wait for batch-0's layer: not network)."""
        new_steps = num_steps - self._seen_steps
        if new_steps > 0 and not overlapped:
            per_step = (network_s - self._seen_network_s) / new_steps
            self.round_trip_s += RECENT_WEIGHT * (per_step - self.round_trip_s)
        self._seen_steps, self._seen_network_s = num_steps, network_s


def probe_costs(
    model: LlamaForCausalLM,
    local: AttentionBackend,
    num_shards: int,
    repeats: int = 9,
) -> EngineNeoCosts:
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
    device = model_device(model)
    for context in PROBE_CONTEXTS:
        held, s = attention_s(local, mc, PROBE_BATCH, context, repeats, None, least_s, device)
        local_s[float(held)] = [s]
        held, s = attention_s(offload, mc, PROBE_BATCH, context, repeats, shard_heads, least_s)
        offload_s[float(held)] = [s]
    tables = NeoCostTables(
        PiecewiseLinear.fit(linear), PiecewiseLinear.fit(local_s), PiecewiseLinear.fit(offload_s)
    )
    return EngineNeoCosts(tables, ROUND_TRIP_S * mc.num_hidden_layers)


def read_costs(path: str | Path, model: LlamaForCausalLM, repeats: int = 9) -> EngineNeoCosts:
    """T_ga and T_ca from an attention CSV (its first model and hardware), T_l probed."""
    with open(path, encoding="utf-8", newline="") as rows:
        first = next(csv.DictReader(rows), None)
    if first is None:
        raise ValueError(f"{path}: an empty attention table")
    local, offload = read_attention_tables(path, first["model"], first["hardware"])
    linear = {float(n): [dense_s(model, n, repeats)] for n in PROBE_TOKENS}
    tables = NeoCostTables(PiecewiseLinear.fit(linear), local, offload)
    return EngineNeoCosts(tables, ROUND_TRIP_S * model.config.num_hidden_layers)


__all__ = ["EngineNeoCosts", "attention_s", "dense_s", "probe_costs", "read_costs"]
