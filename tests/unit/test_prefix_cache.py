"""Prefix caching in the block accounting: hash chain, sharing, LRU eviction, and a state machine
of allocate / compute / free against a plain model keyed by token prefixes."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.block_hash import block_hashes, namespace_seed
from common.block_manager import BlockManager, NoFreeBlocksError

BS = 4


def _cached(bm: BlockManager, req_id: str, tokens: list[int]) -> list[int]:
    """Allocate, compute the whole request, return its table (the usual prefill life)."""
    table = bm.allocate(req_id, len(tokens), tokens)
    bm.mark_computed(req_id, len(tokens))
    return list(table)


def test_hash_chain_names_a_block_by_everything_before_it():
    seed = namespace_seed("model-a")
    a = block_hashes(list(range(10)), BS, seed)
    assert len(a) == 2  # the partial third block has no hash
    assert block_hashes(list(range(8)), BS, seed) == a
    changed_first = block_hashes([99] + list(range(1, 10)), BS, seed)
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # same tokens, other parent
    assert block_hashes(list(range(10)), BS, namespace_seed("model-b")) != a


def test_shared_prefix_is_one_set_of_blocks_held_by_both():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = _cached(bm, "a", list(range(10)))  # 2 full blocks + 1 partial
    b = bm.allocate("b", 11, list(range(8)) + [50, 51, 52])
    assert b[:2] == a[:2] and b[2] != a[2]  # full blocks shared, the partial never
    assert bm.num_cached_tokens("b") == 8
    bm.free("a")
    bm.audit()
    assert bm.num_free_blocks == 8 - 3  # b's three; a's partial block went back
    bm.free("b")
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    bm.audit()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    _cached(bm, "a", list(range(8)))
    bm.allocate("b", 8, list(range(8)))
    assert bm.num_cached_tokens("b") == 4  # the last block is recomputed: its logits are needed
    bm.allocate("c", 9, list(range(9)))
    assert bm.num_cached_tokens("c") == 8


def test_blocks_count_as_cached_only_once_computed():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    bm.allocate("a", 9, list(range(9)))
    assert bm.allocate("b", 9, list(range(9))) and bm.num_cached_tokens("b") == 0
    bm.mark_computed("a", 9)
    bm.mark_computed("b", 9)  # the same prefix computed twice: b's copies stay private
    bm.free("b")
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 8 - 3
    bm.audit()


def test_reuse_after_abort():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = _cached(bm, "a", list(range(12)))
    bm.free("a")  # aborted: its computed blocks stay cached
    assert bm.allocate("b", 13, list(range(13)))[:3] == a[:3]
    assert bm.num_cached_tokens("b") == 12


def test_eviction_takes_never_cached_blocks_first_then_the_least_recently_freed():
    bm = BlockManager(7, BS, enable_prefix_caching=True)
    prompts = {name: [i * 100 + t for t in range(4)] + [7] for i, name in enumerate("xyz")}
    for name, tokens in prompts.items():
        _cached(bm, name, tokens)
    for name in "xyz":
        bm.free(name)  # x is the least recently freed
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 7
    bm.allocate("big", 20)  # 5 blocks: 4 never-cached ones, then x's
    assert bm.num_cached_blocks == 2
    bm.free("big")
    for name, hit in (("x", 0), ("y", 4), ("z", 4)):
        bm.allocate(f"again-{name}", 5, prompts[name])
        assert bm.num_cached_tokens(f"again-{name}") == hit
    bm.audit()


def test_a_block_reused_by_another_request_is_no_longer_matched():
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    a = _cached(bm, "a", list(range(9)))
    bm.free("a")
    taken = bm.allocate("other", 12, [500 + t for t in range(12)])  # needs every block
    assert sorted(taken) == sorted(a)
    bm.free("other")
    bm.allocate("b", 9, list(range(9)))
    assert bm.num_cached_tokens("b") == 0


def test_allocation_that_does_not_fit_takes_nothing_not_even_its_hits():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    _cached(bm, "a", list(range(9)))  # 3 blocks, 2 cached
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", 17, list(range(17)))  # 2 hits + 3 new > 1 free
    assert not bm.has("b") and bm.num_free_blocks == 1
    assert not bm.can_allocate(17, list(range(17))) and bm.can_allocate(12, list(range(12)))
    bm.audit()


def test_off_by_default_and_without_token_ids():
    bm = BlockManager(8, BS)
    _cached(bm, "a", list(range(9)))
    bm.free("a")
    bm.allocate("b", 9, list(range(9)))
    assert bm.num_cached_tokens("b") == 0 and bm.num_cached_blocks == 0


# -- state machine against a plain model --------------------------------------------------------

NUM_BLOCKS = 10
BASES = [[b * 1000 + t for t in range(24)] for b in range(3)]


def _prompt(base: int, n: int, fork: int | None) -> list[int]:
    """A prefix of one of three base prompts, optionally diverging after `fork` tokens."""
    return BASES[base][:n] if fork is None else BASES[base][:fork] + [9] * (n - fork)


prompts = st.builds(_prompt, st.integers(0, 2), st.integers(1, 24), st.none() | st.integers(0, 23))
prompts = prompts.filter(lambda p: len(p) > 0)


class ModelCache:
    """The same contract keyed by token-prefix tuples: what the block manager must agree with."""

    def __init__(self) -> None:
        self.free = NUM_BLOCKS
        self.refs: dict[tuple[int, ...], int] = {}  # cached prefix -> owners
        self.block_of: dict[tuple[int, ...], int] = {}
        self.evictable: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.keys: dict[str, list[tuple[int, ...] | None]] = {}  # per request, per block

    def hits(self, tokens: list[int]) -> list[tuple[int, ...]]:
        found = []
        for i in range(1, (len(tokens) - 1) // BS + 1):
            if tuple(tokens[: i * BS]) not in self.refs:
                break
            found.append(tuple(tokens[: i * BS]))
        return found


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=True)
        self.model = ModelCache()
        self.tokens: dict[str, list[int]] = {}
        self.computed: set[str] = set()
        self.next_id = 0

    @rule(tokens=prompts)
    def allocate(self, tokens: list[int]) -> None:
        m, req_id = self.model, f"r{self.next_id}"
        self.next_id += 1
        hits = m.hits(tokens)
        need = -(-len(tokens) // BS) - len(hits)
        available = m.free + len(m.evictable) - sum(1 for h in hits if m.refs[h] == 0)
        if need > available:
            with pytest.raises(NoFreeBlocksError):
                self.bm.allocate(req_id, len(tokens), tokens)
            return
        table = self.bm.allocate(req_id, len(tokens), tokens)
        assert self.bm.num_cached_tokens(req_id) == len(hits) * BS
        assert table[: len(hits)] == [m.block_of[h] for h in hits]  # the very same blocks
        for h in hits:
            m.refs[h] += 1
            m.evictable.pop(h, None)
        for _ in range(need):
            if m.free:
                m.free -= 1
            else:
                old, _ = m.evictable.popitem(last=False)
                del m.refs[old], m.block_of[old]
        m.keys[req_id] = [*hits, *[None] * need]
        self.tokens[req_id] = tokens

    @precondition(lambda self: set(self.tokens) - self.computed)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        """A request's prefill ends (once): its full blocks become reusable."""
        m = self.model
        req_id = data.draw(st.sampled_from(sorted(set(self.tokens) - self.computed)))
        self.computed.add(req_id)
        tokens, keys = self.tokens[req_id], m.keys[req_id]
        self.bm.mark_computed(req_id, len(tokens))
        for i in range(len(tokens) // BS):
            key = tuple(tokens[: (i + 1) * BS])
            if keys[i] is None and key not in m.refs:
                keys[i], m.refs[key] = key, 1
                m.block_of[key] = self.bm.block_table(req_id)[i]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        m = self.model
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        del self.tokens[req_id]
        self.computed.discard(req_id)
        self.bm.free(req_id)
        for key in reversed(m.keys.pop(req_id)):
            if key is None:
                m.free += 1
                continue
            m.refs[key] -= 1
            if m.refs[key] == 0:
                m.evictable[key] = None

    @invariant()
    def agrees_with_the_model(self) -> None:
        self.bm.audit()
        assert self.bm.num_free_blocks == self.model.free + len(self.model.evictable)
        assert self.bm.num_cached_blocks == len(self.model.refs)


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
