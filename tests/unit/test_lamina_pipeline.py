"""Lamina's pipeline schedule (common/scheduling/lamina_pipeline.py) against hand-computed cases."""

import heapq
import random

import pytest

from common.scheduling.lamina_pipeline import (
    Bound,
    LayerCosts,
    choose_num_batches,
    plan_layer,
)


def test_one_batch_without_overlap_is_the_serial_sum():
    # 10 ms model, 4 ms attention, 0.5 + 0.25 + 0.5 ms on the wire, 0.1 ms each way.
    costs = LayerCosts(0.010, 0.004, 0.0005, 0.00025, 0.0005, 0.0001, kv_proj_s=0.001)
    plan = plan_layer(costs, 1, overlap=False)
    assert plan.period_s == pytest.approx(0.010 + 0.004 + 0.00125 + 0.0002)
    assert plan.bound is Bound.LATENCY
    assert plan.wait_s == pytest.approx(0.0)
    # One batch: the replica idles while the memory group attends and vice versa.
    assert plan.compute_busy == pytest.approx(0.010 / 0.01545)
    assert plan.memory_busy == pytest.approx(0.004 / 0.01545)
    assert plan.compute_idle_s == pytest.approx(0.00545)


def test_q_early_hides_attention_behind_kv_projection_and_transfer():
    costs = LayerCosts(0.010, 0.004, 0.0005, 0.00025, 0.0005, 0.0001, kv_proj_s=0.001)
    plan = plan_layer(costs, 1, overlap=True)
    # Hidden: min(t_a 4 ms, kv_proj 1 ms + kv wire 0.25 ms) = 1.25 ms.
    assert plan.hidden_s == pytest.approx(0.00125)
    assert plan.period_s == pytest.approx(0.01545 - 0.00125)
    # The Fig. 12 breakdown adds up to the period.
    total = plan.model_s + plan.attention_s + plan.network_s - plan.hidden_s + plan.wait_s
    assert total == pytest.approx(plan.period_s)


def test_q_early_hides_at_most_the_attention():
    plan = plan_layer(LayerCosts(0.010, 0.0005, kv_wire_s=0.002, kv_proj_s=0.003), 1)
    assert plan.hidden_s == pytest.approx(0.0005)


def test_lamina_sizing_is_bubble_free():
    # n = 3 on n - 1 = 2 replicas with t_a = t_m / (n - 1): every device busy all the time.
    plan = plan_layer(LayerCosts(0.010, 0.005), 3, overlap=False)
    assert plan.num_replicas == 2
    assert plan.period_s == pytest.approx(0.015)
    assert plan.compute_busy == pytest.approx(1.0)
    assert plan.memory_busy == pytest.approx(1.0)
    assert plan.wait_s == pytest.approx(0.0)


def test_compute_bound():
    # Two batches share one replica (n = 2): 2 x 10 ms of model per period beats the 12 ms path.
    plan = plan_layer(LayerCosts(0.010, 0.002), 2, overlap=False)
    assert plan.bound is Bound.COMPUTE
    assert plan.period_s == pytest.approx(0.020)
    assert plan.wait_s == pytest.approx(0.008)
    assert plan.memory_busy == pytest.approx(0.2)
    assert plan.compute_idle_s == pytest.approx(0.0)


def test_memory_bound():
    # Four batches, three replicas, 6 ms of attention each: the memory group needs 24 ms a layer.
    plan = plan_layer(LayerCosts(0.010, 0.006), 4, overlap=False)
    assert plan.bound is Bound.MEMORY
    assert plan.period_s == pytest.approx(0.024)
    assert plan.compute_busy == pytest.approx(4 * 0.010 / (3 * 0.024))
    assert plan.memory_idle_s == pytest.approx(0.0)


def test_network_bound_counts_each_direction_of_the_link():
    # Out: q 3 ms + kv 1 ms = 4 ms a batch; back: 3 ms. Four batches: 16 ms on the outbound
    # link, above one batch's 14 ms path, 4 x 5 / 3 ms of compute and 4 x 2 ms of attention.
    costs = LayerCosts(0.005, 0.002, q_wire_s=0.003, kv_wire_s=0.001, out_wire_s=0.003)
    plan = plan_layer(costs, 4, overlap=False)
    assert plan.bound is Bound.NETWORK
    assert plan.period_s == pytest.approx(0.016)
    assert plan.link_busy == pytest.approx(1.0)


def test_more_replicas_than_batches_idle_the_extra_ones():
    plan = plan_layer(LayerCosts(0.010, 0.001), 1, num_replicas=3, overlap=False)
    assert plan.period_s == pytest.approx(0.011)
    assert plan.compute_busy == pytest.approx(0.010 / (3 * 0.011))


def test_choose_num_batches_for_fixed_hardware():
    # 64 requests on one replica: splitting them halves each batch's attention, but the model
    # slice has a fixed part (weights read once per batch), so more batches cost more compute.
    def costs_for(n: int) -> LayerCosts:
        per_batch = 64 / n
        return LayerCosts(0.004 + 0.0001 * per_batch, 0.0002 * per_batch)

    plan = choose_num_batches(costs_for, 4, num_replicas=1, overlap=False)
    # n=1: 10.4 + 12.8 = 23.2 ms; n=2: max(7.2 + 6.4, 2 x 7.2) = 14.4 ms; n=3: 3 x 6.13 = 18.4.
    assert plan.num_batches == 2
    assert plan.period_s == pytest.approx(0.0144)


@pytest.mark.parametrize(
    "bad",
    [
        dict(model_s=-1.0, attention_s=0.0),
        dict(model_s=float("nan"), attention_s=0.0),
        dict(model_s=0.001, attention_s=0.0, kv_proj_s=0.002),
    ],
)
def test_wrong_costs_are_refused(bad):
    with pytest.raises(ValueError):
        LayerCosts(**bad)


def test_wrong_counts_are_refused():
    with pytest.raises(ValueError):
        plan_layer(LayerCosts(0.001, 0.001), 0)
    with pytest.raises(ValueError):
        plan_layer(LayerCosts(0.0, 0.0), 1)
    with pytest.raises(ValueError):
        choose_num_batches(lambda n: LayerCosts(0.001, 0.001), 0)


def test_q_early_can_hide_q_on_the_wire_behind_kv_projection():
    # No attention to hide: q's 1 ms on the wire runs beside the 2 ms of K/V-proj.
    plan = plan_layer(LayerCosts(0.010, 0.0, q_wire_s=0.001, kv_proj_s=0.002), 1)
    assert plan.hidden_s == pytest.approx(0.001)


def simulate_pipeline(costs: LayerCosts, n: int, replicas: int, overlap: bool) -> float:
    """An event-by-event run of n batches (FIFO at every device, a batch's next slice on the
    first free replica) through 400 layers: seconds per batch-layer in the middle half."""
    free_replica = [0.0] * replicas
    free = {"out": 0.0, "memory": 0.0, "back": 0.0}

    def occupy(device: str, ready: float, busy: float) -> float:
        free[device] = max(ready, free[device]) + busy
        return free[device]

    # (time, batch, stage, layer); stage 0: model slice, 1: q at the memory group, 2: k/v there.
    events = [(0.0, j, 0, 0) for j in range(n)]
    q_done: dict[int, float] = {}
    layer_ends: list[float] = []
    while events:
        t, j, stage, layer = heapq.heappop(events)
        if layer == 400:
            continue
        if stage == 0:
            r = min(range(replicas), key=free_replica.__getitem__)
            end = free_replica[r] = max(t, free_replica[r]) + costs.model_s
            q_ready = end - costs.kv_proj_s if overlap else end
            q_sent = occupy("out", q_ready, costs.q_wire_s)
            heapq.heappush(events, (q_sent + costs.latency_s, j, 1, layer))
            kv_sent = occupy("out", max(end, q_sent), costs.kv_wire_s)
            heapq.heappush(events, (kv_sent + costs.latency_s, j, 2, layer))
        elif stage == 1 and overlap:
            q_done[j] = occupy("memory", t, costs.attention_s)  # over the previous tokens
        elif stage == 2:
            attended = q_done.pop(j) if overlap else occupy("memory", t, costs.attention_s)
            back = occupy("back", max(t, attended), costs.out_wire_s) + costs.latency_s
            layer_ends.append(back)
            heapq.heappush(events, (back, j, 0, layer + 1))
    ends = sorted(layer_ends)
    first, last = ends[len(ends) // 4], ends[3 * len(ends) // 4]
    return n * (last - first) / sum(1 for e in ends if first < e <= last)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_period_is_what_an_event_by_event_pipeline_settles_to(overlap):
    # The closed form (a marked graph's cycle time) against the pipeline run event by event,
    # over random costs that land on every bound.
    rng = random.Random(7)
    bounds = set()
    for _ in range(60):
        model_s = rng.uniform(1, 10)
        costs = LayerCosts(
            model_s, rng.uniform(0, 10), rng.uniform(0, 3), rng.uniform(0, 3), rng.uniform(0, 3),
            rng.uniform(0, 1), kv_proj_s=rng.uniform(0, 0.3) * model_s,
        )  # fmt: skip
        n, replicas = rng.randint(1, 5), rng.randint(1, 4)
        plan = plan_layer(costs, n, replicas, overlap)
        bounds.add(plan.bound)
        assert simulate_pipeline(costs, n, replicas, overlap) == pytest.approx(
            plan.period_s, rel=2e-3
        )
    assert bounds == set(Bound)
