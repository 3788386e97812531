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

The activities and what each wants while it runs (cores, measured by `bench/sim_validation.py`
as CPU seconds over wall seconds, per process):
- a prefill iteration: `prompt_cores` (the prompt engine runs one torch thread);
- a decode iteration at batch B: `decode_cores(B)`, the token engine, its shards, and the front
  end streaming its B tokens (the decode profile is measured through the HTTP front end too);
- a request crossing the front end (HTTP, Serve's proxy, the router; the way in and the first
  token's way out): `frontend_cores`, for `frontend_s` when alone.

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
from dataclasses import asdict, dataclass, field

from common.perf_model import PiecewiseLinear


@dataclass(frozen=True)
class SharedCPU:
    """The host's cores, its background load, and each activity's demand; see the module."""

    cores: float
    background_cores: float = 0.0  # other work on the host now
    prompt_cores: float = 1.0
    frontend_cores: float = 0.0
    # (batch size, cores) points, interpolated linearly (constant past the ends).
    decode_cores_by_batch: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 1.0))
    # The background while the profile and the demands were measured (None: the same as now).
    profiled_background_cores: float | None = None
    _decode: PiecewiseLinear = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        demands = [self.background_cores, self.prompt_cores, self.frontend_cores]
        demands += [c for _, c in self.decode_cores_by_batch]
        if self.cores <= 0 or min(demands) < 0:
            raise ValueError("shared cpu: cores must be positive and every demand >= 0")
        points = sorted(self.decode_cores_by_batch)
        if len(points) == 1:
            points.append((points[0][0] + 1, points[0][1]))
        xs = tuple(float(b) for b, _ in points)
        ys = tuple(float(c) for _, c in points)
        object.__setattr__(self, "_decode", PiecewiseLinear(xs, ys))

    def decode_cores(self, batch_size: int) -> float:
        xs = self._decode.xs
        return self._decode(min(max(float(batch_size), xs[0]), xs[-1]))

    def slowdown(self, demand_cores: float) -> float:
        """How much slower everything runs now when `demand_cores` want the host."""
        return max(1.0, (self.background_cores + demand_cores) / self.cores)

    def profiled_slowdown(self, demand_cores: float) -> float:
        """The slowdown `demand_cores` alone had when measured."""
        background = self.profiled_background_cores
        if background is None:
            background = self.background_cores
        return max(1.0, (background + demand_cores) / self.cores)

    def stretch(self, own_cores: float, total_cores: float) -> float:
        """Factor on the alone-measured time of an activity wanting `own_cores` while all
        activities together (it included) want `total_cores`."""
        return self.slowdown(total_cores) / self.profiled_slowdown(own_cores)


@dataclass(frozen=True)
class Station:
    """One front-end event loop: CPU seconds it spends per request and per streamed token."""

    name: str
    request_cpu_s: float
    token_cpu_s: float


class FrontEnd:
    """The front end's loops as FIFO servers, inbound order (client, proxy, router); tokens go
    through them in reverse. Times are simulated seconds."""

    def __init__(self, stations: tuple[Station, ...], delay_s: float) -> None:
        self.stations = stations
        self.delay_s = delay_s
        self._free_at = [0.0] * len(stations)

    def _serve(self, index: int, ready_s: float, work_s: float) -> float:
        done = max(ready_s, self._free_at[index]) + work_s
        self._free_at[index] = done
        return done

    def request_in(self, now: float, stretch: float) -> float:
        """When a request arriving now reaches the router's decision."""
        t = now + self.delay_s
        for i, station in enumerate(self.stations):
            t = self._serve(i, t, station.request_cpu_s * stretch)
        return t

    def tokens_out(self, now: float, num_tokens: int, stretch: float) -> float:
        """When the last of `num_tokens` tokens emitted now reaches the client."""
        t = now
        for i in reversed(range(len(self.stations))):
            t = self._serve(i, t, self.stations[i].token_cpu_s * num_tokens * stretch)
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
        work = sum(s.request_cpu_s + s.token_cpu_s for s in self.stations)
        slowdown = self.cpu.profiled_slowdown(self.cpu.frontend_cores)
        return max(self.frontend_s - work * slowdown, 0.0)

    def frontend(self) -> FrontEnd:
        return FrontEnd(self.stations, self.frontend_delay_s)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HostModel:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        frontend_s = float(data.pop("frontend_s"))
        decode = tuple((int(b), float(c)) for b, c in data.pop("decode_cores_by_batch"))
        stations = tuple(Station(**s) for s in data.pop("stations", ()))
        return cls(frontend_s, SharedCPU(decode_cores_by_batch=decode, **data), stations)

    def to_dict(self) -> dict[str, object]:
        c = self.cpu
        return {
            "frontend_s": self.frontend_s,
            "cores": c.cores,
            "background_cores": c.background_cores,
            "profiled_background_cores": c.profiled_background_cores,
            "prompt_cores": c.prompt_cores,
            "frontend_cores": c.frontend_cores,
            "decode_cores_by_batch": [list(p) for p in c.decode_cores_by_batch],
            "stations": [asdict(s) for s in self.stations],
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")
