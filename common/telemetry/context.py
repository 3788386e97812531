"""W3C trace context carried inside msgspec messages as one string field.

A message between services holds `traceparent: str = ""` (common/protocol/), filled by
`inject_context()` on the sender and turned back into an OpenTelemetry `Context` by
`extract_context()` on the receiver, so one request is one trace across the router, engines and
shards.

The string is the W3C `traceparent` header, followed by `;` and the `tracestate` header when there
is one. `traceparent` is hex and dashes only, so the first `;` always splits the two.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_SEPARATOR = ";"


def inject_context(context: Context | None = None) -> str:
    """The current span's trace context (or `context`'s) as one string; "" when there is none."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    traceparent = carrier.get("traceparent", "")
    tracestate = carrier.get("tracestate", "")
    if traceparent and tracestate:
        return traceparent + _SEPARATOR + tracestate
    return traceparent


def extract_context(traceparent: str) -> Context:
    """The `Context` to parent spans on; an empty context (a new root) for "" or a bad string."""
    header, _, tracestate = traceparent.partition(_SEPARATOR)
    carrier = {"traceparent": header.strip()}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier, context=Context())


def trace_id_of(traceparent: str) -> str:
    """The 32-hex-digit trace id inside a carried context string; "" when there is none."""
    span_context = trace.get_current_span(extract_context(traceparent)).get_span_context()
    return format_trace_id(span_context.trace_id) if span_context.is_valid else ""


def current_trace_ids() -> tuple[str, str]:
    """(trace_id, span_id) of the current span as hex, or ("", "") outside any span."""
    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return "", ""
    return format_trace_id(span_context.trace_id), format(span_context.span_id, "016x")


def format_trace_id(trace_id: int) -> str:
    """A trace id as the 32 lowercase hex digits used by W3C headers and trace UIs."""
    return format(trace_id, "032x")
