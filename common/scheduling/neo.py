"""Neo's load-aware scheduler (Neo §3.2): which requests run where, every iteration.

    policy = NeoPolicy(NeoConfig(block_size=16), cost_model)
    plan = policy.schedule(NeoState(local_decodes, offload_decodes, waiting, free, offload_free))

The six steps, each a method named for it:

1. `initialise`: two empty sub-batches (batch-0 mostly local, batch-1 offloaded decodes only).
2. `schedule_local_decodes`: every local decode into batch-0; swap out the youngest until the
   local tier holds this step's new KV, or swap in the oldest offloaded ones while it has room.
3. `schedule_prefills`: FCFS prompts into batch-0 up to the token cap, each keeping its KV local
   if it fits, else swapping it out to the offload tier as it is made.
4. `schedule_offload_decodes`: offloaded decodes into batch-1 or batch-0 while
   T_ca1 <= T_l0 and T_ca0 <= T_l1 + T_ga0 (the offload tier's attention stays hidden);
   a request that fits neither is deferred to a later iteration.
5. `reduce_prefills`: drop offload-bound prefills (latest first) while the inequalities hold.
6. `decide`: the local-only schedule is batch-0 without step 4's offloaded decodes; keep
   whichever has the larger estimated throughput (requests per second).

Pure: no clocks, no IO; the state in, a plan out (`common/scheduling/neo_state.py`). The caller
owns the tiers: it performs the swaps and prefill swap-outs the plan lists, then the step, and
re-queues `preempted_ids` as prompts. Wrong input (a repeated id, negative free blocks, an empty
request) raises ValueError when the state is built. With its shards gone, a token engine passes no
offloaded decodes and `offload_free_blocks=0` (or `NeoConfig(allow_offload=False)`): the plan is
then the local-only schedule, and requests whose KV was offloaded are re-run from their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.scheduling.neo_state import (
    DecodeRequest,
    NeoConfig,
    NeoCostModel,
    NeoPlan,
    NeoState,
    PrefillRequest,
    ReqId,
    StageTimes,
    blocks_for,
)


@dataclass(frozen=True)
class _Change:
    """A tried change to one sub-batch: requests, batch tokens and offloaded context added."""

    num_requests: int
    num_tokens: int
    context: int


_NONE = _Change(0, 0, 0)


@dataclass
class _Draft:
    """The schedule being built, with the running sums the inequalities need (O(1) per try)."""

    local_free: int
    offload_free: int
    prefills: list[PrefillRequest] = field(default_factory=list)
    prefill_offload: set[ReqId] = field(default_factory=set)
    local: list[DecodeRequest] = field(default_factory=list)
    offload0: list[DecodeRequest] = field(default_factory=list)
    offload1: list[DecodeRequest] = field(default_factory=list)
    swap_out: list[DecodeRequest] = field(default_factory=list)
    swap_in: list[DecodeRequest] = field(default_factory=list)
    preempted: list[DecodeRequest] = field(default_factory=list)
    deferred: list[DecodeRequest] = field(default_factory=list)
    prefill_tokens: int = 0
    local_context: int = 0
    offload0_context: int = 0
    offload1_context: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.prefills) + len(self.local) + len(self.offload0) + len(self.offload1)

    @property
    def batch0_tokens(self) -> int:
        return self.prefill_tokens + len(self.local) + len(self.offload0)


class NeoPolicy:
    """Neo's scheduler over a cost model (T_l, T_ga, T_ca: `NeoCostModel`)."""

    def __init__(self, config: NeoConfig, costs: NeoCostModel) -> None:
        self.config = config
        self.costs = costs

    def schedule(self, state: NeoState) -> NeoPlan:
        """One iteration's plan for `state` (see the module docstring for the steps)."""
        draft = self.initialise(state)
        self.schedule_local_decodes(draft, state)
        self.schedule_prefills(draft, state)
        if self.config.allow_offload:
            self.schedule_offload_decodes(draft, state)
            self.reduce_prefills(draft)
        return self.decide(draft)

    # Step 1.
    def initialise(self, state: NeoState) -> _Draft:
        return _Draft(state.local_free_blocks, state.offload_free_blocks)

    # Step 2.
    def schedule_local_decodes(self, draft: _Draft, state: NeoState) -> None:
        """All local decodes into batch-0; swap out (or, offload off, preempt) the youngest
        until the local tier holds this step's new blocks; with no swap-out, swap in the
        oldest offloaded decodes below the watermark (Maximizing GPU)."""
        bs, cap = self.config.block_size, self.config.max_num_seqs
        local = list(state.local_decodes)
        growth = sum(r.growth_blocks(bs) for r in local)
        while local and (growth > draft.local_free or (cap and len(local) > cap)):
            victim = local.pop()
            draft.local_free += victim.blocks(bs)
            growth -= victim.growth_blocks(bs)
            if self.config.allow_offload and victim.blocks(bs) <= draft.offload_free:
                draft.offload_free -= victim.blocks(bs)
                draft.swap_out.append(victim)
            else:
                draft.preempted.append(victim)
        draft.local_free -= growth
        draft.local = local
        draft.local_context = sum(r.context_len for r in local)
        if not draft.swap_out and not draft.preempted and self.config.allow_offload:
            self._swap_in(draft, state)

    def _swap_in(self, draft: _Draft, state: NeoState) -> None:
        bs, cap = self.config.block_size, self.config.max_num_seqs
        total = state.local_total_blocks or state.local_free_blocks
        reserve = total - int(total * self.config.swap_in_watermark)
        for r in state.offload_decodes:
            need = r.blocks(bs) + r.growth_blocks(bs)
            if draft.local_free - need < reserve or (cap and len(draft.local) >= cap):
                break
            draft.local_free -= need
            draft.offload_free += r.blocks(bs)
            draft.swap_in.append(r)
            draft.local.append(r)
            draft.local_context += r.context_len

    # Step 3.
    def schedule_prefills(self, draft: _Draft, state: NeoState) -> None:
        """FCFS prompts into batch-0 up to `max_prefill_tokens` (one longer prompt runs alone):
        KV local if it fits, else offloaded; once one goes to the offload tier the rest follow
        (FCFS order of the tiers). A prompt that fits neither tier stops the scan."""
        bs, cap = self.config.block_size, self.config.max_num_seqs
        offloading = False
        for p in state.waiting_prefills:
            if (
                draft.prefills
                and draft.prefill_tokens + p.prompt_len > self.config.max_prefill_tokens
            ):
                break
            if cap and draft.num_requests >= cap:
                break
            need = blocks_for(p.prompt_len, bs)
            if not offloading and need <= draft.local_free:
                draft.local_free -= need
            elif self.config.allow_offload and need <= draft.offload_free:
                draft.offload_free -= need
                draft.prefill_offload.add(p.req_id)
                offloading = True
            else:
                break
            draft.prefills.append(p)
            draft.prefill_tokens += p.prompt_len

    # Step 4.
    def schedule_offload_decodes(self, draft: _Draft, state: NeoState) -> None:
        """Offloaded decodes into batch-1 (or batch-0, when batch-1's side is full) while both
        inequalities hold; the others wait (Balancing, Hiding CPU)."""
        bs, cap = self.config.block_size, self.config.max_num_seqs
        swapped_in = {r.req_id for r in draft.swap_in}
        for r in state.offload_decodes:
            if r.req_id in swapped_in:
                continue
            growth = r.growth_blocks(bs)
            if growth > draft.offload_free or (cap and draft.num_requests >= cap):
                draft.deferred.append(r)
                continue
            if self._fits(draft, r, batch=1):
                draft.offload1.append(r)
                draft.offload1_context += r.context_len
            elif self._fits(draft, r, batch=0):
                draft.offload0.append(r)
                draft.offload0_context += r.context_len
            else:
                draft.deferred.append(r)
                continue
            draft.offload_free -= growth

    def _fits(self, draft: _Draft, r: DecodeRequest, batch: int) -> bool:
        """Both inequalities with `r` added to `batch`: one request, one token, its context."""
        add = _Change(1, 1, r.context_len)
        return self._times(
            draft, add if batch == 0 else _NONE, add if batch == 1 else _NONE
        ).balanced

    # Step 5.
    def reduce_prefills(self, draft: _Draft) -> None:
        """Drop offload-bound prefills, latest first, while the inequalities still hold and
        batch-0 keeps `prefill_floor_tokens` (Balancing): their KV would only lengthen the
        offload queue that this iteration already keeps busy."""
        floor = self.config.prefill_floor_tokens
        for p in reversed(list(draft.prefills)):
            if p.req_id not in draft.prefill_offload:
                continue
            if draft.batch0_tokens - p.prompt_len < floor:
                break
            if not self._times(draft, _Change(-1, -p.prompt_len, 0)).balanced:
                break
            draft.prefills.remove(p)
            draft.prefill_offload.discard(p.req_id)
            draft.prefill_tokens -= p.prompt_len
            draft.offload_free += blocks_for(p.prompt_len, self.config.block_size)

    # Step 6.
    def decide(self, draft: _Draft) -> NeoPlan:
        """Two-batch schedule or local-only (batch-0 less step 4's offloaded decodes): the
        larger estimated throughput wins; ties go to local-only (no second batch to run)."""
        two = self._times(draft)
        local_only = StageTimes(
            self.costs.linear_s(draft.prefill_tokens + len(draft.local)),
            0.0,
            self.costs.local_attention_s(draft.local_context),
            0.0,
            0.0,
            len(draft.prefills) + len(draft.local),
        )
        use_two = bool(draft.offload0 or draft.offload1) and two.throughput > local_only.throughput
        deferred = draft.deferred if use_two else draft.deferred + draft.offload0 + draft.offload1
        return NeoPlan(
            prefill_ids=_ids(draft.prefills),
            prefill_offload_ids=tuple(
                p.req_id for p in draft.prefills if p.req_id in draft.prefill_offload
            ),
            local_ids=_ids(draft.local),
            offload0_ids=_ids(draft.offload0) if use_two else (),
            offload1_ids=_ids(draft.offload1) if use_two else (),
            swap_out_ids=_ids(draft.swap_out),
            swap_in_ids=_ids(draft.swap_in),
            preempted_ids=_ids(draft.preempted),
            deferred_ids=_ids(deferred),
            two_batch=use_two,
            times=two if use_two else local_only,
        )

    def _times(
        self, draft: _Draft, add0: _Change | None = None, add1: _Change | None = None
    ) -> StageTimes:
        """The five estimates of `draft`, with a tried change to batch-0 or batch-1."""
        add0, add1 = add0 or _NONE, add1 or _NONE
        c = self.costs
        num1 = len(draft.offload1) + add1.num_tokens
        return StageTimes(
            linear0_s=c.linear_s(draft.batch0_tokens + add0.num_tokens),
            linear1_s=c.linear_s(num1) if num1 > 0 else 0.0,
            local_attention0_s=c.local_attention_s(draft.local_context),
            offload_attention0_s=c.offload_attention_s(draft.offload0_context + add0.context),
            offload_attention1_s=c.offload_attention_s(draft.offload1_context + add1.context),
            num_requests=draft.num_requests + add0.num_requests + add1.num_requests,
        )


def _ids(requests: Sequence[DecodeRequest | PrefillRequest]) -> tuple[ReqId, ...]:
    return tuple(r.req_id for r in requests)
