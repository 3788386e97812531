"""What telemetry costs on the decode path, measured side by side in one run.

    python bench/telemetry.py [--rounds 40] [--batch 8] [--tokens 24] [--exporter jsonl]

Two meshes of the same topology run at once as OS processes (1 prompt engine, 1 token engine,
`--shards` attention shards): one with telemetry on, every service exporting its spans and metrics
to its own JSON-lines file (`jsonl:`, a real exporter that serializes and writes every span, token
events included; `--exporter none` records the traced arm's spans and exports nothing: what
recording cost before `none` stopped sampling its own traces), one with
`PHASEMESH_OTEL_EXPORTER=off` (OpenTelemetry's no-op API: no spans, no ids, no metrics). Each round
runs three arms, in an order that turns every round:

- traced: the telemetry mesh, sampled requests. This process plays the router: a
  `router.request` span per request (continuing a caller's sampled context), its context in the
  `GenerateRequest`, and `RequestTrace.on_output` (TTFT/TBT histograms) on every token it
  receives;
- untraced: the same mesh and processes, requests whose trace context says "not sampled", so
  every span of theirs is a no-op, and no router-side records;
- off: the other mesh.

A round sends `--batch` concurrent requests; TBT is the gap between consecutive tokens of a
request as this client receives them, skipping each request's first two (the first token and the
handoff hop). Each round's median TBT is divided by its partners'; the medians of those ratios are
the results (target < 1.05):

- `tbt_ratio_tracing`: traced / untraced, in the same processes: every per-token thing telemetry
  does (the span event, the router's TBT record, the exporter's thread) on against off. This is
  the number that answers "what does telemetry cost decode TBT" (metrics at the engines are per
  request or periodic, never per token, and run in both arms);
- `tbt_ratio_on_off`: traced / off, everything on against everything off, across two meshes;
- `tbt_ratio_mesh_bias`: untraced / off, what the two meshes differ by without tracing. On a
  shared machine with few cores two identical meshes differ by several percent either way (run
  twice and it moves), so `on_off` carries that bias; `tracing` does not.

NOTE: other people's work on a shared machine moves single rounds by tens of percent, hence many
short rounds and medians of paired ratios. The bench also measures the work itself: the CPU time
(`/proc/<pid>/task/*/schedstat`, every thread, nanoseconds) the decode path (the token engine and
its shards) spends per decoded token (`decode_cpu_ratio_*`, same pairing). Also printed:
`DecodeSpan.token()` and `RequestTrace.on_output()` timed alone, against the TBT.

The last line is one JSON object, with `targets` and `targets_met`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from common.engine.request import RequestOutput
from common.model.default import default_model_path
from common.sampling_params import SamplingParams
from common.telemetry import DecodeSpan, Metrics, configure_telemetry, extract_context
from loadgen.cli import positive_int
from services.launch.local_mesh import LocalMesh, Topology
from services.router.mesh_client import MeshEngineClient
from services.router.sse import prepend
from services.router.telemetry import RouterTelemetry

PROMPT_LEN = 64
ARMS = ("traced", "untraced", "off")
TRACING_TBT_TARGET = 1.05  # traced / untraced decode TBT: what telemetry may cost (see above)
RATIOS = {"tracing": ("traced", "untraced"), "on_off": ("traced", "off"),
          "mesh_bias": ("untraced", "off")}  # fmt: skip


@dataclass
class Arm:
    """A way to send requests, and what its rounds measured."""

    mesh: LocalMesh
    client: MeshEngineClient
    router: RouterTelemetry | None  # traced: the router's spans and records
    sampled: bool = True
    round_tbt: list[float] = field(default_factory=list)  # each round's median TBT
    round_cpu_us: list[float] = field(default_factory=list)  # decode-path CPU per token
    gaps: list[float] = field(default_factory=list)

    def decode_pids(self) -> list[int]:
        """The token engine and its shards (`LocalMesh` starts shards, token engines, prompt)."""
        t = self.mesh.topology
        return [p.pid for p in self.mesh.procs[: t.num_shards + t.num_token]]


def router_telemetry() -> RouterTelemetry:
    """The router's telemetry with its metrics on a private in-memory reader (real SDK records)."""
    meter = MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("bench")
    return RouterTelemetry("bench", metrics=Metrics(model_name="bench", meter=meter, use_ray=False))


def caller_traceparent(sampled: bool) -> str:
    """A caller's W3C context: "sampled" is continued sampled under any exporter (`none` starts
    its own traces unsampled); "not sampled" makes every span under it a no-op."""
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-{'01' if sampled else '00'}"


SKIPPED_GAPS = 2  # a request's first two gaps: the first token's, and the handoff hop's
MIN_TOKENS = SKIPPED_GAPS + 2  # tokens a request needs for one gap past the skipped ones


def token_gaps(arrivals: list[tuple[float, int]], skip: int = SKIPPED_GAPS) -> list[float]:
    """Each token's gap (s) from the token before it, but the first `skip + 1`'s, from a
    request's outputs as (arrival time, tokens in it). Tokens that reached the router together
    leave as one output (`services/router/coalesce.py`): its tokens share the wait since the
    output before it evenly, so a loaded machine's batched arrivals neither drop gaps nor count
    zeros. The first output's tokens have no output before them, hence no gap."""
    gaps: list[float] = []
    index, last = 0, None  # tokens so far; when the last output with tokens arrived
    for at, num_tokens in arrivals:
        if num_tokens == 0:
            continue  # a finish with no token
        if last is not None:
            counted = index + num_tokens - max(index, skip + 1)  # its tokens past the skipped
            gaps += [(at - last) / num_tokens] * max(counted, 0)
        index, last = index + num_tokens, at
    return gaps


def decode_gaps(arm: Arm, batch: int, tokens: int, tag: str) -> list[float]:
    """Inter-token gaps (s) of `batch` concurrent requests, each request's first two skipped
    (`token_gaps`)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def arrivals(i: int) -> list[tuple[float, int]]:
        prompt = [(7 * i + j) % 2000 + 8 for j in range(PROMPT_LEN)]
        times = []
        async for out in await traced_outputs(arm, f"{tag}-{i}", prompt, params):
            if out.error:
                raise RuntimeError(f"{tag}-{i} failed: {out.error}")
            times.append((time.perf_counter(), len(out.new_token_ids)))
        return times

    async def run() -> list[list[tuple[float, int]]]:
        return list(await asyncio.gather(*(arrivals(i) for i in range(batch))))

    return [gap for times in asyncio.run(run()) for gap in token_gaps(times)]


async def traced_outputs(
    arm: Arm, req_id: str, prompt: list[int], params: SamplingParams
) -> AsyncGenerator[RequestOutput, None]:
    """One request's outputs through the arm's client. Traced, as the router runs it
    (`services/router/server.py`): its span current while the client admits (the engines get its
    context), every output recorded (`RequestTrace.observe`: TTFT/TBT) as it leaves. Untraced:
    a caller's "not sampled" context current while the client admits."""
    outputs = arm.client.generate(req_id, prompt, params)
    if arm.router is None:
        with current_context(caller_traceparent(sampled=False) if not arm.sampled else ""):
            first = await anext(outputs)
        return prepend(first, outputs)
    trace = arm.router.start(
        req_id, operation="text_completion", num_prompt_tokens=len(prompt),
        max_tokens=params.max_tokens, start_ns=time.time_ns(),
        traceparent=caller_traceparent(sampled=True),
    )  # fmt: skip
    with trace.admission():
        first = await anext(outputs)
    return trace.observe(prepend(first, outputs))


@contextmanager
def current_context(traceparent: str) -> Iterator[None]:
    """The caller's trace context (`traceparent`; "" none) current inside the block."""
    token = otel_context.attach(extract_context(traceparent))
    try:
        yield
    finally:
        otel_context.detach(token)


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
    """Rounds of every arm, the order turning each round; medians and CPU per token recorded."""
    for name, arm in arms.items():
        decode_gaps(arm, 2, 8, f"warmup-{name}")
    num_tokens = args.batch * (args.tokens - 1)
    for r in range(args.rounds):
        order = ARMS[r % 3 :] + ARMS[: r % 3]
        for name in reversed(order) if r % 2 else order:
            arm = arms[name]
            before = cpu_ns(arm.decode_pids())
            gaps = decode_gaps(arm, args.batch, args.tokens, f"{name}{r}")
            arm.round_cpu_us.append((cpu_ns(arm.decode_pids()) - before) / num_tokens / 1e3)
            arm.round_tbt.append(statistics.median(gaps))
            arm.gaps += gaps
        print(f"round {r}: TBT p50 " + ", ".join(
            f"{name} {1e3 * arms[name].round_tbt[-1]:.3f} ms" for name in ARMS))  # fmt: skip


def per_call_us(fn: Callable[[], object], n: int = 20000) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def hot_path_costs() -> dict[str, float]:
    """`DecodeSpan.token()` (the engine's per-token span event) and `RequestTrace.on_output()`
    (the router's per-token TBT record), alone, with this process's real providers."""
    decode = DecodeSpan(caller_traceparent(sampled=True), token_engine="bench")
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


def paired_median(arms: dict[str, Arm], pair: tuple[str, str], metric: str) -> float:
    a, b = (getattr(arms[name], metric) for name in pair)
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def summarize(arms: dict[str, Arm], costs: dict[str, float], args: argparse.Namespace) -> dict:
    tbt = {name: paired_median(arms, pair, "round_tbt") for name, pair in RATIOS.items()}
    cpu = {name: paired_median(arms, pair, "round_cpu_us") for name, pair in RATIOS.items()}
    p50_ms = {name: 1e3 * statistics.median(arm.gaps) for name, arm in arms.items()}
    cpu_us = {name: statistics.median(arm.round_cpu_us) for name, arm in arms.items()}
    for name, (a, b) in RATIOS.items():
        print(f"{name:9s} ({a} / {b}): decode TBT {tbt[name]:.3f}, "
              f"decode-path CPU per token {cpu[name]:.3f}")  # fmt: skip
    per_token_us = costs["span_event_us"] + costs["router_on_output_us"]
    print(f"TBT p50 {', '.join(f'{n} {v:.3f} ms' for n, v in p50_ms.items())}; per token: span "
          f"event {costs['span_event_us']} us + router record {costs['router_on_output_us']} us "
          f"= {per_token_us / (10 * p50_ms['off']):.2f}% of TBT")  # fmt: skip
    return {
        "batch": args.batch,
        "tokens": args.tokens,
        "shards": args.shards,
        "rounds": args.rounds,
        "exporter": args.exporter,
        **{f"tbt_ratio_{name}": round(v, 4) for name, v in tbt.items()},
        **{f"decode_cpu_ratio_{name}": round(v, 4) for name, v in cpu.items()},
        "tbt_p50_ms": {name: round(v, 3) for name, v in p50_ms.items()},
        "decode_cpu_us_per_token": {name: round(v, 1) for name, v in cpu_us.items()},
        **costs,
        "per_token_cost_fraction_of_tbt": round(per_token_us / (1e3 * p50_ms["off"]), 5),
        "targets": {"tbt_ratio_tracing": f"< {TRACING_TBT_TARGET}"},
        "targets_met": {"tbt_ratio_tracing": tbt["tracing"] < TRACING_TBT_TARGET},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=positive_int, default=40,
                        help="rounds (each runs every arm)")  # fmt: skip
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--exporter", choices=["jsonl", "none"], default="jsonl")
    args = parser.parse_args()
    if args.tokens < MIN_TOKENS:  # each request's first gaps are skipped (`token_gaps`)
        parser.error(f"--tokens must be at least {MIN_TOKENS}, so that every request has a gap")
    model = args.model or str(default_model_path())
    folder = Path(tempfile.mkdtemp(prefix="phasemesh-telemetry-bench-"))
    exporter = f"jsonl:{folder}/{{service_id}}.jsonl" if args.exporter == "jsonl" else "none"
    configure_telemetry("bench-router", exporter=exporter.replace("{service_id}", "router"))
    meshes = [LocalMesh.start(Topology(model, num_shards=args.shards, otel_exporter=e))
              for e in (exporter, "off")]  # fmt: skip
    try:
        on, off = meshes[0].engine_client(), meshes[1].engine_client()
        arms = {
            "traced": Arm(meshes[0], on, router_telemetry()),
            "untraced": Arm(meshes[0], on, None, sampled=False),
            "off": Arm(meshes[1], off, None),
        }
        run_rounds(arms, args)
        on.shutdown()
        off.shutdown()
    finally:
        for mesh in meshes:
            mesh.close()
    result = summarize(arms, hot_path_costs(), args)
    result["exported_to"] = str(folder)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
