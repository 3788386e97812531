"""Paged KV block accounting: which blocks each request owns. Pure Python (no torch).

The KV memory itself (and its layout) lives in `common/kv_cache.py`; this class only decides who
owns which block, so the scheduler, the attention shards and the simulator can share it.
"""

from __future__ import annotations


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation needs more blocks than are free; nothing is allocated then."""


class BlockManager:
    """Exact accounting of fixed-size KV blocks.

    Invariant: every block is either in the free list or in exactly one request's block table,
    so `num_free_blocks + sum(len(table)) == num_blocks` at all times.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: recently freed blocks are reused first (still warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, req_id: str) -> bool:
        return req_id in self._tables

    def num_tokens(self, req_id: str) -> int:
        return self._num_tokens[req_id]

    def block_table(self, req_id: str) -> list[int]:
        return self._tables[req_id]

    def req_ids(self) -> list[str]:
        return list(self._tables)

    def can_grow(self, req_id: str, num_tokens: int) -> bool:
        """Whether `req_id` (new or existing) could hold `num_tokens` tokens in total."""
        have = len(self._tables.get(req_id, ()))
        return self.blocks_needed(num_tokens) - have <= len(self._free)

    def allocate(self, req_id: str, num_tokens: int) -> list[int]:
        """Give a new request room for `num_tokens` tokens; return its block table."""
        if req_id in self._tables:
            raise ValueError(f"request {req_id} already holds KV blocks")
        self._tables[req_id] = []
        self._num_tokens[req_id] = 0
        try:
            self.grow(req_id, num_tokens)
        except NoFreeBlocksError:
            del self._tables[req_id], self._num_tokens[req_id]
            raise
        return self._tables[req_id]

    def grow(self, req_id: str, num_tokens: int) -> list[int]:
        """Make room for `num_tokens` tokens in total (e.g. one more for a decode step)."""
        table = self._tables[req_id]
        need = self.blocks_needed(num_tokens) - len(table)
        if need > len(self._free):
            raise NoFreeBlocksError(
                f"request {req_id} needs {need} more KV blocks, {len(self._free)} are free"
            )
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        self._num_tokens[req_id] = max(self._num_tokens[req_id], num_tokens)
        return table

    def free(self, req_id: str) -> int:
        """Return all of a request's blocks (finish, abort or preemption); 0 if it held none."""
        table = self._tables.pop(req_id, None)
        self._num_tokens.pop(req_id, None)
        if not table:
            return 0
        self._free.extend(reversed(table))
        return len(table)

    def slot(self, req_id: str, position: int) -> int:
        """Flat slot index (block * block_size + offset) of token `position` of `req_id`."""
        block = self._tables[req_id][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def slots(self, req_id: str, start: int, end: int) -> list[int]:
        """Flat slot indices of tokens [start, end) of `req_id`: where their k/v are written."""
        table, size = self._tables[req_id], self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]
