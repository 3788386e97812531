"""Neo's cost tables from the shared GPU profile, and the simulator's Neo machine."""

import math
from dataclasses import replace

import pytest

from common.perf_model import neo_costs_from_profile
from loadgen.sim.designs import LLAMA2_70B, profile_path
from loadgen.sim.neo_replay import NEO_MACHINES, NEO_RATES, NeoSearch, NeoSimMachine, probe
from loadgen.sim.rate_search import Probe
from loadgen.sim.simulator import SimRequest
from loadgen.traces import TraceRow

KEY = ("llama2-70b", "h100-80gb", 2)


def test_cost_tables_reproduce_the_profiles_decode_and_prefill_times():
    costs = neo_costs_from_profile(profile_path(), KEY, LLAMA2_70B.kv_bytes_per_token, 100e9)
    # A decode step at batch 8, contexts 512 (profile: ~40 ms on 2 x H100) = T_l + T_ga.
    step_s = costs.linear_s(8) + costs.local_attention_s(8 * 512)
    assert 0.030 < step_s < 0.050
    # A 2048-token prefill (profile: ~300 ms) is almost all linear time.
    assert 0.25 < costs.linear_s(2048) < 0.35
    # Host attention reads 320 KiB per token at 100 GB/s.
    assert costs.offload_attention_s(10_000) == pytest.approx(10_000 * 327_680 / 100e9)
    assert costs.linear_s(0) == costs.local_attention_s(0) == costs.offload_attention_s(0) == 0


def test_offload_budget_must_be_positive():
    with pytest.raises(ValueError):
        neo_costs_from_profile(profile_path(), KEY, LLAMA2_70B.kv_bytes_per_token, 0.0)


def test_every_request_finishes_with_its_tokens_with_and_without_offload():
    requests = [SimRequest(0.1 * i, 1000 + 50 * i, 20 + i) for i in range(30)]
    for offload in (False, True):
        sim = NeoSimMachine(NEO_MACHINES["H100x2"], offload)
        result = sim.run(requests, until_s=600.0)
        assert all(r.generated == r.output_len for r in sim.reqs)
        assert all(math.isfinite(t) for t in result.per_token_s)
        assert not sim.local and not sim.offload and not sim.waiting
    # 30 prompts of 1-2.5k tokens overflow 2 x H100's ~12k KV tokens: Neo offloads some.
    assert result.num_two_batch > 0 and result.max_running > 10


def test_local_only_preempts_and_recomputes_when_decodes_outgrow_hbm():
    # 12 prompts of 1000 tokens fill ~12.2k tokens of KV; 300 tokens each then overflow it.
    requests = [SimRequest(0.0, 1000, 300) for _ in range(12)]
    sim = NeoSimMachine(NEO_MACHINES["H100x2"], offload=False)
    result = sim.run(requests, until_s=600.0)
    assert result.num_preempted > 0 and result.num_swaps == 0
    assert all(r.generated == 300 for r in sim.reqs)
    # A recomputed request re-prefills its prompt and the tokens it had made.
    recomputed = [r for r in sim.reqs if r.generated_in_prompt]
    assert recomputed and all(r.prompt_len == 1000 + r.generated_in_prompt for r in recomputed)
    with_offload = NeoSimMachine(NEO_MACHINES["H100x2"], offload=True)
    assert with_offload.run(requests, until_s=600.0).num_preempted == 0


def test_offload_sustains_a_rate_the_local_only_machine_cannot():
    # 1000-token prompts, 100 tokens out, on 2 x H100 (~12 of them fit in HBM): local-only
    # holds 4 RPS at 0.2 s per token and not 5; with offload 5 RPS holds (0.19 s).
    rows = [TraceRow(0.0, 1000, 100)] * 10
    s = NeoSearch(0.2, replace(NEO_RATES, probe=Probe(duration_s=30.0, warmup_s=5.0)))
    local_ok, _ = probe(NEO_MACHINES["H100x2"], rows, 5.0, False, s)
    neo_ok, neo = probe(NEO_MACHINES["H100x2"], rows, 5.0, True, s)
    assert not local_ok and neo_ok and neo.num_two_batch > 0


def test_measured_attention_tables_replace_the_derived_ones(tmp_path):
    path = tmp_path / "attention.csv"
    path.write_text(
        "model,hardware,tier,batch_size,context_tokens,time_ms\n"
        "llama2-70b,h100-80gb,local,8,1000,1.0\n"
        "llama2-70b,h100-80gb,local,8,2000,2.0\n"
        "llama2-70b,h100-80gb,offload,8,1000,10.0\n"
        "llama2-70b,h100-80gb,offload,8,2000,30.0\n"
        "llama2-70b,h100-80gb,local,8,3000,3.0\n"
    )
    costs = neo_costs_from_profile(
        profile_path(), KEY, LLAMA2_70B.kv_bytes_per_token, 1.0, attention_path=path
    )
    assert costs.local_attention_s(1500) == pytest.approx(0.0015)
    assert costs.offload_attention_s(1500) == pytest.approx(0.020)
    bad = tmp_path / "bad.csv"
    bad.write_text("model,hardware,tier,batch_size,context_tokens,time_ms\n")
    with pytest.raises(ValueError):
        neo_costs_from_profile(profile_path(), KEY, 1, 1.0, attention_path=bad)
