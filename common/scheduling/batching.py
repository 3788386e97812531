"""The engines' machine-level scheduler: `MixedBatchPolicy` (common/scheduling/mixed.py, the very
policy the simulator runs) applied to a real `BlockManager` and turned into runner batches. Pure:
no torch, no sockets.

Each policy iteration (`MixedPlan`: prompts to prefill, decodes to step, decodes preempted) is run
as at most two batches, prefill first: the model runner runs one phase per forward. The policy
counts KV in the cache's blocks and reserves, at each plan, room for the token the iteration
generates; this class mirrors every reservation into the `BlockManager` (allocate, grow, free), so
the policy's count and the block manager's agree. Blocks held outside this scheduler (KV landed
for a hand-off not yet admitted, another scheduler on the same cache) are the policy's
`external_blocks`.

The engine loop reads: `batch = scheduler.schedule()`, run it, `scheduler.update(batch, finished)`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import structlog

from common.block_manager import BlockManager, NoFreeBlocksError
from common.config import SchedulerConfig
from common.scheduling.mixed import MixedBatchPolicy, MixedPlan, MixedPolicyConfig

log = structlog.get_logger(__name__)


class Phase(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Sequence:
    """The runner's view of one request: token counts only."""

    req_id: str
    num_tokens: int  # prompt plus generated so far
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    # Its tokens when known (the prompt): with prefix caching, the prefill starts after the
    # longest cached prefix of them (docs/prefix_caching.md). None: never looked up or cached.
    token_ids: list[int] | None = None
    priority: int = 0  # vLLM's request priority: a lower one waits less for its prefill


@dataclass
class Batch:
    """One forward's sequences, all in one phase, and who was preempted to make room."""

    phase: Phase
    seqs: list[Sequence]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        if self.phase is Phase.DECODE:
            return len(self.seqs)
        return sum(s.num_tokens - s.num_computed for s in self.seqs)


def policy_config(blocks: BlockManager, config: SchedulerConfig) -> MixedPolicyConfig:
    """The policy's knobs for an engine: its cache's blocks, and the YAML's batching limits."""
    return MixedPolicyConfig(
        kv_capacity_tokens=blocks.num_blocks * blocks.block_size,
        prompt_token_cap=config.max_num_batched_tokens,
        max_preemptions=config.max_preemptions,
        starvation_s=config.starvation_s,
        block_size=blocks.block_size,
        max_num_seqs=config.max_num_seqs,
    )


class EngineScheduler:
    """`MixedBatchPolicy` over an engine's `BlockManager` (see the module docstring).

    A prompt machine's scheduler sees only prompts (and `remove`s each once its KV has shipped),
    a token machine's only `add_running` hand-offs: the roles are what each is fed, as in the
    simulator. `clock` dates arrivals and preemptions for the policy's aging.
    """

    def __init__(
        self,
        blocks: BlockManager,
        config: SchedulerConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.blocks = blocks
        self.config = config
        self.clock = clock
        self.policy = MixedBatchPolicy(policy_config(blocks, config))
        self.seqs: dict[str, Sequence] = {}
        self.plan_log: list[MixedPlan] | None = None  # a list: every plan is appended (tests)
        self._rest: deque[Batch] = deque()  # the current plan's batches not yet handed out

    @property
    def num_unfinished(self) -> int:
        return len(self.seqs)

    @property
    def num_preemptions(self) -> int:
        return self.policy.num_preemptions

    @property
    def waiting(self) -> list[Sequence]:
        """Sequences waiting for a prefill, resumes (preempted) first."""
        queued = [*self.policy.resumes, *self.policy.prompts]
        return [self.seqs[str(s.req_id)] for s in queued]

    @property
    def running(self) -> list[Sequence]:
        return [self.seqs[str(r)] for r in self.policy.running]

    @property
    def plan_in_progress(self) -> bool:
        """The current plan still has a batch to hand out (its decodes, after its prefills)."""
        return any(b.seqs for b in self._rest)

    def pending_prompt_tokens(self) -> int:
        return self.policy.pending_prompt_tokens

    def blocks_to_grow(self, whole_len: Callable[[str], int]) -> int:
        """The blocks its sequences (running or waiting to be recomputed) may still take before
        each holds `whole_len(req_id)` tokens, its most: what a token engine keeps free for them
        before it starts another hand-off (services/engine/admission.py)."""
        held = {r: len(self.blocks.block_table(r)) for r in self.seqs if self.blocks.has(r)}
        return sum(
            max(self.blocks.blocks_needed(whole_len(r)) - held.get(r, 0), 0) for r in self.seqs
        )

    def add(self, seq: Sequence) -> None:
        """Queue a sequence for prefill."""
        self.seqs[seq.req_id] = seq
        self.policy.add_prompt(seq.req_id, seq.num_tokens, self.clock(), seq.priority)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose KV is already in its blocks (prefilled elsewhere)."""
        if not self.blocks.has(seq.req_id):
            raise ValueError(f"request {seq.req_id} holds no KV blocks")
        seq.num_computed = seq.num_tokens - 1
        self.seqs[seq.req_id] = seq
        now = self.clock()
        self.policy.add_decode(seq.req_id, seq.num_tokens - 1, now, now, resident=True)

    def remove(self, req_id: str) -> bool:
        """Finish or abort: drop the sequence and free its blocks. False if unknown."""
        found = self.seqs.pop(req_id, None) is not None
        self.policy.remove(req_id)
        self.blocks.free(req_id)
        for batch in self._rest:
            batch.seqs = [s for s in batch.seqs if s.req_id != req_id]
        return found

    def detach(self, req_id: str) -> Sequence | None:
        """Take a sequence out without freeing its blocks: its KV is moving to another tier,
        which frees them once it has landed there (services/engine/kv_swaps.py)."""
        seq = self.seqs.pop(req_id, None)
        self.policy.remove(req_id)
        for batch in self._rest:
            batch.seqs = [s for s in batch.seqs if s.req_id != req_id]
        return seq

    def schedule(self) -> Batch | None:
        """The next batch: the rest of the current plan, else the first of a new plan; None when
        there is nothing to run now."""
        while self._rest:
            batch = self._rest.popleft()
            if batch.seqs:
                return batch
        own = sum(len(self.blocks.block_table(str(r))) for r in self.policy.running
                  if self.blocks.has(str(r)))  # fmt: skip
        # NOTE: blocks shared through the prefix cache count once per holder in `own`, so the
        # policy sees at least what is really held (never less room than there is).
        self.policy.external_blocks = max(self.blocks.num_used_blocks - own, 0)
        plan = self.policy.schedule(self.clock())
        if self.plan_log is not None:
            self.plan_log.append(plan)
        preempted = [self._preempt(str(r)) for r in plan.preempted_ids]
        prefill = Batch(Phase.PREFILL, [self._reserve(str(r), 0) for r in plan.prefill_ids])
        decode = Batch(Phase.DECODE, self._reserve_decodes(plan, preempted))
        first = prefill if prefill.seqs else decode
        first.preempted = preempted
        if first is prefill and decode.seqs:
            self._rest.append(decode)
        return first if first.seqs else None

    def extend_decode(self, batch: Batch, num_steps: int) -> int:
        """Commit up to `num_steps - 1` more decode-only iterations for this decode batch, to run
        with it in one forward call (vLLM's `num_scheduler_steps`); returns how many iterations
        the batch now runs (1: its own alone). Only where nothing else is owed an iteration in
        between: the batch holds every running sequence, no prompt, resume or hand-off waits
        (it would wait all of them for its prefill), the current plan has no batch left, and
        the free blocks hold every step's token (`MixedBatchPolicy.max_decode_steps`, checked
        against the blocks themselves before anything is committed)."""
        policy = self.policy
        if (
            num_steps <= 1
            or batch.phase is not Phase.DECODE
            or self._rest
            or policy.has_waiting
            or len(batch.seqs) != len(policy.running)
        ):
            return 1
        extra = min(num_steps - 1, policy.max_decode_steps())
        if extra <= 0:
            return 1
        blocks = self.blocks
        lens = {s.req_id: policy.num_tokens(s.req_id) + extra for s in batch.seqs}
        need = sum(blocks.blocks_needed(n) - len(blocks.block_table(r)) for r, n in lens.items())
        if need > blocks.num_free_blocks:  # the counts disagree (module docstring): no extension
            return 1
        policy.advance(extra)
        for req_id, num_tokens in lens.items():
            blocks.grow(req_id, num_tokens)
        return 1 + extra

    def update(self, batch: Batch, finished: set[str], num_steps: int = 1) -> None:
        """After a forward of `num_steps` iterations (`extend_decode`): every sequence in it
        computed its input and gained one token an iteration."""
        for seq in batch.seqs:
            seq.num_computed = seq.num_tokens + num_steps - 1
            self.blocks.mark_computed(seq.req_id, seq.num_computed)
            seq.num_tokens += num_steps
        for req_id in finished:
            self.remove(req_id)

    def _reserve_decodes(self, plan: MixedPlan, preempted: list[Sequence]) -> list[Sequence]:
        """The plan's decodes, each with room for its new token. NOTE: one the blocks cannot
        grow (the policy's count and theirs disagree: a bug, not a state) is preempted alone and
        recomputed later, instead of failing the step for every request on the engine."""
        seqs = []
        for r in plan.decode_ids:
            try:
                seqs.append(self._reserve(str(r), 1))
            except NoFreeBlocksError as exc:
                log.error("no block for a planned decode; preempting it", req_id=str(r),
                          error=str(exc))  # fmt: skip
                self.policy.unplan(r, self.clock())
                preempted.append(self._preempt(str(r)))
        return seqs

    def _reserve(self, req_id: str, num_uncomputed: int) -> Sequence:
        """Mirror the policy's reservation into the blocks; `num_uncomputed`: the tokens the
        forward feeds (0: all of them, a prefill)."""
        seq = self.seqs[req_id]
        reserved = self.policy.num_tokens(req_id)  # this iteration's new token included
        seq.num_tokens = reserved - 1
        seq.num_computed = seq.num_tokens - num_uncomputed if num_uncomputed else 0
        if not self.blocks.has(req_id):
            # The tokens it holds now: the cache may cover a prefix of them, never the last one,
            # whose logits the prefill needs (allocating the new token's room too would let a
            # block-aligned prompt be matched whole). The policy still counts its whole length.
            self.blocks.allocate(req_id, seq.num_tokens, seq.token_ids)
            seq.num_computed = self.blocks.num_cached_tokens(req_id)
        self.blocks.grow(req_id, reserved)
        return seq

    def _preempt(self, req_id: str) -> Sequence:
        seq = self.seqs[req_id]
        self.blocks.free(req_id)
        seq.num_computed = 0
        seq.num_preemptions += 1
        return seq
