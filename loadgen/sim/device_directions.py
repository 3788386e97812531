"""The Lamina and Neo directions from a device profile (`device_profile.py`): how many requests a
GPU engine with host attention shards decodes at once within a TBT bound, and at what cost.

Both studies are steady states at one context length (every running request holds `context`
tokens), each arm's batch the largest whose time between tokens stays within the bound and whose
KV fits its tier(s); batch sizes are found by bisection (more requests never step faster).

- **Lamina (§4.2-4.3, Fig. 8 and 10-11).** n batches rotate over n - 1 device replicas (one for
  n <= 2) running the dense part, and one host group attending over all KV in host memory; a
  layer's period is `plan_layer`'s (the live pipeline's), from t_m = dense(b) / layers and
  t_a = host attention(b x context) / layers for each batch of b, q, k, v out and the output back
  over the device-host link, q-early overlap on. Tokens per $ = tokens/s over the replicas' and
  the host's price. Against it, GPU-only decoding on one device: dense + device attention, its
  KV in device memory. Direction: tokens per $ rises from n = 1 to the best n.
- **Neo (§3.2, Fig. 6).** One device with its host: `NeoPolicy` (the live engine's) plans one
  iteration over the running requests, local KV first (the device's room), the rest offloaded;
  an arm sustains a batch when the plan serves every request in one step within the bound.
  The GPU-only arm is the same policy with `allow_offload=False` at the same device budget.
  Direction: offload serves more requests, and more tokens/s, at the same bound.

The bound defaults to `TBT_SLACK` x the GPU-only step at its memory-full batch (the latency that
arm already pays), so it scales with the profile; `--tbt-ms` sets it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from common.perf_model import NeoCostTables
from common.scheduling.lamina_pipeline import LayerCosts, PipelinePlan, plan_layer
from common.scheduling.neo import NeoPolicy
from common.scheduling.neo_state import DecodeRequest, NeoConfig, NeoState, blocks_for
from loadgen.sim.device_profile import (
    DeviceProfile,
    read_profile,
    splitwise_profile,
    with_device_kv_tokens,
)
from loadgen.sim.neo_replay import NEO_MACHINES

TBT_SLACK = 2.0
BLOCK = 16
LAMINA_BATCHES = (1, 2, 3, 4)


def largest(feasible: Callable[[int], bool], high: int) -> int:
    """The largest k in 1..high with `feasible(k)` (monotone: true up to some k), or 0."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        if feasible(mid):
            low = mid
        else:
            high = mid - 1
    return low


def gpu_only_step_s(p: DeviceProfile, batch: int, context: int) -> float:
    return p.dense_s(batch) + p.device_attention_s(batch * context)


def default_bound_s(p: DeviceProfile, context: int) -> float:
    full = max(p.device_kv_tokens // (context + BLOCK), 1)
    return TBT_SLACK * gpu_only_step_s(p, full, context)


def lamina_layer(p: DeviceProfile, batch: float, context: int) -> LayerCosts:
    """One batch's per-layer costs with its KV and attention on the host group."""
    model_s = p.dense_s(batch) / p.num_layers
    link = p.host_link_bytes_s
    return LayerCosts(
        model_s=model_s,
        attention_s=p.host_attention_s(batch * context) / p.num_layers,
        q_wire_s=batch * p.q_bytes_per_token / link,
        kv_wire_s=batch * p.kv_bytes_per_token_layer / link,
        out_wire_s=batch * p.q_bytes_per_token / link,
        latency_s=p.host_link_latency_s,
        kv_proj_s=model_s * p.kv_proj_fraction,
    )


def lamina(p: DeviceProfile, context: int, bound_s: float) -> dict[str, Any]:
    """Per n: the batch, tokens/s and tokens per $ within the bound; and GPU-only's."""
    rows: dict[str, Any] = {}
    for n in LAMINA_BATCHES:

        def plan(k: int, n: int = n) -> PipelinePlan:
            return plan_layer(lamina_layer(p, k, context), n)

        room = p.host_kv_tokens // context // n
        k = largest(lambda k: p.num_layers * plan(k).period_s <= bound_s, room)
        if k == 0:
            rows[f"n={n}"] = {"batch": 0, "tokens_s": 0.0, "tokens_per_usd": 0.0}
            continue
        best = plan(k)
        tbt_s = p.num_layers * best.period_s
        usd_h = best.num_replicas * p.device_usd_h + p.host_usd_h
        rows[f"n={n}"] = {"batch": k * n, "replicas": best.num_replicas,
                          "tbt_ms": round(tbt_s * 1e3, 3), "bound": best.bound.value,
                          "tokens_s": round(k * n / tbt_s, 1), "usd_h": round(usd_h, 2),
                          "tokens_per_usd": round(k * n / tbt_s * 3600 / usd_h)}  # fmt: skip
    gpu_batch = largest(lambda b: gpu_only_step_s(p, b, context) <= bound_s,
                        p.device_kv_tokens // (context + BLOCK))  # fmt: skip
    gpu_s = gpu_only_step_s(p, max(gpu_batch, 1), context)
    per_usd = [rows[f"n={n}"]["tokens_per_usd"] for n in LAMINA_BATCHES]
    best_n = LAMINA_BATCHES[per_usd.index(max(per_usd))]
    return {
        "by_n": rows,
        "gpu_only": {"batch": gpu_batch, "tokens_s": round(gpu_batch / gpu_s, 1),
                     "tokens_per_usd": round(gpu_batch / gpu_s * 3600 / p.device_usd_h)},
        "best_n": best_n,
        "best_over_n1": round(max(per_usd) / per_usd[0], 3) if per_usd[0] else float("inf"),
        "best_over_gpu_only": round(max(per_usd) * gpu_s * p.device_usd_h / 3600 / gpu_batch, 3)
        if gpu_batch else float("inf"),
    }  # fmt: skip


def neo_served(p: DeviceProfile, batch: int, context: int, offload: bool) -> tuple[int, float]:
    """(requests served, step seconds) of `NeoPolicy`'s plan over `batch` running requests."""
    costs = NeoCostTables(p.dense_s, p.device_attention_s, p.host_attention_s)
    config = NeoConfig(block_size=BLOCK, allow_offload=offload)
    per_request = blocks_for(context + 1, BLOCK)  # room for the token it writes next
    local_blocks = p.device_kv_tokens // BLOCK
    num_local = min(batch, local_blocks // per_request)
    local = tuple(DecodeRequest(i, context) for i in range(num_local))
    offloaded = tuple(DecodeRequest(i, context) for i in range(num_local, batch))
    host_blocks = p.host_kv_tokens // BLOCK if offload else 0
    state = NeoState(local, offloaded, (), local_blocks - num_local * blocks_for(context, BLOCK),
                     max(host_blocks - len(offloaded) * per_request, 0), local_blocks)  # fmt: skip
    plan = NeoPolicy(config, costs).schedule(state)
    return plan.num_requests, plan.step_s


def neo(p: DeviceProfile, context: int, bound_s: float) -> dict[str, Any]:
    """Each arm's sustainable batch and tokens/s within the bound, and their ratios."""
    arms: dict[str, dict[str, float]] = {}
    for name, offload in (("gpu_only", False), ("offload", True)):
        room = (p.device_kv_tokens + (p.host_kv_tokens if offload else 0)) // (context + BLOCK)

        def serves(b: int, offload: bool = offload) -> bool:
            served, step_s = neo_served(p, b, context, offload)
            return served == b and step_s <= bound_s

        batch = largest(serves, room)
        step_s = neo_served(p, max(batch, 1), context, offload)[1]
        arms[name] = {"batch": batch, "tbt_ms": round(step_s * 1e3, 3),
                      "tokens_s": round(batch / step_s, 1) if batch else 0.0}  # fmt: skip
    base, off = arms["gpu_only"], arms["offload"]
    return {
        **arms,
        "batch_gain": round(off["batch"] / base["batch"], 3) if base["batch"] else float("inf"),
        "tokens_s_gain": round(off["tokens_s"] / base["tokens_s"], 3)
        if base["tokens_s"]
        else float("inf"),
    }


def directions(p: DeviceProfile, context: int, tbt_ms: float = 0.0) -> dict[str, Any]:
    """Both studies on one profile, with the bound they used."""
    bound_s = tbt_ms / 1e3 if tbt_ms > 0 else default_bound_s(p, context)
    return {"source": p.source, "context": context, "tbt_bound_ms": round(bound_s * 1e3, 3),
            "device_kv_tokens": p.device_kv_tokens,
            "lamina": lamina(p, context, bound_s), "neo": neo(p, context, bound_s)}  # fmt: skip


def load(name: str) -> DeviceProfile:
    """A `NEO_MACHINES` name (the Splitwise table's) or a device profile's path."""
    return splitwise_profile(name) if name in NEO_MACHINES else read_profile(name)


def add_devices_parser(sub: Any) -> None:
    """The `devices` subcommand of `python -m loadgen.sim`."""
    p = sub.add_parser("devices", help="Lamina's tokens per $ vs n and Neo's gain per profile")
    p.add_argument(
        "--profiles", nargs="+", default=["A100x2", "H100x2"],
        help=f"{', '.join(NEO_MACHINES)} (the Splitwise table) or device-profile JSON paths",
    )  # fmt: skip
    p.add_argument("--context", type=int, default=1024, help="each request's KV tokens")
    p.add_argument("--tbt-ms", type=float, default=0.0, help=f"bound (0: {TBT_SLACK}x GPU-only)")
    p.add_argument("--device-kv-tokens", type=int, default=0, help="override the GPU budget")
    p.set_defaults(func=run_devices)


def run_devices(args: argparse.Namespace) -> int:
    results = {}
    print(f"{'profile':<28} {'bound ms':>8} | {'Lamina tok/$ by n=1..4':>30} {'best/n1':>7} "
          f"{'/GPU':>5} | {'Neo batch':>11} {'tok/s':>17} {'gain':>5}")  # fmt: skip
    for name in args.profiles:
        profile = load(name)
        if args.device_kv_tokens:
            profile = with_device_kv_tokens(profile, args.device_kv_tokens)
        r = results[profile.name] = directions(profile, args.context, args.tbt_ms)
        lam, neo_r = r["lamina"], r["neo"]
        per_n = " ".join(f"{lam['by_n'][f'n={n}']['tokens_per_usd']:>7}" for n in LAMINA_BATCHES)
        print(f"{profile.name:<28} {r['tbt_bound_ms']:>8.1f} | {per_n:>30} "
              f"{lam['best_over_n1']:>7.2f} {lam['best_over_gpu_only']:>5.2f} | "
              f"{neo_r['gpu_only']['batch']:>4} -> {neo_r['offload']['batch']:<4} "
              f"{neo_r['gpu_only']['tokens_s']:>7.0f} -> {neo_r['offload']['tokens_s']:<7.0f} "
              f"{neo_r['tokens_s_gain']:>5.2f}")  # fmt: skip
    gains = {
        f"{name}:{key}": value
        for name, r in results.items()
        for key, value in (("lamina_best_over_n1", r["lamina"]["best_over_n1"]),
                           ("neo_batch_gain", r["neo"]["batch_gain"]),
                           ("neo_tokens_s_gain", r["neo"]["tokens_s_gain"]))
    }  # fmt: skip
    targets = dict.fromkeys(gains, "> 1")
    met = {key: value > 1.0 for key, value in gains.items()}
    print(json.dumps({"profiles": results, "targets": targets, "targets_met": met}))
    return 0


__all__ = ["add_devices_parser", "directions", "lamina", "neo", "neo_served"]
