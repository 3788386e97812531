"""Serving metrics named as vLLM names them, recorded to OpenTelemetry, to Ray's metrics and, in
the router, to its own `/metrics` (prometheus-client, `common.telemetry.prometheus`).

Names are written vLLM-style (`phasemesh:time_to_first_token_seconds`), but neither sink accepts
the colon: OpenTelemetry instrument names must match `[a-zA-Z][-_./a-zA-Z0-9]*`, and Ray 2.60
warns that `:` "is no longer allowed" (a FutureWarning today, an error later). Both sinks
therefore get `MetricSpec.exported_name`, the colon turned into `_`, and Prometheus sees:

    OTLP -> collector -> Prometheus:  phasemesh_time_to_first_token_seconds_bucket{...}
    Ray metrics agent -> Prometheus:  ray_phasemesh_time_to_first_token_seconds_bucket{...}

vLLM's Ray wrapper does the same (`vllm:x` becomes `ray_vllm_x`). The OTLP side also records
three GenAI semantic-convention histograms (`gen_ai.server.*`), once per request.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics
from opentelemetry.metrics import Meter

from common.telemetry.setup import telemetry_is_off
from common.telemetry.spans import OPERATION, PROVIDER, PROVIDER_NAME, REQUEST_MODEL

# Seconds. TTFT and queue/prefill: 1 ms to 40 min (vLLM's TTFT buckets).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
# TBT and KV transfer: ms-scale, with 1-5 ms steps where a CPU decode step lives.
TBT_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
               0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
# Whole requests (vLLM's request latency buckets, with sub-second ones for short outputs).
REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# One attention-shard round trip for one layer: tens of microseconds and up.
SHARD_RTT_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
                     0.1, 0.25, 1.0)  # fmt: skip
# The GenAI semantic conventions' recommended buckets.
GENAI_DURATION_BUCKETS = tuple(0.01 * 2**i for i in range(14))
GENAI_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

# Tokens per forward pass: vLLM's `iteration_tokens_total` buckets.
ITERATION_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                           8192.0, 16384.0)  # fmt: skip
# Tokens of one request: vLLM's 1-2-5 buckets, here to a million.
TOKEN_COUNT_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))[:19]

BASE_LABELS = ("model_name", "engine")


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its vLLM-style name, instrument kind, unit, labels and (histograms) buckets."""

    name: str
    kind: str  # "histogram" | "gauge" | "counter"
    unit: str
    description: str
    extra_labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def exported_name(self) -> str:
        """The name both OpenTelemetry and Ray accept: `phasemesh:x` becomes `phasemesh_x`."""
        return self.name.replace(":", "_")

    @property
    def labels(self) -> tuple[str, ...]:
        return BASE_LABELS + self.extra_labels


def short_name(name: str) -> str:
    """A metric's name without its prefix: `phasemesh:x` -> `x`."""
    return name.split(":", 1)[1]


def _hist(name: str, description: str, buckets: tuple[float, ...], *extra: str) -> MetricSpec:
    return MetricSpec(f"phasemesh:{name}", "histogram", "s", description, extra, buckets)


def _gauge(name: str, unit: str, description: str, *extra: str) -> MetricSpec:
    return MetricSpec(f"phasemesh:{name}", "gauge", unit, description, extra)


def _counter(name: str, unit: str, description: str, *extra: str) -> MetricSpec:
    return MetricSpec(f"phasemesh:{name}", "counter", unit, description, extra)


TTFT = _hist("time_to_first_token_seconds", "Time to first token (TTFT)", TTFT_BUCKETS)
TBT = _hist("inter_token_latency_seconds", "Gap between consecutive tokens (TBT)", TBT_BUCKETS)
E2E = _hist("e2e_request_latency_seconds", "End-to-end request latency", REQUEST_BUCKETS)
TPOT = _hist(
    "request_time_per_output_token_seconds", "Decode time / (output tokens - 1)", TBT_BUCKETS
)
QUEUE_TIME = _hist("request_queue_time_seconds", "Time waiting in an engine queue", TTFT_BUCKETS)
PREFILL_TIME = _hist("request_prefill_time_seconds", "Prefill phase of a request", TTFT_BUCKETS)
DECODE_TIME = _hist("request_decode_time_seconds", "Decode phase of a request", REQUEST_BUCKETS)
KV_TRANSFER_TIME = _hist("kv_transfer_time_seconds", "KV transfer of one request", TBT_BUCKETS)
SHARD_RTT = _hist(
    "shard_round_trip_seconds", "One layer's attention round trip", SHARD_RTT_BUCKETS, "shard"
)
RUNNING = _gauge("num_requests_running", "{request}", "Requests in the running batch")
WAITING = _gauge("num_requests_waiting", "{request}", "Requests waiting in queue")
KV_BLOCKS_USED = _gauge("kv_blocks_used", "{block}", "KV cache blocks in use", "shard")
BATCH_SIZE = _gauge("batch_size", "{request}", "Requests in the last batch", "phase")
PROMPT_TOKENS = _counter("prompt_tokens_total", "{token}", "Prefilled prompt tokens")
GENERATION_TOKENS = _counter("generation_tokens_total", "{token}", "Generated tokens")
KV_TRANSFER_BYTES = _counter("kv_transfer_bytes_total", "By", "KV bytes transferred")
REQUEST_SUCCESS = _counter(
    "request_success_total", "{request}", "Finished requests", "finished_reason"
)
REQUEST_ERRORS = _counter("request_errors_total", "{request}", "Failed requests", "kind")
POOL_ENGINES = _gauge(
    "pool_engines", "{engine}", "Engines serving in each pool, as their reports say", "pool"
)
MIGRATIONS = _counter("request_migrations_total", "{request}", "Requests re-run", "reason")
POOL_LOANS = _counter(
    "pool_loans_total", "{loan}", "Times an engine was lent to the mixed pool (by itself)", "home"
)

REQUEST_PROMPT_TOKENS = MetricSpec(
    "phasemesh:request_prompt_tokens",
    "histogram",
    "{token}",
    "Prompt tokens of a request",
    buckets=TOKEN_COUNT_BUCKETS,
)
REQUEST_GENERATION_TOKENS = MetricSpec(
    "phasemesh:request_generation_tokens", "histogram", "{token}",
    "Generated tokens of a request", buckets=TOKEN_COUNT_BUCKETS,
)  # fmt: skip

METRIC_SPECS = (
    TTFT, TBT, E2E, TPOT, QUEUE_TIME, PREFILL_TIME, DECODE_TIME, KV_TRANSFER_TIME, SHARD_RTT,
    RUNNING, WAITING, KV_BLOCKS_USED, BATCH_SIZE, PROMPT_TOKENS, GENERATION_TOKENS,
    KV_TRANSFER_BYTES, REQUEST_SUCCESS, REQUEST_ERRORS, MIGRATIONS, POOL_ENGINES, POOL_LOANS,
    REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS,
)  # fmt: skip

# What the router records itself, on its `/metrics` too.
ROUTER_SPECS = (
    TTFT, TBT, E2E, TPOT, PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS, REQUEST_ERRORS,
    MIGRATIONS, POOL_ENGINES, REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS,
)  # fmt: skip

# The router's `/metrics` only: each engine's, read from its load reports (`EngineCounters`);
# with RUNNING and WAITING, vLLM's engine series. No OpenTelemetry or Ray instrument.
KV_CACHE_USAGE = _gauge("kv_cache_usage_perc", "1", "KV cache usage; 1 means 100 percent")
PREFIX_CACHE_QUERIES = _counter(
    "prefix_cache_queries_total", "{token}", "Prefix cache queries, in prompt tokens looked up"
)
PREFIX_CACHE_HITS = _counter(
    "prefix_cache_hits_total", "{token}", "Prefix cache hits, in prompt tokens found cached"
)
PREEMPTIONS = _counter("num_preemptions_total", "{preemption}", "Requests preempted")
ENGINE_POOL = _gauge(
    "engine_pool", "{engine}", "1 per engine: its home pool and the pool it serves in now",
    "home", "pool",
)  # fmt: skip
ITERATION_TOKENS = MetricSpec(
    "phasemesh:iteration_tokens_total",
    "histogram",
    "{token}",
    "Tokens per forward pass",
    buckets=ITERATION_TOKEN_BUCKETS,
)
REPORTED_SPECS = (
    RUNNING, WAITING, KV_CACHE_USAGE, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PREEMPTIONS,
    ITERATION_TOKENS, ENGINE_POOL,
)  # fmt: skip

Recorder = Callable[..., Any]

if TYPE_CHECKING:
    from common.telemetry.prometheus import PrometheusSink


class _Sink:
    """One metric, recorded to OpenTelemetry, when Ray metrics are on to Ray, and to the
    router's `/metrics` when it serves this metric."""

    __slots__ = ("_otel", "_ray", "_prometheus", "_is_counter")

    def __init__(
        self, spec: MetricSpec, meter: Meter, use_ray: bool, prometheus: PrometheusSink | None
    ):
        self._otel = _otel_recorder(spec, meter)
        self._ray = _ray_recorder(spec) if use_ray else None
        self._prometheus = prometheus.recorder(spec) if prometheus is not None else None
        self._is_counter = spec.kind == "counter"

    def record(self, value: float, labels: dict[str, str]) -> None:
        if self._is_counter and value <= 0:
            return  # Ray rejects non-positive increments; OpenTelemetry gains nothing from 0.
        self._otel(value, labels)
        if self._ray is not None:
            self._ray(value, tags=labels)
        if self._prometheus is not None:
            self._prometheus(value, labels)


def _otel_recorder(spec: MetricSpec, meter: Meter) -> Recorder:
    name, unit = spec.exported_name, spec.unit
    if spec.kind == "histogram":
        return meter.create_histogram(
            name, unit, spec.description, explicit_bucket_boundaries_advisory=spec.buckets
        ).record
    if spec.kind == "gauge":
        return meter.create_gauge(name, unit, spec.description).set
    return meter.create_counter(name, unit, spec.description).add


def _ray_recorder(spec: MetricSpec) -> Recorder:
    # Imported only when Ray is running in this process: importing ray costs about a second.
    from ray.util import metrics as ray_metrics

    name, labels = spec.exported_name, spec.labels
    if spec.kind == "histogram":
        return ray_metrics.Histogram(name, spec.description, list(spec.buckets), labels).observe
    if spec.kind == "gauge":
        return ray_metrics.Gauge(name, spec.description, labels).set
    return ray_metrics.Counter(name, spec.description, labels).inc


def ray_is_running() -> bool:
    """True inside a Ray worker or driver that called `ray.init` (without importing ray)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


class Metrics:
    """The serving metrics of one service replica, labelled `model_name` and `engine`.

    Record methods take seconds, counts or bytes. `use_ray=None` records to Ray's metrics when
    Ray is running in this process (and telemetry is not `off`); `prometheus`: the router's
    `/metrics` registry, which records the metrics it serves (`ROUTER_SPECS`) whatever the
    exporter. Build it after `configure_telemetry` (or pass a `meter`).
    """

    def __init__(
        self,
        *,
        model_name: str = "",
        engine: str = "",
        meter: Meter | None = None,
        use_ray: bool | None = None,
        prometheus: PrometheusSink | None = None,
    ):
        meter = meter or metrics.get_meter("phasemesh")
        use_ray = ray_is_running() and not telemetry_is_off() if use_ray is None else use_ray
        self.labels = {"model_name": model_name, "engine": engine}
        self._sinks = {spec.name: _Sink(spec, meter, use_ray, prometheus) for spec in METRIC_SPECS}
        self._genai = _GenAiMetrics(meter, model_name)

    # Latencies (seconds).
    def record_ttft(self, seconds: float, operation: str = "text_completion") -> None:
        self._sinks[TTFT.name].record(seconds, self.labels)
        self._genai.ttft.record(seconds, self._genai.attributes(operation))

    def record_tbt(self, seconds: float) -> None:
        """One inter-token gap: the per-token hot path, one record per sink."""
        self._sinks[TBT.name].record(seconds, self.labels)

    def record_e2e(self, seconds: float, operation: str = "text_completion") -> None:
        self._sinks[E2E.name].record(seconds, self.labels)
        self._genai.duration.record(seconds, self._genai.attributes(operation))

    def record_tpot(self, seconds: float, operation: str = "text_completion") -> None:
        self._sinks[TPOT.name].record(seconds, self.labels)
        self._genai.tpot.record(seconds, self._genai.attributes(operation))

    def record_request_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """A prefilled request's token counts, at its end."""
        self._sinks[REQUEST_PROMPT_TOKENS.name].record(num_prompt_tokens, self.labels)
        self._sinks[REQUEST_GENERATION_TOKENS.name].record(num_generation_tokens, self.labels)

    def record_queue_time(self, seconds: float) -> None:
        self._sinks[QUEUE_TIME.name].record(seconds, self.labels)

    def record_prefill_time(self, seconds: float) -> None:
        self._sinks[PREFILL_TIME.name].record(seconds, self.labels)

    def record_decode_time(self, seconds: float) -> None:
        self._sinks[DECODE_TIME.name].record(seconds, self.labels)

    def record_kv_transfer(self, seconds: float, num_bytes: int) -> None:
        self._sinks[KV_TRANSFER_TIME.name].record(seconds, self.labels)
        self._sinks[KV_TRANSFER_BYTES.name].record(num_bytes, self.labels)

    def record_shard_rtt(self, seconds: float, shard: str) -> None:
        self._sinks[SHARD_RTT.name].record(seconds, {**self.labels, "shard": shard})

    # Gauges.
    def set_num_requests_running(self, count: int) -> None:
        self._sinks[RUNNING.name].record(count, self.labels)

    def set_num_requests_waiting(self, count: int) -> None:
        self._sinks[WAITING.name].record(count, self.labels)

    def set_kv_blocks_used(self, count: int, shard: str = "") -> None:
        self._sinks[KV_BLOCKS_USED.name].record(count, {**self.labels, "shard": shard})

    def set_batch_size(self, count: int, phase: str) -> None:
        """`phase` is `prefill` or `decode`."""
        self._sinks[BATCH_SIZE.name].record(count, {**self.labels, "phase": phase})

    def set_pool_sizes(self, sizes: Mapping[str, int]) -> None:
        """Engines per pool (`prompt`, `token`, `mixed`), as the router sees them; 0 included."""
        for pool in ("prompt", "token", "mixed"):
            self._sinks[POOL_ENGINES.name].record(sizes.get(pool, 0), {**self.labels, "pool": pool})

    # Counters.
    def add_prompt_tokens(self, count: int) -> None:
        self._sinks[PROMPT_TOKENS.name].record(count, self.labels)

    def add_generation_tokens(self, count: int) -> None:
        self._sinks[GENERATION_TOKENS.name].record(count, self.labels)

    def count_success(self, finished_reason: str) -> None:
        """A finished request: `stop`, `length`, ... as in the OpenAI response."""
        labels = {**self.labels, "finished_reason": finished_reason}
        self._sinks[REQUEST_SUCCESS.name].record(1, labels)

    def count_error(self, kind: str) -> None:
        """A failed request: `kind` is a short fixed word (`overload`, `engine_dead`, ...)."""
        self._sinks[REQUEST_ERRORS.name].record(1, {**self.labels, "kind": kind})

    def count_pool_loan(self, home: str) -> None:
        """This engine (whose home pool is `home`) was lent to the mixed pool."""
        self._sinks[POOL_LOANS.name].record(1, {**self.labels, "home": home})

    def count_migration(self, reason: str) -> None:
        self._sinks[MIGRATIONS.name].record(1, {**self.labels, "reason": reason})


class _GenAiMetrics:
    """The GenAI semantic-convention server histograms (OpenTelemetry only)."""

    def __init__(self, meter: Meter, model_name: str):
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            "s",
            "Time to generate first token for successful responses",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS[:16],
        )
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            "s",
            "Generative AI server request duration",
            explicit_bucket_boundaries_advisory=GENAI_DURATION_BUCKETS,
        )
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            "s",
            "Time per output token generated after the first token",
            explicit_bucket_boundaries_advisory=GENAI_TPOT_BUCKETS,
        )
        self._model_name = model_name
        self._attributes: dict[str, dict[str, str]] = {}

    def attributes(self, operation: str) -> dict[str, str]:
        """The required GenAI attributes, built once per operation name."""
        attributes = self._attributes.get(operation)
        if attributes is None:
            attributes = {OPERATION: operation, PROVIDER: PROVIDER_NAME}
            if self._model_name:
                attributes[REQUEST_MODEL] = self._model_name
            self._attributes[operation] = attributes
        return attributes
