"""Telemetry: OpenTelemetry traces and metrics, and structlog logs, for every PhaseMesh service.

    telemetry = configure_telemetry("router")          # once per process; exporter from env
    configure_logging()                                 # JSON or console, ids on every line
    metrics = Metrics(model_name=model, engine=replica_id)
    with request_span(req_id, model=..., num_prompt_tokens=..., max_tokens=...) as span:
        with bind_request(req_id):
            message.traceparent = inject_context()    # carried to the next process
            ...

Module map: `setup` (providers and exporters), `context` (W3C trace context in messages),
`spans` (the request's spans), `metrics` (vLLM-named metrics to OpenTelemetry and Ray),
`logs` (structlog). See docs/observability.md.
"""

from common.telemetry.context import extract_context, inject_context, trace_id_of
from common.telemetry.logs import bind_request, configure_logging
from common.telemetry.metrics import METRIC_SPECS, Metrics, MetricSpec
from common.telemetry.setup import ExporterSpec, Telemetry, configure_telemetry
from common.telemetry.spans import (
    DecodeSpan,
    kv_transfer_span,
    prefill_span,
    queue_span,
    request_span,
    set_kv_transfer,
    set_route,
    set_usage,
)

__all__ = [
    "METRIC_SPECS",
    "DecodeSpan",
    "ExporterSpec",
    "MetricSpec",
    "Metrics",
    "Telemetry",
    "bind_request",
    "configure_logging",
    "configure_telemetry",
    "extract_context",
    "inject_context",
    "kv_transfer_span",
    "prefill_span",
    "queue_span",
    "request_span",
    "set_kv_transfer",
    "set_route",
    "set_usage",
    "trace_id_of",
]
