"""A shard's side of tracing: `shard.attend`, one span per decode step the token engine traced.

The token engine traces a step (its `token.step` span, `services/engine/telemetry.py`) and sends
that span's context on the step's layer 0 (`AttendBatch.traceparent`). The shard times the step
from layer 0's arrival to its last layer's answer and records it after the fact, a child of
`token.step`, with one `layer` event per layer answered. An untraced step (empty context) costs
one string test on layer 0 and one `None` test per later layer: no span, no clock reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry.util.types import Attributes

from common.protocol import AttendBatch
from common.telemetry.batch_spans import (
    KV_BLOCKS_USED,
    LAYER,
    LAYER_EVENT,
    NUM_ROWS,
    SHARD,
    STEP,
)
from common.telemetry.spans import KV_LAYERS, mark_failed, parent_context, tracer

FAILED_ROWS = "phasemesh.failed_rows"


@dataclass(slots=True)
class _TracedStep:
    step: int
    traceparent: str
    start_ns: int
    num_rows: int
    layer_ns: list[tuple[int, int]] = field(default_factory=list)  # (layer, answered at)


class ShardTelemetry:
    """`shard.attend` spans of one shard; called by its attention loop around each layer."""

    def __init__(self, shard_id: str, num_layers: int) -> None:
        self.shard_id = shard_id
        self.num_layers = num_layers
        self._step: _TracedStep | None = None

    def layer_started(self, batch: AttendBatch) -> None:
        """A layer arrived; layer 0 of a traced step opens its record."""
        if batch.layer == 0:
            self._step = (
                _TracedStep(batch.step, batch.traceparent, time.time_ns(), len(batch.req_ids))
                if batch.traceparent
                else None
            )

    def layer_done(self, batch: AttendBatch, num_failed: int, kv_blocks_used: int) -> None:
        """The layer's answer left; after the step's last layer its span is recorded."""
        step = self._step
        if step is None or step.step != batch.step:
            return
        step.layer_ns.append((batch.layer, time.time_ns()))
        if batch.layer == self.num_layers - 1:
            self._step = None
            attributes: Attributes = {
                STEP: step.step, NUM_ROWS: step.num_rows, KV_LAYERS: len(step.layer_ns),
                KV_BLOCKS_USED: kv_blocks_used, FAILED_ROWS: num_failed, SHARD: self.shard_id,
            }  # fmt: skip
            span = tracer().start_span(
                "shard.attend", context=parent_context(step.traceparent), attributes=attributes,
                start_time=step.start_ns,
            )  # fmt: skip
            for layer, answered_ns in step.layer_ns:
                span.add_event(LAYER_EVENT, {LAYER: layer}, timestamp=answered_ns)
            span.end(end_time=step.layer_ns[-1][1])

    def layer_failed(self, batch: AttendBatch, error: BaseException) -> None:
        """Attention raised: a traced step's span ends here, failed."""
        step, self._step = self._step, None
        if step is None or step.step != batch.step:
            return
        span = tracer().start_span(
            "shard.attend", context=parent_context(step.traceparent),
            attributes={STEP: step.step, LAYER: batch.layer, SHARD: self.shard_id},
            start_time=step.start_ns,
        )  # fmt: skip
        mark_failed(span, error)
        span.end()


__all__ = ["ShardTelemetry"]
