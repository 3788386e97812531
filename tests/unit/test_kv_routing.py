"""KV-aware routing on fabricated state: the engines' cache digests (`common/kv_events.py`), JSQ
with prefix credit (`common/scheduling/cluster.py`) and the `ClusterScheduler` that joins them.

References outside the code under test: plain JSQ's decisions (weight 0 must equal them), a
`BlockManager` whose cache the digests must replicate exactly, and arithmetic on the scores.
"""

from __future__ import annotations

import random

import pytest

from common.block_hash import block_hashes, namespace_seed
from common.block_manager import BlockManager
from common.kv_events import SNAPSHOT_INTERVAL_S, CachedBlocks, CacheDigest, CacheDigests
from common.protocol import LoadReport
from common.roles import Role
from common.scheduling.cluster import JSQPoolPolicy, MachineLoad, RouteRequest
from services.router.cluster_scheduler import ClusterScheduler
from tests.unit.test_cluster_scheduler import engine

P, T = Role.PROMPT, Role.TOKEN
HOMES = {0: P, 1: P, 2: T}
BLOCK = 16


def state(p0: int, p1: int) -> dict[int, MachineLoad]:
    return {0: MachineLoad(0, p0), 1: MachineLoad(1, p1), 2: MachineLoad(2)}


def prompt_pick(weight: float, p0: int, p1: int, cached: dict[int, int]) -> int:
    policy = JSQPoolPolicy(HOMES, prefix_weight=weight)
    return policy.route(RouteRequest(1, 1000, cached), state(p0, p1), 0.0).prompt_machine_id


# -- the policy --------------------------------------------------------------------------------


def test_prefix_credit_outweighs_a_longer_queue_by_exactly_the_credit():
    # Machine 1 caches 512 tokens: 600 - 512 = 88 < 100 wins; with 700 pending, 188 > 100 loses.
    assert prompt_pick(1.0, 100, 600, {1: 512}) == 1
    assert prompt_pick(1.0, 100, 700, {1: 512}) == 0
    assert prompt_pick(0.5, 100, 300, {1: 512}) == 1  # 300 - 256 = 44
    assert prompt_pick(0.5, 100, 400, {1: 512}) == 0  # 400 - 256 = 144


def test_weight_zero_is_plain_jsq():
    rng = random.Random(3)
    for _ in range(200):
        p0, p1 = rng.randrange(0, 2000), rng.randrange(0, 2000)
        cached = {rng.choice([0, 1]): rng.randrange(0, 1000)}
        plain = JSQPoolPolicy(HOMES).route(RouteRequest(1, 1000), state(p0, p1), 0.0)
        assert prompt_pick(0.0, p0, p1, cached) == plain.prompt_machine_id


def test_equal_scores_go_to_the_lowest_id():
    assert prompt_pick(1.0, 300, 300, {}) == 0
    assert prompt_pick(1.0, 400, 300, {0: 100}) == 0  # 300 == 300
    assert prompt_pick(1.0, 300, 400, {1: 100}) == 0


def test_the_token_machine_gets_no_credit():
    policy = JSQPoolPolicy({0: P, 1: T, 2: T}, prefix_weight=1.0)
    loads = {0: MachineLoad(0), 1: MachineLoad(1, decode_tokens=50), 2: MachineLoad(2)}
    decision = policy.route(RouteRequest(1, 100, {1: 10_000}), loads, 0.0)
    assert decision.token_machine_id == 2


# -- the digests ---------------------------------------------------------------------------------


def test_digests_replicate_a_block_manager_cache_through_churn():
    blocks = BlockManager(24, BLOCK, enable_prefix_caching=True)
    digests, replica = CacheDigests(max_events=8, snapshot_interval_s=0.25), CachedBlocks()
    rng = random.Random(0)
    for step in range(60):
        req = f"r{step}"
        tokens = [rng.randrange(4) for _ in range(rng.randrange(17, 80))]  # 4 symbols: overlaps
        if blocks.can_allocate(len(tokens), tokens):
            blocks.allocate(req, len(tokens), tokens)
            blocks.mark_computed(req, len(tokens))
            blocks.free(req)
        digest = digests.next(blocks.cached_hashes(), step * 0.05)  # a snapshot every 5th
        replica.apply(digest)
        assert replica.hashes == set(blocks.cached_hashes()), step
    assert replica.synced


def test_a_lost_digest_drops_credit_until_the_next_snapshot():
    digests, replica = CacheDigests(snapshot_interval_s=3.0), CachedBlocks()
    replica.apply(digests.next([1, 2], 0.0))  # seq 1: snapshot
    assert replica.prefix_blocks([1, 2, 3]) == 2
    digests.next([1, 2, 3], 1.0)  # seq 2: lost on the way
    replica.apply(digests.next([2, 3], 2.0))  # seq 3: a diff that cannot apply
    assert not replica.synced and replica.prefix_blocks([2, 3]) == 0
    replica.expect([2, 3])  # no guesses while out of sync
    assert replica.prefix_blocks([2, 3]) == 0
    replica.apply(digests.next([2, 3, 4], 3.0))  # seq 4: the periodic snapshot
    assert replica.synced and replica.hashes == {2, 3, 4}


@pytest.mark.parametrize("report_s", [0.05, 1.0], ids=["busy", "idle"])
def test_a_router_that_joins_late_resyncs_within_the_interval(report_s: float) -> None:
    """An engine reports every 50 ms while it works and once a second idle: either way a router
    that missed the first snapshot holds the engine's set within `SNAPSHOT_INTERVAL_S`."""
    digests, now = CacheDigests(), 0.0
    digests.next([1], now)  # the first report, before the router subscribed
    replica = CachedBlocks()
    while not replica.synced:
        now += report_s
        replica.apply(digests.next([1, 2], now))
    assert now < SNAPSHOT_INTERVAL_S + report_s and replica.hashes == {1, 2}


@pytest.mark.parametrize("options", [{"max_events": 0}, {"snapshot_interval_s": 0.0},
                                     {"snapshot_interval_s": -1.0}])  # fmt: skip
def test_digests_refuse_bounds_that_would_never_or_always_snapshot(options: dict) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        CacheDigests(**options)


def test_an_older_digest_never_undoes_a_newer_one():
    replica = CachedBlocks()
    replica.apply(CacheDigest(5, True, [1, 2], []))
    replica.apply(CacheDigest(4, False, [], [1, 2]))  # reordered: ignored
    replica.apply(CacheDigest(5, False, [], [1]))  # a duplicate: ignored
    assert replica.hashes == {1, 2}


def test_a_big_diff_goes_out_as_a_snapshot():
    digests = CacheDigests(max_events=4, snapshot_interval_s=100.0)
    assert digests.next([], 0.0).snapshot  # the first report is always one
    assert not digests.next([1, 2], 1.0).snapshot
    big = digests.next(range(10, 20), 2.0)
    assert big.snapshot and big.added == list(range(10, 20)) and big.removed == []


# -- the router's scheduler ---------------------------------------------------------------------


def kv_report(engine_id: str, seq: int, hashes: list[int], pending: int = 0) -> LoadReport:
    return LoadReport(engine_id, None, pending, 0, 0, 0, 1000, kv_seq=seq, kv_snapshot=True,
                      kv_added=hashes)  # fmt: skip


def test_the_scheduler_routes_to_the_engine_holding_the_prefix_and_forgets_a_gone_one():
    entries = [engine("p0", "prompt"), engine("p1", "prompt"), engine("t0", "token")]
    sched = ClusterScheduler(BLOCK, prefix_weight=1.0, cache_namespace="tiny")
    sched.set_engines(entries)
    prompt = list(range(100))  # 6 full blocks, all reusable
    hashes = block_hashes(prompt, BLOCK, namespace_seed("tiny"))
    sched.on_load(kv_report("p0", 1, [], pending=10))
    sched.on_load(kv_report("p1", 1, hashes[:4], pending=70))  # 70 - 64 = 6 < 10
    assert sched.choose(len(prompt), prompt)[0].service_id == "p1"
    # Placed there: its suffix counts as pending (70 + 36) and its blocks as expected.
    assert sched.loads()["p1"].pending_prompt_tokens == 106
    assert sched.cached_blocks()["p1"] == 6
    assert sched.choose(len(prompt))[0].service_id == "p0"  # no ids: plain JSQ
    sched.set_engines([entries[0], entries[2]])  # p1 died: its hashes go with it
    sched.set_engines(entries)  # a same-named entry again: it starts empty
    assert sched.cached_blocks()["p1"] == 0
