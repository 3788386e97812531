"""What `bench/prefix.py` compares its served hit rates with: reuse bounds and the simulator.

- `reuse_bound`: the fraction of prompt tokens in leading full blocks an earlier prompt had (an
  infinite cache shared by every engine; the last token always computed, as the engines do).
- `reuse_at_arrival`: the same, counting only prompts whose prefill had ended (their first token
  seen) when this one was sent. An engine registers a prompt's blocks only after its prefill
  (`BlockManager.mark_computed`), so a turn sent while its predecessor is still prefilling finds
  nothing on any other engine (on the same engine it waits for that prefill and may still hit:
  the bound is a little conservative).
- `simulate_hit_rate`: the cluster simulator (`loadgen/sim/`) on the same requests, cache size and
  routing weight, with a prefill time fitted to the served arm without a cache (`fit_prefill`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from common.block_hash import block_hashes
from common.kv_events import reusable_blocks
from common.perf_model import PerfModel, PiecewiseLinear
from loadgen.sim.designs import CPU_MESH_PROMPT, CPU_MESH_TOKEN, TINY, ClusterSpec, Design
from loadgen.sim.prefix_cache import leading
from loadgen.sim.simulator import SimOptions, SimRequest, SimResult, simulate
from loadgen.target import RequestSpec

BLOCK = 16


def _usable(ids: list[int]) -> list[int]:
    return block_hashes(ids, BLOCK, 0)[: reusable_blocks(len(ids), BLOCK)]


def reuse_bound(prompts: list[list[int]]) -> float:
    """Fraction of prompt tokens an infinite shared cache would find (full leading blocks)."""
    seen: set[int] = set()
    hit = total = 0
    for ids in prompts:
        hit += leading(_usable(ids), seen) * BLOCK
        total += len(ids)
        seen.update(block_hashes(ids, BLOCK, 0))
    return hit / total


def reuse_at_arrival(
    prompts: list[list[int]], sent_s: Sequence[float], computed_s: Sequence[float]
) -> tuple[float, int]:
    """(the reuse bound counting only prefixes computed by each prompt's sending, how many
    prompts find less that way than in `reuse_bound`: their prefix was still being computed).
    `prompts` in sending order; `computed_s`: when each one's first token was seen."""
    hashes = [block_hashes(ids, BLOCK, 0) for ids in prompts]
    hit = total = num_in_flight = 0
    for i, ids in enumerate(prompts):
        usable = _usable(ids)
        computed = {h for j in range(i) if computed_s[j] <= sent_s[i] for h in hashes[j]}
        sent = {h for j in range(i) for h in hashes[j]}
        found = leading(usable, computed)
        num_in_flight += found < leading(usable, sent)
        hit += found * BLOCK
        total += len(ids)
    return hit / total, num_in_flight


def fit_prefill(
    prompt_lens: Sequence[int], ttfts_s: Sequence[float], num_bins: int = 4
) -> PerfModel:
    """A linear prefill time through the no-cache arm's fastest TTFTs: the least in each of
    `num_bins` prompt-length bins (the router's latency included). The simulator queues
    requests itself, so a fit through queued TTFTs would count the queueing twice."""
    by_len = sorted(zip(prompt_lens, ttfts_s, strict=True))
    size = -(-len(by_len) // num_bins)
    bins = [by_len[i : i + size] for i in range(0, len(by_len), size)]
    lens = [statistics.median(n for n, _ in b) for b in bins]
    fastest = [min(t for _, t in b) for b in bins]
    slope, intercept = statistics.linear_regression(lens, fastest)
    slope, intercept = max(slope, 1e-6), max(intercept, 0.0)
    prefill = PiecewiseLinear((0.0, 4096.0), (intercept, intercept + slope * 4096))
    # The token machine's decode step (not compared; of the tiny mesh's TBT's order,
    # docs/simulator.md). NOTE: never 0: a decode run is cut at iteration boundaries.
    decode = PiecewiseLinear((1.0, 64.0), (0.03, 0.03))
    return PerfModel(prefill, decode)


def simulate_hit_rate(
    specs: list[RequestSpec], arrivals_s: list[float], max_tokens: int, num_blocks: int,
    weight: float, perf: PerfModel,
) -> SimResult:  # fmt: skip
    """The simulator on the bench's mesh: 2 prompt machines and 1 token machine of `num_blocks`
    16-token blocks each, the trace's hash ids as each prompt's blocks."""
    if any(s.block_len != BLOCK for s in specs):
        raise ValueError(f"simulated cache: a trace block must be one {BLOCK}-token KV block")
    prompt = replace(CPU_MESH_PROMPT, kv_pool_tokens=num_blocks * BLOCK)
    token = replace(CPU_MESH_TOKEN, kv_pool_tokens=num_blocks * BLOCK)
    cluster = ClusterSpec(Design("bench-prefix", prompt, token, model=TINY), 2, 1)
    requests = [SimRequest(at, s.input_len, max_tokens, s.hash_ids)
                for at, s in zip(arrivals_s, specs, strict=True)]  # fmt: skip
    options = SimOptions(prefix_block_len=BLOCK, prefix_weight=weight, perf=perf)
    return simulate(cluster, requests, options)
