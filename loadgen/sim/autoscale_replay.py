"""An autoscaled cluster in the simulator: the live mesh's scaling decision on time-varying load.

Each deployment (prompt machines, token machines, or a baseline's mixed machines) is sized by the
decision the live mesh runs (`common/scheduling/autoscale.py`'s `decide`), fed the signals its
replicas report (`services/mesh/autoscaling.py`'s `samples_from`: a replica's load is its
largest signal / target), averaged over a look-back window as Serve averages them. A token
machine stands for a token engine with its shard group: they scale as one unit.

Life of a machine: *stopped* (the pool holds `max_replicas` of each deployment), *starting*
(provisioned: it counts for the decision and costs replica-seconds, but takes no work for its
start-up, `StartupModel`), *active* (routable), *draining* (out of routing: it takes no new work and
finishes what it holds, KV still on its way to it included, then stops). Nothing is dropped: a
drain ends only when its machine is idle. A scale-down takes starting machines first (as Serve
stops pending replicas first), then the least-loaded active ones; a scale-up starts stopped
machines, and revives a draining one only when none is stopped.

Faults: a decision's inputs come from the simulator, exact; there is no dead machine here (the
live side's missing or garbled reports give no sample, tested in
tests/unit/test_mesh_autoscaling.py). A request never waits for a machine that will not come:
every deployment keeps at least `min_replicas` (>= 1) routable or starting.

Load steps: `stepped` multiplies a workload's arrival rate by a factor for windows of
simulated time (`3x@600s+600s`: three times the rate from 600 s for 600 s).
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from common.roles import Role
from common.scheduling.autoscale import ScalePolicy, ScaleState, decide
from loadgen.sim.designs import ClusterSpec, Design
from loadgen.sim.machine import SimMachine
from loadgen.sim.simulator import SimOptions, SimRequest, SimResult, Simulator
from loadgen.sim.slo import attainment
from services.mesh.autoscaling import (
    AGE,
    LENT_SIGNAL,
    SIGNALS,
    RateMeter,
    lent_prefill_samples,
    samples_from,
)

# -- load steps ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadStep:
    """The arrival rate times `factor` from `start_s` for `duration_s` (simulated seconds)."""

    factor: float
    start_s: float
    duration_s: float

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.start_s < 0 or self.duration_s <= 0:
            raise ValueError("load step: need factor > 0, start_s >= 0, duration_s > 0")

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


_STEP = re.compile(r"^\s*([0-9.]+)x@([0-9.]+)s?\+([0-9.]+)s?\s*$")


def parse_step(text: str) -> LoadStep:
    """`3x@600s+600s` (or `3x@600+600`): 3 times the rate from 600 s for 600 s."""
    match = _STEP.match(text)
    if match is None:
        raise ValueError(
            f"load step {text!r}: expected FACTORx@STARTs+DURATIONs, e.g. 3x@600s+600s"
        )
    factor, start, duration = (float(g) for g in match.groups())
    return LoadStep(factor, start, duration)


def stepped(requests: Iterable[SimRequest], steps: Sequence[LoadStep]) -> list[SimRequest]:
    """`requests` with time warped so that the rate is `factor` times higher in each step's
    window: a window of d simulated seconds takes factor x d seconds of the original arrivals.
    Steps must not overlap; the order of arrivals is kept."""
    ordered = sorted(steps, key=lambda s: s.start_s)
    for before, after in zip(ordered, ordered[1:], strict=False):
        if after.start_s < before.end_s:
            raise ValueError("load steps overlap")
    # Segments in original time: (original start, simulated start, factor), from 0 on.
    segments: list[tuple[float, float, float]] = []
    original = simulated = 0.0
    for step in ordered:
        original += step.start_s - simulated
        segments.append((original, step.start_s, step.factor))
        original += step.duration_s * step.factor
        segments.append((original, step.end_s, 1.0))
        simulated = step.end_s
    out = []
    index = -1
    for req in sorted(requests, key=lambda r: r.arrival_s):
        while index + 1 < len(segments) and segments[index + 1][0] <= req.arrival_s:
            index += 1
        base_original, base_simulated, factor = segments[index] if index >= 0 else (0.0, 0.0, 1.0)
        arrival = base_simulated + (req.arrival_s - base_original) / factor
        out.append(SimRequest(arrival, req.prompt_len, req.output_len, req.hash_ids))
    return out


# -- options ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleScaling:
    """One deployment's autoscaling: its signals' per-replica targets and the decision's knobs,
    as a deploy YAML's `policy_kwargs` give them (plus `min_replicas` / `max_replicas`)."""

    targets: Mapping[str, float]
    policy: ScalePolicy

    @classmethod
    def from_kwargs(cls, role: Role, kwargs: Mapping[str, Any]) -> RoleScaling:
        knobs = dict(kwargs)
        targets = {str(k): float(v) for k, v in dict(knobs.pop("targets", {})).items()}
        if not targets or any(t <= 0 for t in targets.values()):
            raise ValueError(f"{role}: targets needs at least one signal with a positive target")
        if unknown := set(targets) - set(SIGNALS[role]):
            raise ValueError(f"{role}: signals {sorted(unknown)} are not {role}'s: {SIGNALS[role]}")
        return cls(targets, ScalePolicy(target_load=1.0, **knobs))


# Defaults for the GPU designs (Llama2-70B on DGX machines, Table VI's SLOs), from
# bench/autoscale.py's runs. A prompt machine is sized by the prompt tokens it receives per
# second (its target: what one machine prefills per second while its TTFT p90 holds, well under
# its throughput: a queue of a few prompts already breaks the TTFT limit) plus its backlog (the
# pending tokens, its prefill in progress included, over their target), and counts the prefills
# lent to token machines too: a load step asks for all it needs in one decision (`max_step`
# lets them come at once), the most it asked for while the wish lasted `upscale_after_s`.
# A token machine's decode KV stops growing at the router's "full" figure (40k tokens,
# `SimOptions.thresholds`: the rest goes to the mixed pool), so its target sits below it. The
# averages of a steady load still swing (Poisson arrivals, long-tailed prompts), so a
# scale-down needs the load to fit under the target with room (`scale_down_fill`) for minutes.
# `cooldown_s` covers a machine's start-up from host memory (`StartupModel`) and the flat minute
# earlier runs assumed: the decision after a scale-up finds the new machines reporting, young,
# and adds none meanwhile.
# The prompt side sizes a step (a load past the target by more than the dead band) for its load
# `lead_s` ahead, its rise over `trend_s` projected: half the look-back, which the look-back
# average lags a rising load by, so the first readings of a step, still mostly the load before
# it, ask for the whole step; and a step needing many machines fills the hold in seconds
# (`advance`), so they start seconds after the step instead of `upscale_after_s` after it.
# Projecting over the whole start-up instead overshoots a step (the look-back's rise lasts its
# window, not the start-up) and turns a flat load's noise into scale-ups
# (docs/benchmarks/autoscale.md).
# A swing of the prompt side's load (its arrival rate, which leads a step) is sized at the target
# (`swing_fill` 1): sized to the band's middle, the base load's swings kept replicas for good.
# The token side keeps the middle: its decode tokens lag a step, and the headroom carries the
# step's first half minute until its own scale-up's machines take work.
# And the prompt side takes such a swing's machines back once the last five minutes' mean fits
# fewer at `scale_down_fill` and their peak at the target (`scale_down_peak_fill` 1): the base
# load's swings cross the smaller size's floor every few minutes, so under every reading under
# it the swing's machines stayed until the step.
_SHARED_KNOBS = {
    "max_step": 64,
    "upscale_after_s": 30.0,
    "downscale_after_s": 300.0,
    "cooldown_s": 60.0,
    "warmup_s": 30.0,
}
DEFAULT_ROLES: dict[Role, dict[str, Any]] = {
    Role.PROMPT: {"targets": {"prompt_tokens_per_s": 3500, "pending_prompt_tokens": 16_000},
                  "scale_down_fill": 0.7, "swing_fill": 1.0, "scale_down_peak_fill": 1.0,
                  "lead_s": 15.0, "trend_s": 5.0,
                  **_SHARED_KNOBS},
    Role.TOKEN: {"targets": {"running_decode_tokens": 30_000}, "scale_down_fill": 0.5,
                 **_SHARED_KNOBS},
    Role.MIXED: {"targets": {"pending_prompt_tokens": 1000, "running_decode_tokens": 30_000},
                 "scale_down_fill": 0.4, **_SHARED_KNOBS},
}  # fmt: skip


HostCopy = Literal["every_node", "after_first_start", "none"]
HOST_COPIES: tuple[str, ...] = get_args(HostCopy)


@dataclass(frozen=True)
class StartupModel:
    """A machine's start-up, from provisioning to taking work: `process_s` (the engine process,
    its accelerator context, KV allocation, registration), then the model's weights
    (`Design.model.weight_bytes`) at a load bandwidth: `host_gbps` where the node holds a
    load-ready copy in host memory (the live mesh's weight cache, common/model/weight_cache.py:
    a file in the page cache, mapped), else `storage_gbps` (reading and converting the
    checkpoint). `host_copy`: which nodes hold one: `every_node` (prepared when the node joined:
    `python -m common.model.weight_cache`), `after_first_start` (a node's first replica writes
    it, later ones map it), `none`. `flat_s`: a flat start-up in the model's place, every node
    alike (None: the model; earlier runs' 60 s reproduce with it; a policy file's top-level
    `startup_s` sets it, `default_options`).

    Defaults, for the Splitwise designs (Llama2-70B in fp16 on a DGX, docs/autoscaling.md):
    storage at the 84 s ServerlessLLM cites for existing loaders on that model (Fu et al.,
    OSDI '24, its introduction), host memory at one PCIe Gen5 x16 link's 64 GB/s (eight GPUs
    load their tensor shards over eight such links: the sum is higher), and a process start
    within the 20 s Anyscale reported for a 70B replica's whole start streaming from S3
    (weights included)."""

    process_s: float = 8.0
    host_gbps: float = 64.0
    storage_gbps: float = 140 / 84
    host_copy: HostCopy = "every_node"
    flat_s: float | None = None

    def __post_init__(self) -> None:
        if self.process_s < 0 or self.host_gbps <= 0 or self.storage_gbps <= 0:
            raise ValueError("startup: need process_s >= 0, host_gbps > 0, storage_gbps > 0")
        if self.flat_s is not None and self.flat_s < 0:
            raise ValueError("startup: flat_s must not be negative")
        if self.host_copy not in HOST_COPIES:
            raise ValueError(f"startup: host_copy {self.host_copy!r} is not one of {HOST_COPIES}")

    def seconds(self, weight_bytes: float, started_before: bool) -> float:
        """A start of a node that ran a replica before (`started_before`) or not: `flat_s`
        where set."""
        if self.flat_s is not None:
            return self.flat_s
        cached = self.host_copy == "every_node" or (
            self.host_copy == "after_first_start" and started_before
        )
        return self.start_s(weight_bytes, from_host=cached)

    def start_s(self, weight_bytes: float, from_host: bool) -> float:
        """The process start and `weight_bytes` from host memory or from storage."""
        gbps = self.host_gbps if from_host else self.storage_gbps
        return self.process_s + weight_bytes / 1e9 / gbps


@dataclass(frozen=True)
class AutoscaleOptions:
    """How the simulated cluster autoscales. `roles`: each deployment's scaling (a split design
    has PROMPT and TOKEN, a baseline MIXED); `initial`: machines running at time 0 (default
    `min_replicas`); `startup`: from provisioning to taking work (`StartupModel`: the model, or
    a flat figure); `interval_s`: how often replicas report and the decision runs;
    `look_back_s`: the window each signal is averaged over (Serve's `look_back_period_s`);
    `shards_per_group`: attention shards per token machine (replica-seconds of the shard
    deployment; 0: none)."""

    roles: Mapping[Role, RoleScaling]
    initial: Mapping[Role, int] = field(default_factory=dict)
    startup: StartupModel = field(default_factory=StartupModel)
    interval_s: float = 1.0
    # Serve's default: a step's first decision comes `upscale_after_s` (no shorter) into it, and
    # reads the step's load alone; a long window smooths a long-tailed trace's swings.
    look_back_s: float = 30.0
    shards_per_group: int = 0

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.look_back_s < 0:
            raise ValueError("autoscale: need interval_s > 0, look_back_s >= 0")
        if self.shards_per_group < 0:
            raise ValueError("autoscale: shards_per_group must not be negative")
        for role, scaling in self.roles.items():
            if scaling.policy.min_replicas < 1:
                raise ValueError(f"{role}: min_replicas must be at least 1 (requests need it)")
            n = self.initial.get(role, scaling.policy.min_replicas)
            if not scaling.policy.min_replicas <= n <= scaling.policy.max_replicas:
                raise ValueError(f"{role}: initial {n} outside [min_replicas, max_replicas]")

    def initial_count(self, role: Role) -> int:
        return self.initial.get(role, self.roles[role].policy.min_replicas)


def roles_of(design: Design) -> tuple[Role, ...]:
    """The deployments an autoscaled cluster of `design` has."""
    return (Role.PROMPT, Role.TOKEN) if design.split else (Role.MIXED,)


def default_options(
    design: Design, max_replicas: Mapping[Role, int], **overrides: Any
) -> AutoscaleOptions:
    """`DEFAULT_ROLES`'s targets with `max_replicas` per deployment; `overrides`: any of
    `AutoscaleOptions`' fields, or a role's name (`prompt=`) with knobs for its policy, or
    `startup_s` (a policy file's, `--startup-s`: `StartupModel.flat_s`; None: the model)."""
    if isinstance(overrides.get("startup"), Mapping):  # a YAML file's `startup:` section
        overrides["startup"] = StartupModel(**overrides["startup"])
    flat_s = overrides.pop("startup_s", None)
    if flat_s is not None:
        model = overrides.get("startup", StartupModel())
        overrides["startup"] = replace(model, flat_s=float(flat_s))
    roles = {}
    for role in roles_of(design):
        kwargs = {**DEFAULT_ROLES[role], "max_replicas": max_replicas[role]}
        kwargs.update(overrides.pop(role.value, {}))
        roles[role] = RoleScaling.from_kwargs(role, kwargs)
    return AutoscaleOptions(roles, **overrides)


# -- the autoscaled cluster ---------------------------------------------------------------------


@dataclass
class ReplicaLife:
    """One machine's stay in the cluster (simulated seconds; None: not yet)."""

    machine_id: int
    role: Role
    provisioned_s: float
    active_s: float  # when it takes work (provisioned_s + its start-up; earlier for initial ones)
    draining_s: float | None = None
    stopped_s: float | None = None

    def seconds(self, until_s: float) -> float:
        """Replica-seconds it cost in [0, until_s)."""
        end = until_s if self.stopped_s is None else min(self.stopped_s, until_s)
        return max(0.0, end - max(self.provisioned_s, 0.0))


@dataclass(frozen=True)
class ScaleEvent:
    """A deployment's replica count changed by a decision."""

    time_s: float
    role: Role
    before: int
    after: int


@dataclass
class AutoscaleResult:
    """A run's requests (`sim`), the machines' lives, the decisions' changes, and the count of
    each deployment (starting and active machines) after each change."""

    sim: SimResult
    lives: list[ReplicaLife]
    events: list[ScaleEvent]
    timeline: list[tuple[float, dict[str, int]]]
    shards_per_group: int = 0

    def replica_seconds(self, until_s: float) -> dict[str, float]:
        """Replica-seconds by deployment over [0, until_s) (`shard`: the token machines' shard
        groups, when they have them)."""
        out: dict[str, float] = {}
        for life in self.lives:
            out[life.role.value] = out.get(life.role.value, 0.0) + life.seconds(until_s)
        if self.shards_per_group and Role.TOKEN.value in out:
            out[Role.SHARD.value] = out[Role.TOKEN.value] * self.shards_per_group
        return out

    def num_events(self) -> dict[str, int]:
        counts = {life.role.value: 0 for life in self.lives}
        for event in self.events:
            counts[event.role.value] += 1
        return counts


def fixed_replica_seconds(
    cluster: ClusterSpec, until_s: float, shards_per_group: int = 0
) -> dict[str, float]:
    """A fixed cluster's replica-seconds by deployment over [0, until_s)."""
    if not cluster.design.split:
        return {Role.MIXED.value: cluster.num_prompt * until_s}
    out = {Role.PROMPT.value: cluster.num_prompt * until_s,
           Role.TOKEN.value: cluster.num_token * until_s}  # fmt: skip
    if shards_per_group:
        out[Role.SHARD.value] = out[Role.TOKEN.value] * shards_per_group
    return out


class AutoscaledCluster:
    """A `Simulator` over a pool of `max_replicas` machines per deployment, and the decision
    that sizes each deployment every `interval_s` (see the module)."""

    def __init__(
        self, design: Design, options: AutoscaleOptions, sim_options: SimOptions | None = None
    ) -> None:
        roles = roles_of(design)
        if set(options.roles) != set(roles):
            raise ValueError(f"{design.name}: autoscale needs exactly the roles {roles}")
        self.options = options
        self.weight_bytes = design.model.weight_bytes
        self._started: set[int] = set()  # machines that ran a replica (their node's copy)
        size = {role: options.roles[role].policy.max_replicas for role in roles}
        pool = (
            ClusterSpec(design, size[Role.PROMPT], size[Role.TOKEN])
            if design.split
            else ClusterSpec(design, size[Role.MIXED])
        )
        self.sim = Simulator(pool, sim_options)
        self.roles = roles
        self._stopped: dict[Role, list[int]] = {role: [] for role in roles}
        for machine in self.sim.machines:
            self._stopped[machine.home].append(machine.machine_id)
        self.lives: list[ReplicaLife] = []
        self._life: dict[int, ReplicaLife] = {}  # machine id -> its current life
        self._state = {role: ScaleState(options.initial_count(role)) for role in roles}
        self.events: list[ScaleEvent] = []
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self._history: dict[int, deque[tuple[float, tuple[float, ...]]]] = {}
        self._arrivals: dict[int, RateMeter] = {}  # machine id -> its prompt tokens' rate
        # Initial machines have run long enough that none of their samples is a warm-up one.
        warm = max(options.roles[role].policy.warmup_s for role in roles)
        for role in roles:
            for _ in range(options.initial_count(role)):
                self._provision(role, 0.0, active_s=-warm)
        self._record(0.0)
        self._routed = self._routable(0.0)  # what the simulator's router routes to
        self.sim.set_routable(self._routed, 0.0)

    # -- membership ---------------------------------------------------------------------------

    def _provision(self, role: Role, now: float, active_s: float | None = None) -> None:
        """One more machine of `role`: a stopped one starting, or a draining one revived."""
        stopped = self._stopped[role]
        if stopped:
            machine_id = stopped.pop(0)
            if active_s is None:
                before = machine_id in self._started
                start = now + self.options.startup.seconds(self.weight_bytes, before)
            else:
                start = active_s
            self._started.add(machine_id)
            life = ReplicaLife(machine_id, role, now, start)
            self.lives.append(life)
            self._life[machine_id] = life
            if active_s is not None:  # an initial machine: its arrivals count from time 0
                machine = self.sim.machines[machine_id]
                self._arrivals[machine_id] = RateMeter(now, machine.prompt_tokens_in)
            return
        draining = [life for life in self._lives_of(role) if life.draining_s is not None]
        if not draining:
            raise RuntimeError(f"{role}: no machine left to provision (pool is max_replicas)")
        draining[-1].draining_s = None  # the latest to leave: it holds the most

    def _retire(self, role: Role, now: float) -> None:
        """One machine of `role` fewer: a starting one stopped, else the least-loaded active
        one (newest first on ties) drained."""
        lives = [life for life in self._lives_of(role) if life.draining_s is None]
        starting = [life for life in lives if life.active_s > now]
        if starting:
            self._stop(starting[-1], now)
            return
        machines = self.sim.machines

        def load(life: ReplicaLife) -> tuple[int, int]:
            pending, decode, _ = machines[life.machine_id].load()
            return pending + decode, -life.machine_id

        min(lives, key=load).draining_s = now

    def _stop(self, life: ReplicaLife, now: float) -> None:
        life.stopped_s = now
        del self._life[life.machine_id]
        self._history.pop(life.machine_id, None)
        self._arrivals.pop(life.machine_id, None)
        self._stopped[life.role].append(life.machine_id)

    def _lives_of(self, role: Role) -> list[ReplicaLife]:
        return [life for life in self._life.values() if life.role == role]

    def _routable(self, now: float) -> set[int]:
        return {m for m, life in self._life.items()
                if life.draining_s is None and life.active_s <= now}  # fmt: skip

    def _count(self, role: Role) -> int:
        """Starting and active machines of `role` (what the decision counts)."""
        return sum(1 for life in self._lives_of(role) if life.draining_s is None)

    def _record(self, now: float) -> None:
        self.timeline.append((now, {role.value: self._count(role) for role in self.roles}))

    # -- the loop -----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Machines that finished starting take work, drained ones stop, every active one
        reports, and each deployment's decision runs."""
        for life in list(self._life.values()):
            if life.draining_s is not None and self.sim.machines[life.machine_id].is_idle:
                self._stop(life, now)
        changed = False
        metrics = {role: self._metrics(role, self._signal_names(role), now) for role in self.roles}
        for role in self.roles:
            scaling = self.options.roles[role]
            samples = samples_from(metrics[role], dict(scaling.targets))
            if role == Role.PROMPT:  # prefills lent to token machines are the prompt side's load
                samples += lent_prefill_samples(metrics[Role.TOKEN], dict(scaling.targets))
            before = self._state[role]
            after = decide(scaling.policy, before, samples, now)
            self._state[role] = after
            if after.replicas == before.replicas:
                continue
            changed = True
            self.events.append(ScaleEvent(now, role, before.replicas, after.replicas))
            for _ in range(after.replicas - before.replicas):
                self._provision(role, now)
            for _ in range(before.replicas - after.replicas):
                self._retire(role, now)
        if changed:
            self._record(now)
        routable = self._routable(now)
        if routable != self._routed:
            self._routed = routable
            self.sim.set_routable(routable, now)

    def _signal_names(self, role: Role) -> tuple[str, ...]:
        """The signals `role`'s machines report: its targets', and a token machine's prompt
        arrival rate when the prompt side scales on it (`lent_prefill_samples`)."""
        names = tuple(self.options.roles[role].targets)
        prompt = self.options.roles.get(Role.PROMPT)
        if role == Role.TOKEN and prompt is not None and LENT_SIGNAL in prompt.targets:
            names += (LENT_SIGNAL,)
        return names

    def _metrics(
        self, role: Role, names: tuple[str, ...], now: float
    ) -> dict[str, dict[str, float]]:
        """Each active machine's signals averaged over the look-back window, as Serve hands
        them to a policy: {signal: {replica: value}}, with each replica's age."""
        metrics: dict[str, dict[str, float]] = {AGE: {}, **{name: {} for name in names}}
        horizon = now - self.options.look_back_s
        for life in self._lives_of(role):
            if life.draining_s is not None or life.active_s > now:
                continue  # a draining replica no longer counts, a starting one has no report
            machine = self.sim.machines[life.machine_id]
            history = self._history.setdefault(life.machine_id, deque())
            meter = self._arrivals.get(life.machine_id)
            if meter is None:  # it reports from now on (as a replica does once it runs)
                meter = self._arrivals[life.machine_id] = RateMeter(now, machine.prompt_tokens_in)
            rate = meter.rate(now, machine.prompt_tokens_in)
            history.append((now, signals(machine, names, rate)))
            while history and history[0][0] < horizon:
                history.popleft()
            replica = str(life.machine_id)
            metrics[AGE][replica] = now - life.active_s
            for i, name in enumerate(names):
                metrics[name][replica] = sum(v[i] for _, v in history) / len(history)
        return metrics

    def run(
        self, requests: Iterable[SimRequest], horizon_s: float, progress: bool = False
    ) -> AutoscaleResult:
        """Simulate until every request has finished (and at least until `horizon_s`), deciding
        every `interval_s`."""
        from tqdm import tqdm

        sim = self.sim
        for req in requests:
            sim.submit(req)
        records = sim.records
        unfinished = 0  # records before this one have all finished
        interval = self.options.interval_s
        bar = tqdm(total=math.ceil(horizon_s), disable=not progress, unit="sim s",
                   dynamic_ncols=True)  # fmt: skip
        with bar:
            step = 0
            while True:
                step += 1
                now = step * interval
                sim.advance_until(now)
                self.tick(now)
                bar.update(min(now, horizon_s) - bar.n)
                while unfinished < len(records) and records[unfinished].done_s == (
                    records[unfinished].done_s
                ):
                    unfinished += 1
                if now >= horizon_s and unfinished == len(records):
                    break
        result = sim.result()
        return AutoscaleResult(result, self.lives, self.events, self.timeline,
                               self.options.shards_per_group)  # fmt: skip


def signals(
    machine: SimMachine, names: Sequence[str], prompt_rate: float = 0.0
) -> tuple[float, ...]:
    """A machine's signals as an engine reports them (`services/mesh/autoscaling.py`'s
    `engine_stats`): its prompt tokens' arrival rate (`prompt_rate`, since its last report),
    pending prompt tokens, decode tokens (its KV in use or on its way), and the share of its KV
    that is."""
    pending, decode, free = machine.load()
    capacity = machine.policy.config.kv_capacity_tokens
    values = {
        "prompt_tokens_per_s": prompt_rate,
        "pending_prompt_tokens": float(pending),
        "running_decode_tokens": float(decode),
        "kv_fill": min(max(1.0 - free / capacity, 0.0), 1.0) if capacity else 0.0,
    }
    return tuple(values[name] for name in names)


def simulate_autoscaled(
    design: Design,
    requests: Iterable[SimRequest],
    options: AutoscaleOptions,
    horizon_s: float,
    sim_options: SimOptions | None = None,
    progress: bool = False,
) -> AutoscaleResult:
    """One autoscaled run of `requests` on `design`."""
    return AutoscaledCluster(design, options, sim_options).run(requests, horizon_s, progress)


def summary(result: AutoscaleResult, horizon_s: float, steps: Sequence[LoadStep]) -> dict[str, Any]:
    """A run's figures: replica-seconds by deployment over [0, horizon_s), scale events by
    deployment, the most any deployment made for one load step (the events from its start to
    the next step's, or to the end), TTFT / TBT p90 attainment over the run and within each
    step's window, requests finished."""
    starts = sorted(step.start_s for step in steps)
    per_step = []
    for start, end in zip(starts, [*starts[1:], math.inf], strict=True):
        counts: dict[Role, int] = {}
        for event in result.events:
            if start <= event.time_s < end:
                counts[event.role] = counts.get(event.role, 0) + 1
        per_step.append(max(counts.values(), default=0))
    return {
        "requests": len(result.sim.records),
        "completed": result.sim.num_completed,
        "replica_s": {k: round(v, 1) for k, v in result.replica_seconds(horizon_s).items()},
        "scale_events": result.num_events(),
        "events_per_step": max(per_step, default=0),
        "attainment": rounded(attainment(result.sim)),
        "attainment_in_steps": [
            rounded(attainment(result.sim, step.start_s, step.end_s)) for step in steps
        ],
    }


def rounded(figures: Mapping[str, float | bool]) -> dict[str, float | bool]:
    """Figures to three decimals (verdicts as they are)."""
    return {k: v if isinstance(v, bool) else round(v, 3) for k, v in figures.items()}
