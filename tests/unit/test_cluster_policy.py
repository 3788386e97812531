"""Cluster-level policy rules (Splitwise §IV-A) on fabricated load reports."""

import pytest

from common.roles import Role
from common.scheduling.cluster import (
    JSQPoolPolicy,
    MachineLoad,
    PoolMove,
    PoolThresholds,
    PowerOfTwoPolicy,
    RoundRobinPolicy,
    RouteRequest,
)
from common.scheduling.load_board import LoadBoard

P, T, M = Role.PROMPT, Role.TOKEN, Role.MIXED


def loads(*rows: tuple[int, int, int]) -> dict[int, MachineLoad]:
    """(pending prompt tokens, decode tokens, free kv) per machine id = position."""
    return {i: MachineLoad(i, p, d, f) for i, (p, d, f) in enumerate(rows)}


def split_policy(**thresholds: float) -> JSQPoolPolicy:
    homes = {0: P, 1: P, 2: T, 3: T}
    return JSQPoolPolicy(homes, PoolThresholds(**thresholds))  # type: ignore[arg-type]


def test_jsq_picks_shortest_prompt_and_token_queues_together():
    policy = split_policy(prompt_tokens=10_000)
    state = loads((900, 0, 10**6), (100, 0, 10**6), (0, 5000, 10**6), (0, 3000, 10**6))
    decision = policy.route(RouteRequest(1, 500), state, now=0.0)
    assert (decision.prompt_machine_id, decision.token_machine_id) == (1, 3)
    assert decision.moves == ()


def test_full_prompt_pool_uses_mixed_pool_first():
    policy = split_policy(prompt_tokens=1000)
    policy.pools.apply(PoolMove(3, M), now=0.0)  # token machine 3 already mixed
    state = loads((900, 0, 10**6), (950, 0, 10**6), (0, 10, 10**6), (0, 10, 10**6))
    decision = policy.route(RouteRequest(1, 200), state, now=1.0)
    assert decision.prompt_machine_id == 3
    assert decision.moves == ()


def test_full_prompt_and_mixed_pools_borrow_least_loaded_token_machine():
    policy = split_policy(prompt_tokens=1000)
    state = loads((900, 0, 10**6), (950, 0, 10**6), (0, 800, 10**6), (0, 300, 10**6))
    decision = policy.route(RouteRequest(1, 200), state, now=1.0)
    assert decision.prompt_machine_id == 3
    assert PoolMove(3, M) in decision.moves
    assert policy.pools.current[3] is M and policy.pools.home[3] is T


def test_never_borrows_the_last_machine_of_a_pool():
    policy = JSQPoolPolicy({0: P, 1: T}, PoolThresholds(prompt_tokens=100))
    state = loads((900, 0, 10**6), (0, 0, 10**6))
    decision = policy.route(RouteRequest(1, 200), state, now=0.0)
    assert decision.prompt_machine_id == 0 and decision.moves == ()


def test_token_side_full_on_kv_borrows_a_prompt_machine():
    policy = split_policy(decode_tokens=5000)
    state = loads((0, 0, 10**6), (300, 0, 10**6), (0, 6000, 10**6), (0, 7000, 10**6))
    decision = policy.route(RouteRequest(1, 100), state, now=0.0)
    assert decision.token_machine_id == 0
    assert PoolMove(0, M) in decision.moves


def test_mixed_machine_goes_home_only_when_opposite_work_drained():
    policy = split_policy()
    policy.pools.apply(PoolMove(0, M), now=0.0)  # a prompt machine running tokens
    policy.pools.apply(PoolMove(2, M), now=0.0)  # a token machine running prompts
    busy = loads((500, 40, 10**6), (0, 0, 10**6), (100, 900, 10**6), (0, 0, 10**6))
    assert policy.rebalance(busy, now=1.0) == []
    drained = loads((500, 0, 10**6), (0, 0, 10**6), (0, 900, 10**6), (0, 0, 10**6))
    moves = policy.rebalance(drained, now=2.0)
    assert set(moves) == {PoolMove(0, P), PoolMove(2, T)}
    assert policy.pools.current[0] is P and policy.pools.current[2] is T


def test_machine_mixed_for_long_is_repurposed_to_the_opposite_pool():
    policy = split_policy(repurpose_after_s=60.0)
    policy.pools.apply(PoolMove(0, M), now=0.0)
    still_decoding = loads((0, 500, 10**6), (0, 0, 10**6), (0, 0, 10**6), (0, 0, 10**6))
    assert policy.rebalance(still_decoding, now=30.0) == []
    moves = policy.rebalance(still_decoding, now=61.0)
    assert moves == [PoolMove(0, T, repurposed=True)]
    assert policy.pools.home[0] is T and policy.pools.current[0] is T


def test_baseline_routes_whole_request_to_least_total_load():
    policy = JSQPoolPolicy({0: M, 1: M, 2: M})
    state = loads((100, 5000, 10**6), (2000, 1000, 10**6), (0, 4000, 10**6))
    decision = policy.route(RouteRequest(1, 100), state, now=0.0)
    assert decision.prompt_machine_id == decision.token_machine_id == 1


def test_round_robin_cycles_each_pool_ignoring_load():
    policy = RoundRobinPolicy({0: P, 1: P, 2: T, 3: T, 4: T})
    state = loads(*[(10**6, 10**6, 0)] * 5)
    picks = [policy.route(RouteRequest(i, 10), state, 0.0) for i in range(6)]
    assert [d.prompt_machine_id for d in picks] == [0, 1, 0, 1, 0, 1]
    assert [d.token_machine_id for d in picks] == [2, 3, 4, 2, 3, 4]


def test_power_of_two_never_picks_the_worse_of_two():
    policy = PowerOfTwoPolicy({0: M, 1: M}, seed=3)
    state = loads((5000, 0, 10**6), (10, 0, 10**6))
    assert {policy.route(RouteRequest(i, 10), state, 0.0).prompt_machine_id for i in range(20)} == {
        1
    }


def test_power_of_two_spreads_over_a_large_pool():
    homes = {i: P for i in range(8)} | {8: T, 9: T}
    policy = PowerOfTwoPolicy(homes, seed=0)
    state = loads(*[(0, 0, 10**6)] * 10)
    chosen = {policy.route(RouteRequest(i, 10), state, 0.0).prompt_machine_id for i in range(200)}
    assert len(chosen) >= 6 and chosen <= set(range(8))


def test_full_token_pool_uses_an_already_mixed_machine_before_borrowing():
    policy = split_policy(decode_tokens=5000)
    policy.pools.apply(PoolMove(1, M), now=0.0)  # prompt machine 1 already mixed
    state = loads((0, 0, 10**6), (100, 200, 10**6), (0, 6000, 10**6), (0, 7000, 10**6))
    decision = policy.route(RouteRequest(1, 100), state, now=1.0)
    assert decision.token_machine_id == 1
    assert decision.moves == ()  # nothing borrowed: the mixed pool had room


def test_best_token_machine_without_kv_room_counts_as_full():
    policy = split_policy()
    # Machine 3 has the shorter decode queue but no KV room for a 500-token prompt: the best
    # target is full, so (no mixed machine yet) the idlest prompt machine is borrowed.
    state = loads((0, 0, 10**6), (50, 0, 10**6), (0, 900, 10**6), (0, 100, 400))
    decision = policy.route(RouteRequest(1, 500), state, now=0.0)
    assert decision.token_machine_id == 0 and PoolMove(0, M) in decision.moves


def test_repurposing_never_takes_the_last_machine_of_its_home_pool():
    policy = JSQPoolPolicy({0: P, 1: T, 2: T}, PoolThresholds(repurpose_after_s=10.0))
    policy.pools.apply(PoolMove(0, M), now=0.0)  # the only prompt machine, lent to decoding
    still_decoding = loads((0, 500, 10**6), (0, 0, 10**6), (0, 0, 10**6))
    assert policy.rebalance(still_decoding, now=100.0) == []
    assert policy.pools.home[0] is P and policy.pools.current[0] is M


def test_lent_prefill_skips_machines_running_decodes_past_the_bound():
    # Prompt pool full; the mixed machine 4 and token machine 3 run decodes, token machine 2
    # runs none: with a bound of 0 decode tokens the prefill borrows machine 2 (not the least
    # busy, 3) and never goes to 4.
    homes = {0: P, 1: P, 2: T, 3: T, 4: T}
    policy = JSQPoolPolicy(homes, PoolThresholds(prompt_tokens=1000, lend_prefill_max_decode=0))
    policy.pools.apply(PoolMove(4, M), now=0.0)
    state = loads((900, 0, 10**6), (950, 0, 10**6), (300, 0, 10**6), (0, 200, 10**6),
                  (0, 100, 10**6))  # fmt: skip
    decision = policy.route(RouteRequest(1, 200), state, now=1.0)
    assert decision.prompt_machine_id == 2 and PoolMove(2, M) in decision.moves


def test_lent_prefill_refused_everywhere_queues_in_the_prompt_pool():
    policy = split_policy(prompt_tokens=1000, lend_prefill_max_decode=50)
    state = loads((900, 0, 10**6), (950, 0, 10**6), (0, 800, 10**6), (0, 300, 10**6))
    for board in (state, board_of(policy, state)):
        decision = policy.route(RouteRequest(1, 200), board, now=1.0)
        assert decision.prompt_machine_id == 0 and decision.moves == ()
    assert policy.pools.size(M) == 0


def test_a_decode_borrows_only_a_prompt_machine_with_nothing_pending():
    policy = split_policy(decode_tokens=5000, lend_decode_max_pending=0)
    busy = loads((100, 0, 10**6), (300, 0, 10**6), (0, 6000, 10**6), (0, 7000, 10**6))
    decision = policy.route(RouteRequest(1, 100), busy, now=0.0)
    # Both prompt machines have prefills queued: the decode stays on the least-loaded token
    # machine past its "full" mark, and no prompt machine leaves the prompt pool.
    assert decision.token_machine_id == 2 and decision.moves == ()
    idle = loads((100, 0, 10**6), (0, 0, 10**6), (0, 6000, 10**6), (0, 7000, 10**6))
    decision = policy.route(RouteRequest(2, 100), board_of(policy, idle), now=1.0)
    assert decision.token_machine_id == 1 and PoolMove(1, M) in decision.moves


def test_a_decode_still_goes_to_a_machine_already_mixed_whatever_it_has_pending():
    policy = split_policy(decode_tokens=5000, lend_decode_max_pending=0)
    policy.pools.apply(PoolMove(1, M), now=0.0)
    state = loads((0, 0, 10**6), (100, 200, 10**6), (0, 6000, 10**6), (0, 7000, 10**6))
    decision = policy.route(RouteRequest(1, 100), state, now=1.0)
    assert decision.token_machine_id == 1 and decision.moves == ()


def test_lending_bounds_must_not_be_negative():
    for field in ("lend_prefill_max_decode", "lend_decode_max_pending"):
        with pytest.raises(ValueError, match=field):
            PoolThresholds(**{field: -1})  # type: ignore[arg-type]


def board_of(policy: JSQPoolPolicy, state: dict[int, MachineLoad]) -> LoadBoard:
    """The same loads as the simulator hands them to the policy (a `LoadBoard`)."""
    board = LoadBoard(policy.pools)
    for m, load in state.items():
        board.report(m, load.pending_prompt_tokens, load.decode_tokens, load.free_kv_tokens)
    return board
