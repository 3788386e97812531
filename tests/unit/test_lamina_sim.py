"""The simulator's Lamina decode model (loadgen/sim/lamina_*.py): costs from the profile and the
devices' figures, the replay's bookkeeping against hand-computed steps, and Fig. 10's direction."""

import json

import pytest

from common.perf_model import load_perf_model
from common.scheduling.lamina_pipeline import plan_layer
from loadgen.sim.__main__ import main
from loadgen.sim.designs import profile_path
from loadgen.sim.lamina_config import H20, LLAMA_70B, Extrapolation, LaminaCluster, dense_model
from loadgen.sim.lamina_placement import KVPlacement, Partition
from loadgen.sim.lamina_replay import replay_decode
from loadgen.sim.workload import read_trace
from loadgen.traces import shared_dir

KIMI = shared_dir() / "traces" / "conversation_trace.jsonl"


@pytest.fixture(scope="module")
def kimi_requests():
    """The first 400 Kimi-Conv requests (long contexts: memory bounds the batch)."""
    return [(r.input_len, r.output_len) for r in read_trace(KIMI)[:400]]


def test_dense_part_is_the_profiled_step_less_attention_then_roofline():
    decode = load_perf_model(profile_path(), "llama2-70b", "h100-80gb", 4)
    dense = dense_model(LaminaCluster(4).compute, 4)
    for batch in (1, 16, 64):
        assert 0.9 * decode.decode_s(batch) < dense(batch) < decode.decode_s(batch)
    # Past batch 64: 2 FLOPs per parameter per request on 4 H100s at 50% MFU.
    slope = 2 * 70e9 / (4 * 989e12 * 0.5)
    assert dense(164) - dense(64) == pytest.approx(100 * slope)
    profile = dense_model(LaminaCluster(4).compute, 4, LLAMA_70B, Extrapolation.PROFILE)
    assert profile(164) > dense(164)  # the profile's last segment is steeper


def test_capacity_and_price_follow_the_devices():
    lamina = LaminaCluster(2, 4, num_batches=3)
    assert lamina.replicas == 2 and lamina.label == "Lamina DOP=(4, 4) n=3"
    assert lamina.usd_per_hour == pytest.approx(4 * 11.06 + 4 * 4.63)
    assert lamina.kv_capacity_tokens() == int(4 * 96e9 * 0.9 // (80 * 8 * 128 * 2 * 2))
    # Lamina's Table 5: DOP (2, 4) at $40.64/h against 4 x H100 at $44.24/h.
    assert LaminaCluster(2, 4).usd_per_hour == pytest.approx(40.64)
    assert LaminaCluster(4).usd_per_hour == pytest.approx(44.24)
    assert LaminaCluster(4).kv_capacity_tokens() == int((4 * 80e9 * 0.9 - 140e9) // 327680)


def test_network_bytes_per_layer_are_q_kv_out_and_back():
    costs = LaminaCluster(2, 4).layer_costs(100, 100 * 1000)
    link = 2 * 400e9 / 8  # the replica's two NICs are the slower end
    assert costs.q_wire_s == pytest.approx(100 * 8192 * 2 / link)
    assert costs.kv_wire_s == pytest.approx(100 * 2 * 1024 * 2 / link)
    assert costs.out_wire_s == costs.q_wire_s
    assert costs.attention_s == pytest.approx(
        100_000 * 4096 / (4 * H20.mem_bandwidth_bytes_s * 0.7)
    )


@pytest.mark.parametrize(
    "bad",
    [dict(compute_tp=1), dict(compute_tp=4, num_batches=2), dict(compute_tp=2, num_memory=-1)],
)
def test_impossible_clusters_are_refused(bad):
    with pytest.raises(ValueError):
        LaminaCluster(**bad)  # 1 H100 cannot hold 70B; a baseline has no pipeline


def test_replay_steps_match_the_pipeline_plan():
    # Two requests that cannot share the memory: the first decodes alone while the second waits.
    cluster = LaminaCluster(2, 1, num_batches=2, num_replicas=1)
    prompt = 200_000
    result = replay_decode(cluster, [(prompt, 11), (prompt, 11)])
    assert result.num_tokens == 2 * 10
    # The window is the first request's 10 steps at batch 1 (n = 2 halves it), costed mid-way.
    plan = plan_layer(cluster.layer_costs(0.5, (prompt + 1 + 4.5) / 2), 2, 1)
    assert result.window_tokens == 10
    assert result.mean_tbt_s == pytest.approx(80 * plan.period_s)
    assert result.window_s == pytest.approx(10 * 80 * plan.period_s)
    assert result.end_s == pytest.approx(2 * result.window_s, rel=1e-4)


def test_requests_larger_than_the_memory_are_refused_not_run():
    cluster = LaminaCluster(2, 1)
    capacity = cluster.kv_capacity_tokens()
    requests = [(capacity - 100, 50), (capacity, 10), (1000, 50), (1000, 1)]
    result = replay_decode(cluster, requests)
    assert result.num_refused == 1
    assert result.num_tokens == 2 * 49  # the single-token output had nothing to decode


def test_a_slice_that_fits_at_once_has_no_saturated_window():
    with pytest.raises(ValueError, match="saturated"):
        replay_decode(LaminaCluster(2, 4), [(1000, 50)] * 3)


def test_lamina_decodes_larger_batches_for_less_per_token_on_long_contexts(kimi_requests):
    # Lamina Fig. 10 at equal cost on Kimi-Conv: larger batches, more tokens per $ than vLLM.
    requests = kimi_requests
    vllm = replay_decode(LaminaCluster(4), requests)
    lamina = replay_decode(LaminaCluster(2, 4), requests)
    assert lamina.mean_batch > 2 * vllm.mean_batch
    assert lamina.tokens_per_usd > vllm.tokens_per_usd
    assert lamina.mean_tbt_s > vllm.mean_tbt_s  # §6.1: larger batches, longer TBT


def test_the_lamina_command_prints_a_row_per_cluster_and_a_json_line(capsys):
    args = ["lamina", "--trace", str(KIMI), "--requests", "300", "--memory", "4"]
    assert main(args + ["--batches", "1", "2", "--baseline-tp", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("Lamina DOP=(2, 4) n=2") for line in lines)
    summary = json.loads(lines[-1])
    assert set(summary["figures"]) == {
        "vLLM 4xH100",
        "Lamina DOP=(2, 4) n=1",
        "Lamina DOP=(2, 4) n=2",
    }
    assert set(summary["targets_met"]) == set(summary["targets"])


def test_request_level_placement_fragments_and_unbalances():
    kv = KVPlacement(100, 2, Partition.REQUEST)
    assert kv.place(40, 30) == 0 and kv.place(40, 10) == 1
    assert kv.place(20, 5) is None  # 20 tokens free in all, but 10 on each device
    assert kv.imbalance() == pytest.approx(30 * 2 / 40)
    kv.advance(10)  # each device's one request grows by 10 tokens
    assert kv.imbalance() == pytest.approx(40 * 2 / 60)
    kv.free(0, 40)
    assert kv.place(20, 5) == 0
    head = KVPlacement(100, 2, Partition.HEAD)
    assert head.place(40, 30) == 0 and head.place(40, 10) == 0 and head.place(20, 5) == 0
    assert head.imbalance() == 1.0


def test_head_level_needs_the_kv_heads_to_split_evenly():
    with pytest.raises(ValueError, match="request-level"):
        LaminaCluster(2, 3)
    assert LaminaCluster(2, 3, partition=Partition.REQUEST).label.endswith("req")


def test_request_level_decodes_smaller_batches_with_slower_attention(kimi_requests):
    requests = kimi_requests
    head = replay_decode(LaminaCluster(2, 4), requests)
    by_request = replay_decode(LaminaCluster(2, 4, partition=Partition.REQUEST), requests)
    assert by_request.mean_batch < head.mean_batch
    per_request = by_request.breakdown.sums["attention_s"] / by_request.window_batch_s
    assert per_request > head.breakdown.sums["attention_s"] / head.window_batch_s


def test_auto_n_is_never_slower_than_any_fixed_n_on_the_same_hardware(kimi_requests):
    # Admissions do not depend on n (memory does), so each stretch's best n adds up to the best.
    requests = kimi_requests
    auto = replay_decode(LaminaCluster(2, 4, num_batches=0, num_replicas=1), requests)
    assert auto.cluster.label == "Lamina DOP=(2, 4) n=auto"
    for n in range(1, 5):
        fixed = replay_decode(LaminaCluster(2, 4, num_batches=n, num_replicas=1), requests)
        assert auto.tokens_per_s >= fixed.tokens_per_s * (1 - 1e-9)


def test_the_lamina_command_refuses_impossible_clusters_and_counts(capsys):
    assert main(["lamina", "--trace", str(KIMI), "--memory", "3", "--batches", "1"]) == 2
    assert "request-level" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["lamina", "--trace", str(KIMI), "--batches", "0"])


def test_a_tbt_cap_trades_batch_for_latency(kimi_requests):
    free = replay_decode(LaminaCluster(2, 8), kimi_requests)
    capped = replay_decode(LaminaCluster(2, 8), kimi_requests, max_tbt_s=0.080)
    assert capped.mean_batch < free.mean_batch
    # Checked when a request joins; its stretch's contexts then grow a little past the check.
    assert capped.mean_tbt_s <= 0.080 * 1.02 < free.mean_tbt_s
