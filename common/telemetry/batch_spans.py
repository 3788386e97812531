"""Spans of work that serves many requests at once, or moves one request's KV layer by layer.

    token.step      token engine: one traced decode step; a child of one request, links to the rest
    └── shard.attend    a shard: that step's layers, one event per layer
    kv.receive      a receiver of KV (shard or token engine): first page landed -> last layer

A decode step serves a batch, and a span has one trace. OpenTelemetry's answer for a batch is
links: `token.step` is a child of one request of the step (the newest traced one, so a request's
own trace holds the step it joined) and links to every other request's context, at most
`MAX_LINKS`. Steps are traced only when the token engine samples them (`EngineTelemetry`); an
untraced step carries an empty `traceparent` and costs the shards one string test.

`kv.receive` is a child of the request's `router.request` (the sender's `kv.transfer` is its
sibling): one `kv.land` event per page landed, to set against `kv.transfer`'s `kv.send` events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.trace import Link, Span
from opentelemetry.util.types import Attributes

from common.telemetry.context import extract_context, inject_context
from common.telemetry.spans import KV_BYTES, KV_LAYER_START, KV_LAYERS, parent_context, tracer

MAX_LINKS = 64  # a step's links beyond the first request: bounded, batches can be large
STEP = "phasemesh.step"
NUM_ROWS = "phasemesh.num_rows"
SHARD = "phasemesh.shard"
KV_BLOCKS_USED = "phasemesh.kv.blocks_used"
KV_HEADS = "phasemesh.kv.heads"  # [head_start, head_end) of the pages this receiver holds
LAYER = "phasemesh.layer"
LAYER_EVENT = "layer"  # on shard.attend: one layer answered
KV_LAND_EVENT = "kv.land"  # on kv.receive: one page written into the receiver's cache


def is_sampled(traceparent: str) -> bool:
    """Whether a carried context asks for spans (its sampled flag); False for "" or malformed."""
    if not traceparent:
        return False
    context = trace.get_current_span(extract_context(traceparent)).get_span_context()
    return context.is_valid and context.trace_flags.sampled


def start_step_span(
    name: str, parents: Sequence[str], attributes: Attributes, start_ns: int
) -> Span:
    """A span for work serving several requests: a child of `parents[0]`, linked to the rest."""
    links = [
        Link(trace.get_current_span(extract_context(p)).get_span_context())
        for p in parents[1 : 1 + MAX_LINKS]
    ]
    return tracer().start_span(
        name,
        context=parent_context(parents[0]),
        links=links,
        attributes=attributes,
        start_time=start_ns,
    )


def context_of(span: Span) -> str:
    """`span`'s trace context as a carried string, to make it the parent in another process."""
    return inject_context(trace.set_span_in_context(span))


class KvReceiveSpans:
    """`kv.receive` spans of the requests whose KV is landing here, one per request.

    Called by `KvIngress` for pages that carry a trace context only; thread-safe (the ingress
    thread lands pages, the decode thread may free)."""

    def __init__(self, receiver: str = "") -> None:
        self.receiver = receiver
        self._open: dict[str, Span] = {}
        self._lock = threading.Lock()

    def landed(
        self, req_id: str, traceparent: str, layers: tuple[int, int], heads: tuple[int, int],
        num_bytes: int, complete: bool,
    ) -> None:  # fmt: skip
        """Pages of layers [layers[0], layers[1]) landed; `complete`: the request's last ones."""
        now = time.time_ns()
        with self._lock:
            span = self._open.get(req_id)
            if span is None:
                attributes: Attributes = {KV_HEADS: list(heads), SHARD: self.receiver}
                span = tracer().start_span(
                    "kv.receive", context=parent_context(traceparent), attributes=attributes,
                    start_time=now,
                )  # fmt: skip
                self._open[req_id] = span
            if complete:
                del self._open[req_id]
        span.add_event(
            KV_LAND_EVENT,
            {KV_LAYER_START: layers[0], KV_LAYERS: layers[1] - layers[0], KV_BYTES: num_bytes},
            timestamp=now,
        )
        if complete:
            span.set_attribute(KV_LAYERS, layers[1])
            span.end(end_time=now)

    def ended(self, req_id: str) -> None:
        """The request ended here before all its KV landed (freed, refused, lease expired)."""
        with self._lock:
            span = self._open.pop(req_id, None)
        if span is not None:
            span.set_attribute("phasemesh.kv.incomplete", True)
            span.end()
