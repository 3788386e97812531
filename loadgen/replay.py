"""The replay driver: send each `RequestSpec` at its arrival time, record what came back.

Open loop (the default) means a request is sent at its scheduled time whether or not earlier ones
finished, as the papers' trace replays do; a slow server shows up as growing TTFT, not as a slower
schedule. With `max_concurrency` N the loop closes as vLLM bench's does: a request that arrives
while N are in flight waits, in arrival order, for one to finish; its latencies are measured from
when it is sent, and the wait shows in `send_lag`. Rate and limit both apply (`rate=inf` with N is
a pure closed loop of N users).

Warm-up requests (`warmup`) are sent first, all at once within the same limit, and awaited; their
records are kept apart from the run's, which starts when they are done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

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
    """All records of one run plus its wall span (first send to last completion), the most
    requests it had in flight at once, and the records of its warm-up requests."""

    records: list[RequestRecord]
    duration_s: float
    peak_in_flight: int = 0
    warmup_records: list[RequestRecord] = field(default_factory=list)


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


class _InFlight:
    """Requests sent and not yet finished: the closed loop's slots and the peak count."""

    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {limit}")
        self.slots = asyncio.Semaphore(limit) if limit is not None else None
        self.count = 0
        self.peak = 0

    async def enter(self) -> None:
        if self.slots is not None:
            await self.slots.acquire()
        self.count += 1
        self.peak = max(self.peak, self.count)

    def leave(self) -> None:
        self.count -= 1
        if self.slots is not None:
            self.slots.release()


async def _send_all(
    specs: Sequence[RequestSpec],
    target: Target,
    in_flight: _InFlight,
    run_start_s: float,
    on_done: Callable[[asyncio.Task[RequestRecord]], None] | None = None,
) -> list[RequestRecord]:
    """Send each spec at `run_start_s + spec.arrival_s` (once a slot is free) and await them all."""
    clock = target.clock
    tasks: list[asyncio.Task[RequestRecord]] = []
    for spec in specs:
        await clock.sleep_until(run_start_s + spec.arrival_s)
        await in_flight.enter()
        # NOTE: stamp the send time here, not inside the task: with a virtual clock the
        # driver may advance time to the next arrival before the new task first runs.
        sent = clock.now()
        task = asyncio.create_task(run_one(target, spec, run_start_s, sent))
        task.add_done_callback(lambda _: in_flight.leave())
        if on_done is not None:
            task.add_done_callback(on_done)
        tasks.append(task)
    return list(await asyncio.gather(*tasks))


async def replay(
    specs: Sequence[RequestSpec],
    target: Target,
    *,
    progress: bool = True,
    max_concurrency: int | None = None,
    warmup: Sequence[RequestSpec] = (),
) -> ReplayResult:
    """Send every spec at `run start + spec.arrival_s` (within `max_concurrency` in flight, if
    given) and wait for all of them to finish; `warmup` specs go first (module docstring).

    Each request runs in its own task; the target's timeouts bound how long any can take.
    """
    clock = target.clock
    in_flight = _InFlight(max_concurrency)
    warmup_records = await _send_all(warmup, target, in_flight, clock.now()) if warmup else []
    in_flight.peak = 0
    run_start_s = clock.now()
    bar = tqdm(total=len(specs), disable=not progress, unit="req", dynamic_ncols=True)
    failed = 0

    def on_done(task: asyncio.Task[RequestRecord]) -> None:
        nonlocal failed
        if not task.cancelled() and task.exception() is None and not task.result().ok:
            failed += 1
            bar.set_postfix(errors=failed, refresh=False)
        bar.update(1)

    try:
        records = await _send_all(specs, target, in_flight, run_start_s, on_done)
    finally:
        bar.close()
    return ReplayResult(
        records, clock.now() - run_start_s, in_flight.peak, warmup_records=warmup_records
    )


def warmup_specs(specs: Sequence[RequestSpec], count: int) -> list[RequestSpec]:
    """`count` warm-up requests shaped like the run's first ones (cycled), all due at once, with
    their own prompts: negative indices (so other prompt tails and request ids) and no hash ids or
    dataset text, so they leave nothing in a prefix cache that the run could reuse."""
    if count < 0:
        raise ValueError(f"the warm-up count must be >= 0, got {count}")
    if not specs:
        return []
    return [
        replace(specs[i % len(specs)], req_index=-1 - i, arrival_s=0.0, hash_ids=(),
                prompt_text=None)
        for i in range(count)
    ]  # fmt: skip
