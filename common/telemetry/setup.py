"""`configure_telemetry`: one call per process installs OpenTelemetry tracing and metrics.

The exporter is chosen by argument or by `PHASEMESH_OTEL_EXPORTER`, never hard-wired:

| value        | spans and metrics go to                                              |
| ------------ | -------------------------------------------------------------------- |
| `otlp-http`  | an OTLP/HTTP collector (`OTEL_EXPORTER_OTLP_ENDPOINT`, default :4318) |
| `otlp-grpc`  | an OTLP/gRPC collector (`OTEL_EXPORTER_OTLP_ENDPOINT`, default :4317) |
| `console`    | stderr, pretty JSON                                                  |
| `jsonl:PATH` | PATH, one JSON object per line (spans, then metric snapshots)         |
| `memory`     | in-memory exporter and reader, for tests (`Telemetry.span_exporter`)  |
| `none`       | nowhere; spans still get ids so logs and messages carry trace ids     |
|              | (not sampled: nothing records what nobody reads; a caller's sampled   |
|              | trace is continued); metric instruments are the API's no-op ones      |
| `off`        | nothing installed: the no-op API, no ids, no Ray metrics (benchmarks) |

Unset, it is `otlp-http` (or `otlp-grpc` when `OTEL_EXPORTER_OTLP_PROTOCOL=grpc`) if
`OTEL_EXPORTER_OTLP_ENDPOINT` is set, else `none`. The standard `OTEL_*` variables (endpoint,
headers, `OTEL_METRIC_EXPORT_INTERVAL`, `OTEL_RESOURCE_ATTRIBUTES`, ...) keep their usual meaning.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import IO

import structlog
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    InMemoryMetricReader,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanProcessor,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

from common.config import env

log = structlog.get_logger(__name__)

EXPORTER_KINDS = ("otlp-http", "otlp-grpc", "console", "jsonl", "memory", "none", "off")
# A decode span holds one event per token; the SDK's default cap (128) would drop all but the
# last 128. OTEL_SPAN_EVENT_COUNT_LIMIT still overrides this.
DEFAULT_MAX_SPAN_EVENTS = 8192


@dataclass(frozen=True)
class ExporterSpec:
    """Where telemetry goes: one of `EXPORTER_KINDS`, and a file path for `jsonl`."""

    kind: str
    path: str = ""

    def __post_init__(self) -> None:
        if self.kind not in EXPORTER_KINDS:
            raise ValueError(
                f"telemetry exporter must be one of {', '.join(EXPORTER_KINDS)} "
                f"(jsonl as jsonl:PATH), got {self.kind!r}"
            )
        if (self.kind == "jsonl") != bool(self.path):
            raise ValueError(
                f"telemetry exporter: only jsonl takes a path (jsonl:PATH), got {self}"
            )

    @classmethod
    def parse(cls, value: str) -> ExporterSpec:
        """Parse `otlp-http`, `jsonl:/tmp/spans.jsonl`, ... as written in the environment."""
        kind, _, path = value.strip().partition(":")
        return cls(kind=kind.lower(), path=path)

    @classmethod
    def from_env(cls) -> ExporterSpec:
        """`PHASEMESH_OTEL_EXPORTER`, else OTLP when a standard OTLP endpoint is set, else none."""
        explicit = env("OTEL_EXPORTER")
        if explicit:
            return cls.parse(explicit)
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
        ):
            grpc = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").lower() == "grpc"
            return cls("otlp-grpc" if grpc else "otlp-http")
        return cls("none")


@dataclass
class Telemetry:
    """The installed providers of this process; the in-memory exporter/reader with `memory`."""

    service_name: str
    exporter: ExporterSpec
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    span_exporter: InMemorySpanExporter | None = None
    metric_reader: InMemoryMetricReader | None = None

    def force_flush(self) -> None:
        """Push buffered spans and metrics out now (before a process hands over or exits)."""
        self.tracer_provider.force_flush()
        self.meter_provider.force_flush()

    def shutdown(self) -> None:
        """Flush and stop exporting. The SDK also does this at interpreter exit."""
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


class _Installed:
    """The one `Telemetry` of this process.

    NOTE: process-wide on purpose: OpenTelemetry's global tracer and meter providers can be set
    only once per process, so `configure_telemetry` must hand back the first installation.
    """

    lock = threading.Lock()
    telemetry: Telemetry | None = None


def configure_telemetry(
    service_name: str, *, exporter: str | ExporterSpec | None = None, instance_id: str = ""
) -> Telemetry:
    """Install tracing and metrics for this process, once; later calls return the same `Telemetry`.

    `exporter` overrides the environment (see the module docstring). A later call that asks for a
    different exporter gets the first one and a warning: the global providers cannot be replaced.
    `instance_id` (a replica's service id) becomes the resource's `service.instance.id`.
    """
    spec = ExporterSpec.parse(exporter) if isinstance(exporter, str) else exporter
    with _Installed.lock:
        installed = _Installed.telemetry
        if installed is None:
            installed = _install(service_name, spec or ExporterSpec.from_env(), instance_id)
            _Installed.telemetry = installed
        elif spec is not None and spec != installed.exporter:
            log.warning(
                "telemetry already configured",
                configured=installed.exporter.kind,
                requested=spec.kind,
            )
        return installed


def telemetry_is_off() -> bool:
    """True when this process configured the `off` exporter (`Metrics` then skips Ray too)."""
    installed = _Installed.telemetry
    return installed is not None and installed.exporter.kind == "off"


def _install(service_name: str, spec: ExporterSpec, instance_id: str = "") -> Telemetry:
    attributes = {"service.name": service_name, "service.namespace": "phasemesh"}
    if instance_id:
        attributes["service.instance.id"] = instance_id
    resource = Resource.create(attributes)
    if spec.kind == "off":
        # NOTE: the providers are made but never installed: OpenTelemetry's API stays a no-op
        # (non-recording spans, no ids, instruments that drop values), the cost baseline.
        unused = TracerProvider(resource=resource), MeterProvider(resource=resource)
        return Telemetry(service_name, spec, *unused)
    span_exporter, metric_reader = _exporters_for(spec)
    limits = SpanLimits(
        max_events=None if "OTEL_SPAN_EVENT_COUNT_LIMIT" in os.environ else DEFAULT_MAX_SPAN_EVENTS
    )
    # NOTE: `none` exports nothing, so its own traces start unsampled: their spans still get ids
    # (logs, messages) but record nothing; a recording span would keep every token's event in
    # memory until its end, for nobody. A context a caller sampled is continued (ParentBased),
    # so services with an exporter downstream still see it.
    sampler = ParentBased(ALWAYS_OFF) if spec.kind == "none" else None
    tracer_provider = TracerProvider(resource=resource, span_limits=limits, sampler=sampler)
    if span_exporter is not None:
        tracer_provider.add_span_processor(_processor_for(spec, span_exporter))
    readers = [metric_reader] if metric_reader is not None else []
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    trace.set_tracer_provider(tracer_provider)
    # NOTE: `none` has no metric reader: the SDK would still build and aggregate every
    # measurement (a few microseconds each, several per request and one per streamed gap, on
    # the router's event loop) for nobody; the API's no-op instruments drop them instead.
    if metric_reader is not None:
        metrics.set_meter_provider(meter_provider)
    telemetry = Telemetry(service_name, spec, tracer_provider, meter_provider)
    if spec.kind == "memory":
        assert isinstance(span_exporter, InMemorySpanExporter)
        assert isinstance(metric_reader, InMemoryMetricReader)
        telemetry.span_exporter, telemetry.metric_reader = span_exporter, metric_reader
    return telemetry


def _processor_for(spec: ExporterSpec, exporter: SpanExporter) -> SpanProcessor:
    # Tests read the in-memory exporter right after a span ends: export synchronously there.
    # Everywhere else a background batch keeps exporting off the request path.
    if spec.kind == "memory":
        return SimpleSpanProcessor(exporter)
    return BatchSpanProcessor(exporter)


def _exporters_for(spec: ExporterSpec) -> tuple[SpanExporter | None, MetricReader | None]:
    """The span exporter and metric reader for one exporter spec (both None for `none`)."""
    if spec.kind == "none":
        return None, None
    if spec.kind == "memory":
        return InMemorySpanExporter(), InMemoryMetricReader()
    if spec.kind == "console":
        return ConsoleSpanExporter(out=sys.stderr), _periodic(ConsoleMetricExporter(out=sys.stderr))
    if spec.kind == "jsonl":
        return _jsonl_exporters(spec.path)
    return _otlp_exporters(grpc=spec.kind == "otlp-grpc")


def _jsonl_exporters(path: str) -> tuple[SpanExporter, MetricReader]:
    # Line-buffered append: each record is written as one line as soon as it is exported.
    # NOTE: never closed: the file lives as long as the process (the SDK flushes at exit).
    out: IO[str] = open(path, "a", buffering=1, encoding="utf-8")
    spans = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
    snapshots = ConsoleMetricExporter(
        out=out, formatter=lambda data: data.to_json(indent=None) + "\n"
    )
    return spans, _periodic(snapshots)


def _otlp_exporters(*, grpc: bool) -> tuple[SpanExporter, MetricReader]:
    # Imported here: each protocol pulls in its own transport stack (grpcio or requests).
    if grpc:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # type: ignore[assignment]
            OTLPMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter(), _periodic(OTLPMetricExporter())


def _periodic(exporter: MetricExporter) -> MetricReader:
    # The interval comes from OTEL_METRIC_EXPORT_INTERVAL (default 60 s).
    return PeriodicExportingMetricReader(exporter)
