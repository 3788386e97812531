"""Which KV tier each decode request of a token engine lives in (Neo §3): its own bounded local
KV, or the offload tier on its attention-shard group. Pure: plain state in, a plan out.

`TierPolicy.plan(state) -> TierPlan` names the requests to swap out (local -> shards) and to swap
in (shards -> local) this iteration, and whether it runs as two sub-batches interleaved per layer
(§3.1 asymmetric pipelining: batch-0 the local requests, batch-1 the offloaded ones) or as one.
Neo's load-aware policy (common/scheduling/neo.py) replaces `FillLocalFirst`, the default,
behind the same interface; the simulator can call either.

Accounting is by whole length: a request counts `ceil((num_tokens + remaining) / block_size)`
blocks of its tier from the moment it is placed there, so a local request never runs out of room
mid-stream (the local budget stands for device memory: nothing there may be preempted by it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol


class Tier(enum.StrEnum):
    LOCAL = "local"
    OFFLOADED = "offloaded"  # on the shard group
    MOVING = "moving"  # being swapped either way: in no step until it lands
    ARRIVING = "arriving"  # offloaded, its prefill KV maybe still landing there: not movable yet


@dataclass(frozen=True)
class TierRequest:
    """One decode request as a tier policy sees it."""

    req_id: str
    tier: Tier
    num_tokens: int  # prompt plus generated so far
    num_output_tokens: int  # generated so far (the first token included)
    max_len: int  # the most tokens it may hold: prompt plus max_tokens

    def num_blocks(self, block_size: int) -> int:
        return -(-self.max_len // block_size)


@dataclass(frozen=True)
class TierState:
    """A token engine's decode requests, oldest first, and its local tier's budget in blocks."""

    requests: list[TierRequest]
    local_budget_blocks: int
    block_size: int

    def local_blocks(self) -> int:
        """Blocks the local tier has promised: its requests and those moving to or from it
        (a request swapping out still holds its local copy until the shards have it)."""
        return sum(
            r.num_blocks(self.block_size)
            for r in self.requests
            if r.tier in (Tier.LOCAL, Tier.MOVING)
        )


@dataclass
class TierPlan:
    swap_out: list[str] = field(default_factory=list)  # local -> shard group
    swap_in: list[str] = field(default_factory=list)  # shard group -> local
    two_batch: bool = False  # this iteration's decode as batch-0 (local) and batch-1 (offloaded)
    # The policy's estimate of this iteration's decode step (s), for policies with a cost model
    # (`NeoTierPolicy`); the engine records it beside the measured time.
    predicted_step_s: float | None = None


class TierPolicy(Protocol):
    def plan(self, state: TierState) -> TierPlan: ...


class FillLocalFirst:
    """The default: fill the local tier up to its budget, oldest first; leave the rest offloaded;
    swap a request in when room frees (a local request finished). Never swaps out: every local
    request's whole length was counted when it came in. Two sub-batches whenever both tiers
    step (the shards' attention then overlaps the local rows' dense work)."""

    def plan(self, state: TierState) -> TierPlan:
        free = state.local_budget_blocks - state.local_blocks()
        plan = TierPlan()
        for r in state.requests:
            need = r.num_blocks(state.block_size)
            if r.tier is Tier.OFFLOADED and need <= free:
                plan.swap_in.append(r.req_id)
                free -= need
        plan.two_batch = _both_tiers_step(state, plan)
        return plan


class AlternateTiers:
    """A test policy: every request changes tier each `period` of its own output tokens (local,
    offloaded, local, ...), room permitting, so swaps both ways happen mid-generation. Greedy
    output must not change (tests/integration/test_neo_tiers.py)."""

    def __init__(self, period: int) -> None:
        if period < 1:
            raise ValueError(f"the alternation period must be >= 1, got {period}")
        self.period = period

    def plan(self, state: TierState) -> TierPlan:
        free = state.local_budget_blocks - state.local_blocks()
        plan = TierPlan()
        for r in state.requests:
            want_local = (r.num_output_tokens // self.period) % 2 == 1
            if r.tier is Tier.LOCAL and not want_local:
                plan.swap_out.append(r.req_id)
            elif r.tier is Tier.OFFLOADED and want_local and r.num_blocks(state.block_size) <= free:
                plan.swap_in.append(r.req_id)
                free -= r.num_blocks(state.block_size)
        plan.two_batch = _both_tiers_step(state, plan)
        return plan


def _both_tiers_step(state: TierState, plan: TierPlan) -> bool:
    """Whether, after `plan`'s swaps start (movers sit out), both tiers have a request to step."""
    moving = set(plan.swap_in) | set(plan.swap_out)
    stepping = {r.tier for r in state.requests if r.req_id not in moving}
    return Tier.LOCAL in stepping and bool(stepping & {Tier.OFFLOADED, Tier.ARRIVING})


def tier_policy(spec: str) -> TierPolicy:
    """A policy from its config name: `fill_local` (the default) or `alternate:<period>`.
    `neo` and `neo:<csv>` need a cost model: the engine builds them (`is_neo`)."""
    name, _, arg = spec.partition(":")
    if name in ("", "fill_local"):
        return FillLocalFirst()
    if name == "alternate" and arg.isdigit():
        return AlternateTiers(int(arg))
    raise ValueError(f"unknown tier policy {spec!r}: fill_local, alternate:<period>, neo[:<csv>]")


def is_neo(spec: str) -> bool:
    """Whether `spec` names Neo's load-aware policy (`neo`, or `neo:<attention table csv>`)."""
    return spec.partition(":")[0] == "neo"


__all__ = [
    "AlternateTiers", "FillLocalFirst", "Tier", "TierPlan", "TierPolicy", "TierRequest",
    "TierState", "is_neo", "tier_policy",
]  # fmt: skip
