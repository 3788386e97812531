"""Disaggregation overhead, measured side by side in one run on this machine.

    python bench/disagg.py [--model tiny|small|PATH] [--batches 1 8 32] [--tokens 48]
                           [--skip-transport]

1. Decode TBT (median, p90) at each batch size with local attention (1 prompt engine, 1 token
   engine, 0 shards) and with a 2-shard group (Lamina), as separate OS processes; TBT is the gap
   between consecutive tokens of a request as the client receives them.
2. `bench/transport.py` in a subprocess: the per-layer shard round trip over UCX and over our zmq
   channel against a plain ZeroMQ round trip with the same payload, and bulk (KV-sized) transfer
   rates over UCX and ZeroMQ.

The last line is one JSON object: TBT figures, the shards/local ratio per batch (Lamina's budget is
1.2, α = 0.2) and the transport ratios. The breakdown line says what dominates: the per-step cost
of the shard round trips (layers x RTT) against the local step time.

Which model decides the ratio: Lamina's budget assumes a layer's dense compute dwarfs a network
round trip. The default `tiny` preset (4 layers, hidden 256) computes a layer in ~0.4 ms at batch
8 on the session-13 VM, against a bare 0.13-0.18 ms round trip per layer, so its ratio stays
above 1.4 even with zero software cost; `--model small` (12 layers, hidden 768, ~100 M
parameters) is the preset where the budget can be judged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common.model.default import PRESETS, default_model_path
from common.protocol import SamplingSpec
from services.launch import Mesh, MeshClient, Topology

PROMPT_LEN = 64


def decode_gaps(client: MeshClient, batch: int, tokens: int, tag: str) -> list[float]:
    """Inter-token gaps (s) of `batch` concurrent requests, skipping each one's first two tokens
    (first token and the prefill/handoff hop)."""
    sampling = SamplingSpec(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    arrivals: dict[str, list[float]] = {}
    for i in range(batch):
        req_id = f"{tag}-{i}"
        arrivals[req_id] = []
        client.submit(req_id, [(7 * i + j) % 2000 + 8 for j in range(PROMPT_LEN)], sampling)
    live = batch
    while live:
        out = client.recv(timeout=300)
        arrivals[out.req_id].append(time.perf_counter())
        live -= bool(out.finish_reason)
    gaps = []
    for times in arrivals.values():
        gaps += [b - a for a, b in zip(times[2:], times[3:], strict=False)]
    return gaps


def measure_tbt(model: str, shards: int, batches: list[int], tokens: int) -> dict[str, dict]:
    mesh = Mesh.start(Topology(model, num_prompt=1, num_token=1, num_shards=shards))
    try:
        client = MeshClient(mesh)
        decode_gaps(client, 2, 8, "warmup")
        out = {}
        for batch in batches:
            gaps = sorted(decode_gaps(client, batch, tokens, f"b{batch}"))
            out[str(batch)] = {
                "tbt_p50_ms": round(1e3 * statistics.median(gaps), 3),
                "tbt_p90_ms": round(1e3 * gaps[int(0.9 * (len(gaps) - 1))], 3),
            }
            print(f"shards={shards} batch={batch:3d}: TBT p50 {out[str(batch)]['tbt_p50_ms']} ms"
                  f"  p90 {out[str(batch)]['tbt_p90_ms']} ms")  # fmt: skip
        client.close()
        return out
    finally:
        mesh.close()


def transport_figures() -> dict:
    script = Path(__file__).with_name("transport.py")
    proc = subprocess.run(
        [sys.executable, str(script), "--repeats", "3"], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="a preset (tiny, small) or a model folder")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--skip-transport", action="store_true")
    args = parser.parse_args()
    model = str(default_model_path(args.model)) if args.model in PRESETS else args.model
    local = measure_tbt(model, 0, args.batches, args.tokens)
    sharded = measure_tbt(model, 2, args.batches, args.tokens)
    ratios = {b: round(sharded[b]["tbt_p50_ms"] / local[b]["tbt_p50_ms"], 3) for b in local}
    result: dict = {"tbt_local": local, "tbt_2_shards": sharded, "tbt_ratio_shards_local": ratios}
    for b, r in ratios.items():
        step, extra = local[b]["tbt_p50_ms"], sharded[b]["tbt_p50_ms"] - local[b]["tbt_p50_ms"]
        print(f"batch {b}: shards/local TBT {r} (budget 1.2); the shard round trips add "
              f"{extra:.2f} ms per step on a {step:.2f} ms local step")  # fmt: skip
    if not args.skip_transport:
        result["transport"] = transport_figures()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
