"""Block accounting never leaks, whatever the order of operations (property-based)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.block_manager import BlockManager, NoFreeBlocksError

NUM_BLOCKS, BLOCK_SIZE = 32, 4

operations = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "append", "grow", "preempt", "free"]),
        st.integers(0, 7),  # which request
        st.integers(1, 40),  # how many tokens
    ),
    max_size=200,
)


def _check_invariants(bm: BlockManager) -> None:
    owned = [b for r in bm.req_ids() for b in bm.block_table(r)]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert bm.num_free_blocks + len(owned) == NUM_BLOCKS
    for r in bm.req_ids():
        assert len(bm.block_table(r)) == bm.blocks_needed(bm.num_tokens(r))


@settings(max_examples=300, deadline=None)
@given(operations)
def test_random_operations_never_leak(ops):
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    for op, req, n in ops:
        req_id = f"r{req}"
        try:
            if op == "allocate" and not bm.has(req_id):
                bm.allocate(req_id, n)
            elif op == "append" and bm.has(req_id):
                bm.grow(req_id, bm.num_tokens(req_id) + 1)
            elif op == "grow" and bm.has(req_id):
                bm.grow(req_id, bm.num_tokens(req_id) + n)
            elif op in ("preempt", "free"):
                bm.free(req_id)
        except NoFreeBlocksError:
            pass
        _check_invariants(bm)
    for req_id in bm.req_ids():
        bm.free(req_id)
    assert bm.num_free_blocks == NUM_BLOCKS


def test_failed_allocation_takes_nothing():
    bm = BlockManager(4, 16)
    bm.allocate("a", 40)  # 3 blocks
    with pytest.raises(NoFreeBlocksError, match="needs 2 more KV blocks, 1 are free"):
        bm.allocate("b", 20)
    assert bm.num_free_blocks == 1 and not bm.has("b")


def test_slots_follow_the_block_table():
    bm = BlockManager(8, 4)
    table = bm.allocate("a", 6)
    assert bm.slot("a", 0) == table[0] * 4
    assert bm.slot("a", 5) == table[1] * 4 + 1
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate("a", 1)
