"""The highest request rate a simulated system sustains: the rate search of the provisioning
search (`provision.py`) and of Neo's comparison (`neo.py`).

Feasibility is not monotone in the rate (provision.py's docstring has a cluster that misses its
SLOs at moderate load and meets them at heavier), so a plain bisection can jump over the rates a
system cannot serve. The search climbs a grid of rates to the first miss, then bisects between
the last rate met and it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Probe:
    """One simulated run at a fixed rate: Poisson arrivals for `duration_s` (from `seed`), latency
    counted for the arrivals after `warmup_s`."""

    duration_s: float = 90.0
    warmup_s: float = 10.0
    seed: int = 0


@dataclass(frozen=True)
class SearchSettings:
    """How hard to look: each probe, the rate bounds, the grid the search climbs and the
    bisection steps that refine its first miss."""

    probe: Probe = Probe()
    min_rate: float = 1.0
    max_rate: float = 400.0
    rate_step: float = 10.0
    num_bisections: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.min_rate <= self.max_rate or self.rate_step <= 0:
            raise ValueError("search: need 0 < min_rate <= max_rate and rate_step > 0")


def climb_and_bisect(meets: Callable[[float], bool], start: float, s: SearchSettings) -> float:
    """The highest rate `meets` with every grid rate below it met too: climb from `start` (taken
    as met) in `rate_step`s to the first miss, then bisect below it; `max_rate` when nothing up
    to it misses."""
    lo = start
    while lo < s.max_rate:
        hi = min(lo + s.rate_step, s.max_rate)
        if not meets(hi):
            break
        lo = hi
    else:
        return lo
    for _ in range(s.num_bisections):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo
