"""The engines' side of the router's `GET /metrics`: vLLM's engine series, read at scrape time.

The router records its own series as requests pass (`common.telemetry.prometheus.PrometheusSink`);
what the engines hold (requests running and waiting, KV cache usage, prefix-cache queries and
hits, preemptions, and the histograms of tokens per forward and of queue, prefill and decode time,
`common.telemetry.engine_counts`) it reads from their latest load reports, which carry
`EngineCounters` (common/protocol/control.py): `EngineSeries` is a prometheus-client collector
over them, one series per engine (`engine` = its service id, as vLLM labels an engine by its
index). The mesh client keeps each engine's latest report (`LatestReports`, fed by the inbox's
SUB thread); the in-process client reads its `LLMEngine` (`LLMEngine.load_report`).

Faults: an engine that dies or stops reporting leaves `/metrics` `REPORT_STALE_S` after its last
report (its counters end there; a restarted engine starts new series under its new id, counted
from zero, which Prometheus' `rate` reads as a reset). A report without counters (an older
engine) gives its running and waiting gauges only. A collector that raises makes `/metrics` a
500 and leaves every other endpoint alone.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from common.protocol import LoadReport
from common.telemetry.engine_counts import REPORTED_HISTOGRAMS
from common.telemetry.metrics import (
    BASE_LABELS,
    ENGINE_POOL,
    KV_CACHE_USAGE,
    PREEMPTIONS,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    RUNNING,
    WAITING,
    MetricSpec,
    short_name,
)
from common.telemetry.prometheus import prometheus_name

# Engines report every LOAD_REPORT_INTERVAL_S (services/engine/worker.py), busy or idle: one
# silent this long has gone.
REPORT_STALE_S = 5.0


class LatestReports:
    """Each engine's latest load report and when it came (thread-safe)."""

    def __init__(
        self, stale_s: float = REPORT_STALE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stale_s, self.clock = stale_s, clock
        self._lock = threading.Lock()
        self._latest: dict[str, tuple[float, LoadReport]] = {}

    def on_report(self, report: LoadReport) -> None:
        with self._lock:
            self._latest[report.engine_id] = (self.clock(), report)

    def live(self) -> list[LoadReport]:
        """The reports of engines heard from within `stale_s`; the others are forgotten."""
        now = self.clock()
        with self._lock:
            gone = [e for e, (at, _) in self._latest.items() if now - at > self.stale_s]
            for engine_id in gone:
                del self._latest[engine_id]
            return [report for _, report in self._latest.values()]


class EngineSeries(Collector):
    """vLLM's engine series from the engines' reports, under `prefix` (`vllm` or `phasemesh`)."""

    def __init__(
        self, prefix: str, model_name: str, reports: Callable[[], Sequence[LoadReport]]
    ) -> None:
        self.prefix, self.model_name, self.reports = prefix, model_name, reports

    def collect(self) -> Iterator[Metric]:
        running, waiting, usage = (self._gauge(s) for s in (RUNNING, WAITING, KV_CACHE_USAGE))
        queries, hits, preemptions = (
            self._counter(s) for s in (PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PREEMPTIONS)
        )
        histograms = [
            (short_name(spec.name), [*map(floatToGoString, spec.buckets), "+Inf"],
             HistogramMetricFamily(self._name(spec), spec.description, labels=BASE_LABELS))
            for spec in REPORTED_HISTOGRAMS
        ]  # fmt: skip
        pools = GaugeMetricFamily(self._name(ENGINE_POOL), ENGINE_POOL.description,
                                  labels=ENGINE_POOL.labels)  # fmt: skip
        for report in sorted(self.reports(), key=lambda r: r.engine_id):
            values = [self.model_name, report.engine_id]
            running.add_metric(values, report.num_running)
            waiting.add_metric(values, report.num_waiting)
            if report.role:  # home_roles.py moves the home; lending, the pool it serves in
                pools.add_metric([*values, report.home_role or report.role, report.role], 1)
            counters = report.counters
            if counters is None:
                continue
            total = report.total_kv_blocks
            usage.add_metric(values, min(counters.kv_blocks_used / total, 1.0) if total else 0.0)
            queries.add_metric(values, counters.prefix_cache_queries)
            hits.add_metric(values, counters.prefix_cache_hits)
            preemptions.add_metric(values, counters.num_preemptions)
            for name, bounds, family in histograms:
                counts = counters.histograms.get(name)
                if counts is not None and len(counts.counts) == len(bounds):  # else not ours
                    cumulative = zip(bounds, itertools.accumulate(counts.counts), strict=True)
                    family.add_metric(values, list(cumulative), counts.sum)
        yield from (running, waiting, usage, queries, hits, preemptions, pools)
        yield from (family for _, _, family in histograms)

    def _name(self, spec: MetricSpec) -> str:
        return prometheus_name(spec, self.prefix)

    def _gauge(self, spec: MetricSpec) -> GaugeMetricFamily:
        return GaugeMetricFamily(self._name(spec), spec.description, labels=BASE_LABELS)

    def _counter(self, spec: MetricSpec) -> CounterMetricFamily:
        return CounterMetricFamily(self._name(spec), spec.description, labels=BASE_LABELS)


__all__ = ["REPORT_STALE_S", "EngineSeries", "LatestReports"]
