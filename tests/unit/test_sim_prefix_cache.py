"""The simulator's prefix cache: hits from the trace's block ids, eviction, KV-aware routing."""

from dataclasses import replace

import pytest

from common.kv_events import reusable_blocks
from common.perf_model import PerfModel, PiecewiseLinear
from loadgen.sim.designs import CPU_MESH_PROMPT, CPU_MESH_TOKEN, TINY, ClusterSpec, Design
from loadgen.sim.prefix_cache import SimPrefixCache, chain_keys, leading
from loadgen.sim.simulator import SimOptions, SimRequest, simulate

BLOCK = 16
# 1 ms per prefill token: a prompt's TTFT names the tokens it computed.
PERF = PerfModel(
    PiecewiseLinear((0.0, 1000.0), (0.0, 1.0)), PiecewiseLinear((1.0, 64.0), (0.001, 0.002))
)


def cluster(num_prompt: int = 1, pool_blocks: int = 4096) -> ClusterSpec:
    prompt = replace(CPU_MESH_PROMPT, kv_pool_tokens=pool_blocks * BLOCK)
    return ClusterSpec(Design("test", prompt, CPU_MESH_TOKEN, model=TINY), num_prompt, 1)


def options(weight: float = 0.0) -> SimOptions:
    return SimOptions(prefix_block_len=BLOCK, prefix_weight=weight, perf=PERF)


def request(at: float, ids: tuple[int, ...], tail: int = 5) -> SimRequest:
    return SimRequest(at, len(ids) * BLOCK + tail, 2, ids)


def direct_hits(requests: list[SimRequest]) -> list[int]:
    """An infinite cache on one machine, each prefill long done before the next arrives."""
    seen: set[tuple[int, ...]] = set()
    hits = []
    for req in requests:
        ids = req.hash_ids[: req.prompt_len // BLOCK]
        usable = reusable_blocks(req.prompt_len, BLOCK)
        n = 0
        while n < usable and ids[: n + 1] in seen:
            n += 1
        hits.append(n * BLOCK)
        seen.update(ids[: i + 1] for i in range(len(ids)))
    return hits


def test_hit_rate_of_a_hand_built_trace_equals_the_direct_count():
    trace = [(1, 2, 3), (1, 2, 3, 4, 5), (1, 2, 7), (9,), (1, 2, 3, 4, 5, 6), (2, 3), (9, 8)]
    requests = [request(5.0 * i, ids) for i, ids in enumerate(trace)]
    requests.append(SimRequest(50.0, 3 * BLOCK, 2, (1, 2, 3)))  # block-aligned: last block again
    result = simulate(cluster(), requests, options())
    hits = direct_hits(requests)
    assert [r.prefix_hit_tokens for r in result.records] == hits
    assert hits[-1] == 2 * BLOCK and sum(hits) > 0
    total = sum(r.prompt_len for r in requests)
    assert result.num_prefix_hit_tokens == sum(hits)
    assert result.num_prefill_tokens == total - sum(hits)
    assert result.prefix_hit_rate == pytest.approx(sum(hits) / total)
    for record, hit in zip(result.records, hits, strict=True):  # the suffix's prefill only
        assert record.ttft_s == pytest.approx(PERF.prefill_s(record.prompt_len - hit))


def test_a_prefix_is_found_only_once_its_prefill_has_run():
    same = (1, 2, 3, 4)
    # Two queued behind another prompt run in one batch (neither computed when it is planned);
    # one arriving during that batch's prefill is planned after it and finds the prefix.
    requests = [SimRequest(0.0, 500, 2), request(0.1, same), request(0.1, same),
                request(0.55, same), request(5.0, same)]  # fmt: skip
    records = simulate(cluster(), requests, options()).records
    assert records[1].first_token_s == records[2].first_token_s < records[3].first_token_s
    assert [r.prefix_hit_tokens for r in records] == [0, 0, 0, 4 * BLOCK, 4 * BLOCK]


def test_a_turn_arriving_during_its_prefix_prefill_misses_on_the_other_machine():
    # Plain JSQ sends it to the idle machine; KV-aware routing does too (the busy one's pending
    # prompt outweighs the credit), and there it finds nothing.
    requests = [request(0.0, (1, 2, 3, 4)), request(0.01, (1, 2, 3, 4, 5))]
    for weight in (0.0, 1.0):
        records = simulate(cluster(num_prompt=2), requests, options(weight)).records
        assert [r.prompt_machine for r in records] == [0, 1]
        assert records[1].prefix_hit_tokens == 0


def test_eviction_under_a_tiny_capacity_takes_the_least_recently_freed_tail_first():
    a, b = (1, 2, 3, 4), (5, 6, 7, 8)
    requests = [request(0.0, a), request(1.0, b), request(2.0, a)]
    roomy = simulate(cluster(pool_blocks=64), requests, options()).records
    assert roomy[2].prefix_hit_tokens == 4 * BLOCK
    # 8 blocks: b's prefill (5 blocks with its tail and first token) leaves room for 3 of a's 4
    # evictable blocks; a's tail goes first, so a's third turn still finds its head.
    tiny = simulate(cluster(pool_blocks=8), requests, options()).records
    assert tiny[2].prefix_hit_tokens == 3 * BLOCK


def test_cache_evicts_least_recently_freed_and_never_an_owned_block():
    cache = SimPrefixCache(capacity_blocks=4)
    first, second = chain_keys((1, 2), 2), chain_keys((3, 4), 2)
    for req_id, keys in ((0, first), (1, second)):
        cache.register(req_id, keys)
    cache.release(0)
    cache.shrink(0)  # only the free ones go: request 1 still holds its blocks
    assert leading(first, cache) == 0 and leading(second, cache) == 2
    cache.release(1)
    cache.register(2, first)
    cache.release(2)  # evictable, oldest first: second's tail, second's head, first's tail, ...
    cache.shrink(3)
    assert leading(second, cache) == 1 and leading(first, cache) == 2
    cache.shrink(1)
    assert leading(second, cache) == 0 and leading(first, cache) == 1


def test_kv_aware_routing_sends_a_shared_prefix_to_its_holder():
    shared = (1, 2, 3, 4, 5, 6)
    requests = [
        SimRequest(0.0, 1500, 2, (90, 91)),  # machine 0 busy for 1.5 s ...
        request(0.01, shared),  # ... so this one's prefix is cached on machine 1
        request(10.0, (*shared, 7)),  # both idle again: plain JSQ picks machine 0
    ]
    plain = simulate(cluster(num_prompt=2), requests, options(0.0)).records
    aware = simulate(cluster(num_prompt=2), requests, options(1.0)).records
    assert [r.prompt_machine for r in plain] == [0, 1, 0]
    assert plain[2].prefix_hit_tokens == 0
    assert [r.prompt_machine for r in aware] == [0, 1, 1]
    assert aware[2].prefix_hit_tokens == len(shared) * BLOCK
