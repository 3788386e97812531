"""The router's side of telemetry: the root span of each request and the client-facing metrics.

`RouterTelemetry.start` opens `router.request` when the HTTP request arrives. The `RequestTrace` it
returns follows that request:

- `admission()` makes the span current while the engine client admits and places the request,
  so `MeshEngineClient` records the chosen engines on it and injects its context into
  `GenerateRequest`;
- `on_output()` sees every output as the response takes it (the SSE stream, or the collector of
  a plain response): the first token becomes a `first_token` event and a TTFT sample, each later
  one a TBT sample (no span event: the token engine's `token.decode` holds the per-token events),
  except for a request whose tokens the router holds to its end (`token_gaps=False`: its gaps
  are not seen here; TPOT still is). TBT samples go to the histogram in batches
  (`TBT_BATCH_SAMPLES`, at least every `TBT_BATCH_S`, and at the request's end): recorded one
  per streamed chunk, each record ran Ray's and OpenTelemetry's Python from cold caches, a share
  of the Router's event-loop CPU per chunk that shows in a profile at batch 1; a batch runs them
  warm;
- `observe()` wraps the output stream and ends the span however the stream ends: finished,
  failed (`error.type`, `request_errors_total{kind="generation"}`), or closed early by a client
  that went away (finish reason `abort`).

Times are `time.time_ns()`, the clock spans use, so span-derived and recorded latencies agree.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import Span

from common.engine.request import RequestOutput
from common.telemetry import Metrics, bind_request
from common.telemetry.spans import FIRST_TOKEN_EVENT, end_request_span, start_request_span

ABORT = "abort"  # how a request that the client left ends (vLLM's finished_reason)
TBT_BATCH_SAMPLES = 64
TBT_BATCH_S = 1.0  # a sample taken this long after the oldest pending one flushes them all
TBT_BATCH_NS = int(TBT_BATCH_S * 1e9)


class RouterTelemetry:
    """Starts one `RequestTrace` per request; owns the router replica's `Metrics`."""

    def __init__(self, model_name: str, replica_id: str = "router", metrics: Metrics | None = None):
        self.model_name = model_name
        self.metrics = metrics or Metrics(model_name=model_name, engine=replica_id)

    def start(
        self,
        req_id: str,
        *,
        operation: str,
        num_prompt_tokens: int,
        max_tokens: int,
        start_ns: int,
        traceparent: str = "",
        token_gaps: bool = True,
    ) -> RequestTrace:
        """`traceparent`: the caller's W3C header, if any, to continue its trace; `token_gaps`:
        False when the outputs after the first come together at the end (no TBT samples)."""
        span = start_request_span(
            req_id, model=self.model_name, num_prompt_tokens=num_prompt_tokens,
            max_tokens=max_tokens, operation=operation, parent=traceparent or None,
            start_ns=start_ns,
        )  # fmt: skip
        return RequestTrace(req_id, span, self.metrics, operation, start_ns, num_prompt_tokens,
                            token_gaps=token_gaps)  # fmt: skip


@dataclass(eq=False)
class RequestTrace:
    """One request's span and latency bookkeeping; see the module docstring."""

    req_id: str
    span: Span
    metrics: Metrics
    operation: str
    start_ns: int
    num_prompt_tokens: int
    token_gaps: bool = True
    first_ns: int = field(default=0, init=False)  # when the first token reached the router
    last_ns: int = field(default=0, init=False)
    num_output_tokens: int = field(default=0, init=False)
    finish_reason: str = field(default="", init=False)
    ended: bool = field(default=False, init=False)
    # TBT samples not yet in the histogram (seconds), and when the oldest was taken (ns).
    _gaps: list[float] = field(default_factory=list, init=False)
    _gaps_since: int = field(default=0, init=False)

    @contextmanager
    def admission(self) -> Iterator[None]:
        """The span is current, and the request id on log lines, while the backend admits."""
        # NOTE: failures are recorded by `fail`, once; use_span would add its own.
        current = trace.use_span(
            self.span, end_on_exit=False, record_exception=False, set_status_on_exception=False
        )
        with current, bind_request(self.req_id):
            yield

    def on_output(self, out: RequestOutput) -> None:
        """Record one output as it leaves the router (the per-token path: one histogram record)."""
        now = time.time_ns()
        if out.new_token_ids:
            if not self.first_ns:
                self.first_ns = now
                self.span.add_event(FIRST_TOKEN_EVENT, timestamp=now)
                self.metrics.record_ttft((now - self.start_ns) / 1e9, self.operation)
            elif self.token_gaps:
                if not self._gaps:
                    self._gaps_since = now
                self._gaps.append((now - self.last_ns) / 1e9)
                if len(self._gaps) >= TBT_BATCH_SAMPLES or now - self._gaps_since >= TBT_BATCH_NS:
                    self._record_gaps()
            self.last_ns = now
        self.num_output_tokens = out.num_output_tokens
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value

    async def observe(
        self, outputs: AsyncGenerator[RequestOutput, None]
    ) -> AsyncGenerator[RequestOutput, None]:
        """`outputs`, each recorded as the response takes it; the span ends with the stream."""
        error: BaseException | None = None
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    self.on_output(out)
                    yield out
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the client went away: an abort, not an error
        except BaseException as exc:
            error = exc
            raise
        finally:
            if error is not None:
                self.fail(error, "generation")
            else:
                self.end()

    def fail(self, error: BaseException, kind: str) -> None:
        """End a failed request; `kind` is a fixed word (an `Overloaded` reason, `generation`)."""
        self.metrics.count_error(kind)
        self._end(error)

    def end(self) -> None:
        """End the request: finished, or abandoned by its client before it finished."""
        if self.ended:
            return
        self.finish_reason = self.finish_reason or ABORT
        self.metrics.count_success(self.finish_reason)
        now = time.time_ns()
        self.metrics.record_e2e((now - self.start_ns) / 1e9, self.operation)
        if self.num_output_tokens > 1 and self.first_ns:
            tpot = (self.last_ns - self.first_ns) / 1e9 / (self.num_output_tokens - 1)
            self.metrics.record_tpot(tpot, self.operation)
        self._end(None)

    def _record_gaps(self) -> None:
        gaps, self._gaps = self._gaps, []
        for seconds in gaps:
            self.metrics.record_tbt(seconds)

    def _end(self, error: BaseException | None) -> None:
        if self.ended:
            return
        self.ended = True
        self._record_gaps()
        if self.first_ns:  # prefilled: refused or failed prompts are not counted
            self.metrics.add_prompt_tokens(self.num_prompt_tokens)
            self.metrics.add_generation_tokens(self.num_output_tokens)
            self.metrics.record_request_tokens(self.num_prompt_tokens, self.num_output_tokens)
        end_request_span(
            self.span,
            num_output_tokens=self.num_output_tokens,
            finish_reason=self.finish_reason or "error",
            error=error,
        )
