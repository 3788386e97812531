"""Telemetry: one trace across real processes, metrics with counts, ids on log lines, exporters.

Child processes are real Python interpreters fed a real `common.protocol` message on stdin; the
OTLP test posts to a real HTTP server and decodes the protobuf with the OpenTelemetry proto
package.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
import yaml
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from common.protocol import GenerateRequest, SamplingSpec
from common.telemetry import (
    METRIC_SPECS,
    DecodeSpan,
    ExporterSpec,
    Metrics,
    bind_request,
    configure_logging,
    extract_context,
    inject_context,
    kv_transfer_span,
    prefill_span,
    queue_span,
    request_span,
    set_kv_transfer,
    set_route,
    trace_id_of,
)
from common.telemetry.metrics import REPORTED_SPECS, TBT_BUCKETS, _ray_recorder
from services.app_args import AppArgs

REPO_ROOT = Path(__file__).resolve().parents[2]


# The child: an engine-like process that decodes the message and continues the trace.
CHILD_ENGINE = """
import sys, time, msgspec, structlog
sys.path.insert(0, sys.argv[1])
from common.protocol import EngineCommand
from common.protocol import GenerateRequest, SamplingSpec
from common.telemetry import (DecodeSpan, bind_request, configure_logging, configure_telemetry,
                              prefill_span, queue_span)
configure_telemetry("engine")  # exporter from PHASEMESH_OTEL_EXPORTER
configure_logging()  # stderr is a pipe: JSON
message = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineCommand)
arrived_ns = time.time_ns()
with bind_request(message.req_id, traceparent=message.traceparent):
    structlog.get_logger().info("prefill request received")
queue_span("prompt.queue", message.traceparent, arrived_ns)
with prefill_span(message.traceparent, num_prompt_tokens=len(message.prompt_token_ids),
                  batch_size=1, batch_tokens=len(message.prompt_token_ids)):
    with bind_request(message.req_id):
        structlog.get_logger().info("prefill done")
decode = DecodeSpan(message.traceparent, token_engine="t0")
for _ in range(3):
    decode.token()
decode.finish("length")
"""


# Telemetry settings of the calling shell must not leak into the children.
OTEL_SETTINGS = [
    "PHASEMESH_OTEL_EXPORTER",
    "PHASEMESH_LOG_FORMAT",
    "PHASEMESH_LOG_LEVEL",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
]


def run_child(script: str, env: dict[str, str], stdin: bytes = b"") -> subprocess.CompletedProcess:
    child_env = {k: v for k, v in os.environ.items() if k not in OTEL_SETTINGS}
    child_env.update(PYTHONPATH=str(REPO_ROOT), **env)
    return subprocess.run(
        [sys.executable, "-c", script, str(REPO_ROOT)],
        input=stdin,
        env=child_env,
        capture_output=True,
        timeout=60,
        check=True,
    )


@pytest.fixture
def metric_reader() -> InMemoryMetricReader:
    """A private meter provider per test, so counts never leak between tests."""
    return InMemoryMetricReader()


@pytest.fixture
def metrics(metric_reader: InMemoryMetricReader) -> Metrics:
    meter = MeterProvider(metric_readers=[metric_reader]).get_meter("test")
    return Metrics(model_name="tiny", engine="e0", meter=meter, use_ray=False)


def by_name(finished: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in finished}


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    found: dict[str, list[Any]] = {}
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                found[metric.name] = list(metric.data.data_points)
    return found


# Trace context.


def test_context_string_round_trips_traceparent_and_tracestate(spans: InMemorySpanExporter) -> None:
    upstream = extract_context("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01;vendor=x")
    with request_span("r1", model="m", num_prompt_tokens=1, max_tokens=1, parent=upstream) as span:
        carried = inject_context()
    own = span.get_span_context()
    assert carried == f"00-{own.trace_id:032x}-{own.span_id:016x}-01;vendor=x"
    restored = trace.get_current_span(extract_context(carried)).get_span_context()
    assert (restored.trace_id, restored.span_id) == (own.trace_id, own.span_id)
    assert restored.trace_state.get("vendor") == "x"
    assert trace_id_of(carried) == "0af7651916cd43dd8448eb211c80319c"


@pytest.mark.parametrize(
    "carried", ["", "not-a-traceparent", "00-00000000000000000000000000000000-"]
)
def test_missing_or_bad_context_starts_a_new_trace(
    spans: InMemorySpanExporter, carried: str
) -> None:
    with prefill_span(carried, num_prompt_tokens=1, batch_size=1, batch_tokens=1):
        pass
    (span,) = spans.get_finished_spans()
    assert span.parent is None
    assert trace_id_of(carried) == ""
    assert inject_context() == ""  # outside any span there is nothing to carry


def test_one_trace_spans_two_processes(spans: InMemorySpanExporter, tmp_path: Path) -> None:
    path = tmp_path / "engine.jsonl"
    with request_span("req-7", model="tiny", num_prompt_tokens=3, max_tokens=3) as root:
        message = GenerateRequest(
            req_id="req-7",
            prompt_token_ids=[1, 2, 3],
            sampling=SamplingSpec(max_tokens=3),
            reply_to="ipc:///unused",
            token_engine="ipc:///unused",
            token_kv_endpoint="ipc:///unused",
            traceparent=inject_context(),
        )
        child = run_child(
            CHILD_ENGINE,
            {"PHASEMESH_OTEL_EXPORTER": f"jsonl:{path}"},
            stdin=msgspec.msgpack.encode(message),
        )
    root_context = root.get_span_context()
    trace_id, root_id = f"0x{root_context.trace_id:032x}", f"0x{root_context.span_id:016x}"
    child_spans = {
        record["name"]: record
        for record in map(json.loads, path.read_text().splitlines())
        if "context" in record  # metric snapshots share the file
    }
    assert set(child_spans) == {"prompt.queue", "prompt.prefill", "token.decode"}
    for record in child_spans.values():
        assert record["context"]["trace_id"] == trace_id
        assert record["parent_id"] == root_id  # siblings under router.request, not nested
    assert len(child_spans["token.decode"]["events"]) == 3
    assert child_spans["prompt.prefill"]["attributes"]["gen_ai.usage.input_tokens"] == 3
    log_lines = [json.loads(line) for line in child.stderr.decode().splitlines()]
    assert [line["event"] for line in log_lines] == ["prefill request received", "prefill done"]
    for line in log_lines:
        assert (line["req_id"], line["trace_id"]) == ("req-7", trace_id[2:])


# Spans.


def test_request_phases_are_children_of_the_request(spans: InMemorySpanExporter) -> None:
    with request_span("r2", model="tiny", num_prompt_tokens=5, max_tokens=7) as root:
        set_route(root, prompt_engine="p0", token_engine="t1", shards=["s0", "s1"])
        carried = inject_context()
    queue_span("token.queue", carried, time.time_ns() - 5_000_000)
    with kv_transfer_span(carried, num_layers=4) as transfer:
        set_kv_transfer(transfer, num_bytes=4096, overlap_ratio=0.75)
    finished = by_name(spans.get_finished_spans())
    request = finished["router.request"]
    assert request.kind == trace.SpanKind.SERVER
    assert request.attributes == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "phasemesh",
        "gen_ai.request.model": "tiny",
        "phasemesh.request_id": "r2",
        "gen_ai.usage.input_tokens": 5,
        "gen_ai.request.max_tokens": 7,
        "phasemesh.prompt_engine": "p0",
        "phasemesh.token_engine": "t1",
        "phasemesh.shards": ("s0", "s1"),
    }
    assert request.context is not None
    for name in ("token.queue", "kv.transfer"):
        parent = finished[name].parent
        assert parent is not None and parent.span_id == request.context.span_id
    transfer_attributes = dict(finished["kv.transfer"].attributes or {})
    assert transfer_attributes["phasemesh.kv.bytes"] == 4096
    assert transfer_attributes["phasemesh.kv.overlap_ratio"] == 0.75
    queue = finished["token.queue"]
    assert queue.start_time is not None and queue.end_time is not None
    assert queue.end_time - queue.start_time >= 5_000_000


def test_decode_span_keeps_one_event_per_token_past_the_sdk_default(
    spans: InMemorySpanExporter,
) -> None:
    decode = DecodeSpan("", token_engine="t0")
    for _ in range(1000):  # the SDK would keep only the last 128
        decode.token()
    decode.finish("length")
    (span,) = spans.get_finished_spans()
    assert len(span.events) == 1000
    assert {event.name for event in span.events} == {"token"}
    assert span.attributes is not None
    assert span.attributes["gen_ai.usage.output_tokens"] == 1000
    assert span.attributes["gen_ai.response.finish_reasons"] == ("length",)


def test_an_escaping_exception_marks_the_span_failed(spans: InMemorySpanExporter) -> None:
    with pytest.raises(TimeoutError):
        with request_span("r3", model="tiny", num_prompt_tokens=1, max_tokens=1):
            raise TimeoutError("shard s1 did not answer")
    decode = DecodeSpan("")
    decode.token()
    decode.fail(ConnectionError("engine lost"))
    request, failed_decode = sorted(spans.get_finished_spans(), key=lambda span: span.name)
    assert request.status.status_code == StatusCode.ERROR
    assert request.attributes is not None and request.attributes["error.type"] == "TimeoutError"
    assert failed_decode.attributes is not None
    assert failed_decode.attributes["error.type"] == "ConnectionError"
    assert failed_decode.attributes["gen_ai.usage.output_tokens"] == 1


# Metrics.


def test_metrics_show_up_with_counts_labels_and_buckets(
    metrics: Metrics, metric_reader: InMemoryMetricReader
) -> None:
    for gap in (0.004, 0.006, 0.012):
        metrics.record_tbt(gap)
    metrics.record_ttft(0.25)
    metrics.record_kv_transfer(0.003, num_bytes=1 << 20)
    metrics.set_kv_blocks_used(17, shard="s1")
    metrics.set_batch_size(8, phase="decode")
    metrics.add_generation_tokens(3)
    metrics.add_generation_tokens(0)  # a step that emitted nothing: no point, no error
    metrics.count_error("overload")
    metrics.count_error("overload")
    found = points(metric_reader)
    (tbt,) = found["phasemesh_inter_token_latency_seconds"]
    assert (tbt.count, round(tbt.sum, 6)) == (3, 0.022)
    assert tbt.explicit_bounds == TBT_BUCKETS
    assert dict(tbt.attributes) == {"model_name": "tiny", "engine": "e0"}
    assert found["phasemesh_time_to_first_token_seconds"][0].count == 1
    assert found["phasemesh_kv_transfer_bytes_total"][0].value == 1 << 20
    (blocks,) = found["phasemesh_kv_blocks_used"]
    assert (dict(blocks.attributes)["shard"], blocks.value) == ("s1", 17)
    assert found["phasemesh_batch_size"][0].value == 8
    assert found["phasemesh_generation_tokens_total"][0].value == 3
    (errors,) = found["phasemesh_request_errors_total"]
    assert (dict(errors.attributes)["kind"], errors.value) == ("overload", 2)
    (genai_ttft,) = found["gen_ai.server.time_to_first_token"]
    assert dict(genai_ttft.attributes) == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "phasemesh",
        "gen_ai.request.model": "tiny",
    }


def test_exported_names_are_accepted_by_ray_without_warnings() -> None:
    assert all(spec.name.startswith("phasemesh:") for spec in METRIC_SPECS)
    with warnings.catch_warnings():
        # Ray warns (FutureWarning) on ':' and discards invalid names (UserWarning).
        warnings.simplefilter("error")
        for spec in METRIC_SPECS:
            _ray_recorder(spec)
    with pytest.warns(FutureWarning, match="contains a : character"):
        from ray.util.metrics import Counter

        Counter(METRIC_SPECS[0].name)


# Logs.


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    configure_logging("json", stream=stream)
    yield stream
    structlog.reset_defaults()


def read_log_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_log_lines_carry_request_id_and_trace_id(
    spans: InMemorySpanExporter, json_logs: io.StringIO
) -> None:
    log = structlog.get_logger()
    with request_span("r4", model="tiny", num_prompt_tokens=1, max_tokens=1) as root:
        with bind_request("r4"):
            log.info("admitted", num_prompt_tokens=1)
            log.warning("slow shard")
        log.info("outside bind")
    log.info("after request")
    trace_id = f"{root.get_span_context().trace_id:032x}"
    admitted, slow, outside, after = read_log_lines(json_logs)
    assert (admitted["event"], admitted["level"], admitted["num_prompt_tokens"]) == (
        "admitted",
        "info",
        1,
    )
    for line in (admitted, slow):
        assert (line["req_id"], line["trace_id"]) == ("r4", trace_id)
    assert "req_id" not in outside and outside["trace_id"] == trace_id
    assert "req_id" not in after and "trace_id" not in after


def test_bind_request_takes_the_trace_id_from_a_carried_context(
    json_logs: io.StringIO,
) -> None:
    carried = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with bind_request("r5", traceparent=carried, engine="t0"):
        structlog.get_logger().info("decoded")
    (line,) = read_log_lines(json_logs)
    assert line["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert (line["req_id"], line["engine"]) == ("r5", "t0")


@pytest.mark.parametrize(
    ("environment", "is_json"), [({}, True), ({"LOG_FORMAT": "console"}, False)]
)
def test_log_format_defaults_to_json_off_a_terminal(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], is_json: bool
) -> None:
    monkeypatch.delenv("PHASEMESH_LOG_FORMAT", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv("PHASEMESH_" + name, value)
    stream = io.StringIO()  # not a TTY
    configure_logging(stream=stream)
    try:
        structlog.get_logger().info("ready", port=8000)
    finally:
        structlog.reset_defaults()
    line = stream.getvalue().strip()
    assert line.startswith("{") == is_json
    assert "ready" in line and "port" in line


def test_log_format_and_level_are_checked() -> None:
    with pytest.raises(ValueError, match="json or console"):
        configure_logging("xml")
    with pytest.raises(ValueError, match="logging level"):
        configure_logging("json", level="loud")


# Exporter selection.


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({}, ExporterSpec("none")),
        ({"PHASEMESH_OTEL_EXPORTER": "console"}, ExporterSpec("console")),
        (
            {"PHASEMESH_OTEL_EXPORTER": "jsonl:/tmp/a:b.jsonl"},
            ExporterSpec("jsonl", "/tmp/a:b.jsonl"),
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ExporterSpec("otlp-http")),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            ExporterSpec("otlp-grpc"),
        ),
        (
            {"PHASEMESH_OTEL_EXPORTER": "memory", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
            ExporterSpec("memory"),
        ),
    ],
)
def test_exporter_is_chosen_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], expected: ExporterSpec
) -> None:
    for name in ("PHASEMESH_OTEL_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert ExporterSpec.from_env() == expected


@pytest.mark.parametrize("value", ["zipkin", "jsonl", "memory:/tmp/x"])
def test_bad_exporter_names_are_refused(value: str) -> None:
    with pytest.raises(ValueError, match="telemetry exporter"):
        ExporterSpec.parse(value)


CHILD_MEMORY = """
import json, sys
from common.telemetry import Metrics, configure_telemetry, request_span
first = configure_telemetry("router")
again = configure_telemetry("router", exporter="memory")
with request_span("r", model="tiny", num_prompt_tokens=2, max_tokens=2):
    pass
Metrics(model_name="tiny", engine="r0").record_e2e(1.5)
data = first.metric_reader.get_metrics_data()
names = [m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
resource = dict(first.tracer_provider.resource.attributes)
spans = [s.name for s in first.span_exporter.get_finished_spans()]
print(json.dumps({"same": first is again, "resource": resource, "spans": spans, "metrics": names}))
"""


def test_memory_exporter_in_a_fresh_process_and_idempotent_configure() -> None:
    child = run_child(CHILD_MEMORY, {"PHASEMESH_OTEL_EXPORTER": "memory"})
    report = json.loads(child.stdout)
    assert report["same"] is True
    assert report["resource"]["service.name"] == "router"
    assert report["spans"] == ["router.request"]
    assert "phasemesh_e2e_request_latency_seconds" in report["metrics"]
    assert "gen_ai.server.request.duration" in report["metrics"]


CHILD_TRACER_FIRST = """
import json
from common.telemetry import configure_telemetry, request_span
from common.telemetry.spans import tracer
early = tracer()  # made (and cached) before any provider is installed
telemetry = configure_telemetry("router", exporter="memory")
with request_span("after", model="tiny", num_prompt_tokens=2, max_tokens=2) as span:
    recording = span.is_recording()
print(json.dumps({"same": tracer() is early, "recording": recording,
                  "spans": [s.name for s in telemetry.span_exporter.get_finished_spans()]}))
"""


def test_a_tracer_made_before_configuration_records_to_the_provider_installed_after() -> None:
    """`tracer()` is made once; made early it is the API's proxy, which follows the provider
    `configure_telemetry` installs later: no span is lost to a no-op tracer cached too soon."""
    report = json.loads(run_child(CHILD_TRACER_FIRST, {}).stdout)
    assert report == {"same": True, "recording": True, "spans": ["router.request"]}


CHILD_NONE = """
import json
from common.telemetry import configure_telemetry, inject_context, request_span, trace_id_of
configure_telemetry("router")
with request_span("own", model="tiny", num_prompt_tokens=2, max_tokens=2) as own:
    own_recording = own.is_recording()
    own_context = own.get_span_context()
    carried = inject_context()
caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
with request_span("theirs", model="t", num_prompt_tokens=2, max_tokens=2, parent=caller) as theirs:
    continued, continued_recording = theirs.get_span_context(), theirs.is_recording()
with request_span("forged", model="t", num_prompt_tokens=2, max_tokens=2, parent="00-zz-01") as bad:
    forged_recording, forged_valid = bad.is_recording(), bad.get_span_context().is_valid
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from common.telemetry import Metrics
Metrics(model_name="tiny", use_ray=False).record_ttft(0.2)  # dropped, not an error
print(json.dumps({
    "metrics_sdk": isinstance(metrics.get_meter_provider(), MeterProvider),
    "own_recording": own_recording, "own_valid": own_context.is_valid,
    "own_sampled": own_context.trace_flags.sampled, "carried_trace": trace_id_of(carried),
    "own_trace": f"{own_context.trace_id:032x}", "continued_recording": continued_recording,
    "continued_trace": f"{continued.trace_id:032x}",
    "forged_recording": forged_recording, "forged_valid": forged_valid,
}))
"""


def test_none_exporter_gives_ids_but_records_only_a_callers_sampled_trace() -> None:
    # `none` exports nothing: a trace it starts is not sampled (its spans keep no events, such as
    # a decode span's one per token) but still has ids for logs and messages; a trace a caller
    # sampled goes on sampled, for services downstream that export.
    report = json.loads(run_child(CHILD_NONE, {"PHASEMESH_OTEL_EXPORTER": "none"}).stdout)
    assert report["own_recording"] is False
    assert report["own_valid"] is True and report["own_sampled"] is False
    assert report["carried_trace"] == report["own_trace"] != "0" * 32
    assert report["continued_recording"] is True
    assert report["continued_trace"] == "0af7651916cd43dd8448eb211c80319c"
    # a malformed caller's context is no caller: a trace of its own, unsampled, with ids
    assert report["forged_recording"] is False and report["forged_valid"] is True
    # no metric reader: the API's no-op instruments, not an SDK aggregating for nobody
    assert report["metrics_sdk"] is False


class OtlpReceiver(BaseHTTPRequestHandler):
    """A minimal OTLP/HTTP endpoint: keeps every POST body by path."""

    received: dict[str, list[bytes]]

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.setdefault(self.path, []).append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


CHILD_OTLP = """
from common.telemetry import Metrics, configure_telemetry, request_span
configure_telemetry("router")
with request_span("r-otlp", model="tiny", num_prompt_tokens=2, max_tokens=2):
    pass
Metrics(model_name="tiny").record_ttft(0.2)
"""  # exporting happens at interpreter exit (the SDK's shutdown hook)


def test_otlp_http_exporter_posts_to_the_standard_endpoint() -> None:
    OtlpReceiver.received = {}
    server = HTTPServer(("127.0.0.1", 0), OtlpReceiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        run_child(CHILD_OTLP, {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    finally:
        server.shutdown()
    assert set(OtlpReceiver.received) == {"/v1/traces", "/v1/metrics"}
    request = ExportTraceServiceRequest()
    request.ParseFromString(b"".join(OtlpReceiver.received["/v1/traces"][:1]))
    (resource_spans,) = request.resource_spans
    (span,) = resource_spans.scope_spans[0].spans
    assert span.name == "router.request"
    attributes = {kv.key: kv.value.string_value for kv in span.attributes}
    assert attributes["phasemesh.request_id"] == "r-otlp"


# Deploy configs.


def test_dashboard_queries_only_metrics_that_exist() -> None:
    dashboard = json.loads((REPO_ROOT / "deploy/grafana-dashboard.json").read_text())
    specs = (*METRIC_SPECS, *REPORTED_SPECS)  # REPORTED_SPECS: the router's /metrics only
    exported = {spec.exported_name.removeprefix("phasemesh_") for spec in specs}
    queried = set()
    for panel in dashboard["panels"]:
        for query in panel.get("targets", []):
            for name in re.findall(r"\$\{prefix\}(\w+)", query["expr"]):
                queried.add(re.sub(r"_(bucket|count|sum)$", "", name))
    assert queried == exported  # every query resolves, every metric is on the dashboard
    # It opens on the router's /metrics, which deploy/prometheus.yml scrapes and `make run` serves
    # (Ray's agent there listens on a random port), in vLLM's names, the app's default.
    [prefix] = [v for v in dashboard["templating"]["list"] if v["name"] == "prefix"]
    assert prefix["current"]["value"] == "vllm:" == f"{AppArgs().metrics_names}:"


def test_collector_and_prometheus_configs_wire_the_documented_ports() -> None:
    collector = yaml.safe_load((REPO_ROOT / "deploy/otel-collector.yaml").read_text())
    metrics_pipeline = collector["service"]["pipelines"]["metrics"]
    assert metrics_pipeline["receivers"] == ["otlp"]
    assert {"prometheus", "debug"} <= set(metrics_pipeline["exporters"])
    prometheus_port = collector["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    scrape = yaml.safe_load((REPO_ROOT / "deploy/prometheus.yml").read_text())
    targets = {
        job["job_name"]: job["static_configs"][0]["targets"] for job in scrape["scrape_configs"]
    }
    assert targets == {
        "phasemesh-router": ["localhost:8000"],  # Serve's HTTP port: the router's /metrics
        "ray": ["localhost:8080"],
        "otel-collector": [f"localhost:{prometheus_port}"],
    }


def test_token_engine_samples_shard_round_trips_per_shard(
    metrics: Metrics, metric_reader: InMemoryMetricReader
) -> None:
    from common.scheduling.batching import Sequence
    from services.engine.telemetry import UNTRACED, EngineTelemetry

    telemetry = EngineTelemetry("token-0", "tiny", shards=("shard-0", "shard-1"), metrics=metrics)
    rows = [Sequence("r", 8)]
    assert telemetry.trace_step(1, rows).to_histogram  # the first step is sampled ...
    assert telemetry.trace_step(2, rows) is UNTRACED  # ... the next one, right after, is not
    # Two layers, two shards: shard 0's reply came first in each layer.
    telemetry.record_round_trips([(0, 0.0003), (1, 0.0005), (0, 0.0004), (1, 0.0006)])
    trips = {
        dict(p.attributes)["shard"]: (p.count, round(p.sum, 6))
        for p in points(metric_reader)["phasemesh_shard_round_trip_seconds"]
    }
    assert trips == {"shard-0": (2, 0.0007), "shard-1": (2, 0.0011)}
