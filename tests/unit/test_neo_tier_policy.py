"""`NeoTierPolicy`: Neo's scheduler behind the engine's `TierPolicy`, on hand-built tier states
and hand-set cost tables (the numbers below are what Neo's inequalities and step 6 give)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.scheduling.neo_tiers import NeoTierPolicy
from common.scheduling.tiers import Tier, TierPlan, TierRequest, TierState, is_neo, tier_policy

BS = 16


@dataclass
class Costs:
    """T_l = base + per_token x tokens; T_ga, T_ca proportional to context."""

    base: float = 1e-3
    per_token: float = 1e-5
    local_per_ctx: float = 1e-7
    offload_per_ctx: float = 1e-6

    def linear_s(self, num_tokens: int) -> float:
        return self.base + self.per_token * num_tokens if num_tokens else 0.0

    def local_attention_s(self, num_context_tokens: int) -> float:
        return self.local_per_ctx * num_context_tokens

    def offload_attention_s(self, num_context_tokens: int) -> float:
        return self.offload_per_ctx * num_context_tokens


def req(req_id: str, tier: Tier, num_tokens: int = 40, max_len: int = 64) -> TierRequest:
    return TierRequest(req_id, tier, num_tokens, 2, max_len)  # 4 blocks each, whole length


def test_swaps_in_while_whole_lengths_fit_and_never_swaps_out_reserved_room():
    # Budget 10 blocks: "a" holds 4; "b" (4) fits, "c" (4 more) does not, by whole length,
    # though Neo counting contexts (3 blocks each) would have taken both.
    state = TierState(
        [req("a", Tier.LOCAL), req("b", Tier.OFFLOADED), req("c", Tier.OFFLOADED)], 10, BS
    )
    plan = NeoTierPolicy(Costs()).plan(state)
    assert plan.swap_in == ["b"] and plan.swap_out == []


def test_a_full_local_tier_swaps_nothing_out():
    # Local requests' growth was reserved with their whole length: no shortage, no swap-out.
    state = TierState([req("a", Tier.LOCAL), req("b", Tier.LOCAL), req("c", Tier.OFFLOADED)], 8, BS)
    plan = NeoTierPolicy(Costs()).plan(state)
    assert plan.swap_out == [] and plan.swap_in == []


def test_arriving_and_moving_requests_are_not_moved():
    state = TierState(
        [req("a", Tier.ARRIVING), req("m", Tier.MOVING), req("b", Tier.OFFLOADED)], 64, BS
    )
    plan = NeoTierPolicy(Costs()).plan(state)
    assert plan.swap_in == ["b"]


def test_two_batches_when_offload_attention_hides_under_local_work():
    # Cheap offload attention: Neo puts the offloaded decode in batch-1 and beats local-only.
    state = TierState([req("a", Tier.LOCAL), req("b", Tier.OFFLOADED)], 4, BS)
    policy = NeoTierPolicy(Costs(offload_per_ctx=1e-8))
    plan = policy.plan(state)
    assert plan.two_batch and plan.swap_in == []
    assert policy.last_plan is not None and policy.last_plan.offload1_ids == ("b",)
    c = Costs(offload_per_ctx=1e-8)
    expected = max(c.linear_s(1), 40e-8) + c.linear_s(1) + c.local_attention_s(40)
    assert plan.predicted_step_s == pytest.approx(expected)


def test_one_batch_when_offload_attention_would_show_and_it_still_steps():
    # Offloaded attention far longer than the local work: Neo keeps local-only (it would defer
    # "b"); the engine cannot defer, so "b" steps in the one batch and the estimate counts it.
    costs = Costs(offload_per_ctx=1e-3)
    state = TierState([req("a", Tier.LOCAL), req("b", Tier.OFFLOADED)], 4, BS)
    policy = NeoTierPolicy(costs)
    plan = policy.plan(state)
    assert not plan.two_batch
    assert policy.last_plan is not None and policy.last_plan.deferred_ids == ("b",)
    assert plan.predicted_step_s == pytest.approx(costs.linear_s(2) + 40e-3)


def test_movers_sit_out_of_the_estimate():
    costs = Costs()
    state = TierState([req("a", Tier.OFFLOADED), req("b", Tier.OFFLOADED)], 4, BS)
    plan = NeoTierPolicy(costs).plan(state)
    assert plan.swap_in == ["a"] and not plan.two_batch  # "a" moves: only "b" steps
    assert plan.predicted_step_s == pytest.approx(costs.linear_s(1) + 40e-6)


def test_empty_state_plans_nothing():
    plan = NeoTierPolicy(Costs()).plan(TierState([], 8, BS))
    assert plan == TierPlan(predicted_step_s=0.0)


def test_config_names():
    assert is_neo("neo") and is_neo("neo:/tmp/x.csv") and not is_neo("fill_local")
    with pytest.raises(ValueError, match="neo"):
        tier_policy("neo")  # the engine builds it: it needs a cost model
