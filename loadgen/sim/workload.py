"""Requests for the simulator: a trace replayed as recorded, or its sizes at a Poisson rate."""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Iterator

from loadgen.sim.simulator import SimRequest, cyclic_gc_paused
from loadgen.traces import TraceRow, read_azure_csv, read_mooncake_jsonl


def read_trace(path: str | os.PathLike[str]) -> list[TraceRow]:
    """All rows of an Azure CSV or Mooncake JSONL trace (by extension)."""
    reader = read_mooncake_jsonl if str(path).endswith(".jsonl") else read_azure_csv
    return list(reader(path))


def as_recorded(rows: Iterable[TraceRow], time_scale: float = 1.0) -> Iterator[SimRequest]:
    """The trace's own arrivals; `time_scale` < 1 compresses time (raises the rate)."""
    for row in rows:
        yield SimRequest(row.arrival_s * time_scale, row.input_len, row.output_len, row.hash_ids)


def poisson(
    rows: list[TraceRow], rate: float, duration_s: float, seed: int = 0
) -> list[SimRequest]:
    """Poisson arrivals at `rate` per second for `duration_s`, sizes taken from the trace in
    order (cycling), as Splitwise tunes load (§V-B)."""
    if rate <= 0 or not rows:
        raise ValueError("poisson workload: need a positive rate and a non-empty trace")
    rng = random.Random(seed)
    requests: list[SimRequest] = []
    append, draw, num_rows = requests.append, rng.expovariate, len(rows)
    t = draw(rate)
    with cyclic_gc_paused():
        while t < duration_s:
            row = rows[len(requests) % num_rows]
            append(SimRequest(t, row.input_len, row.output_len, row.hash_ids))
            t += draw(rate)
    return requests
