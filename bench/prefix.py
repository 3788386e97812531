"""Prefix caching and KV-aware routing on the Kimi (Mooncake) conversation trace, served for real.

    python bench/prefix.py [--conversations 40] [--span-s 60] [--token-scale 0.03125]

The trace's `hash_ids` become shared token prefixes (`loadgen.prompts.PromptBuilder`; at the
default scale a 512-token trace block is one 16-token KV block). The bench keeps the first
`--conversations` multi-turn conversations (requests grouped by their first two hash ids, at
least two turns: a bounded run that still carries the trace's turn-to-turn reuse; a plain time
window of a few hundred requests holds mostly first turns) with their trace arrival times
compressed into `--span-s`, and replays them through `MeshEngineClient` (the router's own client,
real processes: `LocalMesh` of 2 prompt engines and 1 token engine) three times, a fresh mesh each:

- (a) no prefix cache, plain JSQ (`prefix_routing_weight` 0);
- (b) prefix cache, plain JSQ;
- (c) prefix cache, KV-aware routing (JSQ with prefix credit, weight `--weight`).

Per arm: prompt tokens computed by the prompt engines (`EngineStats.num_prefill_tokens`), the
cache hit rate (hit / (hit + computed)), TTFT p50/p90 as this client sees them. The reuse bound is
computed from the very prompts sent: the fraction of prompt tokens in leading full blocks whose
hash chain an earlier prompt had (an infinite cache shared by all engines; the last token always
computed, as the engines do). Greedy outputs of the three arms must be equal.

Targets (issue 23): (c) computes <= 0.6x the prefill tokens of (a); (c) TTFT p90 < (b)'s; (c)'s hit
rate within 10% (relative) of the reuse bound. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

from common.block_hash import block_hashes
from common.kv_events import reusable_blocks
from common.model.default import default_model_path
from common.sampling import SamplingParams
from loadgen.arrivals import ArrivalConfig, plan_requests
from loadgen.prompts import PromptBuilder
from loadgen.target import RequestSpec
from loadgen.traces import read_trace, shared_dir
from services.launch.local_mesh import LocalMesh, Topology
from services.router.mesh_client import MeshEngineClient

BLOCK = 16
VOCAB = 2048  # the tiny model's


def conversations(specs: list[RequestSpec], count: int) -> list[RequestSpec]:
    """Every request of the first `count` conversations (in trace order) with two turns or more."""
    by_conv: dict[tuple[int, ...], list[RequestSpec]] = defaultdict(list)
    for spec in specs:
        by_conv[tuple(spec.hash_ids[:2])].append(spec)
    multi = [reqs for reqs in by_conv.values() if len(reqs) >= 2][:count]
    return sorted((s for reqs in multi for s in reqs), key=lambda s: s.req_index)


def reuse_bound(prompts: list[list[int]]) -> float:
    """Fraction of prompt tokens an infinite shared cache would find (full leading blocks)."""
    seen: set[int] = set()
    hit = total = 0
    for ids in prompts:
        hashes = block_hashes(ids, BLOCK, 0)
        usable = reusable_blocks(len(ids), BLOCK)
        n = 0
        while n < usable and hashes[n] in seen:
            n += 1
        hit += n * BLOCK
        total += len(ids)
        seen.update(hashes)
    return hit / total


async def replay(
    client: MeshEngineClient, plan: list[tuple[float, list[int]]], params: SamplingParams
) -> tuple[list[float], list[list[int]]]:
    """Send each prompt at its time; TTFT (s) and output tokens of each, in plan order."""
    start = time.monotonic()

    async def one(i: int, at: float, prompt: list[int]) -> tuple[float, list[int]]:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        sent, first, tokens = time.monotonic(), 0.0, []
        async for out in client.generate(f"req-{i}", prompt, params):
            if out.new_token_ids and not tokens:
                first = time.monotonic() - sent
            tokens += out.new_token_ids
        return first, tokens

    results = await asyncio.gather(*(one(i, at, p) for i, (at, p) in enumerate(plan)))
    return [r[0] for r in results], [r[1] for r in results]


def run_arm(
    args: argparse.Namespace, cache: bool, weight: float, plan: list[tuple[float, list[int]]]
) -> tuple[dict[str, float], list[list[int]]]:
    model = default_model_path("tiny")
    topology = Topology(
        str(model), num_prompt=2, num_token=1, num_blocks=args.num_blocks,
        enable_prefix_caching=cache, pin_decode_groups=False,
    )  # fmt: skip
    mesh = LocalMesh.start(topology)
    try:
        client = MeshEngineClient(
            model, mesh.registry.live, auth=mesh.auth, refresh_s=0.1, prefix_routing_weight=weight
        )
        try:
            while not client.ready():
                time.sleep(0.05)
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
            ttfts, outputs = asyncio.run(replay(client, plan, params))
        finally:
            client.shutdown()
        prompt_stats = [s for s in mesh.stats() if s.role == "prompt"]
    finally:
        mesh.close()
    computed = sum(s.num_prefill_tokens for s in prompt_stats)
    hit = sum(s.num_prefix_hit_tokens for s in prompt_stats)
    cuts = statistics.quantiles(ttfts, n=10)
    figures = {
        "prefill_tokens": computed, "hit_rate": round(hit / (hit + computed), 4),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1),
        "ttft_p90_ms": round(cuts[8] * 1e3, 1),
        "per_engine_prefill": [s.num_prefill_tokens for s in prompt_stats],
    }  # fmt: skip
    return figures, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(shared_dir() / "traces/conversation_trace.jsonl"))
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--span-s", type=float, default=60.0, help="replay span of the arrivals")
    parser.add_argument("--token-scale", type=float, default=1 / 32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per engine")
    parser.add_argument("--weight", type=float, default=1.0, help="arm (c)'s routing weight")
    args = parser.parse_args()
    rows = list(read_trace(args.trace))
    specs = list(plan_requests(rows, ArrivalConfig(token_scale=args.token_scale)))
    chosen = conversations(specs, args.conversations)
    builder = PromptBuilder(vocab_size=VOCAB, seed=0)
    t0, t1 = chosen[0].arrival_s, chosen[-1].arrival_s
    plan = [((s.arrival_s - t0) * args.span_s / max(t1 - t0, 1e-9), builder.prompt_ids(s))
            for s in chosen]  # fmt: skip
    prompts = [p for _, p in plan]
    all_prompts = [builder.prompt_ids(s) for s in specs[: len(specs) // 4]]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    arms, outputs = {}, []
    for name, cache, weight in (("a", False, 0.0), ("b", True, 0.0), ("c", True, args.weight)):
        began = time.monotonic()
        arms[name], out = run_arm(args, cache, weight, plan)
        arms[name]["wall_s"] = round(time.monotonic() - began, 1)
        outputs.append(out)
        print(name, json.dumps(arms[name]), flush=True)
    bound = reuse_bound(prompts)
    a, b, c = arms["a"], arms["b"], arms["c"]
    prefill_ratio = c["prefill_tokens"] / a["prefill_tokens"]
    result = {
        "requests": len(plan), "conversations": args.conversations,
        "prompt_tokens": sum(len(p) for p in prompts), "token_scale": args.token_scale,
        "reuse_bound": round(bound, 4),
        "reuse_bound_first_quarter_of_trace": round(reuse_bound(all_prompts), 4),
        "arms": arms, "prefill_ratio_c_over_a": round(prefill_ratio, 4),
        "outputs_equal": outputs[0] == outputs[1] == outputs[2],
        "cpu": _cpu_model(), "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "targets": {"prefill_ratio_c_over_a": "<= 0.6", "ttft_p90_c_vs_b": "c < b",
                    "hit_rate_c_vs_bound": "within 10% of the bound"},
    }  # fmt: skip
    result["targets_met"] = {
        "prefill_ratio_c_over_a": prefill_ratio <= 0.6,
        "ttft_p90_c_vs_b": c["ttft_p90_ms"] < b["ttft_p90_ms"],
        "hit_rate_c_vs_bound": abs(c["hit_rate"] - bound) <= 0.1 * bound,
    }
    print(json.dumps(result))


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    return f"unknown ({os.cpu_count()} cores)"


if __name__ == "__main__":
    main()
