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

- prompt engines: `pending_prompt_tokens` (Splitwise's JSQ load);
- token engines: `running_decode_tokens` and `kv_fill` (the share of its decode KV in use);
- shards: `kv_fill`; added in whole groups (`group_size: shards_per_group`), together with the
  token engine that claims them.

A replica whose report is missing (starting, or its hook failed) contributes no sample; a
replica whose worker died fails its health check and Serve replaces it, so a dead replica's last
load never holds the count up. Scale-down goes through the replica's graceful shutdown: it
leaves routing first (state `draining`), finishes what it holds, then stops
(`services/mesh/replica.py`).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Any

from common.protocol import LoadReport
from common.roles import Role
from common.scheduling.autoscale import LoadSample, ScalePolicy, ScaleState, decide

AGE = "age_s"
SIGNALS: dict[Role, tuple[str, ...]] = {
    Role.PROMPT: ("pending_prompt_tokens",),
    Role.TOKEN: ("running_decode_tokens", "kv_fill"),
    Role.MIXED: ("pending_prompt_tokens", "running_decode_tokens", "kv_fill"),
    Role.SHARD: ("kv_fill",),
}
STATE_KEY = "phasemesh"  # our part of Serve's per-deployment policy state


def engine_stats(report: LoadReport | None, age_s: float) -> dict[str, float]:
    """An engine replica's `record_autoscaling_stats`: its latest load report's signals."""
    if report is None:
        return {AGE: age_s}
    total = report.total_kv_blocks or 0
    fill = 1.0 - report.free_kv_blocks / total if total else 0.0
    return {
        AGE: age_s,
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
        load = max(float(v) / targets[n] for v, n in zip(values, targets, strict=True))  # type: ignore[arg-type]
        out.append(LoadSample(str(replica), load, float(age)))
    return out


class MeshAutoscalingPolicy:
    """Serve's class-callable policy (`policy_kwargs` are this constructor's arguments)."""

    def __init__(self, targets: dict[str, float], **knobs: Any) -> None:
        if not targets or any(t <= 0 for t in targets.values()):
            raise ValueError("targets: at least one signal with a positive per-replica target")
        known = {s for signals in SIGNALS.values() for s in signals}
        if unknown := set(targets) - known:
            raise ValueError(
                f"unknown autoscaling signals {sorted(unknown)}; known: {sorted(known)}"
            )
        self.targets = dict(targets)
        self.knobs = knobs
        # Refuse bad knobs at deploy time, not per decision (the bounds come from Serve's).
        group = int(knobs.get("group_size", 1))
        ScalePolicy(target_load=1.0, **{"min_replicas": group, "max_replicas": group, **knobs})

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        knobs = {**self.knobs}
        group = int(knobs.get("group_size", 1))
        # Serve's capacity-adjusted bounds, rounded to whole groups.
        knobs["min_replicas"] = -(-lo // group) * group
        knobs["max_replicas"] = max(hi // group * group, knobs["min_replicas"])
        policy = ScalePolicy(target_load=1.0, **knobs)
        saved = ctx.policy_state.get(STATE_KEY)
        state = ScaleState(**saved) if saved else ScaleState(replicas=ctx.target_num_replicas)
        if state.replicas != ctx.target_num_replicas:  # changed by hand (serve deploy): follow it
            state = ScaleState(ctx.target_num_replicas, last_change_at=state.last_change_at,
                               num_changes=state.num_changes)  # fmt: skip
        now = ctx.current_time if ctx.current_time is not None else time.time()
        state = decide(policy, state, samples_from(ctx.aggregated_metrics or {}, self.targets), now)
        return state.replicas, {STATE_KEY: asdict(state)}
