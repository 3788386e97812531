"""Which CPU cores each decode group's processes run on, when a whole mesh shares one host.

A decode step visits the token engine's shards once per layer: the engine sends one message to
each shard, in group order, then blocks until every reply is back. Left to the Linux scheduler,
the shards woken by the engine's sends tend to land on the engine's own core (wake-affine), where
they wait for the engine to block and then run one after another. The placement here gives each
shard of a group its own core, and puts the token engine on the core of its group's *last* shard:
the first shards start the moment their message lands, while the engine is still sending, and the
last one runs as soon as the engine blocks, so a step waits on no shard queued behind another
(bench/disagg.py measures both; docs/mesh.md).

A token engine of several threads (`token_engine_threads`) gets as many cores: its last shard's,
then the next ones in order. Its threads split each GEMM, so two threads held to one core would
take turns through it.

Cores are handed out round-robin, so groups beyond the core count share cores. Prompt engines are
not pinned: they are idle while decode runs and take whichever core is free when a prompt comes.
With fewer than two cores there is nothing to place: every process gets no cores (runs anywhere).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupPlacement:
    """The cores of one decode group: its token engine's, and each of its shards' (empty: any)."""

    engine: tuple[int, ...]
    shards: tuple[tuple[int, ...], ...]


def place_decode_groups(
    num_groups: int, shards_per_group: int, cores: list[int], engine_threads: int = 1
) -> list[GroupPlacement]:
    """One placement per token engine over `cores` (e.g. `sorted(os.sched_getaffinity(0))`);
    each engine gets `engine_threads` cores (at most all of them)."""
    if len(cores) < 2:
        return [GroupPlacement((), ((),) * shards_per_group)] * num_groups
    width = max(1, min(engine_threads, len(cores)))
    next_core = 0
    placements = []
    for _ in range(num_groups):
        shard_cores = []
        for _ in range(shards_per_group):
            shard_cores.append((cores[next_core % len(cores)],))
            next_core += 1
        # The last shard's core first, then the next ones; local attention: cores of its own.
        first = next_core - 1 if shard_cores else next_core
        engine = tuple(cores[(first + i) % len(cores)] for i in range(width))
        if not shard_cores:
            next_core += width
        placements.append(GroupPlacement(engine, tuple(shard_cores)))
    return placements


def pin_this_process(cpus: list[int]) -> None:
    """Run every thread of this process, and every thread it starts later, on `cpus` only.

    NOTE: sched_setaffinity(0) sets the calling thread only; threads that imports already started
    (torch starts one) are set one by one through /proc.
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that just ended
            pass


__all__ = ["GroupPlacement", "pin_this_process", "place_decode_groups"]
