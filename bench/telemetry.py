"""What telemetry costs on the decode path, measured side by side in one run on this machine.

    python bench/telemetry.py [--rounds 16] [--batch 8] [--tokens 32] [--exporter jsonl]

Two meshes of the same topology run at once as OS processes (1 prompt engine, 1 token engine,
`--shards` attention shards):

- on: every service exports its spans and metrics to its own JSON-lines file (`jsonl:`, a real
  exporter that serializes and writes every span, token events included; `--exporter none` keeps
  the spans but exports nothing, `--exporter off` makes both arms off, an A/A check of the
  method); this process plays the router: a `router.request` span per request, its context in
  the `GenerateRequest`, and `RequestTrace.on_output` (TTFT/TBT histograms) on every token;
- off: `PHASEMESH_OTEL_EXPORTER=off` in the services (OpenTelemetry's no-op API: no spans, no
  ids, no metrics) and no router-side telemetry.

Rounds alternate on, off, off, on, ... so drift in the machine's load lands on both. A round sends
`--batch` concurrent requests; TBT is the gap between consecutive tokens of a request as this
client receives them, skipping each request's first two (the first token and the handoff hop).
Each round's median TBT is divided by its partner round's; the median of those ratios is
`tbt_ratio_on_off` (target < 1.05).

NOTE: on a shared 2-core machine other people's work moves single rounds by tens of percent
(`--exporter off`, an A/A run, shows how much today). So the bench also measures the work itself:
the CPU time (`/proc/<pid>/task/*/schedstat`, every thread, nanoseconds) that the decode path (the
token engine and its shards) spends per decoded token, which being descheduled does not change.
`decode_cpu_ratio_on_off` is that, on / off, the median of paired rounds again; on an idle
machine TBT is that work plus the transport, so it bounds the TBT change. Also printed:
`DecodeSpan.token()` and `RequestTrace.on_output()` timed alone, against the TBT.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
    parser.add_argument("--rounds", type=int, default=16, help="rounds per arm")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--exporter", choices=["jsonl", "none", "off"], default="jsonl")
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    folder = Path(tempfile.mkdtemp(prefix="phasemesh-telemetry-bench-"))
    on = args.exporter != "off"
    exporter = f"jsonl:{folder}/{{service_id}}.jsonl" if args.exporter == "jsonl" else args.exporter
    configure_telemetry("bench-router", exporter=exporter.replace("{service_id}", "router"))
    arms = {
        "on": Arm(start_mesh(model, args.shards, exporter), router_telemetry() if on else None),
        "off": Arm(start_mesh(model, args.shards, "off"), None),
    }
    try:
        run_rounds(arms, args)
    finally:
        for arm in arms.values():
            arm.mesh.close()
    result = summarize(arms, hot_path_costs(), args)
    result["exported_to"] = str(folder)
    print(json.dumps(result))


@dataclass
class Arm:
    """One mesh and what its rounds measured."""

    mesh: Mesh
    router: RouterTelemetry | None
    gaps: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)
    round_cpu_us: list[float] = field(default_factory=list)  # decode-path CPU per token

    def decode_pids(self) -> list[int]:
        """The token engine and its shards (`Mesh` starts shards, token engines, prompt)."""
        t = self.mesh.topology
        return [p.pid for p in self.mesh.procs[: t.num_shards + t.num_token]]


def cpu_ns(pids: list[int]) -> int:
    """On-CPU time of every thread of `pids` so far (the scheduler's own count, in ns)."""
    total = 0
    for pid in pids:
        for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            try:
                total += int(stat.read_text().split()[0])
            except (OSError, ValueError):
                continue  # a thread that just exited
    return total


def run_rounds(arms: dict[str, Arm], args: argparse.Namespace) -> None:
    """Alternating rounds: every gap of each arm, each round's median, decode-path CPU time."""
    clients = {name: MeshClient(arm.mesh) for name, arm in arms.items()}
    for name, client in clients.items():
        decode_gaps(client, 2, 8, f"warmup-{name}", arms[name].router)
    for r in range(args.rounds):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            arm = arms[name]
            before = cpu_ns(arm.decode_pids())
            got = decode_gaps(clients[name], args.batch, args.tokens, f"{name}{r}", arm.router)
            num_tokens = args.batch * (args.tokens - 1)
            arm.round_cpu_us.append((cpu_ns(arm.decode_pids()) - before) / num_tokens / 1e3)
            arm.gaps += got
            arm.round_medians.append(statistics.median(got))
        on, off = arms["on"], arms["off"]
        print(f"round {r}: TBT p50 on {1e3 * on.round_medians[-1]:.3f} ms, "
              f"off {1e3 * off.round_medians[-1]:.3f} ms; decode-path CPU per token "
              f"on {on.round_cpu_us[-1]:.0f} us, off {off.round_cpu_us[-1]:.0f} us")  # fmt: skip
    for client in clients.values():
        client.close()


def summarize(arms: dict[str, Arm], costs: dict[str, float], args: argparse.Namespace) -> dict:
    p50 = {name: statistics.median(arm.gaps) for name, arm in arms.items()}
    mean = {name: statistics.mean(arm.gaps) for name, arm in arms.items()}
    on, off = arms["on"], arms["off"]
    paired = [a / b for a, b in zip(on.round_medians, off.round_medians, strict=True)]
    ratio = statistics.median(paired)
    cpu_us = {name: statistics.median(arm.round_cpu_us) for name, arm in arms.items()}
    cpu_ratios = [a / b for a, b in zip(on.round_cpu_us, off.round_cpu_us, strict=True)]
    cpu_ratio = statistics.median(cpu_ratios)
    per_token_us = costs["span_event_us"] + costs["router_on_output_us"]
    print(f"decode TBT on/off, median of {len(paired)} paired rounds: {ratio:.3f} (target < 1.05); "
          f"pooled p50 on {1e3 * p50['on']:.3f} ms, off {1e3 * p50['off']:.3f} ms "
          f"({p50['on'] / p50['off']:.3f}), mean ratio {mean['on'] / mean['off']:.3f}")  # fmt: skip
    print(f"decode-path CPU per token, median of paired rounds: {cpu_ratio:.3f} (target < 1.05); "
          f"median on {cpu_us['on']:.1f} us, off {cpu_us['off']:.1f} us")  # fmt: skip
    print(
        f"per token: span event {costs['span_event_us']} us + router record "
        f"{costs['router_on_output_us']} us = {per_token_us / (1e4 * p50['off']):.2f}% of TBT"
    )
    return {
        "batch": args.batch,
        "tokens": args.tokens,
        "shards": args.shards,
        "rounds": args.rounds,
        "exporter": args.exporter,
        "tbt_p50_ms": {arm: round(1e3 * v, 3) for arm, v in p50.items()},
        "tbt_mean_ms": {arm: round(1e3 * v, 3) for arm, v in mean.items()},
        "tbt_ratio_on_off": round(ratio, 4),
        "tbt_pooled_p50_ratio_on_off": round(p50["on"] / p50["off"], 4),
        "tbt_mean_ratio_on_off": round(mean["on"] / mean["off"], 4),
        "round_ratios": [round(x, 4) for x in paired],
        "decode_cpu_us_per_token": {name: round(v, 2) for name, v in cpu_us.items()},
        "decode_cpu_ratio_on_off": round(cpu_ratio, 4),
        "decode_cpu_round_ratios": [round(x, 4) for x in cpu_ratios],
        **costs,
        "per_token_cost_fraction_of_tbt": round(per_token_us / (1e6 * p50["off"]), 5),
    }


if __name__ == "__main__":
    main()
