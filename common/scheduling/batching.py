"""Machine-level batching (Splitwise §IV-B), pure: no torch, no sockets.

One policy serves the real engine and the simulator:
- prompt phase: FCFS prefill batches capped at `max_num_batched_tokens` (2048 by default; a
  single longer prompt runs alone rather than starving);
- token phase: every running sequence decodes each step (continuous batching) for as long as KV
  blocks last; when they run out, the youngest sequence is preempted, its blocks freed, and it
  goes back to the head of the queue to be recomputed from its tokens.

A `mixed` engine runs both, prompts first. The engine loop reads:
`batch = scheduler.schedule()`, `out = runner.run(batch)`, `scheduler.update(batch, finished)`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from common.block_manager import BlockManager
from common.config import SchedulerConfig


class Phase(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Sequence:
    """The scheduler's view of one request: token counts only."""

    req_id: str
    num_tokens: int  # prompt plus generated so far
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    # Its tokens when known (the prompt): with prefix caching, the prefill starts after the
    # longest cached prefix of them (docs/prefix_caching.md). None: never looked up or cached.
    token_ids: list[int] | None = None


@dataclass
class Batch:
    """One step's plan: the sequences to run in one phase, and who was preempted to make room."""

    phase: Phase
    seqs: list[Sequence]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        if self.phase is Phase.DECODE:
            return len(self.seqs)
        return sum(s.num_tokens - s.num_computed for s in self.seqs)


class BatchScheduler:
    """FCFS prefill batching and memory-bounded continuous decode batching over a BlockManager.

    `prefill` / `decode` pick the phases this machine runs (Splitwise's prompt, token or mixed
    machine); a mixed machine prefers prompts, as Splitwise's mixed pool does.
    """

    def __init__(
        self,
        blocks: BlockManager,
        config: SchedulerConfig,
        prefill: bool = True,
        decode: bool = True,
    ) -> None:
        self.blocks = blocks
        self.config = config
        self.runs_prefill, self.runs_decode = prefill, decode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # total, for metrics and tests

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def pending_prompt_tokens(self) -> int:
        return sum(s.num_tokens for s in self.waiting)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence for prefill."""
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose KV is already in its blocks (prefilled elsewhere)."""
        if not self.blocks.has(seq.req_id):
            raise ValueError(f"request {seq.req_id} holds no KV blocks")
        seq.num_computed = seq.num_tokens - 1
        self.running.append(seq)

    def remove(self, req_id: str) -> bool:
        """Finish or abort: drop the sequence and free its blocks. False if unknown."""
        found = False
        for queue in (self.waiting, self.running):
            for seq in list(queue):
                if seq.req_id == req_id:
                    queue.remove(seq)
                    found = True
        self.blocks.free(req_id)
        return found

    def schedule(self) -> Batch | None:
        """The next step's batch, or None when there is nothing this machine can run now."""
        if self.runs_prefill and self.waiting:
            batch = self._schedule_prefill()
            if batch.seqs:
                return batch
        if self.runs_decode and self.running:
            return self._schedule_decode()
        return None

    def update(self, batch: Batch, finished: set[str]) -> None:
        """After a step: every scheduled sequence computed its input and gained one token."""
        for seq in batch.seqs:
            seq.num_computed = seq.num_tokens
            self.blocks.mark_computed(seq.req_id, seq.num_computed)
            seq.num_tokens += 1
        for req_id in finished:
            self.remove(req_id)

    def _schedule_prefill(self) -> Batch:
        seqs: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) + len(seqs) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seqs and seq.num_tokens > budget:
                break  # FCFS: no skipping ahead of a prompt that does not fit this batch
            # Room for the prompt and the first decoded token, less any cached prefix it reuses.
            if not self.blocks.can_allocate(seq.num_tokens + 1, seq.token_ids):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq.req_id, seq.num_tokens, seq.token_ids)
            # The cached prefix is computed already: the prefill covers the rest only.
            seq.num_computed = self.blocks.num_cached_tokens(seq.req_id)
            seqs.append(seq)
            budget -= seq.num_tokens - seq.num_computed
        if self.runs_decode:
            self.running.extend(seqs)
        return Batch(Phase.PREFILL, seqs)

    def _schedule_decode(self) -> Batch:
        preempted: list[Sequence] = []
        scheduled: list[Sequence] = []
        queue = list(self.running)  # oldest first
        while queue:
            seq = queue.pop(0)
            # The input token sits at position num_tokens - 1: it needs a slot.
            while not self.blocks.can_grow(seq.req_id, seq.num_tokens):
                victim = queue.pop() if queue else seq  # the youngest goes first
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq.req_id, seq.num_tokens)
                scheduled.append(seq)
        return Batch(Phase.DECODE, scheduled, preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.req_id)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
