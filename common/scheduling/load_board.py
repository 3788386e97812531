"""`LoadBoard`: every machine's latest load, filed by pool, so that JSQ finds a pool's least-loaded
machine in O(log n) instead of scanning the pool.

The live router routes among a handful of engines and passes a plain dict of loads. The
simulator's clusters hold a thousand machines and route thousands of requests a second, while
only the few machines an event touched change between two routings: it keeps a board, updates
the machines that changed, and passes the board as the policy's `loads` (a board is a
`Mapping[int, MachineLoad]`). `JSQPoolPolicy` (common/scheduling/cluster.py) asks the board for
a pool's least-loaded machine and makes the same decision either way: the least figure, then the
lowest id, exactly as `shortest` picks.

Each (pool, figure) that JSQ has asked for is a heap of (figure, machine id) entries (packed in
one int, `figure << id bits | id`: the pair's order in one comparison; figures are token counts,
ids from 0), kept lazily: a report pushes an entry for each figure that changed, and an entry
that no longer matches its machine (another figure now, or another pool) is dropped when it
reaches the top.
A heap is rebuilt from its pool's members once it holds eight entries per member, so memory
stays proportional to machines; or dropped then, if JSQ has not asked for it meanwhile (its next
query builds it again): what JSQ asks for only under overload costs nothing in between. Pure.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from heapq import heappush
from typing import TYPE_CHECKING

from common.roles import Role

if TYPE_CHECKING:
    from common.scheduling.cluster import PoolTable

# The figures JSQ ranks machines by: pending prompt tokens, decode tokens, and their sum.
PROMPT_FIGURE, DECODE_FIGURE, TOTAL_FIGURE = 0, 1, 2

Entry = int  # (figure, machine id), packed: figure << id bits | machine id


@dataclass(frozen=True)
class MachineLoad:
    """One machine's latest load report.

    `pending_prompt_tokens`: prompt tokens queued or being prefilled. `decode_tokens`: KV tokens of
    the requests it is decoding or holding for decode (its "running decode tokens").
    `free_kv_tokens`: KV capacity left; `total_kv_tokens`: all it has.
    """

    machine_id: int
    pending_prompt_tokens: int = 0
    decode_tokens: int = 0
    free_kv_tokens: int = 1 << 62
    total_kv_tokens: int = 1 << 62


class LoadBoard(Mapping[int, MachineLoad]):
    """Loads by machine id, and each pool's least-loaded machine by a figure (see the module).

    Bound to the policy's `PoolTable`, whose moves it hears of (`PoolTable.on_move`). Every
    machine of the table must be reported before the first query; a report or query of a
    machine the table does not hold raises KeyError (a board never guesses a load)."""

    def __init__(self, pools: PoolTable) -> None:
        self._pools = pools
        if min(pools.current) < 0:
            raise ValueError("load board: machine ids must be >= 0")
        self._id_bits = max(1, max(pools.current).bit_length())
        self._id_mask = (1 << self._id_bits) - 1
        # machine id -> (pending prompt, decode, total, free KV) tokens, as last reported
        self._reports: dict[int, tuple[int, int, int, int]] = {}
        self._loads: dict[int, MachineLoad] = {}  # built from reports when asked for
        self._heaps: dict[tuple[Role, int], list[Entry]] = {}
        self._pool_heaps: dict[Role, list[tuple[int, list[Entry]]]] = {pool: [] for pool in Role}
        self._bounds = {pool: 8 * pools.size(pool) + 64 for pool in Role}
        self._asked: set[tuple[Role, int]] = set()  # heaps queried since built
        pools.on_move = self._refile

    # -- Mapping --------------------------------------------------------------------------------

    def __getitem__(self, machine_id: int) -> MachineLoad:
        load = self._loads.get(machine_id)
        if load is None:
            pending, decode, _, free = self._reports[machine_id]
            load = self._loads[machine_id] = MachineLoad(machine_id, pending, decode, free)
        return load

    def __iter__(self) -> Iterator[int]:
        return iter(self._reports)

    def __len__(self) -> int:
        return len(self._reports)

    def figures(self, machine_id: int) -> tuple[int, int, int, int]:
        """(pending prompt, decode, total, free KV) tokens as last reported: the `MachineLoad`'s
        figures without building one (JSQ's fullness test, at every routing)."""
        return self._reports[machine_id]

    # -- updates --------------------------------------------------------------------------------

    def report(
        self, machine_id: int, pending_prompt_tokens: int, decode_tokens: int, free_kv_tokens: int
    ) -> None:
        """A machine's latest load (of a machine in the pool table)."""
        report = (pending_prompt_tokens, decode_tokens, pending_prompt_tokens + decode_tokens,
                  free_kv_tokens)  # fmt: skip
        reports = self._reports
        before = reports.get(machine_id)
        if before == report:
            return
        reports[machine_id] = report
        if self._loads:
            self._loads.pop(machine_id, None)
        if before is None:
            self._refile(machine_id)
            return
        pool = self._pools.current[machine_id]
        for figure, heap in self._pool_heaps[pool]:
            value = report[figure]
            if before[figure] != value:
                heappush(heap, value << self._id_bits | machine_id)
                if len(heap) > self._bounds[pool]:
                    self._renew(pool, figure)

    def _refile(self, machine_id: int) -> None:
        """The machine moved (or is new): entries in its pool's heaps (old ones go stale)."""
        for pool in Role:  # pools' sizes changed: entries each heap may hold before a rebuild
            self._bounds[pool] = 8 * self._pools.size(pool) + 64
        report = self._reports.get(machine_id)
        if report is None:
            return  # not reported yet
        pool = self._pools.current[machine_id]
        for figure, heap in self._pool_heaps[pool]:
            heappush(heap, report[figure] << self._id_bits | machine_id)
            if len(heap) > self._bounds[pool]:
                self._renew(pool, figure)

    def _renew(self, pool: Role, figure: int) -> None:
        """A heap full of stale entries: rebuilt if JSQ asked for it since it was built, else
        dropped (JSQ asks for some only under overload; building one again when asked costs
        what a scan of the pool would)."""
        if (pool, figure) in self._asked:
            self._rebuild(pool, figure)
        else:
            del self._heaps[pool, figure]
            self._pool_heaps[pool] = [(f, h) for f, h in self._pool_heaps[pool] if f != figure]

    def _rebuild(self, pool: Role, figure: int) -> list[Entry]:
        """The heap of live entries only."""
        reports = self._reports
        bits = self._id_bits
        heap = [reports[m][figure] << bits | m for m in self._pools.member_set(pool)]
        heapq.heapify(heap)
        self._heaps[pool, figure] = heap
        others = [(f, h) for f, h in self._pool_heaps[pool] if f != figure]
        self._pool_heaps[pool] = others + [(figure, heap)]
        self._asked.discard((pool, figure))
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
        key = (pool, figure)
        heap = self._heaps.get(key)
        if heap is None:
            heap = self._rebuild(pool, figure)
        self._asked.add(key)
        reports, current = self._reports, self._pools.current
        bits, mask = self._id_bits, self._id_mask
        # An entry is live while its machine is in the pool with that figure; a machine may have
        # two live entries (a figure that came back), which name the same machine anyway.
        while heap:
            entry = heap[0]
            value, best_id = entry >> bits, entry & mask
            if current[best_id] is pool and reports[best_id][figure] == value:
                break
            heapq.heappop(heap)
        else:
            return None
        if not credit or weight == 0:
            return best_id
        # Only credited machines can undercut the uncredited least (credits only lower a key).
        best = (value - weight * credit.get(best_id, 0), best_id)
        for machine_id, cached in credit.items():
            if current.get(machine_id) is pool:
                best = min(best, (reports[machine_id][figure] - weight * cached, machine_id))
        return best[1]
