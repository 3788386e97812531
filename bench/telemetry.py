"""What telemetry costs on the decode path, measured side by side in one run on this machine.

    python bench/telemetry.py [--rounds 6] [--batch 8] [--tokens 48] [--shards 2]

Two meshes of the same topology run at once as OS processes (1 prompt engine, 1 token engine,
`--shards` attention shards):

- on: every service exports its spans and metrics to its own JSON-lines file (`jsonl:`, a real
  exporter that serializes and writes every span, token events included); this process plays the
  router: a `router.request` span per request, its context in the `GenerateRequest`, and
  `RequestTrace.on_output` (TTFT/TBT histograms) on every token it receives;
- off: `PHASEMESH_OTEL_EXPORTER=off` in the services (OpenTelemetry's no-op API: no spans, no
  ids, no metrics) and no router-side telemetry.

Rounds alternate on, off, off, on, ... so drift in the machine's load lands on both. A round sends
`--batch` concurrent requests; TBT is the gap between consecutive tokens of a request as this
client receives them, skipping each request's first two (the first token and the handoff hop).
Also printed: `DecodeSpan.token()` and `RequestTrace.on_output()` timed alone, against the TBT.

The last line is one JSON object; `tbt_ratio_on_off` is median TBT on / off (target < 1.05).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from common.engine.request import FinishReason, RequestOutput
from common.model.default import default_model_path
from common.protocol import SamplingSpec
from common.telemetry import DecodeSpan, Metrics, configure_telemetry, inject_context
from services.launch import Mesh, MeshClient, Topology
from services.router_telemetry import RequestTrace, RouterTelemetry

PROMPT_LEN = 64


def router_telemetry() -> RouterTelemetry:
    """The router's telemetry with its metrics on a private in-memory reader (real SDK records)."""
    meter = MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("bench")
    return RouterTelemetry("bench", metrics=Metrics(model_name="bench", meter=meter, use_ray=False))


def decode_gaps(
    client: MeshClient, batch: int, tokens: int, tag: str, router: RouterTelemetry | None
) -> list[float]:
    """Inter-token gaps (s) of `batch` concurrent requests, each request's first two skipped."""
    sampling = SamplingSpec(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    arrivals: dict[str, list[float]] = {}
    traces: dict[str, RequestTrace] = {}
    for i in range(batch):
        req_id = f"{tag}-{i}"
        arrivals[req_id] = []
        traceparent = ""
        if router is not None:
            traces[req_id] = trace = router.start(
                req_id, operation="text_completion", num_prompt_tokens=PROMPT_LEN,
                max_tokens=tokens, start_ns=time.time_ns(),
            )  # fmt: skip
            traceparent = inject_context(otel_trace.set_span_in_context(trace.span))
        prompt = [(7 * i + j) % 2000 + 8 for j in range(PROMPT_LEN)]
        client.submit(req_id, prompt, sampling, traceparent)
    live = batch
    while live:
        out = client.recv(timeout=300)
        arrivals[out.req_id].append(time.perf_counter())
        if router is not None:
            trace = traces[out.req_id]
            finish = FinishReason(out.finish_reason) if out.finish_reason else None
            count = len(arrivals[out.req_id])
            trace.on_output(RequestOutput(out.req_id, out.token_ids, "", finish, 0, count))
            if finish is not None:
                trace.end()
        live -= bool(out.finish_reason)
    gaps = []
    for times in arrivals.values():
        gaps += [b - a for a, b in zip(times[2:], times[3:], strict=False)]
    return gaps


def start_mesh(model: str, shards: int, exporter: str) -> Mesh:
    return Mesh.start(Topology(model, num_shards=shards, otel_exporter=exporter))


def per_call_us(fn: Callable[[], object], n: int = 20000) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def hot_path_costs() -> dict[str, float]:
    """`DecodeSpan.token()` (the engine's per-token span event) and `RequestTrace.on_output()`
    (the router's per-token TBT record), alone, with this process's real providers."""
    decode = DecodeSpan("", token_engine="bench")
    event_us = per_call_us(decode.token, 5000)
    decode.finish("length")
    trace = router_telemetry().start(
        "cost", operation="text_completion", num_prompt_tokens=1, max_tokens=1,
        start_ns=time.time_ns(),
    )  # fmt: skip
    out = RequestOutput("cost", [1], "", None, 1, 1)
    output_us = per_call_us(lambda: trace.on_output(out))
    trace.end()
    return {"span_event_us": round(event_us, 2), "router_on_output_us": round(output_us, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=6, help="rounds per arm")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--shards", type=int, default=2)
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    folder = Path(tempfile.mkdtemp(prefix="phasemesh-telemetry-bench-"))
    configure_telemetry("bench-router", exporter=f"jsonl:{folder}/router.jsonl")
    meshes = {
        "on": start_mesh(model, args.shards, f"jsonl:{folder}/{{service_id}}.jsonl"),
        "off": start_mesh(model, args.shards, "off"),
    }
    try:
        clients = {arm: MeshClient(mesh) for arm, mesh in meshes.items()}
        routers = {"on": router_telemetry(), "off": None}
        for arm, client in clients.items():
            decode_gaps(client, 2, 8, f"warmup-{arm}", routers[arm])
        gaps: dict[str, list[float]] = {"on": [], "off": []}
        round_medians: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(args.rounds):
            for arm in ("on", "off") if r % 2 == 0 else ("off", "on"):
                got = decode_gaps(clients[arm], args.batch, args.tokens, f"{arm}{r}", routers[arm])
                gaps[arm] += got
                round_medians[arm].append(statistics.median(got))
                print(f"round {r} {arm:3s}: TBT p50 {1e3 * round_medians[arm][-1]:.3f} ms")
        for client in clients.values():
            client.close()
    finally:
        for mesh in meshes.values():
            mesh.close()
    result = summarize(gaps, round_medians, hot_path_costs(), args)
    result["exported_to"] = str(folder)
    print(json.dumps(result))


def summarize(
    gaps: dict[str, list[float]],
    round_medians: dict[str, list[float]],
    costs: dict[str, float],
    args: argparse.Namespace,
) -> dict:
    p50 = {arm: statistics.median(g) for arm, g in gaps.items()}
    mean = {arm: statistics.mean(g) for arm, g in gaps.items()}
    paired = [a / b for a, b in zip(round_medians["on"], round_medians["off"], strict=True)]
    ratio = p50["on"] / p50["off"]
    per_token_us = costs["span_event_us"] + costs["router_on_output_us"]
    print(f"decode TBT p50: on {1e3 * p50['on']:.3f} ms, off {1e3 * p50['off']:.3f} ms, "
          f"ratio {ratio:.3f} (target < 1.05); mean ratio {mean['on'] / mean['off']:.3f}; "
          f"per-round ratios {[round(x, 3) for x in paired]}")  # fmt: skip
    print(
        f"per token: span event {costs['span_event_us']} us + router record "
        f"{costs['router_on_output_us']} us = {per_token_us / (1e4 * p50['off']):.2f}% of TBT"
    )
    return {
        "batch": args.batch,
        "tokens": args.tokens,
        "shards": args.shards,
        "rounds": args.rounds,
        "tbt_p50_ms": {arm: round(1e3 * v, 3) for arm, v in p50.items()},
        "tbt_mean_ms": {arm: round(1e3 * v, 3) for arm, v in mean.items()},
        "tbt_ratio_on_off": round(ratio, 4),
        "tbt_mean_ratio_on_off": round(mean["on"] / mean["off"], 4),
        "round_ratio_median": round(statistics.median(paired), 4),
        **costs,
        "per_token_cost_fraction_of_tbt": round(per_token_us / (1e6 * p50["off"]), 5),
    }


if __name__ == "__main__":
    main()
