"""Load that Serve can see: what each mesh replica reports, and the policy Serve calls with it.

Engines and shards receive their work over ZeroMQ, so Serve's request counts for them are zero.
Each replica reports its role's load through Serve's `record_autoscaling_stats` hook
(`replica_stats`), and `MeshAutoscalingPolicy`, named in a deployment's
`autoscaling_config.policy`, turns the aggregated reports into a replica count with the pure
policy the simulator runs (`common/scheduling/autoscale.py`):

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      upscale_delay_s: 0        # the policy's own delays apply (upscale_after_s, ...)
      downscale_delay_s: 0
      policy:
        policy_function: services.mesh.autoscaling:MeshAutoscalingPolicy
        policy_kwargs: {targets: {pending_prompt_tokens: 8192}, cooldown_s: 60}

Signals, per replica (the load is the largest of signal / target, so 1.0 is one replica's worth):

- prompt engines: `prompt_tokens_per_s`, the prompt tokens it received per second since its last
  report (its arrival rate; the target: what one replica prefills per second at its TTFT SLO),
  which sizes a load step at once, and `pending_prompt_tokens` (Splitwise's JSQ load; with a
  rate target, the two add up: `replica_load`), which catches what the rate misses (long
  prompts, a slow replica, arrivals diverted to the mixed pool);
- token engines: `running_decode_tokens` and `kv_fill` (the share of its decode KV in use);
- shards: `kv_fill`; added in whole groups (`group_size: shards_per_group`), together with the
  token engine that claims them.

Token engines and their shards scale as one unit under `MeshAppAutoscalingPolicy`, Serve's
application-level policy (the application's `autoscaling_policy`): one call sees every
deployment, so +1 token engine comes with +`shards_per_group` shards in the same decision
(`decide_groups`). Its `policy_kwargs` name each deployment's targets and knobs:

    autoscaling_policy:
      policy_function: services.mesh.autoscaling:MeshAppAutoscalingPolicy
      policy_kwargs:
        PromptEngine: {targets: {pending_prompt_tokens: 8192}}
        TokenEngine: {targets: {running_decode_tokens: 65536, kv_fill: 0.8}, cooldown_s: 60}
        AttentionShard: {targets: {kv_fill: 0.8}, group_size: 4}   # follows TokenEngine's

With a rate target for the PromptEngine, the prefills the router lent to token engines (the
mixed pool) count as its load (`lent_prefill_samples`): this needs the application-level policy
(a deployment-level one sees its own replicas only).

A deployment it does not name (the Router, whose requests pass through Serve) keeps Serve's
request-based rule (ongoing requests over `target_ongoing_requests`).

A replica whose report is missing (starting, or its hook failed) contributes no sample; a
replica whose worker died fails its health check and Serve replaces it, so a dead replica's last
load never holds the count up. An engine's worker restarted inside its replica starts its
`prompt_tokens_in` counter from 0 again: `RateMeter` reads a counter that went back as counting
from 0 (never a negative rate). A token engine that died lends nothing: no report, no lent
sample. A warm-up hold lasts `warmup_s` from the replica's start at most (its age grows
whatever it reports). Scale-down goes through the replica's graceful shutdown: it
leaves routing first (state `draining`), finishes what it holds, then stops
(`services/mesh/replica.py`). A shard told to stop while the token engine that claims it drains
waits for that engine to leave first, so a group leaves after its engine; a shard of an engine
that stays (Serve picks which replicas stop: on one node, the newest, which are the leaving
engine's) leaves that engine's group broken, and its lost heads are rebuilt on the shard of the
same slot that the leaving engine freed (Lamina §5, docs/failures.md).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Any

import structlog

from common.protocol import LoadReport
from common.roles import Role
from common.scheduling.autoscale import (
    GroupReplicas,
    LoadSample,
    ScalePolicy,
    ScaleState,
    decide,
    decide_groups,
)

log = structlog.get_logger(__name__)

AGE = "age_s"
SIGNALS: dict[Role, tuple[str, ...]] = {
    Role.PROMPT: ("prompt_tokens_per_s", "pending_prompt_tokens"),
    Role.TOKEN: ("running_decode_tokens", "kv_fill"),
    Role.MIXED: (
        "prompt_tokens_per_s",
        "pending_prompt_tokens",
        "running_decode_tokens",
        "kv_fill",
    ),
    Role.SHARD: ("kv_fill",),
}
STATE_KEY = "phasemesh"  # our part of Serve's per-deployment policy state
# A token engine and the shards it claims: the deployments that scale as one (services/app.py).
GROUP_DEPLOYMENTS = ("TokenEngine", "AttentionShard")
PROMPT_DEPLOYMENT = "PromptEngine"  # its load includes the prefills lent to the token engines


class RateMeter:
    """A counter's rate between two readings: a replica's arrival rate from its cumulative
    `prompt_tokens_in`, read at each of Serve's stats calls (Serve averages the readings over
    its look-back window). A counter that went back (the engine restarted) reads as starting
    from 0 again; readings at the same instant repeat the last rate."""

    def __init__(self, now: float, count: float = 0.0) -> None:
        self.last_time, self.last_count, self.last_rate = now, count, 0.0

    def rate(self, now: float, count: float) -> float:
        elapsed = now - self.last_time
        if elapsed <= 0:
            return self.last_rate
        base = self.last_count if count >= self.last_count else 0.0
        self.last_rate = (count - base) / elapsed
        self.last_time, self.last_count = now, count
        return self.last_rate


def engine_stats(
    report: LoadReport | None, age_s: float, arrivals: RateMeter | None = None, now: float = 0.0
) -> dict[str, float]:
    """An engine replica's `record_autoscaling_stats`: its latest load report's signals, and
    with `arrivals` its prompt tokens received per second since the last call (at `now`)."""
    if report is None:
        return {AGE: age_s}
    total = report.total_kv_blocks or 0
    fill = 1.0 - report.free_kv_blocks / total if total else 0.0
    rate = {} if arrivals is None else {
        "prompt_tokens_per_s": arrivals.rate(now, float(report.prompt_tokens_in))}  # fmt: skip
    return {
        AGE: age_s,
        **rate,
        "pending_prompt_tokens": float(report.pending_prompt_tokens),
        "running_decode_tokens": float(report.running_decode_tokens),
        "kv_fill": min(max(fill, 0.0), 1.0),
    }


def shard_stats(used_blocks: int, num_blocks: int, age_s: float) -> dict[str, float]:
    """A shard replica's `record_autoscaling_stats`: the share of its KV blocks in use."""
    return {AGE: age_s, "kv_fill": used_blocks / num_blocks if num_blocks else 0.0}


def samples_from(
    metrics: dict[str, dict[Any, float]], targets: dict[str, float]
) -> list[LoadSample]:
    """One sample per replica that reported every target's signal as a finite number: its load
    in replicas' worth (a missing or garbled report counts for nothing, like none at all)."""
    ages = metrics.get(AGE, {})
    out = []
    for replica, age in ages.items():
        values = [metrics.get(name, {}).get(replica) for name in targets]
        numbers = [v for v in (age, *values) if isinstance(v, int | float) and math.isfinite(v)]
        if len(numbers) != len(values) + 1:
            continue
        shares = {n: float(v) / targets[n] for v, n in zip(values, targets, strict=True)}  # type: ignore[arg-type]
        out.append(LoadSample(str(replica), replica_load(shares), float(age)))
    return out


LENT_SIGNAL = "prompt_tokens_per_s"


def lent_prefill_samples(
    token_metrics: dict[str, dict[Any, float]], prompt_targets: dict[str, float]
) -> list[LoadSample]:
    """The prefills the router lent to token engines (the mixed pool takes a prompt engine's
    overflow), as prompt engines' load: one sample per token engine that reported its prompt
    arrival rate, in prompt engines' worth. Without them a load step reads short while the
    prompt engines are overloaded, just when the mixed pool takes most of it; with them the
    prompt side is sized for all the prompts, and the lending stops once it is. None when the
    prompt side has no rate target. A token engine's warm-up is the token side's: its samples
    here count as warm (they hold no prompt engine's scale-up or -down)."""
    target = prompt_targets.get(LENT_SIGNAL)
    if target is None:
        return []
    return [
        LoadSample(f"lent:{s.replica_id}", s.load, math.inf, lent=True)
        for s in samples_from(token_metrics, {LENT_SIGNAL: target})
    ]


def replica_load(shares: dict[str, float]) -> float:
    """A replica's load from its signals' shares of their targets: the largest, except that the
    prompt tokens arriving and those queued add up (both take its prefill time: keeping up with
    the arrivals and clearing the backlog); a rate alone would under-read a step while the
    router diverts an overloaded engine's arrivals to the mixed pool."""
    arriving = shares.pop("prompt_tokens_per_s", None)
    if arriving is not None:
        shares["prompt_tokens_per_s"] = arriving + shares.pop("pending_prompt_tokens", 0.0)
    return max(shares.values())


def check_targets(targets: dict[str, float]) -> dict[str, float]:
    """Targets as given, or a ValueError naming what is wrong (at deploy time)."""
    if not targets or any(t <= 0 for t in targets.values()):
        raise ValueError("targets: at least one signal with a positive per-replica target")
    known = {s for signals in SIGNALS.values() for s in signals}
    if unknown := set(targets) - known:
        raise ValueError(f"unknown autoscaling signals {sorted(unknown)}; known: {sorted(known)}")
    return dict(targets)


def bounded_policy(knobs: dict[str, Any], lo: int, hi: int) -> ScalePolicy:
    """The policy of `knobs` within Serve's capacity-adjusted bounds, rounded to whole groups."""
    group = int(knobs.get("group_size", 1))
    low = -(-lo // group) * group
    high = max(hi // group * group, low)
    return ScalePolicy(target_load=1.0, **{**knobs, "min_replicas": low, "max_replicas": high})


def saved_state(ctx: Any) -> ScaleState:
    """The state this deployment's last decision left, following a count changed by hand."""
    saved = ctx.policy_state.get(STATE_KEY)
    state = ScaleState(**saved) if saved else ScaleState(replicas=ctx.target_num_replicas)
    if state.replicas != ctx.target_num_replicas:  # changed by hand (serve deploy): follow it
        state = ScaleState(ctx.target_num_replicas, last_change_at=state.last_change_at,
                           num_changes=state.num_changes)  # fmt: skip
    return state


def now_of(ctx: Any) -> float:
    return ctx.current_time if ctx.current_time is not None else time.time()


class MeshAutoscalingPolicy:
    """Serve's class-callable policy (`policy_kwargs` are this constructor's arguments)."""

    def __init__(self, targets: dict[str, float], **knobs: Any) -> None:
        self.targets = check_targets(targets)
        self.knobs = knobs
        # Refuse bad knobs at deploy time, not per decision (the bounds come from Serve's).
        group = int(knobs.get("group_size", 1))
        bounded_policy(knobs, group, group)

    def __call__(
        self, ctx: Any, lent: list[LoadSample] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """The count for `ctx`'s deployment; `lent`: load of its role that other deployments'
        replicas carry for it (`lent_prefill_samples`)."""
        policy = bounded_policy(
            self.knobs, ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        )
        samples = samples_from(ctx.aggregated_metrics or {}, self.targets) + (lent or [])
        state = decide(policy, saved_state(ctx), samples, now_of(ctx))
        return state.replicas, {STATE_KEY: asdict(state)}


class GroupAutoscaling:
    """Token engines and their shard groups decided together (`decide_groups`): the token
    engines' knobs count groups; the shards add their signal and follow."""

    def __init__(
        self, engine_targets: dict[str, float], shard_targets: dict[str, float],
        shards_per_group: int, **knobs: Any,
    ) -> None:  # fmt: skip
        if "group_size" in knobs:
            raise ValueError("TokenEngine's knobs count groups: its group_size is 1")
        if shards_per_group < 1:
            raise ValueError("AttentionShard's group_size (shards_per_group) must be at least 1")
        self.engine_targets, self.shard_targets = check_targets(engine_targets), shard_targets
        self.shards_per_group, self.knobs = shards_per_group, knobs
        bounded_policy(knobs, 1, 1)

    def __call__(self, engines: Any, shards: Any) -> tuple[GroupReplicas, dict[str, Any]]:
        g = self.shards_per_group
        # Whole groups within both deployments' bounds.
        lo = max(engines.capacity_adjusted_min_replicas,
                 -(-shards.capacity_adjusted_min_replicas // g))  # fmt: skip
        hi = min(engines.capacity_adjusted_max_replicas, shards.capacity_adjusted_max_replicas // g)
        policy = bounded_policy(self.knobs, lo, hi)
        engine_samples = samples_from(engines.aggregated_metrics or {}, self.engine_targets)
        shard_samples = samples_from(shards.aggregated_metrics or {}, self.shard_targets)
        state = decide_groups(policy, saved_state(engines), engine_samples, shard_samples, g,
                              now_of(engines))  # fmt: skip
        return GroupReplicas.of(state.replicas, g), {STATE_KEY: asdict(state)}


def requests_policy(ctx: Any) -> float:
    """Serve's default rule, for a deployment whose requests pass through Serve (the Router):
    its ongoing requests over `target_ongoing_requests` per replica (Serve's wrapper adds its
    delays, bounds and cold start)."""
    if ctx.current_num_replicas == 0:
        return float(ctx.target_num_replicas)
    return float(ctx.total_num_requests) / ctx.config.get_target_ongoing_requests()


class MeshAppAutoscalingPolicy:
    """Serve's application-level policy: `policy_kwargs` name deployments (module docstring)."""

    def __init__(self, **deployments: dict[str, Any]) -> None:
        kwargs = {name: dict(options) for name, options in deployments.items()}
        engine_name, shard_name = GROUP_DEPLOYMENTS
        self.group: GroupAutoscaling | None = None
        if shard_name in kwargs:
            shard = kwargs.pop(shard_name)
            if engine_name not in kwargs:
                raise ValueError(f"{shard_name} follows {engine_name}: name both")
            if extra := set(shard) - {"targets", "group_size"}:
                raise ValueError(
                    f"{shard_name} takes targets and group_size only (its count follows "
                    f"{engine_name}'s knobs), not {sorted(extra)}"
                )
            engine = kwargs.pop(engine_name)
            self.group = GroupAutoscaling(
                engine.pop("targets", {}), check_targets(shard.get("targets", {})),
                int(shard.get("group_size", 1)), **engine,
            )  # fmt: skip
        self.roles = {name: MeshAutoscalingPolicy(**options) for name, options in kwargs.items()}
        self._warned = False

    def __call__(self, contexts: dict[Any, Any]) -> tuple[dict[Any, float], dict[Any, Any]]:
        by_name = {dep.name: (dep, ctx) for dep, ctx in contexts.items()}
        decisions: dict[Any, float] = {}
        states: dict[Any, Any] = {}
        engine_name, shard_name = GROUP_DEPLOYMENTS
        for name, (dep, ctx) in by_name.items():
            if name == PROMPT_DEPLOYMENT and name in self.roles and engine_name in by_name:
                token_metrics = by_name[engine_name][1].aggregated_metrics or {}
                lent = lent_prefill_samples(token_metrics, self.roles[name].targets)
                decisions[dep], states[dep] = self.roles[name](ctx, lent)
            elif name in self.roles:
                decisions[dep], states[dep] = self.roles[name](ctx)
            elif name not in GROUP_DEPLOYMENTS or self.group is None:
                decisions[dep], states[dep] = requests_policy(ctx), {}
        if self.group is not None and engine_name in by_name and shard_name in by_name:
            (engine_dep, engines), (shard_dep, shards) = by_name[engine_name], by_name[shard_name]
            counts, states[engine_dep] = self.group(engines, shards)
            decisions[engine_dep], decisions[shard_dep] = counts.token_engines, counts.shards
            states[shard_dep] = {}
        elif self.group is not None and not self._warned:
            # One of the two has no autoscaling_config: neither moves (never half a group).
            log.warning("TokenEngine and AttentionShard scale together: give both an "
                        "autoscaling_config; neither is scaled meanwhile")  # fmt: skip
            self._warned = True
        return decisions, states
