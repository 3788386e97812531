"""The token engine's Neo cost model: tables probed on the tiny model (positive, more work never
cheaper), read from `bench/profile.py --attention`'s CSV, and T_ca's round trip following the
engine's own one-batch sharded steps (not its two-batch ones, whose replies wait for batch-0), and
the per-step overhead following what earlier predictions missed."""

from __future__ import annotations

import pytest

from common.attention import select_backend
from common.model.loader import load_model
from common.perf_model import NeoCostTables, PiecewiseLinear
from services.engine.cost_probe import PROBE_CONTEXTS, EngineNeoCosts, probe_costs, read_costs


def test_probe_gives_positive_non_decreasing_tables(tiny_model_path):
    model = load_model(tiny_model_path)
    costs = probe_costs(model, select_backend("auto"), num_shards=2, repeats=2)
    t = costs.tables
    for table in (t.linear_s_by_tokens, t.local_attention_s_by_context):
        assert all(y > 0 for y in table.ys) and list(table.ys) == sorted(table.ys)
    assert costs.linear_s(0) == costs.local_attention_s(0) == costs.offload_attention_s(0) == 0
    # T_ca carries the round trip on top of the kernel.
    assert costs.offload_attention_s(PROBE_CONTEXTS[0]) > costs.round_trip_s > 0


def test_read_costs_takes_attention_from_the_csv(tiny_model_path, tmp_path):
    path = tmp_path / "attention.csv"
    path.write_text(
        "model,hardware,tier,batch_size,context_tokens,time_ms\n"
        "tiny,cpu,local,8,256,1.0\ntiny,cpu,offload,8,256,4.0\n"
        "tiny,cpu,local,8,1024,2.0\ntiny,cpu,offload,8,1024,8.0\n"
    )
    costs = read_costs(path, load_model(tiny_model_path), repeats=1)
    assert costs.local_attention_s(1024) == pytest.approx(2e-3)
    assert costs.offload_attention_s(256) == pytest.approx(4e-3 + costs.round_trip_s)


def test_round_trip_follows_one_batch_steps_only():
    flat = PiecewiseLinear((0.0, 1.0), (0.0, 0.0))
    costs = EngineNeoCosts(NeoCostTables(flat, flat, flat), round_trip_s=1e-3)
    costs.observe(num_steps=10, network_s=10 * 3e-3)  # 3 ms a step: a fifth of the way there
    assert costs.round_trip_s == pytest.approx(1e-3 + 0.2 * 2e-3)
    before = costs.round_trip_s
    costs.observe(num_steps=20, network_s=10 * 3e-3 + 10 * 50e-3, overlapped=True)
    assert costs.round_trip_s == before  # two-batch steps' waits are not network
    costs.observe(num_steps=20, network_s=1.0)  # no new step: nothing to learn
    assert costs.round_trip_s == before


def test_step_overhead_follows_what_earlier_predictions_missed():
    """Each step's miss moves the overhead a fifth of the way; it lands on every sub-batch's dense
    part, and converges so that a steady step is predicted exactly."""
    dense = PiecewiseLinear((0.0, 8.0), (0.0, 8e-4))  # 0.1 ms a token
    costs = EngineNeoCosts(NeoCostTables(dense, dense, dense), round_trip_s=0.0)
    assert costs.linear_s(4) == pytest.approx(4e-4)
    costs.observe_step(predicted_s=4e-4, measured_s=9e-4)  # missed 0.5 ms
    assert costs.step_overhead_s == pytest.approx(1e-4)
    assert costs.linear_s(4) == pytest.approx(5e-4) and costs.linear_s(0) == 0.0
    for _ in range(60):  # the same step again and again: the miss shrinks geometrically
        costs.observe_step(predicted_s=costs.linear_s(4), measured_s=9e-4)
    assert costs.linear_s(4) == pytest.approx(9e-4, rel=1e-3)
    costs.observe_step(predicted_s=1.0, measured_s=0.0)  # a wildly high prediction
    assert costs.linear_s(1) == 0.0  # never negative


def test_a_bad_cost_table_stops_the_engine_at_start(tmp_path):
    from types import SimpleNamespace

    from services.engine.kv_tiers import build_tier_policy

    runner = SimpleNamespace(model=None, backend=None)
    with pytest.raises(ValueError, match="no cost tables"):
        build_tier_policy(f"neo:{tmp_path / 'missing.csv'}", runner, 2)  # type: ignore[arg-type]
    (tmp_path / "bad.csv").write_text("model,hardware\n")
    with pytest.raises(ValueError, match="no cost tables"):
        build_tier_policy(f"neo:{tmp_path / 'bad.csv'}", runner, 2)  # type: ignore[arg-type]
