"""The replica-count policy (common/scheduling/autoscale.py) on recorded load series."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from common.scheduling.autoscale import (
    WINDOW_SLOTS,
    GroupReplicas,
    Load,
    LoadSample,
    ScalePolicy,
    ScaleState,
    decide,
    decide_groups,
    wanted_replicas,
)

POLICY = ScalePolicy(target_load=1000, min_replicas=1, max_replicas=8, upscale_after_s=10,
                     downscale_after_s=60, cooldown_s=30, warmup_s=30)  # fmt: skip


def samples(*loads: float, age_s: float = 600.0) -> list[LoadSample]:
    return [LoadSample(f"r{i}", load, age_s) for i, load in enumerate(loads)]


def replay(
    policy: ScalePolicy, series: list[float], start: int, period_s: float = 5.0
) -> list[int]:
    """Replicas after each sample of a series of total loads, spread evenly over the replicas."""
    state = ScaleState(replicas=start)
    counts = []
    for i, total in enumerate(series):
        n = state.replicas
        state = decide(policy, state, samples(*([total / n] * n)), now=i * period_s)
        counts.append(state.replicas)
    return counts


def test_load_over_the_target_scales_up_after_the_delay() -> None:
    state = ScaleState(replicas=1)
    state = decide(POLICY, state, samples(2500), now=0.0)
    assert state.replicas == 1 and state.wanted == 2  # wanted, not yet for long enough
    state = decide(POLICY, state, samples(2500), now=9.0)
    assert state.replicas == 1
    state = decide(POLICY, state, samples(2500), now=10.0)
    assert state.replicas == 2 and state.num_changes == 1


def test_step_is_capped() -> None:
    assert wanted_replicas(POLICY, 1, samples(7000)) == 2
    wide = ScalePolicy(target_load=1000, max_step=3)
    assert wanted_replicas(wide, 1, samples(7000)) == 4
    assert wanted_replicas(wide, 6, samples(10, 10, 10, 10, 10, 10)) == 3


def test_bounds_hold() -> None:
    assert wanted_replicas(replace_policy(max_step=8), 4, samples(*[9000] * 4)) == 8
    assert wanted_replicas(POLICY, 2, samples(0, 0)) == 1  # min_replicas


def replace_policy(**kw: object) -> ScalePolicy:
    fields = {**POLICY.__dict__, **kw}
    return ScalePolicy(**fields)  # type: ignore[arg-type]


def test_dead_band_between_the_targets_keeps_the_size() -> None:
    # 2 replicas, 1,500 of load: over one replica's target, under two; and not <= 0.7 x 1,000
    # (what one replica would hold with room), so neither up nor down.
    assert wanted_replicas(POLICY, 2, samples(750, 750)) == 2
    # 600 fits one replica at 0.7 of its target: consolidate.
    assert wanted_replicas(POLICY, 2, samples(300, 300)) == 1


def test_scale_down_is_consolidation_aware() -> None:
    # 3 replicas at 1,500 total: 2 could carry it under the target (750 each) but not at 0.7
    # (1,400): removing one would leave the rest too close to their target, so it stays.
    assert wanted_replicas(POLICY, 3, samples(500, 500, 500)) == 3
    assert wanted_replicas(POLICY, 3, samples(400, 400, 400)) == 2


def test_scale_down_waits_its_delay_and_the_cool_down() -> None:
    state = ScaleState(replicas=2, last_change_at=0.0, num_changes=1)
    state = decide(POLICY, state, samples(10, 10), now=5.0)
    assert state.replicas == 2 and state.wanted == 1
    state = decide(POLICY, state, samples(10, 10), now=64.0)
    assert state.replicas == 2  # 59 s of wanting < 60
    state = decide(POLICY, state, samples(10, 10), now=65.0)
    assert state.replicas == 1


def test_cool_down_blocks_a_change_right_after_one() -> None:
    fast = replace_policy(upscale_after_s=0, downscale_after_s=0, cooldown_s=30)
    state = decide(fast, ScaleState(replicas=1), samples(2500), now=0.0)
    assert state.replicas == 2
    state = decide(fast, state, samples(3000, 3000), now=10.0)
    assert state.replicas == 2  # wanted 3, cooling down
    state = decide(fast, state, samples(3000, 3000), now=30.0)
    assert state.replicas == 3


def test_a_change_of_mind_restarts_the_delay() -> None:
    state = decide(POLICY, ScaleState(replicas=2), samples(2000, 2000), now=0.0)
    assert state.wanted == 3
    state = decide(POLICY, state, samples(800, 800), now=5.0)  # back inside the dead band
    assert state.wanted == 0 and state.wanted_since is None
    state = decide(POLICY, state, samples(2000, 2000), now=8.0)
    state = decide(POLICY, state, samples(2000, 2000), now=15.0)
    assert state.replicas == 2  # 7 s of wanting since the restart
    state = decide(POLICY, state, samples(2000, 2000), now=18.0)
    assert state.replicas == 3


def test_start_up_samples_are_ignored() -> None:
    # A new replica's queue while it loads weights is not the mesh's load.
    cold = [LoadSample("old", 500, 600.0), LoadSample("new", 50_000, 3.0)]
    assert wanted_replicas(POLICY, 2, cold) == 2
    assert wanted_replicas(POLICY, 2, [LoadSample("new", 50_000, 3.0)]) == 2  # all cold: hold
    # Nor does the mesh shrink while the new one starts (it was added for a reason).
    assert (
        wanted_replicas(POLICY, 2, [LoadSample("old", 10, 600.0), LoadSample("new", 0, 3.0)]) == 2
    )


def test_an_slo_breach_adds_a_replica_even_under_the_load_target() -> None:
    breached = [LoadSample("r0", 100, 600.0, slo_breached=True)]
    assert wanted_replicas(POLICY, 1, breached) == 2


def test_shard_groups_come_and_go_whole() -> None:
    shards = ScalePolicy(target_load=100, min_replicas=2, max_replicas=8, group_size=2)
    assert wanted_replicas(shards, 2, samples(150, 150)) == 4  # 300 needs 3: a whole group is 4
    assert wanted_replicas(shards, 4, samples(10, 10, 10, 10)) == 2
    assert all(n % 2 == 0 for n in replay(shards, [50, 300, 900, 900, 10, 10] * 20, start=2))
    with pytest.raises(ValueError, match="multiples of group_size"):
        ScalePolicy(target_load=100, min_replicas=1, group_size=2)


# Token engines with their shard groups: targets of one token engine (decode tokens) and of one
# shard (its KV fill, as a share); 4 shards a group.
GROUPS = ScalePolicy(target_load=1.0, min_replicas=1, max_replicas=4, upscale_after_s=10,
                     downscale_after_s=60, cooldown_s=30, warmup_s=30)  # fmt: skip
SHARDS_PER_GROUP = 4


def replay_groups(series: list[tuple[float, float]], start: int = 1) -> list[GroupReplicas]:
    """Replicas after each sample of a series of (engines' load, shards' load), each spread
    evenly over the replicas there are; one sample every 5 s."""
    state, out = ScaleState(replicas=start), []
    for i, (engine_load, shard_load) in enumerate(series):
        n = state.replicas
        engines = samples(*([engine_load / n] * n))
        num_shards = n * SHARDS_PER_GROUP
        shards = samples(*([shard_load / num_shards] * num_shards))
        state = decide_groups(GROUPS, state, engines, shards, SHARDS_PER_GROUP, now=i * 5.0)
        out.append(GroupReplicas.of(state.replicas, SHARDS_PER_GROUP))
    return out


def test_a_kv_heavy_step_adds_a_token_engine_with_its_whole_shard_group_and_removes_it() -> None:
    # Long decodes: few decode tokens on the engine's side (under its target), the shards' KV
    # over their fill target (6 shards' worth on 4): the shards' side asks for the group.
    series = [(0.3, 1.6)] * 10 + [(0.6, 6.0)] * 20 + [(0.2, 0.4)] * 30
    counts = replay_groups(series)
    assert {c.shards for c in counts} == {4, 8}
    assert all(c.shards == SHARDS_PER_GROUP * c.token_engines for c in counts)
    assert changes([c.token_engines for c in counts], 1) == 2  # one group in, then out
    assert counts[-1] == GroupReplicas(1, 4)
    # The engines' side alone asks for a group as well (decode tokens over target).
    assert replay_groups([(2.5, 0.2)] * 4)[-1] == GroupReplicas(2, 8)


def test_a_group_leaves_only_when_both_its_engines_and_its_shards_fit_one_group_less() -> None:
    state = ScaleState(replicas=2)
    cases = [((0.1, 0.1), 0.9),  # engines idle, shards still full: a group less would not hold
             ((1.8, 0.1), 0.1)]  # shards idle, engines busy  # fmt: skip
    for engine_loads, shard_load in cases:
        shards = samples(*[shard_load] * 8)
        for now in (0.0, 100.0):  # well past the delay
            state = decide_groups(GROUPS, state, samples(*engine_loads), shards, 4, now=now)
        assert state.replicas == 2, (engine_loads, shard_load)
    for now in (200.0, 300.0):
        state = decide_groups(GROUPS, state, samples(0.1, 0.1), samples(*[0.1] * 8), 4, now=now)
    assert state.replicas == 1


def test_a_starting_shard_holds_its_group_and_a_local_mesh_counts_engines_alone() -> None:
    # A group whose new shards are still starting does not leave again, however idle.
    cold = samples(*[0.0] * 4) + [LoadSample("new", 0.0, 3.0)] * 4
    state = ScaleState(replicas=2)
    for now in (0.0, 100.0):
        state = decide_groups(GROUPS, state, samples(0.1, 0.1), cold, 4, now=now)
    assert state.replicas == 2
    # Nor while its new token engine starts (the shards' side alone would let it go).
    state = ScaleState(replicas=2)
    for now in (0.0, 100.0):
        state = decide_groups(GROUPS, state, [LoadSample("new", 0.0, 3.0)],
                              samples(*[0.0] * 8), 4, now=now)  # fmt: skip
    assert state.replicas == 2
    # No shards (local attention): the engines' load alone; a shard sample means nothing.
    state = ScaleState(replicas=1)
    for now in (0.0, 20.0):
        state = decide_groups(GROUPS, state, samples(2.0), samples(9.0), 0, now=now)
    assert state.replicas == 2
    assert GroupReplicas.of(2, 0) == GroupReplicas(2, 0)
    with pytest.raises(ValueError, match="group_size"):  # a group policy counts groups
        decide_groups(ScalePolicy(1.0, 2, 8, group_size=2), state, [], [], 4, 0.0)


def naive(series: list[float], start: int, target: float) -> list[int]:
    """A plain threshold policy: as many replicas as the load over the target, at once."""
    return [max(1, math.ceil(total / target)) for total in series]


def changes(counts: list[int], start: int) -> int:
    return sum(a != b for a, b in zip([start, *counts], counts, strict=False))


def test_a_series_that_makes_a_threshold_policy_flap_changes_this_one_at_most_twice() -> None:
    # A load that wanders around one replica's target (noise on a flat load), then a real step
    # that lasts, then the flat load again: Serve's default-like threshold policy flaps.
    noise = [900, 1100, 950, 1080, 1020, 880, 1150, 990]
    series = noise * 6 + [1800] * 20 + [0] * 30 + noise * 20
    assert changes(naive(series, 1, 1000), 1) >= 20
    counts = replay(POLICY, series, start=1)
    assert changes(counts, 1) == 2  # up for the step, down once it ended; never for the noise
    assert max(counts) == 2 and counts[-1] == 1


def test_bad_policies_are_refused() -> None:
    for kw in ({"target_load": 0}, {"scale_down_fill": 0}, {"max_step": 0}, {"cooldown_s": -1},
               {"min_replicas": 9}):  # fmt: skip
        with pytest.raises(ValueError):
            replace_policy(**kw)


def test_no_scale_up_on_the_backlog_while_the_last_scale_ups_replicas_warm_up() -> None:
    # A step sized at once: 1 -> 5 (3.5 replicas' worth, at 0.85 of the target: the middle of
    # the dead band). The old replica's queue (what it took while the new ones started) still
    # asks for more, but the new ones are warming up: hold, then none is needed.
    fast = replace_policy(upscale_after_s=0, cooldown_s=0, max_step=8)
    state = decide(fast, ScaleState(replicas=1), samples(3500), now=0.0)
    assert state.replicas == 5
    backlog = [LoadSample("old", 9000, 600.0)] + [LoadSample(f"new{i}", 0, 5.0) for i in range(4)]
    state = decide(fast, state, backlog, now=20.0)
    assert state.replicas == 5 and state.num_changes == 1
    # Warm, the step's load swinging 20% over what sized it: inside the band, no change.
    warm = [LoadSample("old", 900, 600.0)] + [LoadSample(f"new{i}", 800, 40.0) for i in range(4)]
    assert decide(fast, state, warm, now=60.0).replicas == 5


def test_a_step_goes_to_the_most_it_asked_for_while_the_wish_lasted() -> None:
    # A rate read over a short window swings: 5, 4.5, then 3.2 replicas' worth at the moment
    # the delay is over. Sized by that last reading the step would need a second scale-up;
    # sized by the first, 6 (5 replicas' worth at 0.85 of the target: the band's middle).
    wide = replace_policy(max_step=8)
    state = ScaleState(replicas=1)
    for now, total in ((0.0, 5000), (5.0, 4500), (10.0, 3200)):
        state = decide(wide, state, samples(total), now=now)
    assert state.replicas == 6 and state.num_changes == 1
    state = decide(wide, state, samples(*[4500 / 6] * 6), now=20.0)
    assert state.replicas == 6 and state.wanted == 0  # nothing to mend after
    # Down by the latest reading: the wish began while the load was still falling.
    for now, total in ((100.0, 1500), (130.0, 900), (160.0, 600)):
        state = decide(wide, state, samples(*[total / 6] * 6), now=now)
    assert state.replicas == 1


def test_no_scale_down_while_a_replica_decided_has_not_reported_yet() -> None:
    # 1 -> 2; the second still starting (no report), the first's queue gone elsewhere (the
    # mixed pool took it): going back to 1 now would flap 1 -> 2 -> 1 before it ever ran.
    fast = replace_policy(downscale_after_s=0, cooldown_s=0)
    state = ScaleState(replicas=2, last_change_at=0.0, num_changes=1)
    for now in (5.0, 10.0):
        state = decide(fast, state, samples(10), now=now)
    assert state.replicas == 2
    assert decide(fast, state, samples(10, 10), now=15.0).replicas == 1  # both report: down
    # It holds no scale-up: a replica whose reports never come does not freeze the count.
    assert decide(fast, ScaleState(replicas=2), samples(5000), now=0.0).wanted == 3


# -- the trend: a scale-up sized for the load `lead_s` ahead -------------------------------------

# The simulator's prompt-side knobs (loadgen/sim/autoscale_replay.py's DEFAULT_ROLES), in loads of
# 1000 per replica.
LEADING = ScalePolicy(target_load=1000, max_replicas=32, max_step=64, upscale_after_s=30,
                      downscale_after_s=300, cooldown_s=60, warmup_s=30, lead_s=15,
                      trend_s=5)  # fmt: skip


def first_change(policy: ScalePolicy, series: list[float], start: int) -> tuple[int, int]:
    """(the second of the first change, the count it went to) over a series of total loads read
    once a second and spread over the replicas (the series never ends before a change)."""
    state = ScaleState(replicas=start)
    for now, total in enumerate(series):
        n = state.replicas
        state = decide(policy, state, samples(*[total / n] * n), now=float(now))
        if state.replicas != start:
            return now, state.replicas
    raise AssertionError("no change")


def look_back(series: list[float], window: int = 30) -> list[float]:
    """Each reading's average over the `window` readings before it (Serve's look-back)."""
    return [sum(series[max(0, i - window + 1) : i + 1]) / min(i + 1, window)
            for i in range(len(series))]  # fmt: skip


def test_a_step_is_met_within_seconds_in_one_scale_up_sized_for_all_of_it() -> None:
    # 8 replicas' worth on 12 replicas, then three times that: the look-back average rises over
    # its window. Once the load is past the target by more than the dead band (a step, not a
    # swing), its rise projected 15 s ahead sizes the scale-up, and the hold filling with the
    # groups the load needs brings the whole step (24 replicas' worth, at least 24) well within
    # `upscale_after_s` of the step, in one change.
    series = look_back([8000.0] * 300 + [24000.0] * 600)
    at, replicas = first_change(LEADING, series, start=12)
    assert 300 < at < 300 + 20 and replicas >= 24
    assert series[at] < 0.85 * 24000  # ahead: the load read then is well short of the step's
    state = ScaleState(replicas=12)
    for now, total in enumerate(series):
        n = state.replicas
        state = decide(LEADING, state, samples(*[total / n] * n), now=float(now))
    assert state.num_changes == 1
    # Without the lead, the hold fills as fast but the diluted reading sizes it short.
    short_at, short = first_change(replace(LEADING, lead_s=0.0), series, start=12)
    assert short_at <= at and short < 24


def test_a_noisy_flat_rate_does_not_flap() -> None:
    # Two hours of a flat load, 8.5 replicas' worth on 12 with Poisson-like noise averaged over
    # a 30 s look-back: its slope, projected, crosses the 12 replicas' target now and then, and
    # a single such reading scales nothing (the hold fills with what the load needs now).
    rng = random.Random(7)
    series = look_back([8500 + rng.gauss(0, 8000) for _ in range(7200)])
    state = ScaleState(replicas=12)
    crossings = 0
    for now, total in enumerate(series):
        state = decide(LEADING, state, samples(*[total / 12] * 12), now=float(now))
        crossings += total + max(state.slope, 0) * LEADING.lead_s > 12 * 1000
    assert crossings > 0  # the projection alone would have scaled up
    assert state.num_changes == 0


def test_replicas_joining_the_sum_make_no_trend() -> None:
    # A replica that warms up adds its load to the total at once: a rise of membership, not of
    # load, which projected a minute ahead would ask for 3 more replicas.
    ahead = replace_policy(upscale_after_s=0, cooldown_s=0, lead_s=60, trend_s=5)
    state = ScaleState(replicas=3)
    for now in range(20):
        young = [LoadSample("r2", 500, age_s=now + 15.0)]  # warm from 15 s on
        state = decide(ahead, state, samples(500, 500) + young, now=float(now))
        assert state.slope == 0.0 and state.replicas == 3


def test_a_bad_lead_or_trend_span_is_refused() -> None:
    with pytest.raises(ValueError, match="lead_s"):
        replace_policy(lead_s=-1)
    with pytest.raises(ValueError, match="trend_s"):
        replace_policy(trend_s=0)


def test_a_larger_wish_fills_its_hold_sooner() -> None:
    # One replica with five replicas' worth: four more are needed, so the 10 s hold is full
    # after 2.5 s of readings; one more needed waits the whole 10 s.
    state = ScaleState(replicas=1)
    wide = replace_policy(max_step=8)
    for now in (0.0, 1.0, 2.0):
        state = decide(wide, state, samples(5000), now=now)
    assert state.replicas == 1
    state = decide(wide, state, samples(5000), now=3.0)
    assert state.replicas == 6
    state = ScaleState(replicas=1)
    for now in (0.0, 3.0, 9.0):
        state = decide(POLICY, state, samples(1500), now=now)
    assert state.replicas == 1
    assert decide(POLICY, state, samples(1500), now=10.0).replicas == 2


# -- a swing sized at the target (`swing_fill`) ----------------------------------------------------

# The prompt side's load on seed 1 of `python bench/autoscale.py --seeds 1 --lend-bounds 0 0`
# before this knob (the simulator's run, 10 prompt machines settled on the base load), in tenths
# of a machine's target, every 5 s from 250 s to 1195 s (the step comes at 1200 s): a swing to
# 11.5 at 335 s, then the base load swinging between 6 and 11 every few minutes.
SEED1_PROMPT_LOAD = [
    91, 89, 90, 88, 87, 88, 93, 93, 98, 103, 105, 105, 101, 106, 107, 105, 108, 114, 115, 115,
    109, 108, 108, 110, 111, 113, 111, 112, 108, 107, 109, 109, 103, 105, 103, 106, 102, 104, 103,
    103, 104, 108, 107, 101, 101, 96, 90, 83, 76, 73, 72, 69, 67, 66, 67, 61, 62, 63, 65, 66, 65,
    68, 67, 67, 67, 66, 63, 59, 59, 61, 67, 73, 79, 83, 89, 96, 97, 95, 94, 93, 95, 92, 90, 86,
    85, 85, 80, 79, 76, 76, 74, 70, 71, 70, 73, 67, 67, 70, 69, 70, 67, 66, 65, 62, 62, 63, 61,
    64, 66, 70, 71, 72, 75, 79, 81, 86, 88, 89, 89, 91, 92, 93, 92, 91, 92, 89, 91, 91, 94, 95,
    97, 98, 100, 97, 99, 97, 94, 96, 92, 91, 87, 84, 83, 81, 80, 79, 78, 77, 73, 75, 74, 77, 81,
    84, 90, 88, 88, 86, 83, 85, 84, 87, 91, 95, 102, 102, 103, 103, 105, 109, 108, 110, 111, 110,
    109, 107, 105, 107, 107, 104, 108, 105, 105, 103, 99, 102, 105, 105, 105, 103
]  # fmt: skip


def replay_counts(policy: ScalePolicy, tenths: list[int], start: int) -> list[int]:
    """`replay` of a series in tenths of the target, read every 5 s."""
    return replay(policy, [t * policy.target_load / 10 for t in tenths], start)


def test_a_swing_sized_at_the_target_does_not_keep_replicas_for_the_base_loads_swings() -> None:
    # Sized to the band's middle (the default), the swing at 335 s buys 13 machines, whose
    # floor (12 at 0.7 of the target: 8.4) the load's peaks of 9-11 cross every few minutes:
    # each wish to scale down ends before its 300 s, and all 13 stay until the step. Sized at
    # the target, the swing buys 11, what its peak needs there, and nothing more.
    middle = replay_counts(LEADING, SEED1_PROMPT_LOAD, start=10)
    at_target = replay_counts(replace(LEADING, swing_fill=1.0), SEED1_PROMPT_LOAD, start=10)
    assert changes(middle, 10) == 1 and set(middle[20:]) == {13}
    assert changes(at_target, 10) == 1 and set(at_target[20:]) == {11}
    assert sum(at_target) < sum(middle) - 300  # replica-seconds / 5: two machines, 15 minutes
    # A step is still sized to the band's middle: one scale-up for all of it.
    series = look_back([8000.0] * 300 + [24000.0] * 600)
    assert first_change(replace(LEADING, swing_fill=1.0), series, start=12)[1] >= 24


def test_a_threshold_policys_flapping_series_changes_a_swing_at_the_target_at_most_twice() -> None:
    noise = [900, 1100, 950, 1080, 1020, 880, 1150, 990]
    series = noise * 6 + [1800] * 20 + [0] * 30 + noise * 20
    counts = replay(replace_policy(swing_fill=1.0), series, start=1)
    assert changes(counts, 1) == 2 and max(counts) == 2 and counts[-1] == 1


def test_a_swing_fill_outside_the_band_is_refused() -> None:
    for fill in (0.5, 1.2):  # under `scale_down_fill` (0.7) the load would sit under the floor
        with pytest.raises(ValueError, match="swing_fill"):
            replace_policy(swing_fill=fill)
    assert replace_policy(swing_fill=0.7).swing_share == 0.7
    assert replace_policy().swing_share == pytest.approx(0.85)  # the band's middle


# -- a scale-down over the window's mean and peak (`scale_down_peak_fill`) -------------------------


def test_a_swing_s_replicas_go_back_when_the_window_s_mean_and_peak_fit_the_smaller_size() -> None:
    # Seed 1's recorded load with the swing sized to the band's middle: 13 machines, whose floor
    # (8.4) the base load's peaks cross every few minutes, so every reading under it for 300 s
    # never happens and all 13 stay. Once a window of 300 s has a mean that fits fewer at 0.7
    # of the target and a peak (at most 11.1) that fits them at the target, it goes down, once.
    middle = replace(LEADING, scale_down_peak_fill=1.0)
    counts = replay_counts(middle, SEED1_PROMPT_LOAD, start=10)
    assert replay_counts(LEADING, SEED1_PROMPT_LOAD, start=10)[-1] == 13
    assert changes(counts, 10) == 2 and counts[-1] < 13
    # Its peak (11.1) does not fit 10 at the target: a swing sized at the target (11) stays.
    at_target = replace(LEADING, swing_fill=1.0, scale_down_peak_fill=1.0)
    assert set(replay_counts(at_target, SEED1_PROMPT_LOAD, start=10)[20:]) == {11}


def window_series(low: float, high: float, minutes: int) -> list[float]:
    """A load read every 5 s swinging between `low` and `high` (in targets) every two minutes."""
    return [(high if (i // 12) % 2 else low) * 1000 for i in range(minutes * 12)]


def test_a_window_whose_peak_would_not_fit_one_replica_less_at_the_target_is_refused() -> None:
    # 4 replicas after a swing from 3; 3's floor is 2.1 (0.7 of its target). The load swings
    # 1.5 <-> 3.2: the mean (2.35) is over the floor: refused. 1.0 <-> 3.1: the mean (2.05)
    # fits, the peak does not fit 3 at the target: refused. 1.2 <-> 2.9: both fit: allowed.
    policy = replace(POLICY, scale_down_peak_fill=1.0, downscale_after_s=300)

    def after_swing(low: float, high: float) -> list[int]:
        state = ScaleState(replicas=4, risen_from=3, last_change_at=-600.0)
        counts = []
        for i, total in enumerate(window_series(low, high, 15)):
            state = decide(policy, state, samples(*[total / 4] * 4), now=i * 5.0)
            counts.append(state.replicas)
        return counts

    assert set(after_swing(1.5, 3.2)) == {4}
    assert set(after_swing(1.0, 3.1)) == {4}
    allowed = after_swing(1.2, 2.9)
    assert allowed[-1] == 3 and changes(allowed, 4) == 1  # once the window spans its 300 s
    assert allowed.index(3) * 5.0 >= 300
    # Without the knob every reading must fit 3 at 0.7 (2.1): 2.9 never does.
    assert set(replay(replace(policy, scale_down_peak_fill=None), window_series(1.2, 2.9, 15),
                      start=4)) == {4}  # fmt: skip


def test_the_window_takes_back_only_what_the_last_scale_up_added() -> None:
    # The same swinging load whose window fits 3, on a size a scale-down or the start settled
    # at (no scale-up to take back): it stays, as under every-reading-under-the-floor.
    policy = replace(POLICY, scale_down_peak_fill=1.0, downscale_after_s=300)
    assert set(replay(policy, window_series(1.2, 2.9, 15), start=4)) == {4}
    # A scale-up from 2 is taken back to 3 at most (the window's mean needs 3 at 0.7).
    state = ScaleState(replicas=4, risen_from=2, last_change_at=-600.0)
    for i, total in enumerate(window_series(1.2, 2.9, 15)):
        state = decide(policy, state, samples(*[total / state.replicas] * state.replicas),
                       now=i * 5.0)  # fmt: skip
    assert state.replicas == 3 and state.risen_from is None


def test_a_warming_replica_restarts_the_window() -> None:
    policy = replace(POLICY, scale_down_peak_fill=1.0, downscale_after_s=300)
    state = ScaleState(replicas=4, risen_from=3, last_change_at=-600.0)
    for i, total in enumerate(window_series(1.2, 2.9, 15)):
        young = 10.0 if i == 40 else 600.0  # one reading from a replica still warming up
        loads = [LoadSample(f"r{k}", total / 4, young if k == 0 else 600.0) for k in range(4)]
        before = state.replicas
        state = decide(policy, state, loads, now=i * 5.0)
        if state.replicas != before:
            assert i * 5.0 >= 200 + 300  # a whole window after the warming reading
    assert state.replicas == 3


def test_the_flapping_series_changes_a_window_policy_at_most_twice() -> None:
    noise = [900, 1100, 950, 1080, 1020, 880, 1150, 990]
    series = noise * 6 + [1800] * 20 + [0] * 30 + noise * 20
    for swing_fill in (None, 1.0):
        policy = replace_policy(swing_fill=swing_fill, scale_down_peak_fill=1.0)
        counts = replay(policy, series, start=1)
        assert changes(counts, 1) == 2 and max(counts) == 2 and counts[-1] == 1


WINDOWED = replace(POLICY, scale_down_peak_fill=1.0, downscale_after_s=300)


def read_window(series: list[tuple[float, float]]) -> list[tuple[float, ScaleState]]:
    """(time, state) after each (time, total) reading of `series` read into the window."""
    state, states = ScaleState(replicas=4), []
    for now, total in series:
        state = state.windowed(WINDOWED, Load(total, reporting=4), now)
        states.append((now, state))
    return states


def test_the_window_s_mean_and_peak_are_exact_where_each_slot_holds_one_reading() -> None:
    # Readings 4.8-10 s apart (a slot is 300 / 63 = 4.76 s): each slot holds one reading, so
    # a slot leaves the window exactly when its reading does.
    rng = random.Random(0)
    now, series = 0.0, []
    for _ in range(400):
        series.append((now, rng.uniform(0.0, 4000.0)))
        now += rng.uniform(4.8, 10.0)
    for now, state in read_window(series):
        window = [total for at, total in series if now - 300 <= at <= now]
        assert state.window_mean_peak() == (sum(window) / len(window), max(window))


def test_a_long_window_read_often_keeps_at_most_its_slots() -> None:
    """Read every 0.1 s (3,000 readings in 300 s), the window keeps at most `WINDOW_SLOTS`
    slots. Its mean and peak are those of its readings plus at most a slot's width (300 / 63 s)
    of older ones: the peak between the exact window's and the wider one's, and the mean within
    the share of those extra readings of the series' range (0-4000) of the exact mean."""
    rng = random.Random(1)
    series = [(i / 10, rng.uniform(0.0, 4000.0)) for i in range(6000)]
    width = 300 / (WINDOW_SLOTS - 1)
    states = read_window(series)
    for i, (now, state) in enumerate(states):
        assert len(state.window) <= WINDOW_SLOTS
        if i % 97:  # the plain computation on a sample of the readings (it is the slow part)
            continue
        exact = [total for at, total in series[: i + 1] if at >= now - 300]
        wider = [total for at, total in series[: i + 1] if at > now - 300 - width]
        held = sum(s.readings for s in state.window)
        assert len(exact) <= held <= len(wider)
        mean, peak = state.window_mean_peak()
        assert max(exact) <= peak <= max(wider)
        extra = (held - len(exact)) / held
        assert abs(mean - sum(exact) / len(exact)) <= extra * 4000 + 1e-9
    assert len(states[-1][1].window) >= WINDOW_SLOTS - 1  # it spans the window


def test_a_scale_down_peak_fill_outside_the_band_is_refused() -> None:
    for fill in (0.5, 1.2):
        with pytest.raises(ValueError, match="scale_down_peak_fill"):
            replace_policy(scale_down_peak_fill=fill)
    # At `scale_down_fill` itself the window asks what every reading under the floor asks.
    assert replace_policy(scale_down_peak_fill=0.7).scale_down_peak_fill == 0.7
