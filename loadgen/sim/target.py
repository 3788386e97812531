"""The simulator as a replay target: `python -m loadgen replay --trace ... --target sim:CONFIG`.

`make_target("Splitwise-HH:25P15T")` returns a `SimTarget` with a virtual clock. The driver's
`clock.sleep_until(t)` runs the simulation up to `t` (no arrival can come earlier), and each
`generate(spec)` submits its request at the current virtual time and waits for it. Once the driver
stops scheduling arrivals (it is waiting on its requests), waiting generators run the simulation
on. Tokens stream as one event for the first token and one per later token, spaced evenly over
the request's decode time (the simulator models a request's mean gap, not each gap).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from loadgen.sim.designs import parse_cluster
from loadgen.sim.shared_cpu import HostModel
from loadgen.sim.simulator import SimOptions, SimRequest, Simulator
from loadgen.target import RequestSpec, StreamEvent, Usage

# Event-loop rounds without a new arrival deadline before waiting requests may run the simulation
# past the last deadline: the driver then has no more arrivals to schedule.
_IDLE_ROUNDS = 3


class VirtualClock:
    """Simulated time: `sleep_until` advances the simulator rather than sleeping."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.horizon_s = 0.0  # no arrival can come before this
        self.deadline_calls = 0

    def now(self) -> float:
        return self.horizon_s

    async def sleep_until(self, deadline_s: float) -> None:
        # NOTE: yield before moving time: requests the driver dispatched at the previous
        # deadline must submit their arrival at that time, before the simulation passes it.
        await asyncio.sleep(0)
        self.horizon_s = max(self.horizon_s, deadline_s)
        self.deadline_calls += 1
        self.sim.advance_until(self.horizon_s)


class SimTarget:
    """A `loadgen.target.Target` answered by the cluster simulator."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.clock = VirtualClock(sim)

    async def generate(self, spec: RequestSpec) -> AsyncIterator[StreamEvent]:
        req = SimRequest(self.clock.now(), spec.input_len, spec.output_len, spec.hash_ids)
        record = self.sim.records[self.sim.submit(req)]
        await self._wait_done(lambda: record.done_s == record.done_s)
        yield StreamEvent(record.first_token_s, 1)
        gap = record.tbt_s if record.output_len > 1 else 0.0
        for i in range(1, record.output_len):
            yield StreamEvent(record.first_token_s + i * gap, 1)
        yield StreamEvent(record.done_s, 0, Usage(record.prompt_len, record.output_len))

    async def _wait_done(self, is_done) -> None:  # type: ignore[no-untyped-def]
        idle, last_calls = 0, -1
        while not is_done():
            await asyncio.sleep(0)
            if self.clock.deadline_calls != last_calls:
                idle, last_calls = 0, self.clock.deadline_calls
                continue
            idle += 1
            if idle >= _IDLE_ROUNDS:
                self.sim.advance_until(float("inf"))

    async def aclose(self) -> None:
        return None


def make_target(config: str, options: SimOptions | None = None) -> SimTarget:
    """A simulator target for `config`: a cluster, e.g. `Splitwise-HH:25P15T` or
    `Baseline-H100:40`, optionally followed by `@` and options (`parse_options`)."""
    cluster, _, extra = config.partition("@")
    return SimTarget(Simulator(parse_cluster(cluster), parse_options(extra, options)))


def parse_options(text: str, base: SimOptions | None = None) -> SimOptions:
    """Comma-separated `key=value`s on top of `base`: `frontend_ms=N` (a front-end latency per
    request), `host=FILE` (a `HostModel` JSON: front end and shared CPU, as measured by
    `bench/sim_validation.py`)."""
    options = base or SimOptions()
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key == "frontend_ms" and value:
            options = replace(options, frontend_s=float(value) / 1000.0)
        elif key == "host" and value:
            host = HostModel.load(value)
            options = replace(options, frontend_s=host.frontend_s, host=host)
        else:
            raise ValueError(f"unknown simulator option {item!r}; known: frontend_ms=N, host=FILE")
    return options
