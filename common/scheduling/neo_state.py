"""The inputs and output of Neo's load-aware scheduler (Neo §3.2): plain, frozen data.

Two KV tiers per token engine: *local* (the engine's own KV, attention beside the model: Neo's
GPU-requests) and *offload* (the attention shards' KV and attention: Neo's CPU-requests). Each
iteration runs at most two sub-batches (asymmetric pipelining, Neo §3.1):

- batch-0: the prefills, every local decode and a few offloaded decodes; its linear part is long;
- batch-1: offloaded decodes only; its linear part is short and its (offloaded) attention long.

Times are seconds for the whole model (all layers): Neo's estimate T = L x (per-layer max terms)
has the same inequalities with every term summed over the layers.

Memory is counted in KV blocks of `block_size` tokens, as a `BlockManager` allocates them: a
request holding n tokens takes ceil(n / block_size) blocks, and one decode step adds one token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

ReqId = int | str  # the simulator numbers requests; engines name them


class NeoCostModel(Protocol):
    """Estimated times (seconds, all layers) of the parts of one iteration (Neo §3.2)."""

    def linear_s(self, num_tokens: int) -> float:
        """T_l: everything but attention (projections, MLP, ...) over `num_tokens` batch tokens
        (a prompt's tokens, one per decode); 0 for 0 tokens."""
        ...

    def local_attention_s(self, num_context_tokens: int) -> float:
        """T_ga: decode attention over local KV, for a sub-batch whose requests hold
        `num_context_tokens` context tokens in all."""
        ...

    def offload_attention_s(self, num_context_tokens: int) -> float:
        """T_ca: decode attention on the offload tier (shards, host CPU) over that many tokens."""
        ...


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class DecodeRequest:
    """A running request: its id and the context tokens its KV holds (prompt + generated)."""

    req_id: ReqId
    context_len: int

    def __post_init__(self) -> None:
        if self.context_len <= 0:
            raise ValueError(f"neo: request {self.req_id!r} has context_len {self.context_len}")

    def blocks(self, block_size: int) -> int:
        return blocks_for(self.context_len, block_size)

    def growth_blocks(self, block_size: int) -> int:
        """Blocks one more token takes (0 or 1)."""
        return blocks_for(self.context_len + 1, block_size) - self.blocks(block_size)


@dataclass(frozen=True)
class PrefillRequest:
    """A waiting prompt: its id and prompt tokens (its KV after the prefill)."""

    req_id: ReqId
    prompt_len: int

    def __post_init__(self) -> None:
        if self.prompt_len <= 0:
            raise ValueError(f"neo: prompt {self.req_id!r} has prompt_len {self.prompt_len}")


@dataclass(frozen=True)
class NeoState:
    """What the scheduler sees at the start of an iteration.

    `local_decodes` (Neo's GPU decoding runqueue) and `offload_decodes` (its CPU decoding
    runqueue) are in priority order, oldest first: swap-outs take from the end of the local
    queue, swap-ins from the front of the offload queue. `waiting_prefills` is FCFS. Free
    blocks are what each tier can still allocate now."""

    local_decodes: Sequence[DecodeRequest]
    offload_decodes: Sequence[DecodeRequest]
    waiting_prefills: Sequence[PrefillRequest]
    local_free_blocks: int
    offload_free_blocks: int
    local_total_blocks: int = 0  # the local tier's size (swap-in watermark); 0: free counts

    def __post_init__(self) -> None:
        if self.local_free_blocks < 0 or self.offload_free_blocks < 0:
            raise ValueError("neo: free blocks must be >= 0")
        if self.local_total_blocks and self.local_total_blocks < self.local_free_blocks:
            raise ValueError("neo: local_total_blocks < local_free_blocks")
        ids = [r.req_id for r in (*self.local_decodes, *self.offload_decodes)]
        ids += [p.req_id for p in self.waiting_prefills]
        if len(set(ids)) != len(ids):
            raise ValueError("neo: a request id appears twice in the state")


@dataclass(frozen=True)
class NeoConfig:
    """Knobs.

    - `max_prefill_tokens` stands for "until the GPU cannot hold the activations" (step 3); a
      prompt longer than it still runs, alone.
    - `prefill_floor_tokens`: step 5 drops offload-bound prefills only while batch-0 keeps at
      least this many tokens (Neo's implementation keeps the linear stage this wide: below it a
      GPU's linear time hardly shrinks with fewer tokens, so dropping more gains nothing).
    - `swap_in_watermark`: swap-ins stop once the local tier would be this full, so that a
      request swapped in is not swapped out again by the next iteration's growth.
    - `allow_offload` False gives the local-only baseline (Neo's GPU-only SwiftLLM): no swap,
      a request that does not fit is preempted (recomputed later), as vLLM does.
    """

    block_size: int = 16
    max_prefill_tokens: int = 2048
    prefill_floor_tokens: int = 256
    swap_in_watermark: float = 0.95
    max_num_seqs: int = 0  # requests in one iteration at most; 0: no limit
    allow_offload: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_prefill_tokens <= 0 or self.max_num_seqs < 0:
            raise ValueError("neo: block_size, max_prefill_tokens > 0 and max_num_seqs >= 0")
        if self.prefill_floor_tokens < 0 or not 0 < self.swap_in_watermark <= 1:
            raise ValueError("neo: prefill_floor_tokens >= 0 and 0 < swap_in_watermark <= 1")


@dataclass(frozen=True)
class StageTimes:
    """The five estimates of one schedule, and its step time and requests served."""

    linear0_s: float  # T_l0
    linear1_s: float  # T_l1 (0 when batch-1 is empty)
    local_attention0_s: float  # T_ga0
    offload_attention0_s: float  # T_ca0
    offload_attention1_s: float  # T_ca1
    num_requests: int

    @property
    def step_s(self) -> float:
        """T = max(T_l0, T_ca1) + max(T_l1 + T_ga0, T_ca0) (Neo §3.2)."""
        first = max(self.linear0_s, self.offload_attention1_s)
        return first + max(self.linear1_s + self.local_attention0_s, self.offload_attention0_s)

    @property
    def balanced(self) -> bool:
        """Both inequalities: T_ca1 <= T_l0 and T_ca0 <= T_l1 + T_ga0 (offload hidden)."""
        return self.offload_attention1_s <= self.linear0_s + 1e-12 and (
            self.offload_attention0_s <= self.linear1_s + self.local_attention0_s + 1e-12
        )

    @property
    def throughput(self) -> float:
        """Requests served (one token each) per second: the quantity step 6 compares."""
        return self.num_requests / self.step_s if self.step_s > 0 else 0.0


@dataclass(frozen=True)
class NeoPlan:
    """One iteration. Every listed request produces one token, except swapped-out ones.

    - `prefill_ids`: prompts prefilled in batch-0; those in `prefill_offload_ids` have their KV
      swapped out to the offload tier as it is made (layer by layer), the rest keep it local.
    - `local_ids`: local decodes in batch-0 (including `swap_in_ids`, whose KV comes back first).
    - `offload0_ids` / `offload1_ids`: offloaded decodes in batch-0 / batch-1.
    - `swap_out_ids`: local decodes whose KV moves to the offload tier; they skip this iteration.
    - `preempted_ids`: local decodes whose KV is dropped (no room in either tier, or offload
      disabled): the caller re-queues them as prompts over their tokens so far.
    - `deferred_ids`: offloaded decodes left for a later iteration (the inequalities, or memory).
    - `two_batch`: False when step 6 kept the local-only schedule (then both offload lists are
      empty and batch-1 does not run).
    """

    prefill_ids: tuple[ReqId, ...] = ()
    prefill_offload_ids: tuple[ReqId, ...] = ()
    local_ids: tuple[ReqId, ...] = ()
    offload0_ids: tuple[ReqId, ...] = ()
    offload1_ids: tuple[ReqId, ...] = ()
    swap_out_ids: tuple[ReqId, ...] = ()
    swap_in_ids: tuple[ReqId, ...] = ()
    preempted_ids: tuple[ReqId, ...] = ()
    deferred_ids: tuple[ReqId, ...] = ()
    two_batch: bool = False
    times: StageTimes = field(default_factory=lambda: StageTimes(0, 0, 0, 0, 0, 0))

    @property
    def step_s(self) -> float:
        return self.times.step_s

    @property
    def throughput(self) -> float:
        return self.times.throughput

    @property
    def is_empty(self) -> bool:
        return not (self.prefill_ids or self.local_ids or self.offload0_ids or self.offload1_ids)

    @property
    def num_requests(self) -> int:
        return (
            len(self.prefill_ids)
            + len(self.local_ids)
            + len(self.offload0_ids)
            + len(self.offload1_ids)
        )
