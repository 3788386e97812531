"""The spans of one request, named as in the design, one trace across every process.

    router.request (SERVER, root)       router: the whole request
    ├── prompt.queue                    prompt engine: arrival to batch start
    ├── prompt.prefill                  prompt engine: the prefill batch holding the request
    ├── kv.transfer                     prompt engine: KV pages to shards / token engine (or
    │                                   to its hold, with pull: each shard's kv.pull follows)
    ├── token.queue                     token engine: KV landed to first decode step
    └── token.decode                    token engine: one event per generated token

Every phase is a child of `router.request`, never of another phase: a decode nested under a
prefill hides where TTFT and TBT go (peer-systems.md, pain point 8). A service that received a
message passes its `traceparent` string as `parent`. Attribute names follow the OpenTelemetry
GenAI conventions where one exists (`gen_ai.*`); PhaseMesh's own are under `phasemesh.`.
Timestamps are `time.time_ns()` (wall clock, comparable across processes).

Two ways to make a span: context managers (`request_span`, `prefill_span`, ...) around code that
runs in one block, and functions that start or record a span without making it current
(`start_request_span`, `record_prefill`, ...) for what a block cannot hold: a streamed request
that outlives its handler, or a batch step that times many requests at once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import ParamSpec

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import Attributes

from common.telemetry.context import extract_context

P = ParamSpec("P")
TRACER_NAME = "phasemesh"
PROVIDER_NAME = "phasemesh"
TOKEN_EVENT = "token"
FIRST_TOKEN_EVENT = "first_token"  # on router.request: the first token reached the router

# Attribute names, GenAI semantic conventions first.
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
ERROR_TYPE = "error.type"
REQUEST_ID = "phasemesh.request_id"
PROMPT_ENGINE = "phasemesh.prompt_engine"
TOKEN_ENGINE = "phasemesh.token_engine"
SHARDS = "phasemesh.shards"
BATCH_SIZE = "phasemesh.batch_size"
BATCH_TOKENS = "phasemesh.batch_tokens"
KV_BYTES = "phasemesh.kv.bytes"
KV_LAYERS = "phasemesh.kv.num_layers"
KV_OVERLAP_RATIO = "phasemesh.kv.overlap_ratio"
KV_LAYER_START = "phasemesh.kv.layer_start"
KV_SEND_EVENT = "kv.send"  # on kv.transfer: one page (a layer, or all layers) handed to a socket

Parent = str | Context | None


@functools.cache
def tracer() -> trace.Tracer:
    """PhaseMesh's tracer, made once (the SDK builds a new one on every `get_tracer`, several
    microseconds on each request's path). Made before configuration it is the API's proxy, which
    follows the provider once one is installed; OpenTelemetry installs one at most once."""
    return trace.get_tracer(TRACER_NAME)


def parent_context(parent: Parent) -> Context | None:
    """A carried `traceparent` string, a `Context`, or None for the current context."""
    return extract_context(parent) if isinstance(parent, str) else parent


def start_request_span(
    req_id: str,
    *,
    model: str,
    num_prompt_tokens: int,
    max_tokens: int,
    operation: str = "text_completion",
    parent: Parent = None,
    start_ns: int | None = None,
) -> Span:
    """`router.request`, the root SERVER span of one request, started but not made current: the
    caller ends it (`end_request_span`).

    For a streamed response, which outlives the handler that admitted it. `operation` is the
    GenAI operation name: `text_completion` or `chat`. Pass `parent` only to continue a caller's
    trace (an incoming `traceparent` header). `start_ns` is when the HTTP request arrived
    (`time.time_ns()`), before validation and tokenization.
    """
    return tracer().start_span(
        "router.request",
        context=parent_context(parent),
        kind=SpanKind.SERVER,
        attributes=_request_attributes(req_id, model, num_prompt_tokens, max_tokens, operation),
        start_time=start_ns,
    )


def _current_for_block(start: Callable[P, Span]) -> Callable[P, AbstractContextManager[Span]]:
    """The context manager of a `start_*` function: its span, current while the block runs and
    ended with it; an escaping exception marks it failed with `error.type`."""

    @contextmanager
    def block(*args: P.args, **kwargs: P.kwargs) -> Iterator[Span]:
        span = start(*args, **kwargs)
        current = trace.use_span(
            span, end_on_exit=True, record_exception=False, set_status_on_exception=False
        )
        with current:
            try:
                yield span
            except BaseException as error:
                mark_failed(span, error)
                raise

    return block


# `router.request` (`start_request_span`'s arguments), current while the block runs.
request_span = _current_for_block(start_request_span)


def end_request_span(
    span: Span, *, num_output_tokens: int, finish_reason: str, error: BaseException | None = None
) -> None:
    """End `router.request` with its usage; a failed request gets status ERROR and `error.type`."""
    set_usage(span, num_output_tokens=num_output_tokens, finish_reason=finish_reason)
    if error is not None:
        mark_failed(span, error)
    span.end()


def _request_attributes(
    req_id: str, model: str, num_prompt_tokens: int, max_tokens: int, operation: str
) -> Attributes:
    return {
        OPERATION: operation,
        PROVIDER: PROVIDER_NAME,
        REQUEST_MODEL: model,
        REQUEST_ID: req_id,
        INPUT_TOKENS: num_prompt_tokens,
        REQUEST_MAX_TOKENS: max_tokens,
    }


def set_route(
    span: Span, *, prompt_engine: str, token_engine: str, shards: Sequence[str] = ()
) -> None:
    """Record the engines and shard group the router chose for this request."""
    span.set_attributes({PROMPT_ENGINE: prompt_engine, TOKEN_ENGINE: token_engine})
    if shards:
        span.set_attribute(SHARDS, list(shards))


def set_usage(span: Span, *, num_output_tokens: int, finish_reason: str) -> None:
    """Record how the request ended: generated token count and OpenAI finish reason."""
    span.set_attributes({OUTPUT_TOKENS: num_output_tokens, FINISH_REASONS: [finish_reason]})


@contextmanager
def prefill_span(
    parent: Parent, *, num_prompt_tokens: int, batch_size: int, batch_tokens: int
) -> Iterator[Span]:
    """`prompt.prefill`: this request's part of a prefill batch (one span per request)."""
    attributes: Attributes = {
        INPUT_TOKENS: num_prompt_tokens,
        BATCH_SIZE: batch_size,
        BATCH_TOKENS: batch_tokens,
    }
    with _span("prompt.prefill", parent, attributes) as span:
        yield span


@contextmanager
def kv_transfer_span(parent: Parent, *, num_layers: int) -> Iterator[Span]:
    """`kv.transfer`: KV pages leaving the prompt engine; finish with `set_kv_transfer`."""
    with _span("kv.transfer", parent, {KV_LAYERS: num_layers}) as span:
        yield span


def set_kv_transfer(span: Span, *, num_bytes: int, overlap_ratio: float) -> None:
    """Bytes moved, and the fraction of the transfer hidden behind prefill compute (0..1)."""
    span.set_attributes({KV_BYTES: num_bytes, KV_OVERLAP_RATIO: overlap_ratio})


def queue_span(name: str, parent: Parent, enqueued_ns: int, end_ns: int | None = None) -> None:
    """Record a finished queue wait (`prompt.queue` or `token.queue`) after the fact.

    Queue time starts and ends in different places of an engine loop, so it is recorded as a
    whole once the request leaves the queue: `enqueued_ns` is `time.time_ns()` at arrival.
    """
    record_span(name, parent, enqueued_ns, end_ns if end_ns is not None else time.time_ns())


def record_prefill(
    parent: Parent,
    start_ns: int,
    end_ns: int,
    *,
    num_prompt_tokens: int,
    batch_size: int,
    batch_tokens: int,
) -> None:
    """`prompt.prefill` after the fact: the batch's forward timed once, one span per request."""
    attributes: Attributes = {
        INPUT_TOKENS: num_prompt_tokens,
        BATCH_SIZE: batch_size,
        BATCH_TOKENS: batch_tokens,
    }
    record_span("prompt.prefill", parent, start_ns, end_ns, attributes)


def record_kv_transfer(
    parent: Parent,
    start_ns: int,
    end_ns: int,
    *,
    num_layers: int,
    num_bytes: int,
    overlap_ratio: float,
    sends: Sequence[tuple[int, int, int, int]] = (),
) -> None:
    """`kv.transfer` after the fact: first KV page sent to last, with `set_kv_transfer`'s fields.

    `sends`: per page (one layer, or every layer when serialized) (layer_start, num_layers,
    bytes, time its send started), each a `kv.send` event."""
    attributes: Attributes = {
        KV_LAYERS: num_layers,
        KV_BYTES: num_bytes,
        KV_OVERLAP_RATIO: overlap_ratio,
    }
    span = tracer().start_span(
        "kv.transfer", context=parent_context(parent), attributes=attributes, start_time=start_ns
    )
    for layer_start, num_page_layers, page_bytes, sent_ns in sends:
        page = {KV_LAYER_START: layer_start, KV_LAYERS: num_page_layers, KV_BYTES: page_bytes}
        span.add_event(KV_SEND_EVENT, page, timestamp=sent_ns)
    span.end(end_time=end_ns)


def record_span(
    name: str, parent: Parent, start_ns: int, end_ns: int, attributes: Attributes = None
) -> None:
    """A finished child span with known start and end times (`time.time_ns()`)."""
    span = tracer().start_span(
        name, context=parent_context(parent), attributes=attributes, start_time=start_ns
    )
    span.end(end_time=end_ns)


class DecodeSpan:
    """`token.decode`: from the request's first decode step to its end, one event per token.

    The span is not made current: an engine loop decodes many requests at once. `token()` is
    the per-token hot path and adds exactly one span event (its timestamp gives the TBT).
    """

    __slots__ = ("_span", "num_tokens")

    def __init__(
        self,
        parent: Parent,
        *,
        token_engine: str = "",
        shards: Sequence[str] = (),
        start_ns: int | None = None,
    ):
        attributes: dict[str, str | list[str]] = {TOKEN_ENGINE: token_engine}
        if shards:
            attributes[SHARDS] = list(shards)
        self._span = tracer().start_span(
            "token.decode",
            context=parent_context(parent),
            attributes=attributes,
            start_time=start_ns,
        )
        self.num_tokens = 0

    def token(self) -> None:
        """One token emitted for this request."""
        self.num_tokens += 1
        self._span.add_event(TOKEN_EVENT)

    def finish(self, finish_reason: str) -> None:
        """End the span with the token count and the OpenAI finish reason."""
        set_usage(self._span, num_output_tokens=self.num_tokens, finish_reason=finish_reason)
        self._span.end()

    def fail(self, error: BaseException) -> None:
        """End the span as failed (engine error, abort, lost shard)."""
        mark_failed(self._span, error)
        self._span.set_attribute(OUTPUT_TOKENS, self.num_tokens)
        self._span.end()


@contextmanager
def _span(
    name: str, parent: Parent, attributes: Attributes, kind: SpanKind = SpanKind.INTERNAL
) -> Iterator[Span]:
    """A span current for the block; an escaping exception marks it failed with `error.type`."""
    with tracer().start_as_current_span(
        name,
        context=parent_context(parent),
        kind=kind,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except BaseException as error:
            mark_failed(span, error)
            raise


def mark_failed(span: Span, error: BaseException) -> None:
    """Status ERROR, `error.type` (the exception class) and an exception event."""
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, str(error)))
    span.set_attribute(ERROR_TYPE, type(error).__qualname__)
