"""Neo's load-aware scheduler (Neo §3.2), step by step, on hand-built states and a linear cost
model whose numbers are checked by hand in each test."""

from dataclasses import dataclass

import pytest

from common.scheduling.neo import NeoPolicy
from common.scheduling.neo_state import (
    DecodeRequest,
    NeoConfig,
    NeoState,
    PrefillRequest,
    StageTimes,
)


@dataclass(frozen=True)
class LinearCosts:
    """T_l(n) = base + per_token x n (0 for no tokens); T_ga, T_ca proportional to context."""

    base: float = 10.0
    per_token: float = 0.01
    ga_per_token: float = 0.0001
    ca_per_token: float = 0.001

    def linear_s(self, num_tokens: int) -> float:
        return self.base + self.per_token * num_tokens if num_tokens > 0 else 0.0

    def local_attention_s(self, num_context_tokens: int) -> float:
        return self.ga_per_token * num_context_tokens

    def offload_attention_s(self, num_context_tokens: int) -> float:
        return self.ca_per_token * num_context_tokens


def dec(req_id, context_len=100):
    return DecodeRequest(req_id, context_len)


def state(local=(), offload=(), waiting=(), local_free=10_000, offload_free=100_000, total=0):
    return NeoState(tuple(local), tuple(offload), tuple(waiting), local_free, offload_free, total)


def policy(costs=None, **config):
    config.setdefault("block_size", 1)
    return NeoPolicy(NeoConfig(**config), costs or LinearCosts())


# Step 1 (initialise) and the plan's estimate.


def test_empty_state_gives_an_empty_local_only_plan():
    plan = policy().schedule(state())
    assert plan.is_empty and not plan.two_batch and plan.num_requests == 0
    assert plan.step_s == 0.0 and plan.throughput == 0.0


def test_step_time_is_neos_two_stage_estimate():
    # T = max(T_l0, T_ca1) + max(T_l1 + T_ga0, T_ca0)
    t = StageTimes(5.0, 1.0, 0.5, 2.0, 6.0, num_requests=12)
    assert t.step_s == 6.0 + 2.0 and t.throughput == 12 / 8.0
    assert not t.balanced  # T_ca1 > T_l0 and T_ca0 > T_l1 + T_ga0
    assert StageTimes(5.0, 1.0, 0.5, 1.5, 5.0, 3).balanced  # both hold with equality


# Step 2: local decodes, swap-out and swap-in.


def test_every_local_decode_runs_in_batch0_when_its_growth_fits():
    plan = policy(block_size=16).schedule(
        # 16 tokens fill a block (the next token takes a new one); 17 do not.
        state([dec(0, 16), dec(1, 17)], local_free=1)
    )
    assert plan.local_ids == (0, 1) and not plan.swap_out_ids and not plan.two_batch
    assert plan.times.local_attention0_s == pytest.approx(0.0001 * 33)


def test_youngest_local_decodes_swap_out_until_the_new_kv_fits():
    # Four requests each need a new block and none is free: the youngest (1 block) leaves and
    # frees one, still short; the next (1 block) too: now 2 free for the 2 left.
    plan = policy(block_size=16).schedule(
        state([dec(0, 48), dec(1, 32), dec(2, 16), dec(3, 16)], local_free=0, offload_free=100)
    )
    assert plan.local_ids == (0, 1)
    assert plan.swap_out_ids == (3, 2)  # youngest first; they skip this iteration
    assert not plan.preempted_ids


def test_a_swap_out_with_no_room_in_the_offload_tier_is_a_preemption():
    plan = policy(block_size=16).schedule(
        state([dec(0, 16), dec(1, 16), dec(2, 48)], local_free=0, offload_free=2)
    )
    # Request 2 holds 3 blocks and the offload tier has 2: it is preempted (its blocks freed
    # are enough for the other two).
    assert plan.preempted_ids == (2,) and not plan.swap_out_ids and plan.local_ids == (0, 1)


def test_oldest_offloaded_decodes_swap_in_while_below_the_watermark():
    # 100 local blocks in all, 50 free; watermark 0.9 keeps 10 free. Each swap-in takes its
    # 20 blocks + 1 for its next token: the first two fit (50 - 42 = 8 < 10: only one does).
    p = policy(swap_in_watermark=0.9)
    plan = p.schedule(state([dec(0, 49)], [dec(1, 20), dec(2, 20)], local_free=50, total=100))
    assert plan.swap_in_ids == (1,) and plan.local_ids == (0, 1)
    assert 1 not in plan.offload1_ids + plan.offload0_ids


def test_no_swap_in_in_an_iteration_that_swaps_out():
    plan = policy().schedule(state([dec(0, 10), dec(1, 10)], [dec(2, 1)], local_free=1, total=1000))
    assert plan.swap_out_ids == (1,) and not plan.swap_in_ids


# Step 3: prefills.


def test_prefills_fcfs_local_first_then_offloaded_up_to_the_token_cap():
    waiting = [PrefillRequest(i, n) for i, n in enumerate([300, 300, 100, 2000])]
    plan = policy(max_prefill_tokens=1000, prefill_floor_tokens=10_000).schedule(
        state(waiting=waiting, local_free=350)
    )
    # 0 fits locally; 1 does not (50 left) and goes to the offload tier, and so does 2 (FCFS
    # order of the tiers) although it would fit locally; 3 would pass the 1000-token cap.
    assert plan.prefill_ids == (0, 1, 2) and plan.prefill_offload_ids == (1, 2)


def test_a_prompt_longer_than_the_cap_runs_alone():
    waiting = [PrefillRequest(0, 5000), PrefillRequest(1, 10)]
    plan = policy(max_prefill_tokens=1000).schedule(state(waiting=waiting))
    assert plan.prefill_ids == (0,)


def test_a_prompt_that_fits_neither_tier_waits_and_blocks_the_queue():
    waiting = [PrefillRequest(0, 500), PrefillRequest(1, 10)]
    plan = policy().schedule(state(waiting=waiting, local_free=100, offload_free=100))
    assert plan.prefill_ids == () and plan.is_empty


# Step 4: offloaded decodes under the two inequalities.


def test_offloaded_decodes_fill_batch1_while_tca1_fits_under_tl0_then_batch0():
    # Batch-0: 10 local decodes of 1000 tokens: T_l0 = 10 + 0.1 = 10.1, T_ga0 = 1.0.
    # Each offloaded decode of 2000 tokens costs T_ca = 2.0: five fit in batch-1
    # (T_ca1 = 10.0 <= T_l0; a sixth, 12.0, would not). Batch-0 then takes offloaded ones
    # while T_ca0 <= T_l1 + T_ga0 = (10 + 0.05) + 1.0 = 11.05 and T_ca1 <= the growing
    # T_l0: five more (10.0); the last waits.
    local = [dec(i, 1000) for i in range(10)]
    offload = [dec(100 + i, 2000) for i in range(11)]
    plan = policy().schedule(state(local, offload, local_free=10))  # full: no swap-in
    assert plan.two_batch
    assert plan.offload1_ids == tuple(range(100, 105))
    assert plan.offload0_ids == tuple(range(105, 110))
    assert plan.deferred_ids == (110,)
    t = plan.times
    assert t.balanced
    assert t.offload_attention1_s <= t.linear0_s
    assert t.offload_attention0_s <= t.linear1_s + t.local_attention0_s
    assert t.step_s == pytest.approx(t.linear0_s + t.linear1_s + t.local_attention0_s)


def test_offload_stops_when_the_offload_tier_is_the_bottleneck():
    # Offloaded attention 100x slower: one 2000-token request (T_ca = 200) exceeds T_l0 and
    # T_l1 + T_ga0 alike, so no offloaded decode runs and the plan is local-only.
    local = [dec(i, 1000) for i in range(10)]
    offload = [dec(100 + i, 2000) for i in range(3)]
    plan = policy(LinearCosts(ca_per_token=0.1)).schedule(state(local, offload, local_free=10))
    assert not plan.two_batch and plan.offload0_ids == plan.offload1_ids == ()
    assert plan.deferred_ids == (100, 101, 102)
    assert plan.local_ids == tuple(range(10))


def test_offloaded_decodes_wait_when_the_offload_tier_has_no_block_for_their_next_token():
    plan = policy(block_size=16).schedule(
        state(
            [dec(0, 1000)], [dec(1, 32)], local_free=0, offload_free=0
        )  # 32 tokens: the next needs a block
    )
    assert plan.deferred_ids == (1,) and not plan.two_batch


# Step 5: reduce prefills.


def test_offload_bound_prefills_are_dropped_while_the_inequalities_hold():
    # Local memory is full: both prompts would swap their KV out. One short offloaded decode
    # (T_ca1 = 0.1) is hidden by far less than the prompts' linear time, so both are dropped
    # down to the floor (the local decodes alone keep batch-0 at 10 tokens >= floor 5).
    local = [dec(i, 100) for i in range(10)]
    waiting = [PrefillRequest(50, 400), PrefillRequest(51, 400)]
    costs = LinearCosts(per_token=0.01)
    plan = policy(costs, prefill_floor_tokens=5).schedule(
        state(local, [dec(100, 100)], waiting, local_free=10)
    )
    assert plan.prefill_ids == ()


def test_an_offload_bound_prefill_stays_when_it_hides_the_offloaded_attention():
    # T_l0 with the prompt = 10 + 0.01 x (10 + 1000) = 20.1; without it 10.1. Batch-1's
    # offloaded attention (15 x 1000 tokens x 0.001 = 15) needs the prompt's linear time.
    local = [dec(i, 100) for i in range(10)]
    offload = [dec(100 + i, 1000) for i in range(15)]
    waiting = [PrefillRequest(50, 1000)]
    plan = policy(prefill_floor_tokens=5).schedule(state(local, offload, waiting, local_free=10))
    assert plan.prefill_ids == (50,) and plan.prefill_offload_ids == (50,)
    assert len(plan.offload1_ids) == 15 and plan.times.balanced


def test_local_prefills_are_never_dropped():
    local = [dec(i, 100) for i in range(10)]
    waiting = [PrefillRequest(50, 400)]
    plan = policy(prefill_floor_tokens=5).schedule(state(local, [dec(100, 100)], waiting))
    assert plan.prefill_ids == (50,) and plan.prefill_offload_ids == ()


# Step 6: two-batch or local-only.


def test_local_only_wins_when_a_second_batch_costs_more_than_it_serves():
    # 60 local decodes: T_l0 = 10.6, T_ga0 = 0.6 -> 60 / 11.2 = 5.36 requests/s. Adding two
    # offloaded ones means a second linear pass (T_l1 = 10.02): 62 / 21.22 = 2.92.
    local = [dec(i, 100) for i in range(60)]
    plan = policy().schedule(state(local, [dec(100, 100), dec(101, 100)], local_free=60))
    assert not plan.two_batch
    assert plan.offload0_ids == plan.offload1_ids == ()
    assert set(plan.deferred_ids) == {100, 101}
    assert plan.times.num_requests == 60
    assert plan.step_s == pytest.approx(10.6 + 0.6)


def test_two_batch_wins_when_the_offload_tier_serves_many():
    local = [dec(i, 100) for i in range(4)]
    offload = [dec(100 + i, 500) for i in range(40)]
    plan = policy().schedule(state(local, offload, local_free=4))
    assert plan.two_batch and plan.num_requests > 4 + 10
    local_only_throughput = 4 / (10.04 + 0.04)
    assert plan.throughput > local_only_throughput


def test_offload_disabled_is_the_local_only_baseline():
    plan = policy(allow_offload=False).schedule(
        state(
            [dec(0, 10), dec(1, 10)],
            [dec(5, 10)],
            [PrefillRequest(9, 100)],
            local_free=1,
        )
    )
    assert plan.preempted_ids == (1,) and not plan.swap_out_ids
    assert plan.prefill_ids == () and not plan.two_batch and not plan.swap_in_ids
    assert plan.local_ids == (0,)


def test_max_num_seqs_bounds_the_iteration():
    local = [dec(i, 10) for i in range(5)]
    plan = policy(max_num_seqs=3).schedule(state(local, waiting=[PrefillRequest(9, 10)]))
    assert plan.local_ids == (0, 1, 2) and plan.swap_out_ids == (4, 3)
    assert plan.prefill_ids == ()


# Wrong inputs.


@pytest.mark.parametrize(
    "build",
    [
        lambda: DecodeRequest(0, 0),
        lambda: PrefillRequest(0, 0),
        lambda: state([dec(0)], [dec(0)]),
        lambda: state(local_free=-1),
        lambda: state(local_free=10, total=5),
        lambda: NeoConfig(block_size=0),
        lambda: NeoConfig(swap_in_watermark=1.5),
    ],
)
def test_wrong_inputs_are_refused(build):
    with pytest.raises(ValueError):
        build()
