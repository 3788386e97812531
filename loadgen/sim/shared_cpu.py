"""A cluster whose machines share one host's CPU cores: PhaseMesh's local mesh on one box.

Splitwise's machines are separate GPUs: an iteration takes its profiled time whatever the others
do, and the front end (HTTP, router) costs nothing next to a 70B model. On a CPU box serving the
tiny model both fail: the prompt engine, the token engine and its shards, the router, Serve's HTTP
proxy and the load generator are processes on the same few cores, and the front end spends about
as much CPU per streamed token as the decode step itself.

`SharedCPU` models that as processor sharing with a uniform slowdown: when activities that want
`D` cores at full speed run together on `cores` cores, each runs `max(1, D / cores)` times slower.
Each activity's time was measured *alone* on the host (with the background load of that time),
so it already holds its own slowdown; running with others, and with the background of the
moment, stretches it by

    slowdown(background + own + others) / slowdown(profiled background + own).

What each activity wants while it runs (cores; measured by `bench/sim_validation.py` as CPU
seconds over wall seconds, per process, with the activity alone on the host):
- a prefill iteration: `prompt_cores` (the prompt engine runs one torch thread);
- a decode iteration at batch B: `chain_cores(B)`, the token engine and its shards. Alone, with
  the front end streaming its tokens, it took `decode_cores(B)`: the decode profile is measured
  through the HTTP front end, so that is the demand its profiled time already holds;
- a front-end loop with work queued: one core (one thread), for the part of the coming interval
  its queue lasts.

The front end is also a queue. Each of its processes (the load generator's client, Serve's HTTP
proxy, the router) is one event loop, a first-come-first-served server that handles every request
on its way in and every token of every stream on its way out. A `FrontEnd` keeps when each loop is
next free: a request waits behind the token chunks already queued there, and the first and last
tokens of a request reach the client behind the chunks ahead of them. A loop's work is its
measured CPU seconds per request and per token, stretched by the shared CPU; the rest of the
front end's latency alone (wake-ups, sockets) is a fixed delay. None of these figures is fitted to
the latencies the simulator then predicts.
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import asdict, dataclass, field

from common.perf_model import PiecewiseLinear

NICE15_SHARE = 36 / 1024  # CFS weights of nice 15 and nice 0


@dataclass(frozen=True)
class SharedCPU:
    """The host's cores, its background load, and each activity's demand; see the module."""

    cores: float
    # Cores taken now by work at a higher priority than the mesh's processes (other users'
    # jobs at nice 0, over Ray's nice-15 workers): the mesh shares what is left ...
    background_cores: float = 0.0
    # ... with the work at its own priority or below (other Ray workers, say).
    shared_background_cores: float = 0.0
    prompt_cores: float = 1.0
    # (batch size, cores) points, interpolated linearly (constant past the ends): a decode alone
    # with its streaming, and the token engine with its shards only.
    decode_cores_by_batch: tuple[tuple[int, float], ...] = ((1, 1.0),)
    chain_cores_by_batch: tuple[tuple[int, float], ...] = ((1, 1.0),)
    # Both backgrounds while the profile and the demands were measured (None: as now).
    profiled_background_cores: float | None = None
    profiled_shared_background_cores: float | None = None
    _curves: tuple[PiecewiseLinear, PiecewiseLinear] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        demands = [self.background_cores, self.shared_background_cores, self.prompt_cores]
        demands += [c for _, c in self.decode_cores_by_batch + self.chain_cores_by_batch]
        if self.cores <= 0 or min(demands) < 0:
            raise ValueError("shared cpu: cores must be positive and every demand >= 0")
        curves = (_curve(self.decode_cores_by_batch), _curve(self.chain_cores_by_batch))
        object.__setattr__(self, "_curves", curves)

    def decode_cores(self, batch_size: int) -> float:
        return _clamped(self._curves[0], batch_size)

    def chain_cores(self, batch_size: int) -> float:
        return _clamped(self._curves[1], batch_size)

    def slowdown(self, demand_cores: float, priority_cores: float = 0.0) -> float:
        """How much slower the mesh's processes run now when they want `demand_cores` and
        higher-priority work (the background, a client) takes `priority_cores` besides."""
        left = self.cores - self.background_cores - priority_cores
        return _shared(demand_cores + self.shared_background_cores, left, self)

    def profiled_slowdown(self, demand_cores: float) -> float:
        """The slowdown `demand_cores` alone had when measured."""
        above, shared = self.profiled_background_cores, self.profiled_shared_background_cores
        above = self.background_cores if above is None else above
        shared = self.shared_background_cores if shared is None else shared
        return _shared(demand_cores + shared, self.cores - above, self)

    def stretch(self, own_cores: float, total_cores: float, priority_cores: float = 0.0) -> float:
        """Factor on the alone-measured time of an activity wanting `own_cores` while all the
        mesh's activities together (it included) want `total_cores`."""
        return self.slowdown(total_cores, priority_cores) / self.profiled_slowdown(own_cores)


def _shared(demand_cores: float, left_cores: float, cpu: SharedCPU) -> float:
    # NOTE: Ray runs its workers at nice 15: CFS gives such a thread 36/1024 of a nice-0 one's
    # share, so higher-priority work leaves the mesh at least that much of the cores, no more.
    left = max(left_cores, cpu.cores * NICE15_SHARE)
    return max(1.0, demand_cores / left)


def _curve(points: tuple[tuple[int, float], ...]) -> PiecewiseLinear:
    if not points:
        raise ValueError("shared cpu: a cores-by-batch curve needs at least one point")
    ordered = sorted(points)
    if len(ordered) == 1:
        ordered.append((ordered[0][0] + 1, ordered[0][1]))
    return PiecewiseLinear(tuple(float(b) for b, _ in ordered), tuple(c for _, c in ordered))


def _clamped(curve: PiecewiseLinear, batch_size: int) -> float:
    return curve(min(max(float(batch_size), curve.xs[0]), curve.xs[-1]))


@dataclass(frozen=True)
class Station:
    """One front-end event loop: CPU seconds it spends per request and per streamed token.
    `priority`: it runs above the mesh's processes (the load generator, at nice 0), so they
    never slow it down; it takes its cores from theirs."""

    name: str
    request_cpu_s: float
    token_cpu_s: float
    priority: bool = False


class FrontEnd:
    """The front end's loops as FIFO servers, inbound order (client, proxy, router); tokens go
    through them in reverse. Times are simulated seconds."""

    def __init__(self, stations: tuple[Station, ...], delay_s: float) -> None:
        self.stations = stations
        self.delay_s = delay_s
        # Each loop's scheduled work, (start, end) in time order: a loop waiting for the one
        # before it in the pipeline is idle, not runnable.
        self._work: list[deque[tuple[float, float]]] = [deque() for _ in stations]

    def busy_cores(self, now: float, horizon_s: float, priority: bool = False) -> float:
        """Cores the loops (those of `priority`) want over [now, now + horizon_s]: each, the
        part of it it works."""
        horizon_s = max(horizon_s, 1e-6)
        end, total = now + horizon_s, 0.0
        for station, work in zip(self.stations, self._work, strict=True):
            if station.priority != priority:
                continue
            while work and work[0][1] <= now:
                work.popleft()
            for start, done in work:
                if start >= end:
                    break
                total += min(done, end) - max(start, now)
        return total / horizon_s

    def work_s(self, num_requests: int, num_tokens: int) -> float:
        """CPU seconds of all loops for that many requests and tokens."""
        return sum(
            num_requests * s.request_cpu_s + num_tokens * s.token_cpu_s for s in self.stations
        )

    def _serve(self, index: int, ready_s: float, work_s: float) -> float:
        """Schedule `work_s` on loop `index` in its first idle gap from `ready_s` on: work is
        placed as it becomes ready downstream, so a loop never idles while work waits (the
        queue is first come, first served by readiness, not by when it was scheduled)."""
        work = self._work[index]
        start, position = ready_s, 0
        while position < len(work):
            busy_start, busy_end = work[position]
            if busy_end > start:
                if busy_start >= start + work_s:
                    break  # it fits in the gap before this interval
                start = busy_end
            position += 1
        if work_s > 0:
            work.insert(position, (start, start + work_s))
        return start + work_s

    def request_in(self, now: float, stretch: float) -> float:
        """When a request arriving now reaches the router's decision."""
        t = now + self.delay_s
        for i, station in enumerate(self.stations):
            t = self._serve(i, t, station.request_cpu_s * (1.0 if station.priority else stretch))
        return t

    def tokens_out(self, now: float, num_tokens: int, stretch: float) -> float:
        """When the last of `num_tokens` tokens emitted now reaches the client."""
        t = now
        for i in reversed(range(len(self.stations))):
            station = self.stations[i]
            factor = 1.0 if station.priority else stretch
            t = self._serve(i, t, station.token_cpu_s * num_tokens * factor)
        return t


@dataclass(frozen=True)
class HostModel:
    """A host measurement file: the front end's latency alone, its loops, and the shared CPU."""

    frontend_s: float
    cpu: SharedCPU
    stations: tuple[Station, ...] = ()

    @property
    def frontend_delay_s(self) -> float:
        """The front end's latency alone that is not loop work (wake-ups, sockets); the loops'
        work ran at the host's slowdown with a request alone in the front end."""
        slowdown = self.cpu.profiled_slowdown(1.0)  # alone: one loop runnable at a time
        work = sum(
            (s.request_cpu_s + s.token_cpu_s) * (1.0 if s.priority else slowdown)
            for s in self.stations
        )
        return max(self.frontend_s - work, 0.0)

    def frontend(self) -> FrontEnd:
        return FrontEnd(self.stations, self.frontend_delay_s)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HostModel:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        frontend_s = float(data.pop("frontend_s"))
        decode, chain = (
            tuple((int(b), float(c)) for b, c in data.pop(key))
            for key in ("decode_cores_by_batch", "chain_cores_by_batch")
        )
        stations = tuple(Station(**s) for s in data.pop("stations", ()))
        cpu = SharedCPU(decode_cores_by_batch=decode, chain_cores_by_batch=chain, **data)
        return cls(frontend_s, cpu, stations)

    def to_dict(self) -> dict[str, object]:
        c = self.cpu
        return {
            "frontend_s": self.frontend_s,
            "cores": c.cores,
            "background_cores": c.background_cores,
            "shared_background_cores": c.shared_background_cores,
            "profiled_background_cores": c.profiled_background_cores,
            "profiled_shared_background_cores": c.profiled_shared_background_cores,
            "prompt_cores": c.prompt_cores,
            "decode_cores_by_batch": [list(p) for p in c.decode_cores_by_batch],
            "chain_cores_by_batch": [list(p) for p in c.chain_cores_by_batch],
            "stations": [asdict(s) for s in self.stations],
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")
