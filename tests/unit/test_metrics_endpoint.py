"""The router's `GET /metrics`: its own series and the engines' from their load reports, in vLLM's
names or ours, parsed back with prometheus-client's own parser.

The served path is the real FastAPI app over a real `InProcessEngineClient` (httpx's ASGI
transport); the mesh's aggregation is `EngineSeries` over `LoadReport`s as the wire decodes them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from common.engine.core import LLMEngine
from common.protocol import EngineCounters, LoadReport
from common.roles import Role
from common.telemetry.engine_counts import BucketCounts, EngineHistograms
from common.telemetry.metrics import ITERATION_TOKEN_BUCKETS, ITERATION_TOKENS, QUEUE_TIME
from common.telemetry.prometheus import PrometheusSink
from services.router.engine_client import InProcessEngineClient
from services.router.metrics_endpoint import EngineSeries, LatestReports
from services.router.server import Router

KEY = "sekret"
PROMPT = list(range(3, 40))  # 37 tokens: two full blocks of 16 looked up in the prefix cache


def samples(text: str) -> dict[str, list[Sample]]:
    """Every sample of an exposition by its sample name (the parser rejects a malformed one)."""
    out: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(found: dict[str, list[Sample]], name: str, **labels: str) -> float:
    [sample] = [s for s in found[name] if labels.items() <= s.labels.items()]
    return sample.value


def serve(router: Router, *requests: tuple[str, str, dict | None]) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=router.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            out = []
            for method, path, body in requests:
                headers = {"Authorization": f"Bearer {KEY}"} if body is not None else {}
                out.append(await http.request(method, path, json=body, headers=headers))
            return out

    return asyncio.run(main())


@pytest.fixture(scope="module")
def router(tiny_model_path: Path):
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=64)
    client = InProcessEngineClient(engine, engine_id="router-a")
    router = Router(client, tiny_model_path, "tiny", "router-a", api_key=KEY)
    yield router
    client.shutdown()


def test_one_request_shows_in_vllm_named_series(router: Router) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "stream": True}
    done, metrics, stats = serve(
        router, ("POST", "/v1/completions", body), ("GET", "/metrics", None),
        ("GET", "/stats", None),
    )  # fmt: skip
    assert done.status_code == 200, done.text
    assert metrics.status_code == 200  # open without the key, as in vLLM; /stats is not
    assert stats.status_code == 401
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    found = samples(metrics.text)
    router_labels = {"model_name": "tiny", "engine": "router-a"}
    assert value(found, "vllm:time_to_first_token_seconds_count", **router_labels) == 1
    assert value(found, "vllm:e2e_request_latency_seconds_count") == 1
    # 5 tokens streamed: at most 4 gaps (tokens that reach the router together are one output,
    # and a fast engine may have them all out before the first wake-up).
    gaps = found.get("vllm:inter_token_latency_seconds_count", [])
    assert "# TYPE vllm:inter_token_latency_seconds histogram" in metrics.text
    assert sum(s.value for s in gaps) <= 4
    assert value(found, "vllm:prompt_tokens_total") == len(PROMPT)
    assert value(found, "vllm:generation_tokens_total") == 5
    assert value(found, "vllm:request_success_total", finished_reason="length") == 1
    assert value(found, "vllm:request_prompt_tokens_sum") == len(PROMPT)
    assert value(found, "vllm:request_prompt_tokens_bucket", le="50.0") == 1
    assert value(found, "vllm:request_prompt_tokens_bucket", le="20.0") == 0
    assert value(found, "vllm:request_generation_tokens_sum") == 5
    # The engine's series, read from it at scrape time.
    assert value(found, "vllm:num_requests_running", **router_labels) == 0
    assert value(found, "vllm:num_requests_waiting") == 0
    # Finished: its blocks stay cached but evictable, free as vLLM counts them.
    assert value(found, "vllm:kv_cache_usage_perc") == 0
    assert value(found, "vllm:prefix_cache_queries_total") == len(PROMPT)
    assert value(found, "vllm:prefix_cache_hits_total") == 0
    assert value(found, "vllm:num_preemptions_total") == 0
    # One prefill of 37 tokens and 4 decode steps of one row: 5 forwards, 41 tokens.
    assert value(found, "vllm:iteration_tokens_total_count") == 5
    assert value(found, "vllm:iteration_tokens_total_sum") == len(PROMPT) + 4
    assert value(found, "vllm:iteration_tokens_total_bucket", le="1.0") == 4
    assert value(found, "vllm:iteration_tokens_total_bucket", le="32.0") == 4
    assert value(found, "vllm:iteration_tokens_total_bucket", le="64.0") == 5
    assert not [name for name in found if not name.startswith("vllm:")]
    assert not [name for name in found if name.endswith("_created")]

    # The same prompt again: its two full blocks come from the prefix cache.
    serve(router, ("POST", "/v1/completions", body))
    [again] = serve(router, ("GET", "/metrics", None))
    found = samples(again.text)
    assert value(found, "vllm:prefix_cache_queries_total") == 2 * len(PROMPT)
    assert value(found, "vllm:prefix_cache_hits_total") == 32
    assert value(found, "vllm:time_to_first_token_seconds_count") == 2


def test_phasemesh_names_switch_every_series(tiny_model_path: Path) -> None:
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=64)
    client = InProcessEngineClient(engine)
    router = Router(client, tiny_model_path, "tiny", prometheus=PrometheusSink("phasemesh"))
    try:
        [metrics] = serve(router, ("GET", "/metrics", None))
    finally:
        client.shutdown()
    families = {f.name for f in text_string_to_metric_families(metrics.text)}
    assert "phasemesh:time_to_first_token_seconds" in families
    assert "phasemesh:kv_cache_usage_perc" in families
    assert "phasemesh:prefix_cache_hits" in families  # a counter family: `_total` on samples
    assert all(name.startswith("phasemesh:") for name in families), families


def counters(used: int, preempted: int, iteration_sizes: list[int]) -> EngineCounters:
    histograms = EngineHistograms()
    for size in iteration_sizes:
        histograms.observe(ITERATION_TOKENS, size)
    histograms.observe(QUEUE_TIME, 0.03)
    return EngineCounters(
        prefix_cache_queries=100, prefix_cache_hits=48, num_preemptions=preempted,
        kv_blocks_used=used, histograms=histograms.snapshot(),
    )  # fmt: skip


def report(engine_id: str, running: int, counts: EngineCounters | None) -> LoadReport:
    sent = LoadReport(
        engine_id=engine_id, role=Role.TOKEN, pending_prompt_tokens=0, running_decode_tokens=0,
        num_running=running, num_waiting=1, free_kv_blocks=10, total_kv_blocks=40,
        counters=counts,
    )  # fmt: skip
    return msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=LoadReport)  # the wire


def test_engine_series_one_per_reporting_engine() -> None:
    now = [100.0]
    latest = LatestReports(stale_s=5.0, clock=lambda: now[0])
    latest.on_report(report("token-1", 3, counters(10, 2, [1, 1, 300, 20000])))
    latest.on_report(report("prompt-1", 1, None))  # an engine that sends no counters
    now[0] += 4.0
    latest.on_report(report("token-2", 0, counters(40, 0, [])))
    sink = PrometheusSink("vllm", specs=())
    sink.registry.register(EngineSeries("vllm", "m", latest.live))
    found = samples(sink.render().decode())
    assert {s.labels["engine"]: s.value for s in found["vllm:num_requests_running"]} == {
        "prompt-1": 1, "token-1": 3, "token-2": 0,
    }  # fmt: skip
    assert value(found, "vllm:kv_cache_usage_perc", engine="token-1") == 0.25
    assert value(found, "vllm:kv_cache_usage_perc", engine="token-2") == 1.0
    assert [s.labels["engine"] for s in found["vllm:prefix_cache_hits_total"]] == [
        "token-1", "token-2",
    ]  # fmt: skip
    assert value(found, "vllm:num_preemptions_total", engine="token-1") == 2
    buckets = {s.labels["le"]: s.value for s in found["vllm:iteration_tokens_total_bucket"]
               if s.labels["engine"] == "token-1"}  # fmt: skip
    assert buckets["1.0"] == 2 and buckets["256.0"] == 2 and buckets["512.0"] == 3
    assert buckets["16384.0"] == 3 and buckets["+Inf"] == 4
    assert value(found, "vllm:iteration_tokens_total_sum", engine="token-1") == 20302
    assert not [s for s in found["vllm:iteration_tokens_total_count"]
                if s.labels["engine"] == "token-2"]  # fmt: skip
    # The engines' phase histograms, in the names vLLM's dashboards query.
    assert value(found, "vllm:request_queue_time_seconds_count", engine="token-2") == 1
    assert value(found, "vllm:request_queue_time_seconds_bucket", engine="token-2", le="0.04") == 1
    assert value(found, "vllm:request_queue_time_seconds_bucket", engine="token-2", le="0.02") == 0
    assert value(found, "vllm:request_queue_time_seconds_sum", engine="token-2") == 0.03

    now[0] += 2.0  # token-1 and prompt-1 silent for 6 s: gone from the exposition
    found = samples(sink.render().decode())
    assert [s.labels["engine"] for s in found["vllm:num_requests_running"]] == ["token-2"]


def test_engine_pool_shows_each_engines_home_and_current_pool() -> None:
    latest = LatestReports()
    moved = msgspec.structs.replace(report("token-1", 0, None), role=Role.PROMPT,
                                    home_role=Role.PROMPT)  # fmt: skip
    lent = msgspec.structs.replace(report("token-2", 0, None), role=Role.MIXED,
                                   home_role=Role.TOKEN)  # fmt: skip
    for sent in (moved, lent, report("token-3", 0, None)):
        latest.on_report(sent)
    sink = PrometheusSink("phasemesh", specs=())
    sink.registry.register(EngineSeries("phasemesh", "m", latest.live))
    found = samples(sink.render().decode())
    pools = {s.labels["engine"]: (s.labels["home"], s.labels["pool"], s.value)
             for s in found["phasemesh:engine_pool"]}  # fmt: skip
    assert pools == {"token-1": ("prompt", "prompt", 1), "token-2": ("token", "mixed", 1),
                     "token-3": ("token", "token", 1)}  # fmt: skip


def test_iteration_buckets_match_vllm() -> None:
    assert ITERATION_TOKEN_BUCKETS == (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                       16384)  # fmt: skip
    iterations = BucketCounts(ITERATION_TOKEN_BUCKETS)
    for size in (1, 8, 9, 16384, 16385):
        iterations.observe(size)
    assert iterations.counts[:4] == [1, 1, 1, 0] and iterations.counts[-2:] == [1, 1]
    assert iterations.total == 1 + 8 + 9 + 16384 + 16385


def test_metrics_names_is_an_app_option() -> None:
    from services.app_args import AppArgs

    assert AppArgs().metrics_names == "vllm"
    assert AppArgs.model_validate({"metrics_names": "phasemesh"}).metrics_names == "phasemesh"
    with pytest.raises(ValueError, match="metrics_names"):
        AppArgs.model_validate({"metrics_names": "prometheus"})
    json.dumps(AppArgs().model_dump(mode="json"))  # the YAML's args stay plain
