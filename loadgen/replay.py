"""The open-loop replay driver: send each `RequestSpec` at its arrival time, record what came back.

Open loop means a request is sent at its scheduled time whether or not earlier ones finished, as
the papers' trace replays do; a slow server shows up as growing TTFT, not as a slower schedule.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog
from tqdm import tqdm

from loadgen.target import RequestSpec, Target, Usage

log = structlog.get_logger(__name__)


@dataclass
class RequestRecord:
    """What one request measured. Times are seconds; `send_s` is relative to the run start.

    `itl_s` holds every gap between consecutive token-carrying chunks (the papers' TBT).
    `output_tokens` comes from the server's usage when sent, else from counting chunks.
    `error` is None for a request that completed, else `"ExceptionType: message"`.
    """

    req_index: int
    scheduled_s: float
    input_len: int
    output_len: int
    send_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, (E2E - TTFT) / (tokens - 1); vLLM's TPOT."""
        if self.e2e_s is None or self.ttft_s is None or self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class ReplayResult:
    """All records of one run plus its wall span (first send to last completion)."""

    records: list[RequestRecord]
    duration_s: float


async def run_one(
    target: Target, spec: RequestSpec, run_start_s: float, sent: float
) -> RequestRecord:
    """Send one request through `target` and measure it from `sent` (the dispatch time on the
    target's clock); never raises on a failed request."""
    record = RequestRecord(spec.req_index, spec.arrival_s, spec.input_len, spec.output_len)
    record.send_s = sent - run_start_s
    last_token_s: float | None = None
    last_event_s: float | None = None
    chunk_tokens = 0
    usage: Usage | None = None
    try:
        async for event in target.generate(spec):
            usage = event.usage or usage
            last_event_s = event.time_s
            if event.num_tokens <= 0:
                continue
            if last_token_s is None:
                record.ttft_s = event.time_s - sent
            else:
                record.itl_s.append(event.time_s - last_token_s)
            last_token_s = event.time_s
            chunk_tokens += event.num_tokens
        if last_token_s is None:
            if usage is None or usage.completion_tokens < 1 or last_event_s is None:
                raise RuntimeError("stream finished without any token")
            # Tokens whose text is empty (a special token) stream no text: usage says they came,
            # and the client learned it with the last chunk.
            record.ttft_s = last_event_s - sent
            last_token_s = last_event_s
    except Exception as exc:  # any failure belongs to this request, not to the run
        record.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
        log.debug("request_failed", req_index=spec.req_index, error=record.error)
    record.output_tokens = usage.completion_tokens if usage is not None else chunk_tokens
    record.prompt_tokens = usage.prompt_tokens if usage is not None else None
    if record.ok and last_token_s is not None:
        record.e2e_s = last_token_s - sent
    return record


async def replay(
    specs: Sequence[RequestSpec], target: Target, *, progress: bool = True
) -> ReplayResult:
    """Send every spec at `run start + spec.arrival_s` and wait for all of them to finish.

    Each request runs in its own task; the target's timeouts bound how long any can take.
    """
    clock = target.clock
    run_start_s = clock.now()
    bar = tqdm(total=len(specs), disable=not progress, unit="req", dynamic_ncols=True)
    tasks: list[asyncio.Task[RequestRecord]] = []
    failed = 0

    def on_done(task: asyncio.Task[RequestRecord]) -> None:
        nonlocal failed
        if not task.cancelled() and task.exception() is None and not task.result().ok:
            failed += 1
            bar.set_postfix(errors=failed, refresh=False)
        bar.update(1)

    try:
        for spec in specs:
            await clock.sleep_until(run_start_s + spec.arrival_s)
            # NOTE: stamp the send time here, not inside the task: with a virtual clock the
            # driver may advance time to the next arrival before the new task first runs.
            sent = clock.now()
            task = asyncio.create_task(run_one(target, spec, run_start_s, sent))
            task.add_done_callback(on_done)
            tasks.append(task)
        records = list(await asyncio.gather(*tasks))
    finally:
        bar.close()
    return ReplayResult(records, duration_s=clock.now() - run_start_s)
