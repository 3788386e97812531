"""`decode_lanes: auto`'s choice from a token engine's measured one-lane steps: lanes only when the
engine idles on its shards for longer than it computes (lane_choice.py's pricing), checked against
hand-computed Lamina pipeline periods."""

from __future__ import annotations

import pytest

from common.scheduling.lane_choice import MeasuredSteps, choose_decode_lanes


def per_layer(t_m: float, t_a: float, t_net: float, steps: int = 10, layers: int = 4):
    """Sums over `steps` steps of `layers` layers with these per-layer costs (ms)."""
    n = steps * layers / 1e3
    return MeasuredSteps(steps, layers, (t_m + t_a + t_net) * n, (t_a + t_net) * n, t_a * n,
                         t_net * n)  # fmt: skip


def test_a_compute_bound_engine_keeps_one_lane():
    # n = 1: 2 + 1 + 0.5 = 3.5 ms; n = 2: max(2 + 0.5 + 0.5, 2 x 2) = 4 ms.
    assert choose_decode_lanes(per_layer(t_m=2.0, t_a=1.0, t_net=0.5)) == 1


def test_an_engine_idling_on_its_shards_takes_lanes():
    # n = 1: 1 + 2 + 1 = 4; n = 2: max(1 + 1 + 1, 2, 2) = 3; n = 3: max(2.67, 3, 2) = 3 (tie: 2).
    assert choose_decode_lanes(per_layer(t_m=1.0, t_a=2.0, t_net=1.0)) == 2
    # Latency-bound: n = 2: max(1 + 1 + 4, 2, 2) = 6; n = 3: max(1 + 0.67 + 4, 3, 2) = 5.67.
    assert choose_decode_lanes(per_layer(t_m=1.0, t_a=2.0, t_net=4.0)) == 3
    assert choose_decode_lanes(per_layer(t_m=1.0, t_a=2.0, t_net=4.0), max_lanes=2) == 2
    # The shards bound it (n x t_a / n = 6 for any n > 1): the fewest lanes that get there.
    assert choose_decode_lanes(per_layer(t_m=1.0, t_a=6.0, t_net=2.0)) == 2


def test_nothing_measured_is_refused_and_no_time_keeps_one_lane():
    with pytest.raises(ValueError, match="nothing measured"):
        choose_decode_lanes(MeasuredSteps(0, 4, 0.0, 0.0, 0.0, 0.0))
    assert choose_decode_lanes(MeasuredSteps(3, 4, 0.0, 0.0, 0.0, 0.0)) == 1


def test_model_peers_make_lanes_pay_for_a_compute_bound_engine():
    # Without peers (above): 1 lane. With one peer (R = 2 replicas) each relayed slice costs
    # t_net more on (R - 1) / R of the slices: n = 1 runs on the engine alone, 3.5 ms;
    # n = 2: max(2 + 0.5 + 0.5 + 0.25, 2 x 2 / 2) = 3.25; n = 3 (= R + 1): max(2 + 0.33 + 0.75,
    # 3 x 2 / 2) = 3.08.
    measured = per_layer(t_m=2.0, t_a=1.0, t_net=0.5)
    assert choose_decode_lanes(measured) == 1
    assert choose_decode_lanes(measured, num_peers=1) == 3
    # Three peers: up to R + 1 = 5 lanes are priced, past the default cap of 3.
    assert choose_decode_lanes(measured, num_peers=3) == 5
    with pytest.raises(ValueError, match="num_peers"):
        choose_decode_lanes(measured, num_peers=-1)


def test_auto_lanes_price_the_peers_linked_when_they_choose():
    from services.engine.lanes import AutoLanes
    from services.engine.shard_round_trip import DecodeTimes

    auto = AutoLanes(num_layers=4, warmup_steps=10)
    times = DecodeTimes(num_steps=9, step_s=0.14, wait_s=0.06, attend_s=0.04, network_s=0.02)
    assert auto.lanes(times, num_peers=1) == 1 and auto.chosen is None  # still measuring
    times.num_steps = 10  # 10 steps x 4 layers: t_m 2 ms, t_a 1, t_net 0.5, as above
    assert auto.lanes(times, num_peers=1) == 3
    assert auto.lanes(times, num_peers=0) == 3  # chosen once
