"""KV cache events: which block hashes an engine holds, published compactly and replicated by the
router for KV-aware routing (docs/prefix_caching.md). Pure (no sockets).

An engine's `CacheDigests` turns its cached-hash set into one `CacheDigest` per load report: the
hashes stored and evicted since the last report (as Dynamo's KV events), or the whole set (a
snapshot) on its first report, once `snapshot_interval_s` has passed since the last one, and
whenever the diff would pass `max_events`. The router's `CachedBlocks` replays them. Load reports
travel PUB/SUB, which drops messages under load, so every digest carries a sequence number: a
diff applies only right after the one before it; after a gap the replica forgets everything (no
credit, plain JSQ for that engine) until the next snapshot. A lost report therefore costs a cache
miss, never a wrong token: routing is advisory and the engine's own `BlockManager` decides what it
reuses.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from common.block_hash import BlockHash

MAX_EVENTS = 512  # a diff larger than this goes out as a snapshot instead
# A router that joined late or lost a digest resyncs within this, however often the engine reports
# (every 50 ms while it works, once a second idle: a count of reports would stretch with the rate).
SNAPSHOT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class CacheDigest:
    """One report's news of an engine's cached blocks. `snapshot`: `added` is the whole set."""

    seq: int
    snapshot: bool
    added: list[BlockHash]
    removed: list[BlockHash]


class CacheDigests:
    """The engine's side: diffs its cached-hash set between reports.

    NOTE: diffing costs O(cached blocks) per report (a few thousand set operations at 20 Hz for
    this mesh's caches); hooks in `BlockManager` would cost O(changes) but couple it to reporting.
    """

    def __init__(
        self, max_events: int = MAX_EVENTS, snapshot_interval_s: float = SNAPSHOT_INTERVAL_S
    ) -> None:
        if max_events <= 0 or snapshot_interval_s <= 0:
            raise ValueError("cache digests: max_events and snapshot_interval_s must be positive")
        self.max_events = max_events
        self.snapshot_interval_s = snapshot_interval_s
        self._seq = 0
        self._published: set[BlockHash] = set()
        self._last_snapshot_s: float | None = None

    def next(self, cached: Collection[BlockHash], now_s: float) -> CacheDigest:
        """The digest for the report going out at `now_s` (a monotonic clock), given the hashes
        cached now."""
        held = set(cached)
        added = held - self._published
        removed = self._published - held
        snapshot = (
            self._last_snapshot_s is None
            or now_s - self._last_snapshot_s >= self.snapshot_interval_s
            or len(added) + len(removed) > self.max_events
        )
        self._seq += 1
        self._published = held
        if snapshot:
            self._last_snapshot_s = now_s
            return CacheDigest(self._seq, True, sorted(held), [])
        return CacheDigest(self._seq, False, sorted(added), sorted(removed))


class CachedBlocks:
    """The router's replica of one engine's cached hashes, rebuilt from its digests."""

    def __init__(self) -> None:
        self.hashes: set[BlockHash] = set()
        self.seq = 0  # the last digest applied; 0: none yet
        self.synced = False  # False until a snapshot, and again after a lost digest

    def apply(self, digest: CacheDigest) -> None:
        if digest.seq <= self.seq:
            return  # a duplicate or an older digest overtaken by a newer one
        if digest.snapshot:
            self.hashes = set(digest.added)
            self.synced = True
        elif self.synced and digest.seq == self.seq + 1:
            self.hashes.difference_update(digest.removed)
            self.hashes.update(digest.added)
        else:
            # A digest was lost: what it said is unknown, so trust nothing until a snapshot.
            self.hashes.clear()
            self.synced = False
        self.seq = digest.seq

    def expect(self, hashes: Sequence[BlockHash]) -> None:
        """A request just routed here will compute these blocks: count them before its report
        does, so a burst sharing a prefix follows the first one (the next snapshot corrects a
        guess that did not come true)."""
        if self.synced:
            self.hashes.update(hashes)

    def prefix_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a prompt's hash chain this engine holds."""
        count = 0
        for h in hashes:
            if h not in self.hashes:
                break
            count += 1
        return count


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt an engine may reuse: its lookup leaves the last token to compute
    (`BlockManager._lookup`), so the router credits no more than that."""
    return max(num_tokens - 1, 0) // block_size
