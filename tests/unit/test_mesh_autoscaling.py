"""Serve's side of the autoscaling policy: replica stats, and the policy called with Ray Serve's
own `AutoscalingContext` (and wrapped by Serve's own policy wrapper, as the controller does)."""

from __future__ import annotations

from typing import Any

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import (
    _apply_app_level_autoscaling_config,
    _apply_autoscaling_config,
)
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from common.protocol import LoadReport
from common.roles import Role
from services.mesh.autoscaling import (
    STATE_KEY,
    MeshAppAutoscalingPolicy,
    MeshAutoscalingPolicy,
    RateMeter,
    engine_stats,
    samples_from,
    shard_stats,
)

DEPLOYMENT = DeploymentID(name="PromptEngine", app_name="default")


def context(
    metrics: dict[str, dict[str, float]], *, replicas: int, now: float,
    state: dict[str, Any] | None = None, lo: int = 1, hi: int = 4,
    deployment: DeploymentID = DEPLOYMENT, num_requests: float = 0.0,
) -> AutoscalingContext:  # fmt: skip
    ids = {r: ReplicaID(r, deployment) for m in metrics.values() for r in m}
    config = AutoscalingConfig(min_replicas=lo, max_replicas=hi, upscale_delay_s=0,
                               downscale_delay_s=0, target_ongoing_requests=10)  # fmt: skip
    return AutoscalingContext(
        deployment_id=deployment, deployment_name=deployment.name, app_name="default",
        current_num_replicas=replicas, target_num_replicas=replicas,
        running_replicas=list(ids.values()), total_num_requests=num_requests,
        total_queued_requests=0.0,
        aggregated_metrics={k: {ids[r]: v for r, v in m.items()} for k, m in metrics.items()},
        raw_metrics=None, capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        policy_state=state or {}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=now, config=config,
    )  # fmt: skip


def test_engine_stats_from_a_load_report() -> None:
    report = LoadReport(engine_id="e", role=Role.TOKEN, pending_prompt_tokens=300,
                        running_decode_tokens=1200, num_running=3, num_waiting=0,
                        free_kv_blocks=25, total_kv_blocks=100)  # fmt: skip
    stats = engine_stats(report, 40.0)
    assert stats == {"age_s": 40.0, "pending_prompt_tokens": 300.0,
                     "running_decode_tokens": 1200.0, "kv_fill": 0.75}  # fmt: skip
    assert engine_stats(None, 1.0) == {"age_s": 1.0}  # no report yet: no load sample
    assert shard_stats(30, 120, 5.0) == {"age_s": 5.0, "kv_fill": 0.25}


def test_a_replica_without_every_signal_gives_no_sample() -> None:
    metrics = {"age_s": {"a": 90.0, "b": 1.0}, "running_decode_tokens": {"a": 2000.0, "b": 9.0},
               "kv_fill": {"a": 0.9}}  # fmt: skip
    (sample,) = samples_from(metrics, {"running_decode_tokens": 4000, "kv_fill": 0.6})
    assert sample.replica_id == "a" and sample.load == pytest.approx(1.5)  # KV fill dominates
    # Garbled reports (NaN, infinity, not a number) give no sample instead of a wrong count.
    garbled = {"age_s": {"a": 90.0, "b": float("nan"), "c": 50.0, "d": 9.0},
               "kv_fill": {"a": float("inf"), "b": 0.5, "c": "full", "d": 0.3}}  # fmt: skip
    assert [s.replica_id for s in samples_from(garbled, {"kv_fill": 0.6})] == ["d"]


def test_the_policy_scales_up_through_serves_wrapper_and_keeps_its_state() -> None:
    policy = _apply_autoscaling_config(
        MeshAutoscalingPolicy({"pending_prompt_tokens": 1000}, upscale_after_s=10, warmup_s=0)
    )
    busy = {"age_s": {"p0": 60.0}, "pending_prompt_tokens": {"p0": 2500.0}}
    replicas, state = policy(context(busy, replicas=1, now=100.0))
    assert replicas == 1 and state[STATE_KEY]["wanted"] == 2
    replicas, state = policy(context(busy, replicas=1, now=111.0, state=state))
    assert replicas == 2 and state[STATE_KEY]["num_changes"] == 1


@pytest.mark.parametrize("lead_s", [0.0, 15.0])
def test_a_rising_arrival_rate_scales_up_ahead_through_serves_wrapper(lead_s: float) -> None:
    # The trend lives in Serve's policy state between calls: 600 then 1600 prompt tokens/s on
    # one replica with an empty queue, a step past the target by more than the dead band, rising
    # by 0.2 replicas' worth a second: 4.6 replicas' worth 15 s ahead, 6 replicas at the band's
    # middle, all in this scale-up (the load now asks for 2).
    policy = _apply_autoscaling_config(MeshAutoscalingPolicy(
        {"prompt_tokens_per_s": 1000, "pending_prompt_tokens": 4000}, upscale_after_s=0,
        cooldown_s=0, warmup_s=0, max_step=8, lead_s=lead_s, trend_s=5))  # fmt: skip
    state: dict[str, Any] = {}
    for now, rate in ((100.0, 600.0), (105.0, 1600.0)):
        arriving = {"age_s": {"p0": 60.0}, "prompt_tokens_per_s": {"p0": rate},
                    "pending_prompt_tokens": {"p0": 0.0}}  # fmt: skip
        replicas, state = policy(context(arriving, replicas=1, now=now, state=state, hi=8))
    assert state[STATE_KEY]["slope"] == pytest.approx(0.2)  # replicas' worth per second
    assert replicas == (6 if lead_s else 2)


def test_shard_groups_follow_serves_bounds_in_whole_groups() -> None:
    policy = MeshAutoscalingPolicy({"kv_fill": 0.5}, group_size=2, upscale_after_s=0,
                                   cooldown_s=0, warmup_s=0)  # fmt: skip
    full = {"age_s": {"s0": 60.0, "s1": 60.0}, "kv_fill": {"s0": 0.9, "s1": 0.8}}
    replicas, _ = policy(context(full, replicas=2, now=0.0, lo=2, hi=7))
    assert replicas == 4  # 3.4 replicas' worth, a whole group more (max rounded down to 6)


def test_bad_policy_kwargs_fail_at_deploy_time() -> None:
    with pytest.raises(ValueError, match="unknown autoscaling signals"):
        MeshAutoscalingPolicy({"queue": 3})
    with pytest.raises(ValueError, match="positive"):
        MeshAutoscalingPolicy({"kv_fill": 0})
    with pytest.raises(ValueError, match="scale_down_fill"):
        MeshAutoscalingPolicy({"kv_fill": 0.5}, scale_down_fill=2)


GROUP_KWARGS: dict[str, Any] = {
    "PromptEngine": {"targets": {"pending_prompt_tokens": 1000}, "upscale_after_s": 0,
                     "warmup_s": 0},
    "TokenEngine": {"targets": {"running_decode_tokens": 1000}, "upscale_after_s": 5,
                    "downscale_after_s": 5, "cooldown_s": 0, "warmup_s": 0},
    "AttentionShard": {"targets": {"kv_fill": 0.5}, "group_size": 2},
}  # fmt: skip


def app_contexts(
    loads: dict[str, dict[str, dict[str, float]]], replicas: dict[str, int], now: float,
    states: dict[DeploymentID, Any] | None = None, num_requests: float = 10.0,
) -> dict[DeploymentID, AutoscalingContext]:  # fmt: skip
    """Serve's contexts for one application-level call: per deployment, its replicas' metrics
    (every replica a minute old) and its count; `num_requests`: the Router's, through Serve."""
    out = {}
    for name, count in replicas.items():
        dep = DeploymentID(name=name, app_name="default")
        metrics = loads.get(name, {})
        metrics = {"age_s": {r: 60.0 for m in metrics.values() for r in m}, **metrics}
        out[dep] = context(metrics, replicas=count, now=now, deployment=dep, hi=8,
                           state=(states or {}).get(dep), num_requests=num_requests)  # fmt: skip
    return out


def test_the_app_policy_adds_and_removes_a_token_engine_with_its_shard_group() -> None:
    """Through Serve's own application-level wrapper, as the controller calls it."""
    policy = _apply_app_level_autoscaling_config(MeshAppAutoscalingPolicy(**GROUP_KWARGS))
    replicas = {"Router": 1, "PromptEngine": 1, "TokenEngine": 1, "AttentionShard": 2}
    # Long decodes: the engine's decode tokens under target, its shards' KV past theirs.
    kv_heavy = {"TokenEngine": {"running_decode_tokens": {"t0": 600.0}},
                "AttentionShard": {"kv_fill": {"s0": 0.8, "s1": 0.7}}}  # fmt: skip
    by_name = lambda d: {dep.name: n for dep, n in d.items()}  # noqa: E731
    decided, states = policy(app_contexts(kv_heavy, replicas, now=100.0))
    assert by_name(decided) == replicas  # wanted, not yet for upscale_after_s
    decided, states = policy(app_contexts(kv_heavy, replicas, now=106.0, states=states))
    assert by_name(decided) == {**replicas, "TokenEngine": 2, "AttentionShard": 4}
    replicas = by_name(decided)
    idle = {
        "TokenEngine": {"running_decode_tokens": {"t0": 10.0, "t1": 0.0}},
        "AttentionShard": {"kv_fill": {"s0": 0.1, "s1": 0.0, "s2": 0.05, "s3": 0.0}},
    }
    for now in (200.0, 206.0):
        decided, states = policy(app_contexts(idle, replicas, now=now, states=states))
    assert by_name(decided) == {**replicas, "TokenEngine": 1, "AttentionShard": 2}
    # The Router keeps Serve's request-based rule: 35 ongoing requests, 10 a replica.
    decided, _ = policy(app_contexts({}, replicas, now=300.0, num_requests=35.0))
    assert by_name(decided)["Router"] == 4
    # Shards without an autoscaling_config (Serve passes no context): no half group moves.
    no_shards = {n: c for n, c in replicas.items() if n != "AttentionShard"}
    decided, _ = policy(app_contexts(kv_heavy, no_shards, now=400.0))
    assert "TokenEngine" not in by_name(decided) and by_name(decided)["PromptEngine"] == 1


def test_app_policy_kwargs_fail_at_deploy_time() -> None:
    with pytest.raises(ValueError, match="name both"):
        MeshAppAutoscalingPolicy(AttentionShard={"targets": {"kv_fill": 0.5}, "group_size": 2})
    with pytest.raises(ValueError, match="targets and group_size only"):
        MeshAppAutoscalingPolicy(**{**GROUP_KWARGS, "AttentionShard": {
            "targets": {"kv_fill": 0.5}, "group_size": 2, "cooldown_s": 5}})  # fmt: skip
    with pytest.raises(ValueError, match="count groups"):
        MeshAppAutoscalingPolicy(**{**GROUP_KWARGS, "TokenEngine": {
            "targets": {"kv_fill": 0.5}, "group_size": 2}})  # fmt: skip
    with pytest.raises(ValueError, match="unknown autoscaling signals"):
        MeshAppAutoscalingPolicy(**{**GROUP_KWARGS, "AttentionShard": {
            "targets": {"queue": 1}, "group_size": 2}})  # fmt: skip


def test_arrivals_and_backlog_add_up_into_a_prompt_engines_load() -> None:
    meter = RateMeter(100.0)
    report = LoadReport(engine_id="e", role=Role.PROMPT, pending_prompt_tokens=2000,
                        running_decode_tokens=0, num_running=0, num_waiting=2,
                        free_kv_blocks=10, total_kv_blocks=10, prompt_tokens_in=3000)  # fmt: skip
    stats = engine_stats(report, 40.0, meter, now=102.0)
    assert stats["prompt_tokens_per_s"] == 1500.0  # 3,000 tokens in 2 s
    targets = {"prompt_tokens_per_s": 1000.0, "pending_prompt_tokens": 4000.0}
    metrics = {k: {"r0": v} for k, v in stats.items()}
    # Keeping up with 1.5 replicas' worth of arrivals and clearing half a replica's backlog.
    assert [s.load for s in samples_from(metrics, targets)] == [2.0]
    # Without a rate target the queue stands alone (the largest signal, as before).
    assert [s.load for s in samples_from(metrics, {"pending_prompt_tokens": 4000.0})] == [0.5]
    # Readings at the same instant repeat the rate; a counter that went back restarts from 0.
    assert meter.rate(102.0, 3000.0) == 1500.0
    assert meter.rate(104.0, 1000.0) == 500.0


def test_prefills_lent_to_token_engines_count_as_the_prompt_engines_load() -> None:
    """A step the prompt engines cannot take goes to the mixed pool: with a rate target, the
    app policy sizes the PromptEngine for all the prompts, its own and those it lent."""
    kwargs = {**GROUP_KWARGS, "PromptEngine": {"targets": {"prompt_tokens_per_s": 1000},
                                               "upscale_after_s": 0, "warmup_s": 0,
                                               "max_step": 8}}  # fmt: skip
    policy = _apply_app_level_autoscaling_config(MeshAppAutoscalingPolicy(**kwargs))
    replicas = {"PromptEngine": 1, "TokenEngine": 2, "AttentionShard": 4}
    step = {"PromptEngine": {"prompt_tokens_per_s": {"p0": 1200.0}},
            "TokenEngine": {"running_decode_tokens": {"t0": 500.0, "t1": 500.0},
                            "prompt_tokens_per_s": {"t0": 900.0, "t1": 1100.0}}}  # fmt: skip
    decided, _ = policy(app_contexts(step, replicas, now=100.0))
    assert {dep.name: n for dep, n in decided.items()}["PromptEngine"] == 4  # 3.2 engines' worth
    # Without the lent ones (a pending-only target), 1.2 engines' worth of its own asks for 2.
    pending_only = {
        **kwargs,
        "PromptEngine": {**kwargs["PromptEngine"], "targets": {"pending_prompt_tokens": 1000}},
    }
    step["PromptEngine"] = {"pending_prompt_tokens": {"p0": 1200.0}}
    decided, _ = MeshAppAutoscalingPolicy(**pending_only)(app_contexts(step, replicas, now=0.0))
    assert {dep.name: n for dep, n in decided.items()}["PromptEngine"] == 2
