"""The shared-host model (PhaseMesh's CPU mesh): processor sharing, front-end loops as queues."""

import csv
import json
from dataclasses import replace

import pytest

from common.perf_model import PiecewiseLinear
from loadgen.sim.designs import parse_cluster, perf_model_for
from loadgen.sim.shared_cpu import FrontEnd, HostModel, SharedCPU, Station
from loadgen.sim.simulator import SimOptions, SimRequest, simulate
from loadgen.sim.target import parse_options

PREFILL_MS = {16: 10.0, 64: 20.0, 256: 60.0}  # by batch tokens (batch size 1)
DECODE_MS = {1: 15.0, 4: 24.0, 16: 40.0}  # at the tiny model's decode context (64)


@pytest.fixture
def cpu_mesh_profile(tmp_path, monkeypatch):
    """A fabricated `bench/profile.py` table for the CPU mesh."""
    path = tmp_path / "profile.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "hardware", "prompt_size", "batch_size", "token_size",
                         "peak_power", "average_power", "prompt_time", "token_time",
                         "e2e_time", "tensor_parallel"])  # fmt: skip
        for prompt, prefill in PREFILL_MS.items():
            writer.writerow(["tiny", "cpu-local-mesh", prompt, 1, 32, 0, 0, prefill, 15.0, 0, 1])
        for batch, decode in DECODE_MS.items():
            writer.writerow(["tiny", "cpu-local-mesh", 64, batch, 32, 0, 0, 20.0, decode, 0, 1])
    monkeypatch.setenv("PHASEMESH_PERF_PROFILE", str(path))
    perf_model_for.cache_clear()
    yield path
    perf_model_for.cache_clear()


def host(background: float = 0.0, delay_work: tuple[float, float] = (0.005, 0.001)) -> HostModel:
    """Measured on an otherwise idle host; `background` cores of other work now."""
    cpu = SharedCPU(
        cores=2.0, background_cores=background, prompt_cores=1.0,
        decode_cores_by_batch=((1, 1.1), (16, 1.6)), chain_cores_by_batch=((1, 1.0), (16, 1.2)),
        profiled_background_cores=0.0,
    )  # fmt: skip
    request_s, token_s = delay_work
    stations = (Station("client", request_s, token_s, priority=True),) + tuple(
        Station(n, request_s, token_s) for n in ("proxy", "router")
    )
    return HostModel(0.030, cpu, stations)


def test_the_mesh_shares_what_higher_priority_work_leaves():
    cpu = SharedCPU(cores=2.0, background_cores=0.5)  # 0.5 cores of nice-0 work
    assert cpu.stretch(1.0, 1.0) == 1.0  # 1 core wanted of the 1.5 left: no slowdown
    assert cpu.stretch(1.0, 3.0) == pytest.approx(2.0)  # 3 cores wanted of 1.5
    assert cpu.slowdown(1.5, priority_cores=0.5) == pytest.approx(1.5)  # a client takes 0.5
    # Profiled beside 1 core of background, running now beside 1.5.
    later = SharedCPU(cores=2.0, background_cores=1.5, profiled_background_cores=1.0)
    assert later.stretch(1.0, 1.0) == pytest.approx(2.0)
    # Work at the mesh's own priority shares with it instead of going first.
    peers = SharedCPU(cores=2.0, shared_background_cores=1.0)
    assert peers.slowdown(2.0) == pytest.approx(1.5)
    # Saturated by nice-0 work, Ray's nice-15 workers still get their CFS share, no more.
    starved = SharedCPU(cores=2.0, background_cores=2.0)
    assert starved.slowdown(0.5) == pytest.approx(0.5 / (2.0 * 36 / 1024))


def test_decode_cores_interpolate_and_hold_past_the_ends():
    cpu = SharedCPU(cores=2.0, decode_cores_by_batch=((1, 1.0), (9, 2.0)))
    assert cpu.decode_cores(5) == pytest.approx(1.5)
    assert cpu.decode_cores(64) == pytest.approx(2.0) and cpu.decode_cores(0) == 1.0
    assert cpu.chain_cores(7) == 1.0  # one point: constant


def test_front_end_loops_are_fifo_a_request_waits_behind_queued_tokens():
    loop = Station("router", request_cpu_s=0.010, token_cpu_s=0.001)
    frontend = FrontEnd((loop,), delay_s=0.002)
    assert frontend.request_in(0.0, stretch=1.0) == pytest.approx(0.012)
    # 50 tokens emitted at t=1 keep the loop busy until 1.05; a request at 1.01 waits for them.
    assert frontend.tokens_out(1.0, 50, stretch=1.0) == pytest.approx(1.05)
    assert frontend.request_in(1.01, stretch=1.0) == pytest.approx(1.06)
    # A stretched loop takes longer for the same CPU work.
    assert frontend.tokens_out(2.0, 10, stretch=2.0) == pytest.approx(2.02)
    # Its queue lasts 10 of the next 40 ms: a quarter of a core over that horizon.
    assert frontend.busy_cores(2.01, horizon_s=0.04) == pytest.approx(0.25)


def test_a_loop_never_idles_while_work_waits_for_it():
    client = Station("client", request_cpu_s=0.001, token_cpu_s=0.001, priority=True)
    router = Station("router", request_cpu_s=0.002, token_cpu_s=0.001)
    frontend = FrontEnd((client, router), delay_s=0.0)
    # 100 tokens at t=0: the router is busy until 0.1, then the client until 0.2.
    assert frontend.tokens_out(0.0, 100, stretch=1.0) == pytest.approx(0.2)
    # A request at t=0.01 is not stuck behind the tokens' future turn at the client: the client
    # is idle until 0.1, so it goes first; the router is busy with tokens until 0.1.
    assert frontend.request_in(0.01, stretch=1.0) == pytest.approx(0.102)
    # Work counts as busy cores only while it runs: the client idles over [0, 0.1).
    assert frontend.busy_cores(0.0, horizon_s=0.1) == pytest.approx(1.0)
    assert frontend.busy_cores(0.0, horizon_s=0.1, priority=True) == pytest.approx(0.01)
    # The client is above the mesh: a stretch never slows it.
    assert frontend.tokens_out(1.0, 10, stretch=3.0) == pytest.approx(1.0 + 0.03 + 0.01)


def test_host_model_round_trips_and_its_delay_excludes_loop_work(tmp_path):
    model = host(delay_work=(0.006, 0.001))
    model.save(tmp_path / "host.json")
    assert HostModel.load(tmp_path / "host.json") == model
    # 30 ms alone, of which the three loops' request and first-token work are 21 ms.
    assert model.frontend_delay_s == pytest.approx(0.030 - 3 * 0.007)


def test_front_end_latency_alone_is_the_measured_one(cpu_mesh_profile):
    record = simulate(
        parse_cluster("PhaseMesh-CPU:1P1T"), [SimRequest(0.0, 64, 1)], SimOptions(host=host())
    ).records[0]
    # TTFT alone = front end (in, and the first token out) + the profiled prefill.
    assert record.ttft_s == pytest.approx(0.030 + 0.020)


def test_a_request_alone_costs_its_measured_front_end_prefill_and_decode(cpu_mesh_profile):
    options = parse_options("", SimOptions(host=host()))
    record = simulate(parse_cluster("PhaseMesh-CPU:1P1T"), [SimRequest(0.0, 64, 3)], options)
    record = record.records[0]
    # The front end alone (30 ms, its way in and the first token's way out), the prefill.
    assert record.ttft_s == pytest.approx(0.030 + 0.020)
    # Two decode steps at batch 1, each token out through the loops; the KV hop is ~0.1 ms.
    assert record.tbt_s == pytest.approx(0.015, rel=0.05)


def test_concurrent_work_on_a_busy_host_stretches_latency(cpu_mesh_profile):
    requests = [SimRequest(0.001 * i, 64, 20) for i in range(12)]
    cluster = parse_cluster("PhaseMesh-CPU:1P1T")
    quiet = simulate(cluster, requests, SimOptions(host=host(background=0.0)))
    busy = simulate(cluster, requests, SimOptions(host=host(background=1.5)))
    for metric in ("ttft_s", "tbt_s"):
        mean = [sum(getattr(r, metric) for r in res.records) / 12 for res in (quiet, busy)]
        assert mean[1] > mean[0] * 1.1
    alone = simulate(cluster, requests[:1], SimOptions(host=host())).records[0]
    assert max(r.ttft_s for r in quiet.records) > 2 * alone.ttft_s  # the burst queues


def test_request_cpu_beyond_the_latency_alone_runs_after_the_first_token(cpu_mesh_profile):
    # 3 loops x 15 ms of request CPU, but the front end alone took only 30 ms: the first token
    # still comes 30 ms + the prefill after arrival, as measured.
    model = host(delay_work=(0.015, 0.001))
    record = simulate(
        parse_cluster("PhaseMesh-CPU:1P1T"), [SimRequest(0.0, 64, 1)], SimOptions(host=model)
    ).records[0]
    assert record.ttft_s == pytest.approx(0.030 + 0.020)
    assert model.frontend_delay_s == 0.0


def test_loop_cpu_per_step_is_what_the_profiled_decode_streamed():
    # Decode minus chain cores, times the profiled step: 0.1 x 15 ms at B=1, 0.4 x 40 at B=16.
    step_s = PiecewiseLinear((1.0, 16.0), (0.015, 0.040))
    chunk = host().chunk_cpu_s(step_s)
    assert chunk is not None
    assert chunk(1.0) == pytest.approx(0.0015) and chunk(16.0) == pytest.approx(0.016)
    # Each loop takes its share of the per-token costs (equal here).
    frontend = host().frontend(step_s)
    assert frontend.tokens_out(0.0, 1, stretch=1.0) == pytest.approx(0.0015)


def test_a_hand_off_stalls_the_token_machine_step_that_admits_it(cpu_mesh_profile):
    cluster = parse_cluster("PhaseMesh-CPU:1P1T")
    stalled = replace(host(), handoff_s=0.004)
    # Alone: the first decode gap is the profiled step plus the stall; the next is a plain step.
    alone = [
        simulate(cluster, [SimRequest(0.0, 64, 3)], SimOptions(host=h)).records[0]
        for h in (host(), stalled)
    ]
    assert alone[1].tbt_s - alone[0].tbt_s == pytest.approx(0.004 / 2, abs=2e-4)

    # A request already decoding waits too: the step that admits a newcomer is the whole batch's.
    # Its own admission stalls it once; a newcomer's, once more.
    def stall_cost(requests: list[SimRequest]) -> float:
        e2e = [simulate(cluster, requests, SimOptions(host=h)).records[0].e2e_s
               for h in (host(), stalled)]  # fmt: skip
        return e2e[1] - e2e[0]

    long = SimRequest(0.0, 64, 40)
    assert stall_cost([long]) == pytest.approx(0.004, abs=1e-4)
    assert stall_cost([long, SimRequest(0.2, 64, 2)]) - 0.004 == pytest.approx(0.004, abs=1.5e-3)


def test_host_files_without_a_hand_off_stall_still_load(tmp_path):
    model = replace(host(), handoff_s=0.003)
    model.save(tmp_path / "host.json")
    assert HostModel.load(tmp_path / "host.json").handoff_s == 0.003
    data = json.loads((tmp_path / "host.json").read_text())
    del data["handoff_s"]
    (tmp_path / "host.json").write_text(json.dumps(data))
    assert HostModel.load(tmp_path / "host.json").handoff_s == 0.0


def test_each_request_draws_its_front_end_excess_from_the_measured_ones(cpu_mesh_profile, tmp_path):
    # The front end alone took 30 ms at its low decile, and up to 10 ms more for some requests.
    jittery = replace(host(), frontend_jitter_s=(0.0, 0.0, 0.004, 0.010))
    jittery.save(tmp_path / "host.json")
    assert HostModel.load(tmp_path / "host.json") == jittery
    requests = [SimRequest(1.0 * i, 64, 1) for i in range(40)]  # far apart: each one alone
    cluster = parse_cluster("PhaseMesh-CPU:1P1T")
    ttfts = [r.ttft_s for r in simulate(cluster, requests, SimOptions(host=jittery)).records]
    excess = {round(t - (0.030 + 0.020), 4) for t in ttfts}
    assert excess == {0.0, 0.004, 0.010}  # every measured value is drawn, nothing else
    again = [r.ttft_s for r in simulate(cluster, requests, SimOptions(host=jittery)).records]
    assert again == ttfts  # seeded: the same input simulates the same way
