"""A device profile measured on this machine: the costs the simulator's Lamina and Neo studies
read (`loadgen/sim/device_profile.py`'s format), for a preset model on an engine's device with
its host attention shards.

    python bench/device_profile.py --device cuda [--model small] [--shards 2] [--out FILE]
    python -m loadgen.sim devices --profiles A100x2 H100x2 FILE

Measured as a token engine probes Neo's costs at start-up (`services/engine/cost_probe.py`): the
dense part of a decode step by batch tokens on the device (T_l), decode attention by context
tokens over KV in device memory with the engine's backend (T_ga), and over KV in host memory with
the shards' CPU kernel at one thread, each of `--shards` shards its share of the KV heads (T_ca);
then one-way copies between device memory and pinned host memory, large (bandwidth) and small
(latency). On the CPU (`--device cpu`, the test's smoke run) the "device" is the host itself and
the copies are host memory copies: the figures describe that machine, not a GPU.

The GPU memory budget (`--device-kv-tokens`) and the host's KV room are arguments, not
measurements: the study asks what a budget buys. Prices are Lamina Table 1's (an H100 chip per
hour for the device, the host priced as Lamina prices its memory devices against it).

The last line is one JSON object: `device_profile` (the profile, also written to `--out`), the
probe's wall time, `targets` and `targets_met` (every table measured and non-decreasing, and the
host tier slower per token than the device's on a GPU).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from common.attention import select_backend
from common.device import resolve_device
from common.model.default import default_model_path
from common.model.loader import load_model
from common.perf_model import PiecewiseLinear
from loadgen.sim.device_profile import HOST_PRICE_RATIO, DeviceProfile, write_profile
from services.engine.cost_probe import (
    PROBE_BATCH,
    PROBE_CONTEXTS,
    PROBE_TOKENS,
    attention_s,
    dense_s,
    least_s,
)

H100_USD_H = 11.06  # Lamina Table 1, per chip
COPY_BYTES = 64 << 20


def copy_costs(device: torch.device, repeats: int) -> tuple[float, float]:
    """(bytes/s of a large device -> pinned host copy, seconds of a small one)."""
    on_gpu = device.type == "cuda"
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    small = torch.empty(4096, dtype=torch.uint8, device=device)
    dst = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=on_gpu)

    def copy(t: torch.Tensor) -> None:
        dst[: t.numel()].copy_(t, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize(device)

    large_s = least_s(lambda: copy(src), repeats)
    return COPY_BYTES / large_s, least_s(lambda: copy(small), repeats)


def measure(args: argparse.Namespace) -> DeviceProfile:
    device = resolve_device(args.device)
    model = load_model(str(default_model_path(args.model)), None, device=device)
    mc = model.config
    r = args.repeats
    dense = {float(n): [dense_s(model, n, r)] for n in PROBE_TOKENS}
    local = select_backend("auto", device)
    from common.attention.cpu_kernel import CpuKernelAttention, kernel_available

    host = CpuKernelAttention(num_threads=1) if kernel_available() else select_backend("torch")
    shard_heads = max(mc.num_key_value_heads // max(args.shards, 1), 1)
    device_attn: dict[float, list[float]] = {}
    host_attn: dict[float, list[float]] = {}
    for context in PROBE_CONTEXTS:
        held, s = attention_s(local, mc, PROBE_BATCH, context, r, None, least_s, device)
        device_attn[float(held)] = [s]
        held, s = attention_s(host, mc, PROBE_BATCH, context, r, shard_heads, least_s)
        host_attn[float(held)] = [s]
    link_bytes_s, latency_s = copy_costs(device, r)
    dtype_bytes = torch.finfo(getattr(torch, mc.dtype)).bits // 8 if device.type != "cpu" else 4
    q_dim, kv_dim = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    h = mc.hidden_size
    layer_params = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * mc.intermediate_size
    kv_bytes = 2 * mc.num_hidden_layers * kv_dim * dtype_bytes
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return DeviceProfile(
        name=f"{name} {args.model}",
        source=f"bench/device_profile.py --device {args.device} --model {args.model}",
        num_layers=mc.num_hidden_layers,
        q_bytes_per_token=q_dim * dtype_bytes,
        kv_bytes_per_token=kv_bytes,
        kv_proj_fraction=2 * h * kv_dim / layer_params,
        device_kv_tokens=args.device_kv_tokens,
        host_kv_tokens=args.host_kv_tokens,
        dense_s=PiecewiseLinear.fit(dense),
        device_attention_s=PiecewiseLinear.fit(device_attn),
        host_attention_s=PiecewiseLinear.fit(host_attn),
        host_link_bytes_s=link_bytes_s,
        host_link_latency_s=latency_s,
        device_usd_h=H100_USD_H,
        host_usd_h=H100_USD_H * HOST_PRICE_RATIO,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default="small", help="a preset (common/model/default.py)")
    parser.add_argument("--shards", type=int, default=2, help="host attention shards")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device-kv-tokens", type=int, default=16384, help="GPU KV budget")
    parser.add_argument("--host-kv-tokens", type=int, default=1 << 20)
    parser.add_argument("--out", default="", help="also write the profile here")
    args = parser.parse_args()
    began = time.perf_counter()
    profile = measure(args)
    if args.out:
        write_profile(profile, args.out)
    tables = [profile.dense_s, profile.device_attention_s, profile.host_attention_s]
    last = PROBE_CONTEXTS[-1]
    per_token = {"device": profile.device_attention_s(last) / last,
                 "host": profile.host_attention_s(last) / last}  # fmt: skip
    met = {
        "tables_non_decreasing": all(len(t.xs) >= 2 and list(t.ys) == sorted(t.ys) for t in tables),
        # On a GPU, host memory is the slower tier (Neo's and Lamina's premise); on the CPU
        # both tiers are host memory.
        "host_slower_than_device": args.device == "cpu" or per_token["host"] > per_token["device"],
    }
    print(json.dumps({
        "device_profile": profile.to_json(),
        "attention_s_per_context_token": per_token,
        "probe_s": round(time.perf_counter() - began, 2),
        "targets": {"tables_non_decreasing": True, "host_slower_than_device": True},
        "targets_met": met,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
