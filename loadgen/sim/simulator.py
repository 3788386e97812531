"""The discrete-event cluster simulator: a heap of events, plain Python.

Three events: a request arrives (the cluster policy routes it to a prompt and a token machine), a
machine's iteration or decode run ends (its machine-level policy plans the next), and a request's
KV lands on its token machine. A fourth, a request entering the front end, exists only when the
machines share one host's CPU (`SimOptions.shared_cpu`, `loadgen/sim/shared_cpu.py`).
Machines are `SimMachine`s running `common.scheduling.mixed`'s `MixedBatchPolicy`; routing is
`common.scheduling.cluster`'s policy, fed the machines' exact loads.

With `SimOptions.prefix_block_len` each machine keeps a prefix cache of the requests' trace blocks
(`hash_ids`, `loadgen/sim/prefix_cache.py`): prefills cost their uncached suffix, and the router
credits each prompt machine with the prefix it holds (`prefix_weight`), as the live router does.
"""

from __future__ import annotations

import gc
import heapq
import random
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import cast

import structlog

from common.config import SchedulerConfig
from common.kv_events import reusable_blocks
from common.perf_model import PerfModel
from common.roles import Role
from common.scheduling.cluster import JSQPoolPolicy, PoolThresholds, RouteRequest
from common.scheduling.home_roles import HomeRolePolicy
from common.scheduling.load_board import LoadBoard
from common.scheduling.mixed import MixedBatchPolicy, MixedPolicyConfig
from loadgen.sim.designs import ClusterSpec, perf_model_for
from loadgen.sim.machine import SimMachine, StepTimes
from loadgen.sim.prefix_cache import BlockKey, SimPrefixCache, chain_keys
from loadgen.sim.shared_cpu import FrontEnd, HostModel

log = structlog.get_logger(__name__)

ARRIVAL, RUN_END, KV_LANDED, FRONTEND = 0, 1, 2, 3
Event = tuple[float, int, int, int, int]  # (time, sequence number, kind, a, b)
NO_PREFIX: Mapping[int, int] = MappingProxyType({})  # a request no machine caches any of


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request to simulate: arrival time (s), prompt and output lengths (tokens), and its
    prompt's prefix-block ids (a Mooncake trace's `hash_ids`; empty: nothing shared)."""

    arrival_s: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class RequestRecord:
    """Per-request outcome; times are seconds of simulated time, NaN until they happen."""

    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_machine: int = -1
    token_machine: int = -1
    first_token_s: float = float("nan")
    done_s: float = float("nan")
    prefix_hit_tokens: int = 0  # found cached at its (last) prefill

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.arrival_s

    @property
    def tbt_s(self) -> float:
        """Mean time between tokens after the first (NaN for single-token outputs)."""
        if self.output_len <= 1:
            return float("nan")
        return (self.done_s - self.first_token_s) / (self.output_len - 1)


@dataclass
class SimResult:
    """What a simulation produced: request records and cluster counters."""

    cluster: ClusterSpec
    records: list[RequestRecord]
    end_s: float
    num_events: int
    num_pool_moves: int = 0
    busy_s_by_machine: list[float] = field(default_factory=list)
    num_prefill_tokens: int = 0  # computed by all machines (uncached suffixes, recomputes)
    num_prefix_hit_tokens: int = 0
    # Home changes of `SimOptions.thresholds.home_roles` (common/scheduling/home_roles.py), and
    # each machine's home at the end.
    num_home_moves: int = 0
    homes: dict[int, Role] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found cached / prompt tokens prefilled, as the engines count them."""
        total = self.num_prefill_tokens + self.num_prefix_hit_tokens
        return self.num_prefix_hit_tokens / total if total else 0.0

    @property
    def num_completed(self) -> int:
        return sum(1 for r in self.records if r.done_s == r.done_s)


_ENGINE = SchedulerConfig()


@dataclass(frozen=True)
class SimOptions:
    """Scheduler knobs of a run (defaults follow Splitwise §IV). The machine-level ones default
    to the engines' (`SchedulerConfig`): both run `MixedBatchPolicy`."""

    prompt_token_cap: int = _ENGINE.max_num_batched_tokens
    max_preemptions: int = _ENGINE.max_preemptions
    starvation_s: float = _ENGINE.starvation_s
    # A token machine holding ~40k KV tokens (~35 conversation requests) is "full": past that
    # batch size its TBT passes 1.2x, so the router looks to the mixed pool. With `home_roles`,
    # machines' homes follow the queue mix too, by the live router's policy (home_roles.py).
    thresholds: PoolThresholds = PoolThresholds(decode_tokens=40_000)
    # The front end's latency per request (HTTP, router, and the first token's way back), outside
    # every machine: a request reaches its prompt machine this long after it arrives. Zero at
    # Splitwise's scale (milliseconds against seconds); measured for PhaseMesh's CPU mesh.
    frontend_s: float = 0.0
    # Machines and front end on one host's cores (PhaseMesh's CPU mesh): the shared CPU and the
    # front end's loops as queues; `frontend_s` is then the host's. None: independent GPUs.
    host: HostModel | None = None
    # Tokens per trace prefix block (a Mooncake 512-token block, token-scaled; the served
    # engines' KV block): > 0 models each machine's prefix cache. 0: every prefill computes all.
    prefix_block_len: int = 0
    # KV-aware routing: JSQ's prompt-machine key less this x cached prefix tokens (the router's
    # `mesh.prefix_routing_weight`); 0: plain JSQ.
    prefix_weight: float = 0.0
    # One performance model for every machine instead of the profile's (a bench's own fit).
    perf: PerfModel | None = None


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cycle collector off for the block. A replay keeps every request's objects
    (request, record, arrival event) alive to its end, millions of them, and its events make no
    reference cycles: each of the collector's passes over them would free nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Simulator:
    """Replays requests through a cluster; `run` returns a `SimResult`."""

    def __init__(self, cluster: ClusterSpec, options: SimOptions | None = None) -> None:
        self.cluster = cluster
        self.options = options = options or SimOptions()
        self.transfer = cluster.transfer_model()
        self._transfer_s: dict[int, float] = {}  # prompt tokens -> visible transfer s (memo)
        types = cluster.machine_types()
        self.block_keys: dict[int, tuple[BlockKey, ...]] = {}  # req_id -> its blocks' keys
        step_times: dict[int, StepTimes] = {}  # id(perf model) -> its memo, for each type
        self.machines = []
        for i, (machine_type, home) in enumerate(types):
            perf = options.perf or perf_model_for(machine_type, cluster.model)
            times = step_times.setdefault(id(perf), StepTimes(perf))
            self.machines.append(SimMachine(
                i, home, self._policy_for(machine_type), perf, self._cache_for(machine_type),
                self.block_keys, options.prefix_block_len, times,
            ))  # fmt: skip
        self.cpu = options.host.cpu if options.host else None
        # The front end's per-request excess (measured), drawn seeded: the same input, the same run.
        self._frontend_jitter = options.host.frontend_jitter_s if options.host else ()
        self._rng = random.Random(0)
        self.frontend: FrontEnd | None = None
        if options.host is not None:
            # The decode profile and the demands measured beside it give the loops' CPU per step.
            step_s = self.machines[-1].perf.decode_s_by_batch
            self.frontend = options.host.frontend(step_s)
        if self.cpu is not None:
            # NOTE: contention changes between iterations; a multi-step run would freeze it.
            for machine in self.machines:
                machine.max_run_steps = 1
        self.router = JSQPoolPolicy(
            {i: home for i, (_, home) in enumerate(types)}, options.thresholds,
            options.prefix_weight,
        )  # fmt: skip
        deployed = dict(self.router.pools.home)
        self.homes = (
            HomeRolePolicy(options.thresholds, deployed)
            if options.thresholds.home_roles is not None and self.router.pools.is_split
            else None
        )
        # The machines' loads as the router sees them, refreshed for the machines an event
        # touched (`_changed`) before each routing: a few per request, not the whole cluster.
        self.loads = LoadBoard(self.router.pools)
        self._changed: set[int] = set(range(len(self.machines)))
        self.records: list[RequestRecord] = []
        self.output_len: list[int] = []  # by req_id
        self._events: list[Event] = []
        # Submitted requests' first events, in time order, kept out of the heap (a replay
        # submits every arrival up front): the heap holds only what machines have scheduled.
        self._arrivals: deque[Event] = deque()
        self._seq = 0
        self._num_moves = 0
        self.now = 0.0
        self.num_events = 0

    def _policy_for(self, machine_type) -> MixedBatchPolicy:  # type: ignore[no-untyped-def]
        config = MixedPolicyConfig(
            kv_capacity_tokens=machine_type.kv_capacity_tokens(self.cluster.model),
            prompt_token_cap=self.options.prompt_token_cap,
            max_preemptions=self.options.max_preemptions,
            starvation_s=self.options.starvation_s,
        )
        return MixedBatchPolicy(config)

    def _cache_for(self, machine_type) -> SimPrefixCache | None:  # type: ignore[no-untyped-def]
        block_len = self.options.prefix_block_len
        if block_len <= 0:
            return None
        return SimPrefixCache(machine_type.kv_capacity_tokens(self.cluster.model) // block_len)

    def _push(self, time_s: float, kind: int, a: int, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, self._seq, kind, a, b))

    def _push_arrival(self, time_s: float, kind: int, req_id: int) -> None:
        """A request's first event: on the time-ordered stream, or on the heap when it comes
        earlier than the stream's last (either way ordered by (time, submission) as one heap)."""
        self._seq += 1
        event = (time_s, self._seq, kind, req_id, 0)
        if self._arrivals and time_s < self._arrivals[-1][0]:
            heapq.heappush(self._events, event)
        else:
            self._arrivals.append(event)

    def submit(self, req: SimRequest) -> int:
        """Queue one request's arrival; its id indexes `records`."""
        req_id = len(self.records)
        self.records.append(RequestRecord(req.arrival_s, req.prompt_len, req.output_len))
        self.output_len.append(req.output_len)
        if self.options.prefix_block_len > 0 and req.hash_ids:
            num_full = req.prompt_len // self.options.prefix_block_len
            self.block_keys[req_id] = chain_keys(req.hash_ids, num_full)
        if self.cpu is not None:
            self._push_arrival(req.arrival_s, FRONTEND, req_id)
        else:
            self._push_arrival(req.arrival_s + self.options.frontend_s, ARRIVAL, req_id)
        return req_id

    def advance_until(self, time_s: float) -> float:
        """Process every event up to `time_s`; the time of the last one processed."""
        events, arrivals, pop = self._events, self._arrivals, heapq.heappop
        num_events = 0
        while True:
            if arrivals and (not events or arrivals[0] < events[0]):
                if arrivals[0][0] > time_s:
                    break
                now, _, kind, a, b = arrivals.popleft()
            elif events and events[0][0] <= time_s:
                now, _, kind, a, b = pop(events)
            else:
                break
            self.now = now
            # (by name, most frequent first: compiled, each is a direct call)
            if kind == RUN_END:
                self._on_run_end(now, a, b)
            elif kind == ARRIVAL:
                self._on_arrival(now, a, b)
            elif kind == KV_LANDED:
                self._on_kv_landed(now, a, b)
            else:
                self._on_frontend(now, a, b)
            num_events += 1
        self.num_events += num_events
        return self.now

    def run(self, requests: Iterable[SimRequest]) -> SimResult:
        """Simulate until every request has finished."""
        with cyclic_gc_paused():
            for req in requests:
                self.submit(req)
            self.advance_until(float("inf"))
            return self.result()

    def result(self) -> SimResult:
        busy = [m.busy_s for m in self.machines]
        for machine in self.machines:
            for req_id, hit in machine.hit_tokens.items():
                self.records[req_id].prefix_hit_tokens = hit
        return SimResult(
            self.cluster, self.records, self.now, self.num_events, self._num_moves, busy,
            num_prefill_tokens=sum(m.num_computed_tokens for m in self.machines),
            num_prefix_hit_tokens=sum(m.num_hit_tokens for m in self.machines),
            num_home_moves=self.homes.num_moves if self.homes is not None else 0,
            homes=dict(self.router.pools.home),
        )  # fmt: skip

    # -- events ---------------------------------------------------------------------------------

    def _on_frontend(self, now: float, req_id: int, _: int) -> None:
        """A request enters the front end; it reaches the router's decision when it leaves."""
        assert self.frontend is not None
        stretch = self._loop_stretch(now, self.frontend.work_s(1, 0))
        extra_s = self._rng.choice(self._frontend_jitter) if self._frontend_jitter else 0.0
        self._push(self.frontend.request_in(now, stretch, extra_s), ARRIVAL, req_id)

    def _loop_stretch(self, now: float, work_s: float) -> float:
        """Wall seconds per CPU second of the mesh's front-end loops' work (`work_s`) now."""
        assert self.cpu is not None
        return self.cpu.slowdown(*self._demand(now, work_s))

    def _client_time(self, now: float, num_tokens: int) -> float:
        """When tokens emitted now reach the client (now, without a modelled front end)."""
        if self.frontend is None or num_tokens == 0:
            return now
        stretch = self._loop_stretch(now, self.frontend.work_s(0, num_tokens))
        return self.frontend.tokens_out(now, num_tokens, stretch)

    def _on_arrival(self, now: float, req_id: int, _: int) -> None:
        record = self.records[req_id]
        if record.output_len <= 0 or record.prompt_len <= 0:
            record.first_token_s = record.done_s = now  # nothing to compute
            return
        loads = self._refreshed_loads()
        if self.homes is not None:
            for move in self.homes.observe(self.router.pools.home, loads, now):
                self.router.pools.apply(move, now)
        self._num_moves += len(self.router.rebalance(loads, now))
        keys = self._usable_keys(req_id, record.prompt_len) if self.block_keys else ()
        decision = self.router.route(self._route_request(req_id, record, keys), loads, now)
        self._num_moves += len(decision.moves)
        record.prompt_machine = decision.prompt_machine_id
        record.token_machine = decision.token_machine_id
        machine = self.machines[decision.prompt_machine_id]
        if machine.cache is not None and keys:
            machine.cache.expect(req_id, keys)
        machine.policy.add_prompt(req_id, record.prompt_len, record.arrival_s)
        machine.prompt_tokens_in += record.prompt_len
        if record.token_machine != record.prompt_machine:
            self.machines[record.token_machine].inbound_kv_tokens += record.prompt_len
            self._changed.add(record.token_machine)
        self._kick(machine, now)

    def _refreshed_loads(self) -> LoadBoard:
        """The board, with the loads of the machines changed since the last routing (those the
        router routes to: a machine out of its pools keeps no load there)."""
        machines, loads, routable = self.machines, self.loads, self.router.pools.current
        for machine_id in self._changed:
            if machine_id in routable:
                pending, decode, free = machines[machine_id].load()
                loads.report(machine_id, pending, decode, free)
        self._changed.clear()
        return loads

    def set_routable(self, machine_ids: Iterable[int], now: float) -> None:
        """Route only to `machine_ids` from now on (an autoscaled cluster: machines that have
        started, less those draining). As the live router does when its set of engines
        changes, the routing policy is rebuilt over the new set; a machine that stays keeps
        its home and current pool (and when it was lent), one that joins starts at its type's
        home. A machine left out still finishes what it holds: events need no routing."""
        old = self.router.pools
        keep = sorted(set(machine_ids))
        if not keep:
            raise ValueError("set_routable: at least one machine")
        homes = {m: old.home.get(m, self.machines[m].home) for m in keep}
        self.router = JSQPoolPolicy(homes, self.options.thresholds, self.options.prefix_weight)
        pools = self.router.pools
        pools.sync({m: (homes[m], old.current[m]) for m in keep if m in old.current}, now)
        for m in keep:
            if m in old.mixed_since and m in pools.mixed_since:
                pools.mixed_since[m] = old.mixed_since[m]
        self.loads = LoadBoard(pools)
        self._changed = set(keep)

    def _usable_keys(self, req_id: int, prompt_len: int) -> tuple[BlockKey, ...]:
        """The blocks of a prompt a lookup may reuse (its last token is always computed)."""
        usable = reusable_blocks(prompt_len, max(self.options.prefix_block_len, 1))
        return self.block_keys.get(req_id, ())[:usable]

    def _route_request(
        self, req_id: int, record: RequestRecord, keys: tuple[BlockKey, ...]
    ) -> RouteRequest:
        """What the router knows: with KV-aware routing, each machine's cached prefix tokens."""
        if not keys or self.options.prefix_weight == 0:
            return RouteRequest(req_id, record.prompt_len, NO_PREFIX)
        block_len = self.options.prefix_block_len
        cached = {m.machine_id: m.cache.routing_blocks(keys) * block_len
                  for m in self.machines if m.cache is not None}  # fmt: skip
        return RouteRequest(req_id, record.prompt_len, {m: n for m, n in cached.items() if n})

    def _on_run_end(self, now: float, machine_id: int, version: int) -> None:
        machine = self.machines[machine_id]
        if version != machine.version or machine.run is None:
            return  # superseded by an interrupt
        plan, finished = machine.complete()
        first: Sequence[int] = ()
        if plan.prefill_ids:
            prefill_ids = cast("tuple[int, ...]", plan.prefill_ids)  # (the simulator's are ints)
            first = [r for r in prefill_ids if self._after_prefill(machine, r, now, finished)]
        if finished or self.frontend is not None:  # (the front end streams every token out)
            decoded_s = self._client_time(now, len(plan.decode_ids))
        for req_id in finished:
            record = self.records[req_id]
            if req_id in first:  # done at its first token
                record.done_s = record.first_token_s
            elif req_id in plan.prefill_ids:  # a recompute that generated its last token
                record.done_s = self._client_time(now, 1)
            else:
                record.done_s = decoded_s
            self._request_out(record.done_s)
        self._kick(machine, now)

    def _request_out(self, done_s: float) -> None:
        """A request's last token reached the client: its loops' closing work is queued."""
        if self.frontend is not None and self.frontend.on_path < 1.0:
            stretch = self._loop_stretch(done_s, self.frontend.work_s(1, 0))
            self.frontend.request_out(done_s, stretch)

    def _after_prefill(
        self, machine: SimMachine, req_id: int, now: float, finished: Sequence[int]
    ) -> bool:
        """A prefill of `req_id` ended: its first token (True), or a recompute (False)."""
        record = self.records[req_id]
        if record.first_token_s == record.first_token_s:
            return False  # a recompute after preemption, not a first token
        record.first_token_s = now if self.frontend is None else self._client_time(now, 1)
        if record.token_machine == machine.machine_id:
            return True
        if req_id in finished:  # a one-token output: no KV to send after all
            self.machines[record.token_machine].inbound_kv_tokens -= record.prompt_len
            self._changed.add(record.token_machine)
            return True
        machine.forget(req_id)  # the KV leaves for the token machine
        delay = self._transfer_s.get(record.prompt_len)
        if delay is None:
            delay = self._transfer_s[record.prompt_len] = self.transfer.visible_s(record.prompt_len)
        self._push(now + delay, KV_LANDED, req_id, record.token_machine)
        return True

    def _on_kv_landed(self, now: float, req_id: int, machine_id: int) -> None:
        record = self.records[req_id]
        machine = self.machines[machine_id]
        machine.inbound_kv_tokens -= record.prompt_len
        machine.add_decode(req_id, record.prompt_len, record.arrival_s, now)
        if self.options.host is not None:
            # The step that admits it waits for its KV on the shards: the whole batch stalls.
            machine.pending_stall_s += self.options.host.handoff_s
        self._kick(machine, now)

    def _kick(self, machine: SimMachine, now: float) -> None:
        """New work for `machine`: start it if idle, else end its decode run early. Every
        event that changes a machine's load kicks it, or marks it `_changed` itself."""
        machine_id = machine.machine_id
        self._changed.add(machine_id)
        end_s: float | None
        if machine.run is None:
            run = machine.start(now, self.output_len)
            if run is None:
                return
            if self.cpu is not None:
                run.step_s *= self._run_stretch(machine, now)
            end_s = run.end_s
        else:
            end_s = machine.interrupt(now)
            if end_s is None:
                return
        self._seq += 1  # (`_push`, inline: once or twice per event)
        heapq.heappush(self._events, (end_s, self._seq, RUN_END, machine_id, machine.version))

    def _run_cores(self, machine: SimMachine, alone: bool = False) -> float:
        """Cores `machine`'s current run wants (0 when idle); `alone`: the demand its profiled
        time holds (a decode's own streaming included)."""
        cpu, run = self.cpu, machine.run
        if cpu is None or run is None:
            return 0.0
        if run.plan.prefill_ids:
            return cpu.prompt_cores
        batch_size = len(run.plan.decode_ids)
        return cpu.decode_cores(batch_size) if alone else cpu.chain_cores(batch_size)

    def _run_stretch(self, machine: SimMachine, now: float) -> float:
        """Factor on the profiled time of the run `machine` starts now, beside everything else."""
        assert self.cpu is not None and machine.run is not None
        demand, priority = self._demand(now, machine.run.step_s)
        return self.cpu.stretch(self._run_cores(machine, alone=True), demand, priority)

    def _demand(self, now: float, horizon_s: float) -> tuple[float, float]:
        """Cores wanted over the coming `horizon_s` by the mesh's processes (the machines' runs
        and its front-end loops) and by higher-priority loops (the client), each loop for the
        part of it its queue lasts."""
        assert self.frontend is not None
        busy = sum(self._run_cores(machine) for machine in self.machines)
        loops = self.frontend.busy_cores(now, horizon_s)
        return busy + loops, self.frontend.busy_cores(now, horizon_s, priority=True)


def simulate(
    cluster: ClusterSpec, requests: Iterable[SimRequest], options: SimOptions | None = None
) -> SimResult:
    """Run one simulation of `requests` on `cluster`."""
    result = Simulator(cluster, options).run(requests)
    log.debug("simulated", cluster=cluster.label, events=result.num_events, end_s=result.end_s)
    return result
