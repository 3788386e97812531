"""The interface between the replay driver and whatever serves the requests.

A *target* is any object with the shape of `Target` below. `replay` hands it one `RequestSpec` at
a time, at the spec's arrival time, and iterates what `generate` yields. Two implementations:

- `loadgen.http_target.OpenAIStreamingTarget`: streams `POST /v1/completions` from a real
  OpenAI-compatible server (PhaseMesh's router, vLLM, SGLang, ...).
- the simulator (`loadgen/sim/`, `--target sim:CONFIG`): answers from a performance model. The
  CLI imports `loadgen.sim.target` and calls `make_target(config: str)`, which returns a
  `Target`; nothing else in loadgen knows about the simulator.

Contract of `Target.generate(spec)`:

- It is an async generator. It yields one `StreamEvent` per streamed chunk, in arrival order, with
  `time_s` read from the target's own `clock` (so a simulator can run in virtual time) and
  `num_tokens` the tokens that chunk carried (usually 1; 0 for a usage-only chunk).
- If the server reports usage, the last event carries it (`usage`); the driver then counts output
  tokens from usage instead of from chunks.
- It reports failure by raising. Any exception is recorded as that request's error (the class name
  and message); the driver never lets one request's failure stop the run. A target must bound its
  own waits (connect and read timeouts) so that a dead server produces errors, not a hang.

`Target.clock` supplies `now()` and `sleep_until()`: the driver schedules arrivals and stamps send
times with it. `WallClock` is real time; a simulator passes a virtual clock whose `sleep_until`
advances simulated time. `aclose()` releases connections once the run is over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its schedule and its (already token-scaled) lengths.

    `hash_ids` are the trace's prefix-block ids (Mooncake); each id stands for `block_len` prompt
    tokens, so equal ids at equal positions mean an identical prefix. Prompt token ids are built
    from these by the HTTP target only, so a simulator never pays for them.
    """

    req_index: int
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = field(default=())
    block_len: int = 512
    prompt_text: str | None = None  # the dataset's own prompt (ShareGPT), else one is built


@dataclass(frozen=True)
class Usage:
    """Token counts as the server reported them (`usage` of the final stream chunk)."""

    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class StreamEvent:
    """One streamed chunk: when it arrived, how many tokens it held, and usage on the last one."""

    time_s: float
    num_tokens: int
    usage: Usage | None = None


class Clock(Protocol):
    """Time source for the driver: real time for HTTP, simulated time for the simulator."""

    def now(self) -> float: ...

    async def sleep_until(self, deadline_s: float) -> None: ...


class Target(Protocol):
    """Anything that serves `RequestSpec`s as a stream of `StreamEvent`s (see module docstring)."""

    @property
    def clock(self) -> Clock: ...

    def generate(self, spec: RequestSpec) -> AsyncIterator[StreamEvent]: ...

    async def aclose(self) -> None: ...


class WallClock:
    """Monotonic real time; `sleep_until` sleeps on the running event loop."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep_until(self, deadline_s: float) -> None:
        delay = deadline_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
