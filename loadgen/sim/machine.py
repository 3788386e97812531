"""One simulated machine: a `MixedBatchPolicy`, a performance model, and its current iteration.

Decode-only stretches run as one *run* of many iterations (one event instead of one per token):
the run lasts until the first running request would finish, or memory would run out, and is cut
short at the next iteration boundary when new work arrives (`interrupt`). This keeps the event count
proportional to requests, not tokens.

With a prefix cache (`loadgen/sim/prefix_cache.py`) a prefill costs its uncached suffix only: the
prompts a plan admits look their blocks up when it starts, and register their own when it ends.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from common.kv_events import reusable_blocks
from common.perf_model import PerfModel
from common.roles import Role
from common.scheduling.mixed import MixedBatchPolicy, MixedPlan
from loadgen.sim.prefix_cache import BlockKey, SimPrefixCache

REQ_BITS = 40  # request ids below 2**40 (a replay's record indexes)
REQ_MASK = (1 << REQ_BITS) - 1


class StepTimes:
    """A performance model's iteration times, memoized: machines ask for the same batch sizes
    and prefill lengths over and over, and the lookups are pure (the same floats)."""

    def __init__(self, perf: PerfModel) -> None:
        self.perf = perf
        self.decode: dict[int, float] = {}  # batch size -> step seconds, as asked so far
        self.iteration: dict[tuple[int, int], float] = {}  # (prefill tokens, decodes) -> s

    def decode_s(self, batch_size: int) -> float:
        step_s = self.decode.get(batch_size)
        if step_s is None:
            step_s = self.decode[batch_size] = self.perf.decode_s(batch_size)
        return step_s

    def iteration_s(self, num_prefill_tokens: int, num_decodes: int) -> float:
        key = (num_prefill_tokens, num_decodes)
        step_s = self.iteration.get(key)
        if step_s is None:
            step_s = self.iteration[key] = self.perf.iteration_s(*key)
        return step_s


@dataclass(slots=True)
class Run:
    """The iteration (or run of decode-only iterations) in progress."""

    plan: MixedPlan
    start_s: float
    step_s: float
    num_steps: int
    stall_s: float = 0.0  # before the first iteration: hand-offs being admitted (shared_cpu.py)

    @property
    def end_s(self) -> float:
        return self.start_s + self.stall_s + self.step_s * self.num_steps


class SimMachine:
    """A machine's state in the simulator; the `Simulator` drives it through events."""

    def __init__(
        self,
        machine_id: int,
        home: Role,
        policy: MixedBatchPolicy,
        perf: PerfModel,
        cache: SimPrefixCache | None = None,
        block_keys: Mapping[int, tuple[BlockKey, ...]] | None = None,
        block_len: int = 0,
        step_times: StepTimes | None = None,
    ) -> None:
        self.machine_id = machine_id
        self.home = home
        self.policy = policy
        self._kv_capacity = policy.config.kv_capacity_tokens
        self.perf = perf
        # Shared by the machines of one type (the simulator's), or this machine's own.
        self.step_times = step_times or StepTimes(perf)
        self.run: Run | None = None
        self.version = 0  # bumps whenever the pending end-of-run event is superseded
        self.inbound_kv_tokens = 0  # KV in flight towards this SimMachine
        self.prompt_tokens_in = 0  # of the prompts routed to it (an engine's `LoadReport` counter)
        self.busy_s = 0.0
        self.max_run_steps = 0  # > 0: decode runs end after this many iterations
        self.pending_stall_s = 0.0  # the next run waits this long first (hand-offs landed)
        # (policy step when done, req_id) packed in one int, `step << REQ_BITS | req_id`: the
        # same order as the pair, compared as one number (cheaper than a tuple, pushed often).
        self._finish_heap: list[int] = []
        self._tracked: dict[int, int] = {}  # req_id -> join_step already in the heap
        self._landed: deque[int] = deque()  # decodes whose KV landed, waiting to join (FCFS)
        self.cache = cache
        # req_id -> its full prompt blocks' keys (the simulator's dict, filled as requests come)
        self.block_keys = {} if block_keys is None else block_keys
        self.block_len = block_len
        self.hit_tokens: dict[int, int] = {}  # req_id -> prefix found cached at its prefill
        self.num_hit_tokens = 0
        self.num_computed_tokens = 0  # prefill tokens computed (the uncached suffixes)

    def load(self) -> tuple[int, int, int]:
        """What its load report would say: (pending prompt tokens, decode tokens, free KV
        tokens), a `MachineLoad`'s figures."""
        policy, run = self.policy, self.run
        # NOTE: a prefill in progress is still pending work for JSQ; without it every busy
        # machine would look idle between batches.
        running_prefill = run.plan.num_prefill_tokens if run is not None else 0
        held = policy.kv_used + self.inbound_kv_tokens
        return (policy.pending_prompt_tokens + running_prefill, held, self._kv_capacity - held)

    @property
    def is_idle(self) -> bool:
        """Nothing running, queued, or on its way here (KV routed to it that has not landed):
        a draining machine may stop."""
        policy = self.policy
        return (
            self.run is None
            and self.inbound_kv_tokens == 0
            and not policy.running
            and not policy.has_waiting
        )

    def add_decode(self, req_id: int, prompt_len: int, arrival_s: float, now: float) -> None:
        """A request's KV landed from its prompt machine: it joins when memory allows."""
        self.policy.add_decode(req_id, prompt_len, arrival_s, now)
        self._landed.append(req_id)

    def start(self, now: float, output_len: Sequence[int]) -> Run | None:
        """Plan and start the next iteration or decode run; None when there is nothing to do."""
        policy, landed = self.policy, self._landed
        if not (policy.running or policy.prompts or policy.resumes or policy.arrived_decodes):
            return None  # idle (a prompt machine between prompts): `schedule` would plan nothing
        plan = policy.schedule(now)
        # The plan's joins: its prefills, and the landed decodes it admitted (the policy takes
        # them FCFS, so they are the head of `_landed`).
        joined: Sequence[int] = cast("tuple[int, ...]", plan.prefill_ids)  # (ids are ints here)
        if len(landed) > len(policy.arrived_decodes):
            joined = list(joined)
            for _ in range(len(landed) - len(policy.arrived_decodes)):
                joined.append(landed.popleft())
        prefill_ids, decode_ids = plan.prefill_ids, plan.decode_ids
        if not prefill_ids and not decode_ids:
            self.run = None
            return None
        self._track(joined, output_len)
        stall_s, self.pending_stall_s = self.pending_stall_s, 0.0
        times = self.step_times  # (its memos read inline: a lookup per run)
        if prefill_ids:
            key = (self._computed_prefill_tokens(plan), len(decode_ids))
            step_s = times.iteration.get(key)
            if step_s is None:
                step_s = times.iteration_s(*key)
            run = self.run = Run(plan, now, step_s, 1, stall_s)
        else:
            step_s = times.decode.get(len(decode_ids))
            if step_s is None:
                step_s = times.decode_s(len(decode_ids))
            run = self.run = Run(plan, now, step_s, self._run_len(), stall_s)
        self.version += 1
        return run

    def interrupt(self, now: float) -> float | None:
        """Cut a decode run at the first iteration boundary after `now`; the new end time, or
        None if there is no run to cut."""
        run = self.run
        if run is None or run.num_steps == 1:
            return None
        done = max(1, math.ceil((now - run.start_s - run.stall_s) / run.step_s))
        if done >= run.num_steps:
            return None
        run.num_steps = done
        self.version += 1
        return run.end_s

    def complete(self) -> tuple[MixedPlan, list[int]]:
        """Apply the finished run to the policy; its plan and the requests that are done."""
        run = self.run
        assert run is not None
        self.policy.advance(run.num_steps - 1)
        if self.cache is not None:  # the prefills' blocks are computed: others may now reuse them
            for req_id in run.plan.prefill_ids:
                self.cache.register(int(req_id), self.block_keys.get(int(req_id), ()))
        self.busy_s += run.stall_s + run.step_s * run.num_steps
        self.run = None
        return run.plan, self._pop_finished()

    def _computed_prefill_tokens(self, plan: MixedPlan) -> int:
        """The plan's prefill tokens less the cached prefixes its prompts find now (a prefix
        whose prefill has not ended is not found: `register` comes at the end of its run)."""
        cache = self.cache
        if cache is None:
            self.num_computed_tokens += plan.num_prefill_tokens
            return plan.num_prefill_tokens
        for req_id in plan.preempted_ids:
            cache.release(int(req_id))
        num_hit = 0
        for req_id in plan.prefill_ids:
            keys = self.block_keys.get(int(req_id), ())
            usable = reusable_blocks(self.policy.running[req_id].prompt_len, self.block_len)
            hit = cache.acquire(int(req_id), keys[:usable]) * self.block_len
            self.hit_tokens[int(req_id)] = hit
            num_hit += hit
        # Allocating the plan's KV evicts what no longer fits in the free blocks.
        cache.shrink(self.policy.kv_free // self.block_len)
        self.num_hit_tokens += num_hit
        self.num_computed_tokens += plan.num_prefill_tokens - num_hit
        return plan.num_prefill_tokens - num_hit

    def _run_len(self) -> int:
        """Decode iterations until the first finish, memory exhaustion or waiting work."""
        policy = self.policy
        if not self._finish_heap or policy.prompts or policy.resumes or policy.arrived_decodes:
            return 1  # (`has_waiting`, inline)
        until_finish = (self._finish_heap[0] >> REQ_BITS) - policy.step + 1
        steps = max(1, min(until_finish, policy.max_decode_steps() + 1))
        return min(steps, self.max_run_steps) if self.max_run_steps else steps

    def _track(self, joined: Sequence[int], output_len: Sequence[int]) -> None:
        """Put newly (re)joined requests on the finish heap, keyed by the policy step at which
        they will have generated all their tokens. NOTE: a running request's finish step holds
        while it runs (its `join_step` and `gen_base` change only when it joins again), so
        only the requests a plan joined need a look."""
        running, tracked, heap = self.policy.running, self._tracked, self._finish_heap
        for req_id in joined:
            seq = running.get(req_id)
            if seq is None:
                continue
            finish_step = seq.join_step + output_len[req_id] - seq.gen_base
            if tracked.get(req_id) != finish_step:
                tracked[req_id] = finish_step
                heapq.heappush(heap, finish_step << REQ_BITS | req_id)
        # The top must be current: `_run_len` reads the next finish from it.
        while heap:
            entry = heap[0]
            req_id = entry & REQ_MASK
            if req_id in running and tracked.get(req_id) == entry >> REQ_BITS:
                break
            heapq.heappop(heap)

    def _is_current(self, finish_step: int, req_id: int) -> bool:
        """False for entries of requests that left, or of an earlier stay (before a preemption)."""
        return req_id in self.policy.running and self._tracked.get(req_id) == finish_step

    def _pop_finished(self) -> list[int]:
        heap = self._finish_heap
        due = (self.policy.step + 1) << REQ_BITS  # entries below: finish steps <= step
        if not heap or heap[0] >= due:
            return []  # most runs: nobody finishes (a prefill, a cut run)
        done: list[int] = []
        while heap and heap[0] < due:
            entry = heapq.heappop(heap)
            req_id = entry & REQ_MASK
            if self._is_current(entry >> REQ_BITS, req_id):
                done.append(req_id)
                self.forget(req_id)
        return done

    def forget(self, req_id: int) -> None:
        """The request's KV left this SimMachine (for its token machine)."""
        self.policy.finish(req_id)
        self._tracked.pop(req_id, None)
        if self.cache is not None:
            self.cache.release(req_id)
