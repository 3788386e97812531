"""Neo's load-aware scheduler (neo.py) as a token engine's `TierPolicy` (tiers.py).

`NeoTierPolicy.plan(TierState)` builds a `NeoState` from the engine's tiers, asks `NeoPolicy`,
and maps its `NeoPlan` back to what this engine can do. The engine differs from Neo's in three
ways, each mapped conservatively:

- Memory is reserved by whole length (tiers.py): a local request never outgrows its room, so Neo
  sees the local tier's free blocks *plus* this step's growth of the local requests (already
  reserved); its swap-outs and preemptions then only follow a real shortage. A swap-in Neo plans
  is kept only while its whole length fits what the local tier has unpromised (Neo counts its
  context); preemption (dropping KV to recompute) does not exist here, so a preempted request
  stays where it is (its room was reserved), and the shard group's room is the shards' to refuse
  (a refused swap-out ends that request alone, retryably: services/engine/kv_swaps.py).
- It cannot defer an offloaded decode: every request on the shards steps every iteration. Neo's
  `two_batch` (step 6) picks the schedule: True runs the local rows as batch-0 and every
  offloaded row as batch-1 (§3.1), False one batch with both tiers.
- Prefills run on prompt engines: Neo sees no waiting prompts.

`predicted_step_s` is the step the engine will run, not Neo's plan: batch-0 the local rows that
stay (movers sit out), batch-1 the offloaded ones (those still arriving included), timed with
Neo's formula for two batches, and T_l(all) + max(T_ga, T_ca) (local attention runs while the
shards attend) for one.
"""

from __future__ import annotations

from common.scheduling.neo import NeoPolicy
from common.scheduling.neo_state import DecodeRequest, NeoConfig, NeoCostModel, NeoPlan, NeoState
from common.scheduling.tiers import Tier, TierPlan, TierRequest, TierState

# Room Neo may assume on the shard group: the shards reserve whole lengths and refuse what does
# not fit, so the engine does not count it (a refusal ends that request alone, retryably).
UNCOUNTED_OFFLOAD_BLOCKS = 1 << 30


class NeoTierPolicy:
    """A `TierPolicy` deciding by Neo's load-aware scheduler over `costs` (see the module doc)."""

    def __init__(self, costs: NeoCostModel, config: NeoConfig | None = None) -> None:
        self.costs = costs
        self.config = config
        self.last_plan: NeoPlan | None = None  # Neo's own answer, for tests and the bench

    def plan(self, state: TierState) -> TierPlan:
        neo = NeoPolicy(self.config or NeoConfig(block_size=state.block_size), self.costs)
        plan = neo.schedule(self.neo_state(state))
        self.last_plan = plan
        out = TierPlan(
            swap_out=[str(i) for i in plan.swap_out_ids],
            swap_in=self._swap_ins(state, plan),
            two_batch=plan.two_batch,
        )
        out.two_batch = out.two_batch and self._both_step(state, out)
        out.predicted_step_s = self.predict(state, out)
        return out

    def neo_state(self, state: TierState) -> NeoState:
        bs = state.block_size
        local = [_decode(r) for r in state.requests if r.tier is Tier.LOCAL]
        # Only settled offloaded requests may move; those still arriving just step.
        offload = [_decode(r) for r in state.requests if r.tier is Tier.OFFLOADED]
        free = max(0, state.local_budget_blocks - state.local_blocks())
        reserved_growth = sum(r.growth_blocks(bs) for r in local)
        local_free = free + reserved_growth
        return NeoState(
            local, offload, (), local_free, UNCOUNTED_OFFLOAD_BLOCKS,
            local_total_blocks=max(state.local_budget_blocks, local_free),
        )  # fmt: skip

    def _swap_ins(self, state: TierState, plan: NeoPlan) -> list[str]:
        """Neo's swap-ins, oldest first, while their whole length fits the unpromised room."""
        free = state.local_budget_blocks - state.local_blocks()
        by_id = {r.req_id: r for r in state.requests if r.tier is Tier.OFFLOADED}
        kept = []
        for req_id in plan.swap_in_ids:
            r = by_id.get(str(req_id))
            if r is None or r.num_blocks(state.block_size) > free:
                break
            free -= r.num_blocks(state.block_size)
            kept.append(r.req_id)
        return kept

    @staticmethod
    def _both_step(state: TierState, plan: TierPlan) -> bool:
        rows0, rows1 = _stepping(state, plan)
        return bool(rows0 and rows1)

    def predict(self, state: TierState, plan: TierPlan) -> float:
        """Seconds of the decode step the engine runs after `plan`'s swaps start."""
        rows0, rows1 = _stepping(state, plan)
        c = self.costs
        ctx0, ctx1 = sum(r.num_tokens for r in rows0), sum(r.num_tokens for r in rows1)
        if plan.two_batch:
            first = max(c.linear_s(len(rows0)), c.offload_attention_s(ctx1))
            return first + c.linear_s(len(rows1)) + c.local_attention_s(ctx0)
        attend = max(c.local_attention_s(ctx0), c.offload_attention_s(ctx1))
        return c.linear_s(len(rows0) + len(rows1)) + attend


def _decode(r: TierRequest) -> DecodeRequest:
    return DecodeRequest(r.req_id, max(r.num_tokens, 1))


def _stepping(state: TierState, plan: TierPlan) -> tuple[list[TierRequest], list[TierRequest]]:
    """(local rows, offloaded rows) of the step after `plan`'s swaps start (movers sit out)."""
    moving = set(plan.swap_in) | set(plan.swap_out)
    rows = [r for r in state.requests if r.req_id not in moving]
    local = [r for r in rows if r.tier is Tier.LOCAL]
    return local, [r for r in rows if r.tier in (Tier.OFFLOADED, Tier.ARRIVING)]


__all__ = ["NeoTierPolicy"]
