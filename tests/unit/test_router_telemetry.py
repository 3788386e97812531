"""The router's `router.request` span and metrics at the edges: refusals, a caller's trace, a client
that leaves. The real FastAPI app over fake backends (httpx's ASGI transport), read back through
OpenTelemetry's in-memory exporter and reader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from common.engine.request import FinishReason, RequestOutput
from common.sampling_params import SamplingParams
from common.telemetry import Metrics
from services.router import telemetry as router_telemetry
from services.router.engine_client import EngineClientStats
from services.router.server import Router
from services.router.streams import Overloaded

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class FakeBackend:
    """Refuses every request, or streams `num_tokens` one-token outputs."""

    max_context = None  # the model's

    def __init__(self, refuse: bool = False, num_tokens: int = 3) -> None:
        self.refuse, self.num_tokens = refuse, num_tokens
        self.holds: list[bool] = []  # each request's `hold_to_end`

    async def generate(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hold_to_end: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        self.holds.append(hold_to_end)
        if self.refuse:
            raise Overloaded("max_num_requests", "The server is busy.")
        for i in range(1, self.num_tokens + 1):
            await asyncio.sleep(0.001)
            finish = FinishReason.LENGTH if i == self.num_tokens else None
            yield RequestOutput(req_id, [7], "x", finish, len(prompt_token_ids), i)

    def abort(self, req_id: str) -> None:
        pass

    def stats(self) -> EngineClientStats:
        return EngineClientStats()

    def engine_reports(self) -> list:
        return []

    def ready(self) -> bool:
        return True


@pytest.fixture
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


def make_router(model_path: Path, backend: Any, reader: InMemoryMetricReader) -> Router:
    router = Router(backend, model_path, "tiny")
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    router.telemetry.metrics = Metrics(model_name="tiny", meter=meter, use_ray=False)
    return router


def post(router: Router, body: dict[str, Any], headers: dict[str, str] | None = None) -> int:
    async def main() -> int:
        transport = httpx.ASGITransport(app=router.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            response = await http.post("/v1/completions", json=body, headers=headers)
            return response.status_code

    return asyncio.run(main())


def the_request(spans: InMemorySpanExporter) -> ReadableSpan:
    (span,) = [s for s in spans.get_finished_spans() if s.name == "router.request"]
    return span


def counts(reader: InMemoryMetricReader, name: str) -> dict[tuple, float]:
    """{sorted label items: value} of a counter, or of a histogram's counts."""
    data = reader.get_metrics_data()
    found: dict[tuple, float] = {}
    for resource_metrics in data.resource_metrics if data else []:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        value = getattr(point, "count", None) or getattr(point, "value", 0)
                        found[tuple(sorted((point.attributes or {}).items()))] = value
    return found


def test_a_refused_request_is_a_failed_span_and_an_error_by_kind(
    tiny_model_path: Path, spans: InMemorySpanExporter, reader: InMemoryMetricReader
) -> None:
    router = make_router(tiny_model_path, FakeBackend(refuse=True), reader)
    assert post(router, {"prompt": [5, 6, 7], "max_tokens": 4}) == 429
    span = the_request(spans)
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes is not None and span.attributes["error.type"] == "Overloaded"
    assert [e.name for e in span.events] == ["exception"]  # no first token, one exception
    errors = counts(reader, "phasemesh_request_errors_total")
    assert list(errors.values()) == [1]
    assert ("kind", "max_num_requests") in next(iter(errors))
    assert counts(reader, "phasemesh_time_to_first_token_seconds") == {}
    assert counts(reader, "phasemesh_prompt_tokens_total") == {}


def test_a_callers_traceparent_makes_the_request_its_child(
    tiny_model_path: Path, spans: InMemorySpanExporter, reader: InMemoryMetricReader
) -> None:
    router = make_router(tiny_model_path, FakeBackend(num_tokens=3), reader)
    header = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
    assert post(router, {"prompt": [5, 6, 7], "max_tokens": 3, "stream": True}, header) == 200
    span = the_request(spans)
    assert span.parent is not None and span.context is not None
    assert (f"{span.context.trace_id:032x}", f"{span.parent.span_id:016x}") == (
        CALLER_TRACE,
        CALLER_SPAN,
    )
    assert span.attributes is not None
    assert span.attributes["gen_ai.usage.output_tokens"] == 3
    assert [e.name for e in span.events] == ["first_token"]
    assert list(counts(reader, "phasemesh_inter_token_latency_seconds").values()) == [2]
    success = counts(reader, "phasemesh_request_success_total")
    assert list(success.values()) == [1] and ("finished_reason", "length") in next(iter(success))


def test_a_plain_response_holds_its_tokens_to_the_end_unless_it_has_stop_strings(
    tiny_model_path: Path, spans: InMemorySpanExporter, reader: InMemoryMetricReader
) -> None:
    """A non-streaming request's tokens wait in its stream (`hold_to_end`): the router sees its
    gaps only as one, so it records TTFT and TPOT but no TBT sample. Stop strings are matched in
    the router as the text comes, so such a request is not held."""
    backend = FakeBackend(num_tokens=3)
    router = make_router(tiny_model_path, backend, reader)
    assert post(router, {"prompt": [5, 6, 7], "max_tokens": 3}) == 200
    assert post(router, {"prompt": [5, 6, 7], "max_tokens": 3, "stop": ["zz"]}) == 200
    assert post(router, {"prompt": [5, 6, 7], "max_tokens": 3, "stream": True}) == 200
    assert backend.holds == [True, False, False]
    assert list(counts(reader, "phasemesh_time_to_first_token_seconds").values()) == [3]
    assert list(counts(reader, "phasemesh_request_time_per_output_token_seconds").values()) == [3]
    assert list(counts(reader, "phasemesh_inter_token_latency_seconds").values()) == [2 + 2]


def test_a_client_that_leaves_ends_the_request_as_abort(
    tiny_model_path: Path, spans: InMemorySpanExporter, reader: InMemoryMetricReader
) -> None:
    router = make_router(tiny_model_path, FakeBackend(num_tokens=1000), reader)
    backend = router.client
    trace = router.telemetry.start(
        "r-left", operation="text_completion", num_prompt_tokens=3, max_tokens=1000, start_ns=0
    )

    async def read_two_then_leave() -> None:
        outputs = trace.observe(backend.generate("r-left", [5, 6, 7], SamplingParams()))
        for _ in range(2):
            await anext(outputs)
        await outputs.aclose()

    asyncio.run(read_two_then_leave())
    span = the_request(spans)
    assert span.status.status_code != StatusCode.ERROR
    assert span.attributes is not None
    assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert span.attributes["gen_ai.usage.output_tokens"] == 2
    success = counts(reader, "phasemesh_request_success_total")
    assert ("finished_reason", "abort") in next(iter(success))
    # the one gap it saw was still pending when the client left: recorded at the end all the same
    assert list(counts(reader, "phasemesh_inter_token_latency_seconds").values()) == [1]


def test_tbt_samples_reach_the_histogram_in_batches_and_all_by_the_request_end(
    tiny_model_path: Path,
    spans: InMemorySpanExporter,
    reader: InMemoryMetricReader,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each gap is kept until `TBT_BATCH_SAMPLES` are pending, or one comes `TBT_BATCH_S` after the
    oldest pending one, or the request ends: none is lost and none is recorded twice."""
    clock = [0]
    monkeypatch.setattr(router_telemetry.time, "time_ns", lambda: clock[0])
    router = make_router(tiny_model_path, FakeBackend(), reader)
    trace = router.telemetry.start(
        "r-gaps", operation="text_completion", num_prompt_tokens=3, max_tokens=10**4, start_ns=0
    )

    def tokens(n: int, gap_ms: int) -> None:
        for _ in range(n):
            clock[0] += gap_ms * 1_000_000
            trace.on_output(RequestOutput("r-gaps", [7], "x", None, 3, 1))

    def recorded() -> float:
        return sum(counts(reader, "phasemesh_inter_token_latency_seconds").values())

    batch = router_telemetry.TBT_BATCH_SAMPLES
    tokens(1 + batch - 1, gap_ms=5)  # the first token (TTFT), then one gap short of a batch
    assert recorded() == 0
    tokens(1, gap_ms=5)
    assert recorded() == batch
    tokens(3, gap_ms=5)
    assert recorded() == batch
    tokens(1, gap_ms=int(router_telemetry.TBT_BATCH_S * 1000))  # the oldest pending is 1 s old
    assert recorded() == batch + 4
    tokens(2, gap_ms=5)
    trace.end()
    assert recorded() == batch + 6
    data = reader.get_metrics_data()
    (point,) = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "phasemesh_inter_token_latency_seconds"
        for p in m.data.data_points
    ]
    assert point.sum == pytest.approx((batch + 5) * 0.005 + router_telemetry.TBT_BATCH_S)
