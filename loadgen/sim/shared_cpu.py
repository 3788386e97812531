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
front end's latency alone (wake-ups, sockets) is a delay. The latency alone varies from request to
request (scheduling, wake-ups, the event loops' other work): `frontend_s` is its low decile, and
each request draws an extra delay from `frontend_jitter_s`, the measured latencies above it, so a
request alone sees the measured distribution.

The hand-off from the prompt engine to the token engine is a stall of the token machine. The
engine sends the KV pages to the shards and the hand-off to the token engine, which admits the
request into its next step; the shards hold that step's first layer until the newcomer's KV has
landed, so the whole batch waits, not only the newcomer. `HostModel.handoff_s` is that stall:
the first decode gap of a request alone minus a profiled batch-1 step and the KV transfer. None of
these figures is fitted to the latencies the simulator then predicts.
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


@dataclass(eq=False)
class FrontEnd:
    """The front end's loops as FIFO servers, inbound order (client, proxy, router); tokens go
    through them in reverse. Times are simulated seconds.

    `on_path`: the part of each loop's request CPU spent before the first token (the rest runs
    after the last). `chunk_cpu_s`: the loops' CPU for the tokens one step emits, by their count
    (None: each station's `token_cpu_s` per token); each station takes its share of
    `token_cpu_s`."""

    stations: tuple[Station, ...]
    delay_s: float
    on_path: float = 1.0
    chunk_cpu_s: PiecewiseLinear | None = None

    def __post_init__(self) -> None:
        total = sum(s.token_cpu_s for s in self.stations)
        self._shares = [s.token_cpu_s / total if total else 0.0 for s in self.stations]
        # Each loop's scheduled work, (start, end) in time order: a loop waiting for the one
        # before it in the pipeline is idle, not runnable.
        self._work: list[deque[tuple[float, float]]] = [deque() for _ in self.stations]

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
        """CPU seconds of all loops for that many requests and one step's `num_tokens`."""
        return sum(
            num_requests * s.request_cpu_s + self._token_work_s(i, num_tokens)
            for i, s in enumerate(self.stations)
        )

    def _token_work_s(self, index: int, num_tokens: int) -> float:
        """Loop `index`'s CPU for the `num_tokens` tokens one step emits."""
        if num_tokens <= 0:
            return 0.0
        if self.chunk_cpu_s is None:
            return num_tokens * self.stations[index].token_cpu_s
        return self._shares[index] * self.chunk_cpu_s(float(num_tokens))

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

    def request_in(self, now: float, stretch: float, extra_s: float = 0.0) -> float:
        """When a request arriving now reaches the router's decision; `extra_s`: its own share
        of the front end's variation (a draw from `HostModel.frontend_jitter_s`)."""
        t = now + self.delay_s + extra_s
        for i, station in enumerate(self.stations):
            work_s = station.request_cpu_s * self.on_path
            t = self._serve(i, t, work_s * (1.0 if station.priority else stretch))
        return t

    def request_out(self, now: float, stretch: float) -> None:
        """A request's last token left its loops at `now`: the rest of its request CPU (closing
        the stream, bookkeeping) runs then, off its latency but in the loops' queues."""
        for i in reversed(range(len(self.stations))):
            station = self.stations[i]
            work_s = station.request_cpu_s * (1.0 - self.on_path)
            self._serve(i, now, work_s * (1.0 if station.priority else stretch))

    def tokens_out(self, now: float, num_tokens: int, stretch: float) -> float:
        """When the last of `num_tokens` tokens emitted now reaches the client."""
        t = now
        for i in reversed(range(len(self.stations))):
            factor = 1.0 if self.stations[i].priority else stretch
            t = self._serve(i, t, self._token_work_s(i, num_tokens) * factor)
        return t


@dataclass(frozen=True)
class HostModel:
    """A host measurement file: the front end's latency alone, its loops, the shared CPU, and
    the hand-off's stall of the token machine (see the module)."""

    frontend_s: float
    cpu: SharedCPU
    stations: tuple[Station, ...] = ()
    handoff_s: float = 0.0
    frontend_jitter_s: tuple[float, ...] = ()  # each >= 0; a request draws one (see the module)

    def _alone_work_s(self, chunk_cpu_s: PiecewiseLinear | None) -> tuple[float, float]:
        """(request CPU, first-token CPU) of the loops for a request alone, as wall seconds at
        the host's slowdown then (one loop runnable at a time)."""
        frontend = FrontEnd(self.stations, 0.0, chunk_cpu_s=chunk_cpu_s)
        slowdown = self.cpu.profiled_slowdown(1.0)
        factors = [1.0 if s.priority else slowdown for s in self.stations]
        request = sum(s.request_cpu_s * f for s, f in zip(self.stations, factors, strict=True))
        token = sum(frontend._token_work_s(i, 1) * f for i, f in enumerate(factors))
        return request, token

    @property
    def frontend_delay_s(self) -> float:
        """The front end's latency alone that is not loop work (wake-ups, sockets); the loops'
        work ran at the host's slowdown with a request alone in the front end."""
        return self.frontend().delay_s

    def frontend(self, step_s: PiecewiseLinear | None = None) -> FrontEnd:
        """The loops as queues. `step_s`: the profiled decode step by batch size, which with the
        decode and chain demands gives the loops' CPU per step (see `chunk_cpu_s`)."""
        chunk = self.chunk_cpu_s(step_s) if step_s is not None else None
        request, token = self._alone_work_s(chunk)
        # NOTE: the loops' request CPU was measured over whole requests; when it exceeds the
        # latency alone, only part of it can lie before the first token: the rest comes after.
        on_path = min(1.0, max(self.frontend_s - token, 0.0) / request) if request > 0 else 1.0
        delay = max(self.frontend_s - on_path * request - token, 0.0)
        return FrontEnd(self.stations, delay, on_path, chunk)

    def chunk_cpu_s(self, step_s: PiecewiseLinear) -> PiecewiseLinear | None:
        """The loops' CPU for the tokens of one decode step, by batch size: what they took while
        the profiled decode streamed at each measured batch (decode minus chain cores, times the
        step). Each loop wakes once per step, so a token alone costs more than one of a large
        batch; a per-token mean pooled over the sweep is the large batches'. None without
        stations or with one batch point."""
        cpu = self.cpu
        points = sorted({b for b, _ in cpu.decode_cores_by_batch + cpu.chain_cores_by_batch})
        if not self.stations or len(points) < 2:
            return None
        work = [
            max(cpu.decode_cores(b) - cpu.chain_cores(b), 0.0) * step_s(float(b)) for b in points
        ]
        return PiecewiseLinear(tuple(float(b) for b in points), tuple(work))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HostModel:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        frontend_s = float(data.pop("frontend_s"))
        handoff_s = float(data.pop("handoff_s", 0.0))  # host files before the hand-off stall
        jitter = tuple(float(x) for x in data.pop("frontend_jitter_s", ()))
        decode, chain = (
            tuple((int(b), float(c)) for b, c in data.pop(key))
            for key in ("decode_cores_by_batch", "chain_cores_by_batch")
        )
        stations = tuple(Station(**s) for s in data.pop("stations", ()))
        cpu = SharedCPU(decode_cores_by_batch=decode, chain_cores_by_batch=chain, **data)
        return cls(frontend_s, cpu, stations, handoff_s, jitter)

    def to_dict(self) -> dict[str, object]:
        c = self.cpu
        return {
            "frontend_s": self.frontend_s,
            "handoff_s": self.handoff_s,
            "frontend_jitter_s": list(self.frontend_jitter_s),
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
