"""A shard's side of tracing: `shard.attend`, one span per decode step the token engine traced.

The token engine traces a step (its `token.step` span, `services/engine/telemetry.py`) and sends
that span's context on the step's layer 0 (`AttendBatch.traceparent`). The shard times the step
from layer 0's arrival to its last layer's answer being ready, and records it after that answer
left (`flush`), a child of `token.step`, with one `layer` event per layer. An untraced step
(empty context) costs a string test on layer 0 and two `None` tests per layer: no span, no clock
reads.

With `kv_transfer: pull`, the prompt engine's `kv.transfer` ends when the KV is held; each shard's
`kv.pull` (a child of the request's `router.request`, from the announce's arrival here to the
landing) covers the rest: `kv.pull.ask` when the `KvPull` left, `kv.pull.answer` when the hold
answered (bytes, layers); the gap to the end is the wait for a free period between decode steps
and the landing. A pull that failed (hold silent, a miss, a landing that raised) ends with status
ERROR and the reason. Untraced requests (no sampled context on the announce) cost one string test.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import Attributes

from common.protocol import AttendBatch, KvAnnounce
from common.telemetry.batch_spans import (
    KV_BLOCKS_USED,
    KV_HEADS,
    LAYER,
    LAYER_EVENT,
    NUM_ROWS,
    SHARD,
    STEP,
    is_sampled,
)
from common.telemetry.spans import (
    ERROR_TYPE,
    KV_BYTES,
    KV_LAYERS,
    mark_failed,
    parent_context,
    tracer,
)

FAILED_ROWS = "phasemesh.failed_rows"
PULL_ASK_EVENT = "kv.pull.ask"  # on kv.pull: the KvPull left for the hold
PULL_ANSWER_EVENT = "kv.pull.answer"  # on kv.pull: the hold's KV arrived (bytes, layers)


@dataclass(slots=True)
class _TracedStep:
    step: int
    traceparent: str
    start_ns: int
    num_rows: int
    layer_ns: list[tuple[int, int]] = field(default_factory=list)  # (layer, answer ready at)
    num_failed: int = 0
    kv_blocks_used: int = 0


class ShardTelemetry:
    """`shard.attend` spans of one shard; called by its attention loop around each layer."""

    def __init__(self, shard_id: str, num_layers: int) -> None:
        self.shard_id = shard_id
        self.num_layers = num_layers
        self._step: _TracedStep | None = None  # the traced step under way
        self._done: _TracedStep | None = None  # a traced step answered, its span not recorded

    def layer_started(self, batch: AttendBatch) -> None:
        """A layer arrived; layer 0 of a traced step opens its record."""
        if batch.layer == 0:
            self._step = (
                _TracedStep(batch.step, batch.traceparent, time.time_ns(), len(batch.req_ids))
                if batch.traceparent
                else None
            )

    def layer_done(self, batch: AttendBatch, num_failed: int, kv_blocks_used: int) -> None:
        """The layer's answer is ready (not yet sent: a send may complete after the token engine
        already moved on). After a traced step's last layer, `flush` records its span."""
        step = self._step
        if step is None or step.step != batch.step:
            return
        step.layer_ns.append((batch.layer, time.time_ns()))
        if batch.layer == self.num_layers - 1:
            step.num_failed, step.kv_blocks_used = num_failed, kv_blocks_used
            self._step, self._done = None, step

    def flush(self) -> None:
        """Record a finished step's span, after its last answer left (off the engine's wait)."""
        step, self._done = self._done, None
        if step is None:
            return
        attributes: Attributes = {
            STEP: step.step, NUM_ROWS: step.num_rows, KV_LAYERS: len(step.layer_ns),
            KV_BLOCKS_USED: step.kv_blocks_used, FAILED_ROWS: step.num_failed,
            SHARD: self.shard_id,
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


@dataclass(slots=True)
class KvPullTrace:
    """One traced pull's times, recorded as its `kv.pull` span by `end` (on the puller's thread:
    no span is open between calls)."""

    traceparent: str
    shard_id: str
    heads: tuple[int, int]
    announced_ns: int
    asked_ns: int = 0
    answered_ns: int = 0
    num_bytes: int = 0
    num_layers: int = 0

    def asked(self) -> None:
        self.asked_ns = time.time_ns()

    def answered(self, num_bytes: int, num_layers: int) -> None:
        self.answered_ns, self.num_bytes, self.num_layers = time.time_ns(), num_bytes, num_layers

    def end(self, error: str = "") -> None:
        """The pull is over: landed (`error` empty) or lost (why)."""
        attributes: dict[str, str | int | list[int]] = {
            SHARD: self.shard_id, KV_HEADS: list(self.heads),
        }  # fmt: skip
        if self.answered_ns:
            attributes |= {KV_BYTES: self.num_bytes, KV_LAYERS: self.num_layers}
        span = tracer().start_span(
            "kv.pull", context=parent_context(self.traceparent), attributes=attributes,
            start_time=self.announced_ns,
        )  # fmt: skip
        if self.asked_ns:
            span.add_event(PULL_ASK_EVENT, timestamp=self.asked_ns)
        if self.answered_ns:
            answer: Attributes = {KV_BYTES: self.num_bytes, KV_LAYERS: self.num_layers}
            span.add_event(PULL_ANSWER_EVENT, answer, timestamp=self.answered_ns)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
            span.set_attribute(ERROR_TYPE, "kv_lost")
        span.end()


def trace_pull(announce: KvAnnounce, shard_id: str, announced_ns: int) -> KvPullTrace | None:
    """A `KvPullTrace` for an announced pull whose request is traced, else None."""
    if not is_sampled(announce.traceparent):
        return None
    heads = (announce.head_start, announce.head_end)
    return KvPullTrace(announce.traceparent, shard_id, heads, announced_ns)


__all__ = ["KvPullTrace", "ShardTelemetry", "trace_pull"]
