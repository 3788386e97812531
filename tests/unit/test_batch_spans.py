"""Spans of decode steps and of KV landing: which steps a token engine traces, what parents and
links its `token.step` gets, a shard's `shard.attend`, a receiver's `kv.receive`; and that
untraced work makes no span. Checked against the carried contexts themselves (their span ids)
and the pages and layers fed in."""

from __future__ import annotations

import torch
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.block_manager import BlockManager
from common.kv_cache import KVCache
from common.kv_ingress import KvIngress
from common.protocol import AttendBatch, KvPages
from common.scheduling.batching import Sequence
from common.telemetry import inject_context
from common.telemetry.spans import tracer
from services.engine.telemetry import UNTRACED, EngineTelemetry
from services.shard.telemetry import ShardTelemetry

UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


def request_context(name: str) -> tuple[str, int]:
    """A sampled request's carried context and its span id (the parent its spans must name)."""
    with tracer().start_as_current_span(name) as span:
        return inject_context(), span.get_span_context().span_id


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_a_step_is_traced_when_a_request_joins_a_child_of_it_linked_to_the_rest(spans):
    telemetry = EngineTelemetry("token-0", "tiny", shards=("shard-0", "shard-1"))
    (first, first_id), (second, second_id) = request_context("a"), request_context("b")
    telemetry.on_handoff("a", first)
    telemetry.decode_started("a")
    rows = [Sequence("a", 9)]
    trace = telemetry.trace_step(1, rows)
    assert trace.traceparent and trace.round_trips == []
    telemetry.step_done(trace)
    assert telemetry.trace_step(2, rows) is UNTRACED  # nobody joined, the interval has not passed
    telemetry.on_handoff("b", second)
    telemetry.decode_started("b")
    telemetry.step_done(telemetry.trace_step(3, [*rows, Sequence("b", 5)]))
    steps = named(spans, "token.step")
    assert [s.parent.span_id for s in steps if s.parent] == [first_id, second_id]
    assert [[link.context.span_id for link in s.links] for s in steps] == [[], [first_id]]
    assert [dict(s.attributes or {})["phasemesh.num_rows"] for s in steps] == [1, 2]


def test_a_step_of_unsampled_requests_only_makes_no_span(spans):
    telemetry = EngineTelemetry("token-0", "tiny", shards=("shard-0",))
    telemetry.on_handoff("c", UNSAMPLED)
    telemetry.decode_started("c")
    trace = telemetry.trace_step(1, [Sequence("c", 4)])
    assert trace.traceparent == "" and trace.span is None
    telemetry.step_done(trace)
    assert named(spans, "token.step") == []


def test_a_shard_records_a_traced_step_with_one_event_per_layer_and_nothing_for_others(spans):
    step_context, step_id = request_context("token.step")
    shard = ShardTelemetry("shard-1", num_layers=3)
    for step, traceparent in [(7, step_context), (8, "")]:
        for layer in range(3):
            batch = AttendBatch(step, layer, ["a", "b"] if layer == 0 else [])
            batch.traceparent = traceparent if layer == 0 else ""
            shard.layer_started(batch)
            shard.layer_done(batch, num_failed=0, kv_blocks_used=5)
            shard.flush()
    (attend,) = named(spans, "shard.attend")
    assert attend.parent is not None and attend.parent.span_id == step_id
    attributes = dict(attend.attributes or {})
    assert (attributes["phasemesh.step"], attributes["phasemesh.num_rows"]) == (7, 2)
    assert attributes["phasemesh.kv.blocks_used"] == 5
    layers = [dict(e.attributes or {})["phasemesh.layer"] for e in attend.events]
    assert layers == [0, 1, 2]


def test_kv_that_carries_a_context_lands_as_one_kv_receive_span_with_an_event_per_page(spans):
    context, request_id = request_context("router.request")
    cache = KVCache(2, 8, 4, 2, 8, torch.float32)
    ingress = KvIngress(BlockManager(8, 4), cache, receiver="shard-0")
    k = torch.zeros(1, 6, 2, 8)
    for req_id, traceparent in [("traced", context), ("plain", "")]:
        for layer in range(2):
            page = KvPages(req_id, layer, 1, 6, 0, 2, total_layers=2, traceparent=traceparent)
            ingress.receive(page, k, k)
    (receive,) = named(spans, "kv.receive")
    assert receive.parent is not None and receive.parent.span_id == request_id
    pages = [dict(e.attributes or {}) for e in receive.events]
    assert [p["phasemesh.kv.layer_start"] for p in pages] == [0, 1]
    assert [p["phasemesh.kv.bytes"] for p in pages] == [2 * k.nbytes] * 2
    assert dict(receive.attributes or {})["phasemesh.kv.heads"] == (0, 2)


def test_a_request_freed_before_its_kv_completes_ends_its_kv_receive_incomplete(spans):
    context, _ = request_context("router.request")
    ingress = KvIngress(BlockManager(8, 4), KVCache(2, 8, 4, 2, 8, torch.float32))
    k = torch.zeros(1, 3, 2, 8)
    ingress.receive(KvPages("r", 0, 1, 3, 0, 2, total_layers=2, traceparent=context), k, k)
    assert named(spans, "kv.receive") == []  # still open: one layer of two
    ingress.free("r")
    (receive,) = named(spans, "kv.receive")
    assert dict(receive.attributes or {})["phasemesh.kv.incomplete"] is True


def test_a_chunked_prefill_is_one_span_from_its_first_chunk_and_one_queue_span(spans):
    telemetry = EngineTelemetry("prompt-0", "tiny")
    carried, root_id = request_context("router.request")
    telemetry.on_prompt("r", carried)
    first_chunk_ns = telemetry.prefill_started(["r"])  # its first chunk
    last_step_ns = telemetry.prefill_started(["r"])  # chunks later: the batch's last step
    assert last_step_ns >= first_chunk_ns
    telemetry.prefill_done([Sequence("r", 40)], last_step_ns, last_step_ns + 1_000)
    (queue,), (prefill,) = named(spans, "prompt.queue"), named(spans, "prompt.prefill")
    assert queue.end_time == first_chunk_ns  # the queue ended at the first chunk, once
    assert prefill.start_time == first_chunk_ns and prefill.end_time == last_step_ns + 1_000
    assert prefill.parent is not None and prefill.parent.span_id == root_id
