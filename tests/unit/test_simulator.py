"""The simulator: unloaded latencies from the performance model, conservation, load response."""

import math
import random

import pytest

from common.roles import Role
from common.scheduling.cluster import PoolThresholds
from common.scheduling.home_roles import HomeRoleThresholds
from loadgen.sim import provision
from loadgen.sim.designs import DESIGNS, ClusterSpec, parse_cluster, perf_model_for
from loadgen.sim.provision import SearchSettings, mixes_within
from loadgen.sim.simulator import SimOptions, SimRequest, Simulator, simulate
from loadgen.sim.slo import check_slos
from loadgen.sim.workload import as_recorded, poisson, read_trace
from loadgen.traces import shared_dir

TRACE = shared_dir() / "traces" / "AzureLLMInferenceTrace_conv.csv"


def test_one_request_on_a_split_cluster_costs_prefill_transfer_and_decodes():
    cluster = parse_cluster("Splitwise-HH:2P2T")
    record = simulate(cluster, [SimRequest(1.0, 1500, 50)]).records[0]
    prompt = perf_model_for(cluster.design.prompt_type, cluster.model)
    token = perf_model_for(cluster.design.token_type, cluster.model)
    transfer = cluster.transfer_model().visible_s(1500)
    assert record.prompt_machine < 2 <= record.token_machine
    assert record.ttft_s == pytest.approx(prompt.prefill_s(1500))
    assert record.e2e_s == pytest.approx(prompt.prefill_s(1500) + transfer + 49 * token.decode_s(1))


def test_one_request_on_a_baseline_has_no_transfer():
    cluster = parse_cluster("Baseline-A100:3")
    record = simulate(cluster, [SimRequest(0.0, 700, 20)]).records[0]
    perf = perf_model_for(cluster.design.prompt_type, cluster.model)
    assert record.prompt_machine == record.token_machine
    assert record.e2e_s == pytest.approx(perf.prefill_s(700) + 19 * perf.decode_s(1))


def test_single_token_outputs_finish_at_first_token():
    result = simulate(parse_cluster("Splitwise-AA:1P1T"), [SimRequest(0.0, 300, 1)])
    record = result.records[0]
    assert record.done_s == record.first_token_s and math.isnan(record.tbt_s)


def test_every_trace_request_completes_with_ordered_timestamps():
    rows = read_trace(TRACE)[:1500]
    result = simulate(parse_cluster("Splitwise-HA:3P3T"), list(as_recorded(rows, time_scale=0.2)))
    assert result.num_completed == len(rows)
    for r, row in zip(result.records, rows, strict=True):
        assert r.output_len == row.output_len
        assert r.arrival_s < r.first_token_s <= r.done_s


def test_latency_grows_with_load_and_slos_break_when_overloaded():
    rows = read_trace(TRACE)[:3000]
    cluster = parse_cluster("Splitwise-HH:2P3T")
    light = check_slos(simulate(cluster, poisson(rows, 1.0, 120.0, seed=1)))
    heavy = check_slos(simulate(cluster, poisson(rows, 30.0, 60.0, seed=1)))
    assert light.met
    assert not heavy.met
    assert heavy.slowdowns["e2e_p50"] > light.slowdowns["e2e_p50"]


def test_overload_pulls_machines_into_the_mixed_pool():
    rows = read_trace(TRACE)[:3000]
    result = simulate(parse_cluster("Splitwise-HH:4P2T"), poisson(rows, 25.0, 60.0, seed=2))
    assert result.num_pool_moves > 0
    assert result.num_completed == len(result.records)


def test_iso_power_mixes_fit_the_budget():
    h100 = ClusterSpec(DESIGNS["Baseline-H100"], 40)
    mixes = list(mixes_within(DESIGNS["Splitwise-HH"], h100.power, "power", step=5))
    assert mixes and all(m.power <= h100.power + 1e-9 for m in mixes)
    assert all(m.num_machines == 40 for m in mixes)
    (baseline,) = mixes_within(DESIGNS["Baseline-A100"], h100.power, "power")
    assert baseline.num_prompt == 70  # Splitwise §VI-B: 70 DGX-A100 in 40 DGX-H100's power


def test_parse_cluster_errors_are_clear():
    with pytest.raises(ValueError, match="unknown design"):
        parse_cluster("Splitwise-XY:1P1T")
    with pytest.raises(ValueError, match="prompt and token counts"):
        parse_cluster("Splitwise-HH:4")


def test_replay_driver_runs_against_the_simulator_target():
    import asyncio

    from loadgen.replay import replay
    from loadgen.sim.target import make_target
    from loadgen.target import RequestSpec

    rows = read_trace(TRACE)[:40]
    specs = [RequestSpec(i, r.arrival_s, r.input_len, r.output_len) for i, r in enumerate(rows)]
    target = make_target("Splitwise-HH:2P2T")
    result = asyncio.run(replay(specs, target, progress=False))
    sim_records = target.sim.records
    assert all(r.ok for r in result.records) and len(sim_records) == len(rows)
    for got, sim in zip(
        sorted(result.records, key=lambda r: r.req_index), sim_records, strict=True
    ):
        assert got.ttft_s == pytest.approx(sim.ttft_s)
        assert got.e2e_s == pytest.approx(sim.e2e_s)
        assert got.output_tokens == sim.output_len


def test_max_rate_stops_below_a_valley_a_bisection_would_jump(monkeypatch):
    # SLOs met at 5-15 and 50-80 RPS only: a mix whose token machines saturate before the router
    # borrows, at moderate load. Bisecting [5, 200] would report ~80.
    def valley(_cluster, _rows, rate, _settings, _options=None):
        return rate <= 15 or 50 <= rate <= 80

    monkeypatch.setattr(provision, "meets_slos", valley)
    settings = SearchSettings(min_rate=5.0, max_rate=200.0, rate_step=10.0, num_bisections=6)
    rate = provision.max_rate(None, [], settings)  # type: ignore[arg-type]
    assert 15 <= rate < 25  # below the first miss at 25, within the bisection's resolution
    always = SearchSettings(min_rate=5.0, max_rate=42.0, rate_step=10.0)
    monkeypatch.setattr(provision, "meets_slos", lambda *a, **k: True)
    assert provision.max_rate(None, [], always) == 42.0  # type: ignore[arg-type]
    monkeypatch.setattr(provision, "meets_slos", lambda *a, **k: False)
    assert provision.max_rate(None, [], always) == 0.0  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SearchSettings(min_rate=0.0)


def _shifting_mix() -> list[SimRequest]:
    """A minute of chat (short prompts, long outputs), a minute of long prompts, two of chat."""
    rng, requests, t = random.Random(3), [], 0.0
    for end, prompt_len, output_len, rate in ((60, 300, 200, 5), (120, 6000, 5, 8),
                                              (240, 300, 200, 5)):  # fmt: skip
        while t < end:
            requests.append(SimRequest(t, prompt_len, output_len))
            t += rng.expovariate(rate)
    return requests


def test_a_prompt_heavy_phase_moves_a_token_machines_home_and_back():
    cluster, requests = parse_cluster("Splitwise-HH:2P3T"), _shifting_mix()
    homes = HomeRoleThresholds(hold_s=5.0, cooldown_s=15.0)
    options = SimOptions(thresholds=PoolThresholds(decode_tokens=40_000, home_roles=homes))
    sim = Simulator(cluster, options)
    for request in requests:
        sim.submit(request)
    deployed = dict(sim.router.pools.home)
    sim.advance_until(60.0)
    assert sim.router.pools.home == deployed  # chat only: nothing moves
    sim.advance_until(120.0)  # the prompt-heavy minute: token machines (2-4) moved toward prompt
    assert any(sim.router.pools.home[m] != Role.TOKEN for m in (2, 3, 4))
    assert all(sim.router.pools.home[m] == Role.PROMPT for m in (0, 1))
    sim.advance_until(float("inf"))
    result = sim.result()
    assert result.num_completed == len(requests)
    assert result.num_home_moves >= 2 and result.homes == deployed  # back once chat settled
    # Without the option, homes never move.
    assert simulate(cluster, requests).homes == deployed
