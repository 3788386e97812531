"""An engine's side of telemetry: the phase spans of its requests, its histograms and gauges.

`Engine` calls these at the edges of each phase; every span is a child of the request's
`router.request` (its `traceparent` came in the `GenerateRequest` or `DecodeHandoff`):

    prompt engine   on_prompt ... prefill_started -> prompt.queue
                    prefill_done                  -> prompt.prefill (one span per request)
                    kv_shipped                    -> kv.transfer (bytes, layers, overlap ratio)
                    handed_off                    -> the traceparent for the DecodeHandoff
    token engine    on_handoff ... decode_started -> token.queue, and token.decode opens
                    token                         -> one span event per generated token
                    trace_step ... step_done      -> token.step (sampled steps), round trips
                    finished / aborted            -> token.decode ends

Batch phases are timed once per batch and recorded after the fact (`record_prefill`), one span
per request. `token()` is the per-token hot path: one dict lookup and one span event, no metric.
A decode step with sharded rows is traced (`token.step`, whose context the shards' `shard.attend`
spans are children of) when a sharded request joined the batch since the last traced step, so
every request's trace holds the first step it took, or when `ROUND_TRIP_INTERVAL_S` has passed;
an untraced step costs two comparisons and sends the shards an empty context.
Gauges (running, waiting, KV blocks, batch sizes) are set from the load report, at most every
`GAUGE_INTERVAL_S`, never per step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from opentelemetry.trace import Span

from common.protocol import LoadReport
from common.scheduling.batching import Sequence as Seq
from common.telemetry import DecodeSpan, Metrics, queue_span
from common.telemetry.batch_spans import (
    MAX_LINKS,
    NUM_ROWS,
    STEP,
    context_of,
    is_sampled,
    start_step_span,
)
from common.telemetry.engine_counts import EngineHistograms
from common.telemetry.metrics import DECODE_TIME, ITERATION_TOKENS, PREFILL_TIME, QUEUE_TIME
from common.telemetry.spans import record_kv_transfer, record_prefill
from services.engine.kv_shipper import KvRoute

GAUGE_INTERVAL_S = 0.5
ROUND_TRIP_INTERVAL_S = 0.1  # shard round trips: one decode step at most this often

# Where a request is, as far as telemetry cares.
QUEUED = "queued"  # a prompt waiting for its prefill
PREFILLED = "prefilled"  # first token out; handed off next, or decoded here (mixed)
HANDED = "handed"  # a handoff waiting for its KV or for decode memory
DECODING = "decoding"


@dataclass(slots=True)
class _Traced:
    traceparent: str
    arrived_ns: int
    phase: str
    decode_ns: int = 0
    prefill_ns: int = 0  # its prefill's first step began (a long one runs in chunks)


@dataclass(slots=True)
class StepTrace:
    """What one decode step records: round trips (None: not timed) and its `token.step` span
    (`traceparent` is its context, for the shards; "" when the step is not traced)."""

    round_trips: list[tuple[int, float]] | None = None
    traceparent: str = ""
    span: Span | None = None
    to_histogram: bool = False


UNTRACED = StepTrace()  # shared by every untraced step: nothing is allocated for one


class EngineTelemetry:
    """Spans and metrics of one engine's requests; see the module docstring."""

    def __init__(
        self,
        engine_id: str,
        model_name: str,
        shards: Sequence[str] = (),
        metrics: Metrics | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.shards = tuple(shards)  # the shard group's service ids (token engines)
        self.metrics = metrics or Metrics(model_name=model_name, engine=engine_id)
        self.requests: dict[str, _Traced] = {}
        self.decoding: dict[str, DecodeSpan] = {}
        self.batch_sizes = {"prefill": 0, "decode": 0}
        self._last_gauges = 0.0
        self._last_round_trips = float("-inf")
        self._joined: list[str] = []  # decoding since the last traced step, newest last
        # Decode steps since start, those run as Neo's two sub-batches, and the recent ones'
        # (predicted s, measured s, kind) when a tier policy predicts them (`EngineStats`).
        self.num_decode_steps = self.num_two_batch_steps = 0
        self.step_times: deque[tuple[float, float, int]] = deque(maxlen=4096)
        # For the load report's `EngineCounters` (the router's /metrics): tokens per forward
        # (prefill batches: `Prefill` counts them; decode steps: here) and the phase times.
        self.histograms = EngineHistograms()

    # -- arrivals ---------------------------------------------------------------------------------

    def on_prompt(self, req_id: str, traceparent: str) -> None:
        self.requests[req_id] = _Traced(traceparent, time.time_ns(), QUEUED)

    def on_handoff(self, req_id: str, traceparent: str) -> None:
        self.requests[req_id] = _Traced(traceparent, time.time_ns(), HANDED)

    # -- prefill ----------------------------------------------------------------------------------

    def prefill_started(self, req_ids: Iterable[str]) -> int:
        """A prefill step starts now: its new prompts leave the queue (at their first step, a
        long prompt's first chunk). Returns the time (ns)."""
        now = time.time_ns()
        for req_id in req_ids:
            traced = self.requests.get(req_id)
            if traced is not None and traced.phase == QUEUED and not traced.prefill_ns:
                traced.prefill_ns = now
                queue_span("prompt.queue", traced.traceparent, traced.arrived_ns, now)
                queued_s = (now - traced.arrived_ns) / 1e9
                self.metrics.record_queue_time(queued_s)
                self.histograms.observe(QUEUE_TIME, queued_s)
        return now

    def prefill_done(self, seqs: list[Seq], start_ns: int, end_ns: int) -> None:
        """The batch's forward pass (and first-token sampling) ran from `start_ns` to `end_ns`;
        a request whose prefill ran in chunks began at its first chunk (`prefill_started`), so
        its span and prefill time cover the chunks and the decode steps between them.

        Recomputed requests (preempted while decoding) are part of their decode, not a prefill.
        """
        batch_tokens = sum(seq.num_tokens for seq in seqs)
        self.batch_sizes["prefill"] = len(seqs)
        for seq in seqs:
            traced = self.requests.get(seq.req_id)
            if traced is None or traced.phase != QUEUED:
                continue
            traced.phase = PREFILLED
            began = traced.prefill_ns or start_ns
            record_prefill(
                traced.traceparent, began, end_ns, num_prompt_tokens=seq.num_tokens,
                batch_size=len(seqs), batch_tokens=batch_tokens,
            )  # fmt: skip
            self.metrics.record_prefill_time((end_ns - began) / 1e9)
            self.histograms.observe(PREFILL_TIME, (end_ns - began) / 1e9)

    def kv_shipped(self, routes: list[KvRoute], num_layers: int, prefill_end_ns: int) -> None:
        """Each request's KV went out: first send to last, and how much of it prefill hid.

        The overlap ratio is the part of the send window before the forward pass ended (1.0 for
        layer-wise shipping, whose last layer leaves before sampling; 0.0 when serialized)."""
        for route in routes:
            traced = self.requests.get(route.req_id)
            if traced is None or not route.num_bytes:
                continue
            start, end = route.first_sent_ns, route.last_sent_ns
            window = end - start
            hidden = min(max(prefill_end_ns - start, 0), window)
            overlap = hidden / window if window > 0 else float(end <= prefill_end_ns)
            record_kv_transfer(
                traced.traceparent, start, end, num_layers=num_layers,
                num_bytes=route.num_bytes, overlap_ratio=overlap, sends=route.sends,
            )  # fmt: skip
            self.metrics.record_kv_transfer(window / 1e9, route.num_bytes)

    def traceparent(self, req_id: str) -> str:
        """The request's trace context ("" when unknown), e.g. for its KV pages."""
        traced = self.requests.get(req_id)
        return traced.traceparent if traced is not None else ""

    def handed_off(self, req_id: str) -> str:
        """The request leaves for its token engine: its trace context, for the handoff."""
        traced = self.requests.pop(req_id, None)
        return traced.traceparent if traced is not None else ""

    # -- decode -----------------------------------------------------------------------------------

    def decode_started(self, req_id: str) -> None:
        """The request joins the decode batch: its queue wait ends and `token.decode` opens."""
        traced = self.requests.get(req_id)
        if traced is None or traced.phase not in (HANDED, PREFILLED):
            return
        now = time.time_ns()
        if traced.phase == HANDED:
            queue_span("token.queue", traced.traceparent, traced.arrived_ns, now)
        traced.phase, traced.decode_ns = DECODING, now
        self._joined.append(req_id)
        self.decoding[req_id] = DecodeSpan(
            traced.traceparent, token_engine=self.engine_id, shards=self.shards, start_ns=now
        )

    def token(self, req_id: str) -> None:
        """One token emitted (the hot path): an event on `token.decode` if the request decodes."""
        span = self.decoding.get(req_id)
        if span is not None:
            span.token()

    def decode_step(self, batch_size: int, two_batches: bool) -> None:
        self.batch_sizes["decode"] = batch_size
        self.histograms.observe(ITERATION_TOKENS, batch_size)
        self.num_decode_steps += 1
        self.num_two_batch_steps += two_batches

    def step_timed(self, predicted_s: float, measured_s: float, kind: int) -> None:
        """A decode step its tier policy predicted (`kind`: 0 local rows only, 1 one batch with
        shard rows, 2 two sub-batches)."""
        self.step_times.append((predicted_s, measured_s, kind))

    def trace_step(self, step: int, sharded: Sequence[Seq]) -> StepTrace:
        """What decode step `step` over the `sharded` rows records (see the module docstring)."""
        if not sharded:
            return UNTRACED
        now = time.monotonic()
        to_histogram = now - self._last_round_trips >= ROUND_TRIP_INTERVAL_S
        if not (to_histogram or self._joined):
            return UNTRACED
        if to_histogram:
            self._last_round_trips = now
        joined, self._joined = self._joined, []
        trace = StepTrace(round_trips=[], to_histogram=to_histogram)
        # The newest request that joined is the parent: its trace holds the step it joined.
        ids = [*reversed(joined), *(s.req_id for s in sharded)][: MAX_LINKS + 1]
        parents = [tp for tp in dict.fromkeys(self.traceparent(r) for r in ids) if is_sampled(tp)]
        if parents:
            attributes = {STEP: step, NUM_ROWS: len(sharded)}
            trace.span = start_step_span("token.step", parents, attributes, time.time_ns())
            trace.traceparent = context_of(trace.span)
        return trace

    def step_done(
        self, trace: StepTrace, round_trips: Sequence[tuple[int, float]] | None = None
    ) -> None:
        """The step ran: end its `token.step` span, record its round trips if they are due."""
        if trace.span is not None:
            trace.span.end()
        if trace.to_histogram:
            self.record_round_trips(round_trips or ())

    def record_round_trips(self, round_trips: Sequence[tuple[int, float]]) -> None:
        """(shard index in the group, seconds from its send to its reply), per shard and layer."""
        for index, seconds in round_trips:
            shard = self.shards[index] if index < len(self.shards) else str(index)
            self.metrics.record_shard_rtt(seconds, shard)

    def finished(self, req_id: str, finish_reason: str) -> None:
        traced = self.requests.pop(req_id, None)
        span = self.decoding.pop(req_id, None)
        if span is not None:
            span.finish(finish_reason)
        if traced is not None and traced.decode_ns:
            decode_s = (time.time_ns() - traced.decode_ns) / 1e9
            self.metrics.record_decode_time(decode_s)
            self.histograms.observe(DECODE_TIME, decode_s)

    def aborted(self, req_id: str, error: BaseException | None = None) -> None:
        """Forget the request; a decode under way ends as `abort`, or failed with `error`."""
        self.requests.pop(req_id, None)
        span = self.decoding.pop(req_id, None)
        if span is None:
            return
        if error is not None:
            span.fail(error)
        else:
            span.finish("abort")

    # -- gauges -----------------------------------------------------------------------------------

    def report(self, load: LoadReport, kv_blocks_used: int) -> None:
        """Set the gauges from a load report, at most every `GAUGE_INTERVAL_S`."""
        now = time.monotonic()
        if now - self._last_gauges < GAUGE_INTERVAL_S:
            return
        self._last_gauges = now
        self.metrics.set_num_requests_running(load.num_running)
        self.metrics.set_num_requests_waiting(load.num_waiting)
        self.metrics.set_kv_blocks_used(kv_blocks_used)
        for phase, size in self.batch_sizes.items():
            self.metrics.set_batch_size(size, phase)
