"""A simulated machine's prefix cache: the trace's prefix blocks, kept as an engine keeps them.

Mooncake traces name each 512-token prompt block by a `hash_ids` entry, equal ids meaning the same
content; at a token scale one trace block is `block_len` tokens (loadgen/prompts.py builds the
served prompts the same way). `chain_keys` chains the ids, as `common/block_hash.py` chains token
blocks, so an equal key means an equal whole prefix.

`SimPrefixCache` follows `common/block_manager.py`'s rules with counts instead of blocks: a
request pins the leading cached blocks it finds when its prefill is planned (`acquire`), its own
blocks become cached only once that prefill has run (`register`, the engine's `mark_computed`),
and a block nobody holds is evictable, least recently freed first and tail before head
(`release`). Evictable blocks live in the machine's free KV only (`shrink`).

The router's view (`routing_blocks`) adds the blocks of requests routed here and not yet computed,
as `common.kv_events.CachedBlocks.expect` does between load reports.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

BlockKey = int


def chain_keys(hash_ids: Sequence[int], num_blocks: int) -> tuple[BlockKey, ...]:
    """Keys of a prompt's first `num_blocks` full blocks: each names its id and all before it."""
    keys: list[BlockKey] = []
    parent = 0
    for hash_id in hash_ids[:num_blocks]:
        # NOTE: Python hashes tuples of ints without a per-process seed: equal in every run.
        parent = hash((parent, hash_id))
        keys.append(parent)
    return tuple(keys)


def leading(keys: Sequence[BlockKey], present: object) -> int:
    """How many leading `keys` are in `present` (anything with `in`)."""
    count = 0
    for key in keys:
        if key not in present:  # type: ignore[operator]
            break
        count += 1
    return count


class SimPrefixCache:
    """One machine's cached blocks: owned (reference-counted) or evictable (LRU)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("prefix cache: capacity_blocks must be > 0")
        self.capacity_blocks = capacity_blocks
        self._owners: Counter[BlockKey] = Counter()  # cached blocks requests hold: references
        self._evictable: OrderedDict[BlockKey, None] = OrderedDict()  # first: evicted first
        self._held: dict[int, list[BlockKey]] = {}  # req_id -> cached blocks it references
        self._expected: Counter[BlockKey] = Counter()  # routed here, not computed yet
        self._expected_by: dict[int, tuple[BlockKey, ...]] = {}
        self.num_evictions = 0

    def __contains__(self, key: object) -> bool:
        return key in self._owners or key in self._evictable

    @property
    def num_cached_blocks(self) -> int:
        return len(self._owners) + len(self._evictable)

    def routing_blocks(self, keys: Sequence[BlockKey]) -> int:
        """Leading blocks the router credits its machine with: cached, or expected here."""
        count = 0
        for key in keys:
            if key not in self and key not in self._expected:
                break
            count += 1
        return count

    def expect(self, req_id: int, keys: Sequence[BlockKey]) -> None:
        """`req_id` was routed here and will compute `keys` (the router's guess)."""
        self._expected_by[req_id] = tuple(keys)
        self._expected.update(keys)

    def acquire(self, req_id: int, keys: Sequence[BlockKey]) -> int:
        """A prefill of `req_id` is planned: pin the leading cached `keys`; how many it found.
        `keys` are the blocks its lookup may reuse (the last prompt token is always computed)."""
        num_hit = leading(keys, self)
        held = self._held.setdefault(req_id, [])
        for key in keys[:num_hit]:
            if key in held:
                continue  # NOTE: a recompute still holding its blocks (never in this simulator)
            self._evictable.pop(key, None)
            self._owners[key] += 1
            held.append(key)
        return num_hit

    def register(self, req_id: int, keys: Sequence[BlockKey]) -> None:
        """`req_id`'s prefill ran: its full prompt blocks are computed and now cached. A block
        another request already cached stays private to it (as in the BlockManager)."""
        self._drop_expected(req_id)
        held = self._held.setdefault(req_id, [])
        for key in keys:
            if key not in self:
                self._owners[key] += 1
                held.append(key)

    def release(self, req_id: int) -> None:
        """`req_id` left its machine (finished, shipped, preempted): its blocks lose a reference;
        those nobody holds become evictable, tail first (a prefix's tail goes before its head)."""
        self._drop_expected(req_id)
        for key in reversed(self._held.pop(req_id, [])):
            self._owners[key] -= 1
            if self._owners[key] == 0:
                del self._owners[key]
                self._evictable[key] = None

    def shrink(self, free_blocks: int) -> None:
        """Evict least recently freed blocks until the evictable ones fit in `free_blocks`."""
        room = max(min(free_blocks, self.capacity_blocks - len(self._owners)), 0)
        while len(self._evictable) > room:
            self._evictable.popitem(last=False)
            self.num_evictions += 1

    def _drop_expected(self, req_id: int) -> None:
        for key in self._expected_by.pop(req_id, ()):
            self._expected[key] -= 1
            if self._expected[key] == 0:
                del self._expected[key]
