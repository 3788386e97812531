"""Paged KV block accounting: which blocks each request owns, and which hold a cached prefix.
Pure Python (no torch).

The KV memory itself (and its layout) lives in `common/kv_cache.py`; this class only decides who
owns which block, so the scheduler, the attention shards and the simulator can share it.

With `enable_prefix_caching` (docs/prefix_caching.md), a full block whose K/V is computed is also
named by its hash chain (`common/block_hash.py`); when its last owner frees it, it stays cached
(evictable) until free blocks run out, least recently freed first. A new request given its token ids
starts with its longest cached prefix of full blocks, shared (reference-counted), never written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from common.block_hash import BlockHash, block_hashes, namespace_seed


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation needs more blocks than are free; nothing is allocated then."""


class BlockManager:
    """Exact accounting of fixed-size KV blocks.

    Invariant: every block is either free (never cached), evictable (cached, owned by nobody) or
    owned by the requests counted in its reference count, so
    `len(free) + len(evictable) + len(distinct owned blocks) == num_blocks` (`audit` checks it).
    Without prefix caching, nothing is ever evictable or shared.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        cache_namespace: str = "",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.seed = namespace_seed(cache_namespace)
        # Pop from the end: recently freed blocks are reused first (still warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}
        # The prefix cache: hash <-> block for computed full blocks, and the unowned ones in LRU
        # order (first = evicted first).
        self._cached: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Per request: its full blocks' hashes (from the tokens given at allocation), how many of
        # them are registered in the cache, and how many tokens it found cached.
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}
        self._num_cached_tokens: dict[str, int] = {}
        self.num_queried_tokens = 0  # prompt tokens looked up, for the hit rate
        self.num_hit_tokens = 0  # of which found cached

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never cached, or cached and evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> Collection[BlockHash]:
        """The hashes of every cached block, owned or evictable (what KV-aware routing credits)."""
        return self._cached.keys()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, req_id: str) -> bool:
        return req_id in self._tables

    def num_tokens(self, req_id: str) -> int:
        return self._num_tokens[req_id]

    def num_cached_tokens(self, req_id: str) -> int:
        """Tokens at the start of `req_id`'s table that were cached at allocation (computed)."""
        return self._num_cached_tokens.get(req_id, 0)

    def block_table(self, req_id: str) -> list[int]:
        return self._tables[req_id]

    def req_ids(self) -> list[str]:
        return list(self._tables)

    def can_grow(self, req_id: str, num_tokens: int) -> bool:
        """Whether `req_id` (new or existing) could hold `num_tokens` tokens in total."""
        have = len(self._tables.get(req_id, ()))
        return self.blocks_needed(num_tokens) - have <= self.num_free_blocks

    def can_allocate(self, num_tokens: int, token_ids: Sequence[int] | None = None) -> bool:
        """Whether a new request of these tokens would fit, counting the prefix it would reuse
        (a cached block it reuses is not taken from the free ones; an evictable one stops being
        free)."""
        hits = self._lookup(self._hashes(token_ids, num_tokens), num_tokens)
        return self._fits(num_tokens, hits)

    def _fits(self, num_tokens: int, hits: list[int]) -> bool:
        reused_free = sum(1 for b in hits if self._refs[b] == 0)
        return self.blocks_needed(num_tokens) - len(hits) <= self.num_free_blocks - reused_free

    def allocate(
        self, req_id: str, num_tokens: int, token_ids: Sequence[int] | None = None
    ) -> list[int]:
        """Give a new request room for `num_tokens` tokens; return its block table. With prefix
        caching and `token_ids` (its tokens so far), the table starts with the longest cached
        prefix of its full blocks, leaving at least its last token to compute (its logits are
        needed): `num_cached_tokens(req_id)` says how many tokens that skips."""
        if req_id in self._tables:
            raise ValueError(f"request {req_id} already holds KV blocks")
        hashes = self._hashes(token_ids, num_tokens)
        hits = self._lookup(hashes, num_tokens)
        if not self._fits(num_tokens, hits):
            need = self.blocks_needed(num_tokens) - len(hits)
            raise NoFreeBlocksError(
                f"request {req_id} needs {need} more KV blocks, {self.num_free_blocks} are free"
            )
        for block in hits:
            self._evictable.pop(block, None)
            self._refs[block] += 1
        self._tables[req_id] = hits
        self._num_tokens[req_id] = len(hits) * self.block_size
        if hashes is not None:
            self._req_hashes[req_id] = hashes
            self._num_registered[req_id] = len(hits)
            self._num_cached_tokens[req_id] = len(hits) * self.block_size
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += len(hits) * self.block_size
        return self.grow(req_id, num_tokens)

    def grow(self, req_id: str, num_tokens: int) -> list[int]:
        """Make room for `num_tokens` tokens in total (e.g. one more for a decode step)."""
        table = self._tables[req_id]
        need = self.blocks_needed(num_tokens) - len(table)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {req_id} needs {need} more KV blocks, {self.num_free_blocks} are free"
            )
        for _ in range(max(need, 0)):
            table.append(self._take_block())
        self._num_tokens[req_id] = max(self._num_tokens[req_id], num_tokens)
        return table

    def mark_computed(self, req_id: str, num_computed: int) -> None:
        """`req_id`'s first `num_computed` tokens hold their K/V now: its full blocks among them
        become reusable. A block whose hash another block already holds (two requests computed
        the same prefix at once) stays private and is freed, not cached, at the end."""
        hashes = self._req_hashes.get(req_id)
        if hashes is None:
            return
        table = self._tables[req_id]
        done = min(num_computed // self.block_size, len(hashes), len(table))
        for i in range(self._num_registered[req_id], done):
            if hashes[i] not in self._cached:
                self._cached[hashes[i]] = table[i]
                self._hash_of[table[i]] = hashes[i]
        self._num_registered[req_id] = max(done, self._num_registered[req_id])

    def free(self, req_id: str) -> int:
        """Drop a request's blocks (finish, abort or preemption); 0 if it held none. Its cached
        blocks stay cached until evicted; the tail goes first, being the least likely reused."""
        table = self._tables.pop(req_id, None)
        self._num_tokens.pop(req_id, None)
        self._req_hashes.pop(req_id, None)
        self._num_registered.pop(req_id, None)
        self._num_cached_tokens.pop(req_id, None)
        if not table:
            return 0
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        return len(table)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody owns (e.g. after new weights)."""
        while self._evictable:
            self._free.append(self._evict())

    def slot(self, req_id: str, position: int) -> int:
        """Flat slot index (block * block_size + offset) of token `position` of `req_id`."""
        block = self._tables[req_id][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def slots(self, req_id: str, start: int, end: int) -> list[int]:
        """Flat slot indices of tokens [start, end) of `req_id`: where their k/v are written."""
        table, size = self._tables[req_id], self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def audit(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (tests and debugging)."""
        owners = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                owners[block] += 1
        assert owners == self._refs, "a reference count differs from the tables holding it"
        owned = sum(1 for n in owners if n)
        assert len(self._free) + len(self._evictable) + owned == self.num_blocks, "a block leaked"
        assert not any(owners[b] for b in self._free), "a free block is owned"
        assert all(owners[b] == 0 and b in self._hash_of for b in self._evictable)
        assert not any(b in self._hash_of for b in self._free), "a free block is still cached"
        assert {b: h for h, b in self._cached.items()} == self._hash_of

    def _hashes(self, token_ids: Sequence[int] | None, num_tokens: int) -> list[BlockHash] | None:
        """The hash chain of a new request's full blocks; None without prefix caching."""
        if not self.enable_prefix_caching or token_ids is None:
            return None
        return block_hashes(token_ids[:num_tokens], self.block_size, self.seed)

    def _lookup(self, hashes: list[BlockHash] | None, num_tokens: int) -> list[int]:
        """The blocks of the longest cached prefix of `hashes`, short of the last token."""
        if not hashes or not self._cached:
            return []
        hits: list[int] = []
        for h in hashes[: (num_tokens - 1) // self.block_size]:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _take_block(self) -> int:
        """A block for one owner: a never-cached one if any, else the LRU evictable one."""
        block = self._free.pop() if self._free else self._evict()
        self._refs[block] = 1
        return block

    def _evict(self) -> int:
        """Uncache the least recently freed evictable block and return it."""
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._hash_of.pop(block)]
        return block
