"""The performance model against the profile table's own numbers."""

import csv
import statistics

import pytest

from common.perf_model import KVTransferModel, PiecewiseLinear, TransferMode, load_perf_model
from loadgen.sim.designs import profile_path

KEY = ("llama2-70b", "h100-80gb", 8)


def profile_rows():
    with open(profile_path(), newline="") as f:
        for row in csv.DictReader(f):
            if (row["model"], row["hardware"], int(row["tensor_parallel"])) == KEY:
                yield row


def test_piecewise_linear_interpolates_and_extrapolates():
    f = PiecewiseLinear((0.0, 10.0, 20.0), (1.0, 2.0, 4.0))
    assert f(5.0) == pytest.approx(1.5)
    assert f(15.0) == pytest.approx(3.0)
    assert f(30.0) == pytest.approx(6.0)  # the last segment's slope, continued
    assert f(-100.0) == 0.0  # never negative


def test_fit_is_monotone_through_noisy_medians():
    f = PiecewiseLinear.fit({1: [5.0, 7.0, 6.0], 2: [4.0], 3: [9.0]})
    assert f.ys == (6.0, 6.0, 9.0)


def test_model_hits_the_profile_medians_at_profiled_points():
    model = load_perf_model(profile_path(), *KEY)
    rows = list(profile_rows())
    # The knot at 2048 batch tokens pools 1 x 2048 and 4 x 512 (Splitwise's keying).
    at_2048 = [
        float(r["prompt_time"])
        for r in rows
        if int(r["batch_size"]) * int(r["prompt_size"]) == 2048
    ]
    assert model.prefill_s(2048) * 1000 == pytest.approx(statistics.median(at_2048), rel=1e-9)
    sweep = [
        float(r["token_time"])
        for r in rows
        if r["prompt_size"] == "512" and r["batch_size"] == "32"
    ]
    assert model.decode_s(32) * 1000 == pytest.approx(statistics.median(sweep), rel=1e-9)


def test_prefill_and_decode_grow_with_work_and_h100_beats_a100():
    h100 = load_perf_model(profile_path(), *KEY)
    a100 = load_perf_model(profile_path(), "llama2-70b", "a100-80gb", 8)
    assert h100.prefill_s(4096) > h100.prefill_s(1024) > 0
    assert h100.decode_s(64) > h100.decode_s(1) > 0
    assert a100.prefill_s(2048) > h100.prefill_s(2048)
    assert a100.decode_s(16) > h100.decode_s(16)


def test_mixed_iteration_costs_prefill_of_all_tokens_with_interference():
    model = load_perf_model(profile_path(), *KEY, mixed_interference=1.1)
    assert model.iteration_s(1000, 24) == pytest.approx(model.prefill_s(1024) * 1.1)
    assert model.iteration_s(0, 24) == model.decode_s(24)
    assert model.iteration_s(1000, 0) == model.prefill_s(1000)


def test_unknown_hardware_is_a_clear_error():
    with pytest.raises(ValueError, match="no profile rows"):
        load_perf_model(profile_path(), "llama2-70b", "tpu-v9", 8)


def test_kv_transfer_modes():
    # 400 Gbps, 320 KiB per token: 1000 tokens take 6.55 ms serialized.
    link = dict(bandwidth_bytes_s=50e9, kv_bytes_per_token=327_680, layerwise_residual_s=0.005)
    serialized = KVTransferModel(**link, mode=TransferMode.SERIALIZED)
    layerwise = KVTransferModel(**link, mode=TransferMode.LAYERWISE)
    auto = KVTransferModel(**link, mode=TransferMode.AUTO)
    assert serialized.visible_s(1000) == pytest.approx(1000 * 327_680 / 50e9)
    assert serialized.visible_s(4000) == pytest.approx(4 * serialized.visible_s(1000))
    assert layerwise.visible_s(100) == layerwise.visible_s(8000) == 0.005
    assert auto.visible_s(100) == serialized.visible_s(100)  # small prompts: serialized
    assert auto.visible_s(8000) == 0.005  # large prompts: layer-wise


def test_memory_bound_time_and_its_refusals():
    from common.perf_model import memory_bound_s

    assert memory_bound_s(7e9, 1e12, 0.7) == pytest.approx(0.01)
    for bandwidth, efficiency in ((0.0, 0.7), (1e12, 0.0), (1e12, 1.5)):
        with pytest.raises(ValueError):
            memory_bound_s(1.0, bandwidth, efficiency)


def test_dense_decode_is_the_step_less_attention_and_continues_its_last_segment():
    from common.perf_model import PerfModel, dense_decode_model

    decode = PerfModel(PiecewiseLinear((0, 1), (1, 2)), PiecewiseLinear((1, 2, 4), (10, 11, 15)))
    dense = dense_decode_model(decode, attention_s_per_request=0.5)
    assert [dense(b) for b in (1, 2, 4)] == [9.5, 10.0, 13.0]
    assert dense(6) == pytest.approx(13.0 + 2 * 1.5)  # (13 - 10) / (4 - 2) per request
    assert dense_decode_model(decode, 0.5, slope_past_s=0.25)(8) == pytest.approx(14.0)
