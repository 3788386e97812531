"""The router's `/metrics`: a prometheus-client registry of its own, in vLLM's names or ours.

`PrometheusSink(prefix)` makes one prometheus-client instrument per metric it serves (the router's
own, `ROUTER_SPECS`), named `<prefix>:<name>`: with `vllm`, `vllm:time_to_first_token_seconds`,
so a dashboard made for vLLM reads it unchanged; with `phasemesh`, the names of
docs/observability.md. `Metrics(prometheus=sink)` records into it beside OpenTelemetry and Ray;
several `Metrics` of one process may share a sink (the router's and its mesh client's). Series
read from elsewhere at scrape time (the engines' load reports) are collectors registered on
`registry` (services/router/metrics_endpoint.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from common.telemetry.metrics import ROUTER_SPECS, MetricSpec, Recorder, short_name

# No `_created` series beside each counter and histogram (the series vLLM users know; Prometheus
# needs none of them). A process-wide switch of prometheus-client, set where the router imports it.
disable_created_metrics()

MetricsNames = Literal["vllm", "phasemesh"]
# The classic text format (vLLM's, what every Prometheus reads; `vllm:` names need nothing newer).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def prometheus_name(spec: MetricSpec, prefix: str) -> str:
    """`phasemesh:x` as served under `prefix`: `vllm:x` or `phasemesh:x`."""
    return f"{prefix}:{short_name(spec.name)}"


class PrometheusSink:
    """One registry and the instruments of `specs` in it (see the module docstring)."""

    def __init__(self, prefix: MetricsNames = "vllm", specs: Iterable[MetricSpec] = ROUTER_SPECS):
        self.prefix = prefix
        self.registry = CollectorRegistry()
        self._recorders = {spec.name: self._instrument(spec) for spec in specs}

    def name(self, spec: MetricSpec) -> str:
        return prometheus_name(spec, self.prefix)

    def recorder(self, spec: MetricSpec) -> Recorder | None:
        """`record(value, labels)` for a metric this sink serves; None for the others."""
        return self._recorders.get(spec.name)

    def render(self) -> bytes:
        """The exposition: every series of the registry, in Prometheus' text format."""
        return generate_latest(self.registry)

    def _instrument(self, spec: MetricSpec) -> Recorder:
        name, doc, labels, registry = self.name(spec), spec.description, spec.labels, self.registry
        if spec.kind == "histogram":
            histogram = Histogram(name, doc, labels, registry=registry, buckets=spec.buckets)
            child = _children(histogram)
            return lambda value, tags: child(tags).observe(value)
        if spec.kind == "gauge":
            gauge = _children(Gauge(name, doc, labels, registry=registry))
            return lambda value, tags: gauge(tags).set(value)
        counter = _children(Counter(name, doc, labels, registry=registry))  # `_total` added back
        return lambda value, tags: counter(tags).inc(value)


def _children(metric: Any) -> Callable[[dict[str, str]], Any]:
    """`metric.labels(**tags)`, each label set's child looked up once: label values are fixed
    words (docs/observability.md), so the children are few, and the per-token path (TBT) skips
    prometheus-client's lock and label checks."""
    children: dict[tuple[tuple[str, str], ...], Any] = {}

    def child(tags: dict[str, str]) -> Any:
        key = tuple(tags.items())
        found = children.get(key)
        if found is None:
            found = children[key] = metric.labels(**tags)
        return found

    return child


__all__ = ["CONTENT_TYPE", "MetricsNames", "PrometheusSink", "prometheus_name"]
