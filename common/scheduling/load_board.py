"""`LoadBoard`: every machine's latest load, filed by pool, so that JSQ finds a pool's least-loaded
machine in O(log n) instead of scanning the pool.

The live router routes among a handful of engines and passes a plain dict of loads. The
simulator's clusters hold a thousand machines and route thousands of requests a second, while
only the few machines an event touched change between two routings: it keeps a board, updates
the machines that changed, and passes the board as the policy's `loads` (a board is a
`Mapping[int, MachineLoad]`). `JSQPoolPolicy` (common/scheduling/cluster.py) asks the board for
a pool's least-loaded machine and makes the same decision either way: the least figure, then the
lowest id, exactly as `shortest` picks.

Each (pool, figure) that JSQ has asked for is a heap of (figure, machine id, stamp) entries,
kept lazily: an update pushes a fresh entry, and an entry whose stamp is not its machine's
latest is dropped when it reaches the top. A heap is rebuilt from its pool's members once stale
entries outnumber live ones, so memory stays proportional to machines. Pure.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from common.roles import Role

if TYPE_CHECKING:
    from common.scheduling.cluster import MachineLoad, PoolTable

# The figures JSQ ranks machines by: pending prompt tokens, decode tokens, and their sum.
PROMPT_FIGURE, DECODE_FIGURE, TOTAL_FIGURE = 0, 1, 2

Entry = tuple[int, int, int]  # (figure, machine id, stamp)


class LoadBoard(Mapping[int, "MachineLoad"]):
    """Loads by machine id, and each pool's least-loaded machine by a figure (see the module).

    Bound to the policy's `PoolTable`, whose moves it hears of (`PoolTable.on_move`)."""

    def __init__(self, pools: PoolTable) -> None:
        self._pools = pools
        self._loads: dict[int, MachineLoad] = {}
        self._figures: dict[int, tuple[int, int, int]] = {}
        self._stamps: dict[int, int] = {}
        self._next_stamp = 0
        self._heaps: dict[tuple[Role, int], list[Entry]] = {}
        pools.on_move = self._refile

    # -- Mapping --------------------------------------------------------------------------------

    def __getitem__(self, machine_id: int) -> MachineLoad:
        return self._loads[machine_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._loads)

    def __len__(self) -> int:
        return len(self._loads)

    # -- updates --------------------------------------------------------------------------------

    def update(self, load: MachineLoad) -> None:
        """A machine's latest load (a machine of the pool table; its first report files it)."""
        machine_id = load.machine_id
        self._loads[machine_id] = load
        figures = (load.pending_prompt_tokens, load.decode_tokens,
                   load.pending_prompt_tokens + load.decode_tokens)  # fmt: skip
        if self._figures.get(machine_id) != figures:
            self._figures[machine_id] = figures
            self._refile(machine_id)

    def _refile(self, machine_id: int) -> None:
        """New entries for the machine in its current pool's heaps; older ones go stale."""
        figures = self._figures.get(machine_id)
        if figures is None:
            return  # not reported yet
        self._next_stamp += 1
        stamp = self._stamps[machine_id] = self._next_stamp
        pool = self._pools.current[machine_id]
        for figure in (PROMPT_FIGURE, DECODE_FIGURE, TOTAL_FIGURE):
            heap = self._heaps.get((pool, figure))
            if heap is not None:
                heapq.heappush(heap, (figures[figure], machine_id, stamp))
                if len(heap) > 4 * self._pools.size(pool) + 64:
                    self._rebuild(pool, figure)

    def _rebuild(self, pool: Role, figure: int) -> list[Entry]:
        stamps, figures = self._stamps, self._figures
        heap = [(figures[m][figure], m, stamps[m]) for m in self._pools.members(pool)
                if m in figures]  # fmt: skip
        heapq.heapify(heap)
        self._heaps[pool, figure] = heap
        return heap

    # -- queries --------------------------------------------------------------------------------

    def least(
        self,
        pool: Role,
        figure: int,
        credit: Mapping[int, int] | None = None,
        weight: float = 0.0,
    ) -> int | None:
        """The pool's member with the least `figure` (less `weight` x its `credit`, the prefix
        it caches: KV-aware JSQ), lowest id on ties; None for an empty pool."""
        heap = self._heaps.get((pool, figure))
        if heap is None:
            heap = self._rebuild(pool, figure)
        stamps = self._stamps
        while heap and heap[0][2] != stamps[heap[0][1]]:
            heapq.heappop(heap)
        if not heap:
            return None
        best_id = heap[0][1]
        if not credit or weight == 0:
            return best_id
        # Only credited machines can undercut the uncredited least (credits only lower a key).
        figures, current = self._figures, self._pools.current
        best = (figures[best_id][figure] - weight * credit.get(best_id, 0), best_id)
        for machine_id, cached in credit.items():
            if current.get(machine_id) is pool and machine_id in figures:
                best = min(best, (figures[machine_id][figure] - weight * cached, machine_id))
        return best[1]
