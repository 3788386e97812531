"""Machine-level scheduling (Splitwise §IV-B): mixed continuous batching, the ONE policy that both
the live engines (through `common.scheduling.batching.PolicyScheduler`, over their real
`BlockManager`) and the simulator (`loadgen.sim.machine.SimMachine`) run, through the same methods:
`add_prompt` / `add_decode` / `schedule` / `finish`. Feeding both the same arrivals gives the same
plans (tests/unit/test_policy_equivalence.py).

Rules, in the order `schedule` applies them:

1. Prompts first. Waiting prompts are admitted FCFS into this iteration up to `prompt_token_cap`
   batch tokens (a single longer prompt runs alone), so TTFT stays low.
2. If a prompt does not fit in KV memory, running decodes are preempted to make room: the youngest
   first (a decode's priority grows with its age), and never one that has already been preempted
   `max_preemptions` times. A preempted request loses its KV and waits to be recomputed.
3. A preempted request's priority keeps growing while it waits: once it has waited
   `starvation_s` it goes ahead of new prompts.
4. Decodes whose KV arrived from another machine join FCFS while memory lasts (token-machine rule).
5. Every running decode generates one token per iteration; if their growth would overflow memory,
   the youngest preemptable decodes are preempted.

A prompt-only or token-only machine is the degenerate case (no decodes / no prompts), so every
role runs through this one class: a prompt machine `finish`es a request once its KV has left.

Memory is counted in KV blocks of `block_size` tokens, as a `BlockManager` allocates them: a
sequence holding n tokens takes ceil(n / block_size) blocks. The simulator uses block_size 1 (exact
token counts, O(1) per query); an engine uses its cache's block size, so the policy's count is the
block manager's. Blocks the machine holds outside the policy (KV landing for a hand-off not yet
admitted, another policy sharing the cache) are `external_blocks`.

Time is counted in iterations (`step`), so that many decode-only iterations can be applied at once
(`advance`) in O(1): a sequence's generated count is `gen_base + step - join_step`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain, count
from typing import NamedTuple

ReqId = int | str  # the simulator numbers requests; engines name them


@dataclass(frozen=True)
class MixedPolicyConfig:
    """Knobs of mixed continuous batching."""

    kv_capacity_tokens: int
    prompt_token_cap: int = 2048
    max_preemptions: int = 2
    starvation_s: float = 1.0
    block_size: int = 1  # KV allocation granule, in tokens
    max_num_seqs: int = 0  # running sequences at most; 0: no limit but memory

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens <= 0 or self.prompt_token_cap <= 0 or self.block_size <= 0:
            raise ValueError(
                "mixed policy: kv_capacity_tokens, prompt_token_cap and block_size must be > 0"
            )
        if self.max_num_seqs < 0:
            raise ValueError("mixed policy: max_num_seqs must be >= 0")
        if self.max_preemptions < 0 or self.starvation_s < 0:
            raise ValueError("mixed policy: max_preemptions and starvation_s must be >= 0")


@dataclass(eq=False, slots=True)
class SeqState:
    """One request on the machine. Its KV holds `prompt_len + generated` tokens; a prefill here
    computes `prompt_len + gen_base` (the prompt, plus the generated tokens after a preemption)."""

    req_id: ReqId
    prompt_len: int
    arrival_s: float
    order: int = 0  # arrival order on the machine: breaks ties between equal arrival times
    num_preemptions: int = 0
    gen_base: int = 0
    join_step: int = 0
    waiting_since_s: float = 0.0
    is_resume: bool = field(default=False)
    priority: int = 0  # vLLM's request priority: a lower one is prefilled sooner

    @property
    def prefill_len(self) -> int:
        return self.prompt_len + self.gen_base


class MixedPlan(NamedTuple):
    """One iteration: prompts to prefill, decodes to step, and requests preempted to make room.
    (A named tuple: the simulator makes millions, and a frozen dataclass costs three times as
    much to build.)"""

    prefill_ids: tuple[ReqId, ...] = ()
    num_prefill_tokens: int = 0
    decode_ids: tuple[ReqId, ...] = ()
    preempted_ids: tuple[ReqId, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.prefill_ids and not self.decode_ids


EMPTY_PLAN = MixedPlan()


def preemption_order(
    running: Iterable[SeqState], max_preemptions: int, ignore_cap: bool = False
) -> list[SeqState]:
    """Running decodes in preemption order: the youngest (lowest age priority: latest arrival)
    first; one already preempted `max_preemptions` times is left out unless `ignore_cap`."""
    eligible = [s for s in running if ignore_cap or s.num_preemptions < max_preemptions]
    return sorted(eligible, key=lambda s: (-s.arrival_s, -s.order))


def next_victim(running: Iterable[SeqState], max_preemptions: int) -> SeqState | None:
    """The decode to preempt when memory runs out for growth (rule 5): the youngest under the
    cap, else, as a last resort, the youngest of all; None when nothing runs. The token engine's
    sharded decodes take the same choice (services/engine/admission.py)."""
    running = list(running)
    victims = preemption_order(running, max_preemptions) or preemption_order(
        running, max_preemptions, ignore_cap=True
    )
    return victims[0] if victims else None


class MixedBatchPolicy:
    """Mixed continuous batching with prompt priority, aging and a preemption cap (see module)."""

    def __init__(self, config: MixedPolicyConfig) -> None:
        self.config = config
        self.step = 0
        self.prompts: deque[SeqState] = deque()  # new prompts, by priority then FCFS
        self.resumes: list[SeqState] = []  # preempted, oldest arrival first
        self.arrived_decodes: deque[SeqState] = deque()  # KV landed from elsewhere, FCFS
        self.running: dict[ReqId, SeqState] = {}
        self.pending_prompt_tokens = 0  # prefill tokens waiting (prompts and resumes)
        self.external_blocks = 0  # KV blocks of the machine held outside this policy
        self.num_preemptions = 0  # in all, for metrics and tests
        self._kv_offset = 0  # sum over running of (prompt_len + gen_base - join_step)
        self._prefilling: set[ReqId] = set()
        self._order = count()
        self._capacity_blocks = config.kv_capacity_tokens // config.block_size
        self._exact_tokens = config.block_size == 1  # a block per token: counts in O(1)

    # -- inputs ---------------------------------------------------------------------------------

    def add_prompt(
        self, req_id: ReqId, prompt_len: int, arrival_s: float, priority: int = 0
    ) -> None:
        """A new prompt; it waits behind those of its `priority` or lower that came first, ahead
        of those of a higher one (vLLM's: lower is sooner). Resumes keep their place."""
        seq = SeqState(req_id, prompt_len, arrival_s, next(self._order), waiting_since_s=arrival_s,
                       priority=priority)  # fmt: skip
        if not self.prompts or self.prompts[-1].priority <= priority:
            self.prompts.append(seq)  # the common case: no priorities, O(1)
        else:
            at = next(i for i, s in enumerate(self.prompts) if s.priority > priority)
            self.prompts.insert(at, seq)
        self.pending_prompt_tokens += prompt_len

    def add_decode(
        self, req_id: ReqId, prompt_len: int, arrival_s: float, now: float, resident: bool = False
    ) -> None:
        """A request prefilled elsewhere (first token generated there), `prompt_len` tokens before
        that token. In the simulator its KV lands here when memory allows (FCFS); an engine's
        arrives before the hand-off (`resident`: already in the machine's blocks), so it joins
        the running decodes at once."""
        seq = SeqState(req_id, prompt_len, arrival_s, next(self._order), gen_base=1,
                       waiting_since_s=now)  # fmt: skip
        if resident:
            self._join(seq, gen_base=1, join_step=self.step)
        else:
            self.arrived_decodes.append(seq)

    def advance(self, num_steps: int) -> None:
        """`num_steps` more decode-only iterations ran over the current running set."""
        self.step += num_steps

    def finish(self, req_id: ReqId) -> None:
        """The request is done here (finished, or its KV left for its token machine)."""
        seq = self.running.pop(req_id)
        self._kv_offset -= seq.prompt_len + seq.gen_base - seq.join_step

    def remove(self, req_id: ReqId) -> bool:
        """Forget a request wherever it is (an abort); False if it is not here."""
        if req_id in self.running:
            self.finish(req_id)
            return True
        for queue in (self.prompts, self.resumes, self.arrived_decodes):
            for seq in queue:
                if seq.req_id == req_id:
                    queue.remove(seq)  # type: ignore[arg-type]
                    if queue is not self.arrived_decodes:
                        self.pending_prompt_tokens -= seq.prefill_len
                    return True
        return False

    def unplan(self, req_id: ReqId, now: float) -> None:
        """Take back a decode the last plan stepped: its machine found no block for it (its
        count and the policy's disagree). It is preempted as if before that plan (the token the
        plan counted is not generated) and recomputed later; its batch-mates go on."""
        seq = self.running[req_id]
        seq.join_step += 1
        self._kv_offset -= 1  # it holds `prompt_len + gen_base - join_step` (+ step)
        self._preempt(seq, now, [])

    # -- queries --------------------------------------------------------------------------------

    def num_generated(self, req_id: ReqId) -> int:
        seq = self.running[req_id]
        return seq.gen_base + self.step - seq.join_step

    def num_tokens(self, req_id: ReqId) -> int:
        """The KV a running request holds: its prompt and every token generated so far (the one
        this iteration generates included, once planned)."""
        return self.running[req_id].prompt_len + self.num_generated(req_id)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    @property
    def capacity_blocks(self) -> int:
        return self._capacity_blocks

    @property
    def used_blocks(self) -> int:
        """Blocks the running requests hold (external ones not counted)."""
        if self._exact_tokens:
            return self._kv_offset + len(self.running) * self.step
        return sum(self.blocks_for(self.num_tokens(r)) for r in self.running)

    @property
    def kv_used(self) -> int:
        if self._exact_tokens:  # the simulator's, asked for every load report
            return self._kv_offset + len(self.running) * self.step + self.external_blocks
        return (self.used_blocks + self.external_blocks) * self.config.block_size

    @property
    def kv_free(self) -> int:
        return self.config.kv_capacity_tokens - self.kv_used

    @property
    def free_blocks(self) -> int:
        return self._capacity_blocks - self.used_blocks - self.external_blocks

    def _fits(self, num_tokens: int) -> bool:
        """Whether `num_tokens` more fit in this iteration's plan so far."""
        if self._exact_tokens:  # the general count below, inline (the simulator's every plan)
            used = self._kv_offset + len(self.running) * self.step + self.external_blocks
            return self._capacity_blocks - used - len(self._prefilling) >= num_tokens
        return self.free_blocks - self._prefill_growth() >= self.blocks_for(num_tokens)

    def _prefill_growth(self) -> int:
        """Blocks this iteration's prefills take at the token each generates. NOTE: while a plan
        is made they are counted at their prefill length (the iteration has not run), so
        without this each admission would see the room of the ones before it twice."""
        if self._exact_tokens:
            return len(self._prefilling)
        bs = self.config.block_size
        return sum(1 for r in self._prefilling if self.num_tokens(r) % bs == 0)

    @property
    def has_waiting(self) -> bool:
        return bool(self.prompts or self.resumes or self.arrived_decodes)

    def max_decode_steps(self) -> int:
        """How many decode-only iterations the running set can take before memory runs out (a
        lower bound with blocks: each sequence may need a new block every block_size steps)."""
        num_running = len(self.running)
        if not num_running:
            return 0
        if self._exact_tokens:  # `free_blocks`, inline (the simulator asks at every decode run)
            used = self._kv_offset + num_running * self.step + self.external_blocks
            return (self._capacity_blocks - used) // num_running
        return self.free_blocks // num_running * self.config.block_size

    # -- the plan -------------------------------------------------------------------------------

    def schedule(self, now: float) -> MixedPlan:
        """Plan the next iteration (rules 1-5 of the module docstring) and commit it.

        Prefilled sequences join `running` at once (their KV is reserved) and decode from the next
        iteration; the iteration itself counts as one step.
        """
        running, has_prompts = self.running, self.prompts or self.resumes
        if not running and not has_prompts and not self.arrived_decodes:
            self._prefilling.clear()
            return EMPTY_PLAN  # an idle machine (a prompt machine between prompts)
        preempted: list[ReqId] = []
        if self._prefilling:
            self._prefilling = set()
        # (req_id, prefill tokens) admitted
        prefill = self._admit_prefills(now, preempted) if has_prompts else []
        if self.arrived_decodes:
            self._admit_arrived_decodes()
        self._fit_growth(now, preempted)
        prefilling = self._prefilling
        if prefilling:
            decode_ids = tuple(r for r in running if r not in prefilling)
        else:
            decode_ids = tuple(running)
        if prefill or decode_ids:
            self.step += 1  # an empty plan is not an iteration
        if not prefill:
            return MixedPlan((), 0, decode_ids, tuple(preempted) if preempted else ())
        prefill_ids, num_tokens = zip(*prefill, strict=True)
        return MixedPlan(prefill_ids, sum(num_tokens), decode_ids, tuple(preempted))

    def _waiting_order(self, now: float) -> Iterator[SeqState]:
        if not self.resumes:
            return iter(self.prompts)
        starvation = self.config.starvation_s
        starved = [s for s in self.resumes if now - s.waiting_since_s >= starvation]
        fresh = [s for s in self.resumes if now - s.waiting_since_s < starvation]
        return chain(starved, self.prompts, fresh)

    def _admit_prefills(self, now: float, preempted: list[ReqId]) -> list[tuple[ReqId, int]]:
        admitted: list[SeqState] = []
        lengths: list[tuple[ReqId, int]] = []
        budget = self.config.prompt_token_cap
        max_num_seqs = self.config.max_num_seqs
        for seq in self._waiting_order(now):
            prefill_len = seq.prompt_len + seq.gen_base  # (`prefill_len`, read once)
            if admitted and prefill_len > budget:
                break  # FCFS: nothing skips ahead of a prompt that does not fit
            if 0 < max_num_seqs <= len(self.running):
                break
            if not self._fits(prefill_len + 1) and not self._preempt_for(
                prefill_len + 1, now, preempted
            ):
                break
            admitted.append(seq)
            lengths.append((seq.req_id, prefill_len))
            budget -= prefill_len
            # Reserve its KV now so later admissions see it.
            self._join(seq, seq.gen_base + 1, self.step + 1)  # (gen_base, join_step)
            self._prefilling.add(seq.req_id)
        for seq, (_, prefill_len) in zip(admitted, lengths, strict=True):
            self._unqueue(seq, prefill_len)
        return lengths

    def _admit_arrived_decodes(self) -> None:
        while self.arrived_decodes and self._fits(self.arrived_decodes[0].prompt_len + 2):
            if 0 < self.config.max_num_seqs <= len(self.running):
                return
            seq = self.arrived_decodes.popleft()
            self._join(seq, gen_base=seq.gen_base, join_step=self.step)

    def _fit_growth(self, now: float, preempted: list[ReqId]) -> None:
        """Make room for one more token per running decode."""
        if self._exact_tokens:  # the common case, inline: room for all (free >= growth)
            num_running = len(self.running)
            used = self._kv_offset + num_running * (self.step + 1) + self.external_blocks
            if used <= self._capacity_blocks:
                return
        while self.running and self.free_blocks < self._growth_blocks():
            running = [s for s in self.running.values() if s.req_id not in self._prefilling]
            victim = next_victim(running, self.config.max_preemptions)
            if victim is None:
                return
            self._preempt(victim, now, preempted)

    def _growth_blocks(self) -> int:
        """New blocks one more token for every running request takes (decodes, and this
        iteration's prefills at the token they generate): one each whose last block is full."""
        if self._exact_tokens:
            return len(self.running)
        return sum(1 for r in self.running if self.num_tokens(r) % self.config.block_size == 0)

    def _victims(self, ignore_cap: bool) -> list[SeqState]:
        """Running decodes in preemption order (`preemption_order`); this iteration's prefills
        are never preempted."""
        running = [s for s in self.running.values() if s.req_id not in self._prefilling]
        return preemption_order(running, self.config.max_preemptions, ignore_cap)

    def _preempt_for(self, need: int, now: float, preempted: list[ReqId]) -> bool:
        """Preempt youngest eligible decodes until `need` KV tokens fit; False (and no
        preemption at all) if even all eligible decodes would not free enough."""
        victims = self._victims(ignore_cap=False)
        freeable = sum(self.blocks_for(self.num_tokens(s.req_id)) for s in victims)
        if self.free_blocks - self._prefill_growth() + freeable < self.blocks_for(need):
            return False
        for seq in victims:
            if self._fits(need):
                break
            self._preempt(seq, now, preempted)
        return True

    def _preempt(self, seq: SeqState, now: float, preempted: list[ReqId]) -> None:
        generated = self.num_generated(seq.req_id)
        self.finish(seq.req_id)
        resumed = SeqState(
            seq.req_id,
            seq.prompt_len,
            seq.arrival_s,
            seq.order,
            num_preemptions=seq.num_preemptions + 1,
            gen_base=generated,
            waiting_since_s=now,
            is_resume=True,
        )
        self.resumes.append(resumed)
        self.resumes.sort(key=lambda s: (s.arrival_s, s.order))
        self.pending_prompt_tokens += resumed.prefill_len
        self.num_preemptions += 1
        preempted.append(seq.req_id)

    def _unqueue(self, seq: SeqState, prefill_len: int) -> None:
        self.pending_prompt_tokens -= prefill_len
        if seq.is_resume:
            self.resumes.remove(seq)
        else:
            # Admitted prompts are always the head of the FCFS deque: admission stops at the
            # first prompt that does not fit.
            self.prompts.popleft()

    def _join(self, seq: SeqState, gen_base: int, join_step: int) -> None:
        seq.gen_base, seq.join_step = gen_base, join_step
        self.running[seq.req_id] = seq
        self._kv_offset += seq.prompt_len + gen_base - join_step
