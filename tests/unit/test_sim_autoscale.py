"""The simulator's autoscaled cluster (loadgen/sim/autoscale_replay.py): the live mesh's decision
on a trace with a load step; machines start after a delay and drain without dropping work."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.roles import Role
from loadgen.sim.__main__ import main
from loadgen.sim.autoscale_replay import (
    AutoscaleResult,
    LoadStep,
    RoleScaling,
    StartupModel,
    default_options,
    parse_step,
    simulate_autoscaled,
    stepped,
    summary,
)
from loadgen.sim.designs import DESIGNS
from loadgen.sim.simulator import SimRequest
from loadgen.sim.workload import poisson, read_trace
from loadgen.traces import shared_dir

TRACE = shared_dir() / "traces" / "AzureLLMInferenceTrace_conv.csv"
HH = DESIGNS["Splitwise-HH"]
STEP = LoadStep(3.0, 120.0, 120.0)
DURATION = 360.0
# A small cluster's loads swing wider than the defaults' 40 machines': a deeper dead band.
FAST = {
    "upscale_after_s": 5.0,
    "downscale_after_s": 30.0,
    "cooldown_s": 20.0,
    "warmup_s": 10.0,
    "scale_down_fill": 0.5,
}


def run(seed: int = 0, **overrides: Any) -> AutoscaleResult:
    rows = read_trace(TRACE)[:3000]
    base = poisson(rows, 8.0, DURATION + STEP.duration_s * 2, seed)
    requests = [r for r in stepped(base, [STEP]) if r.arrival_s < DURATION]
    options = default_options(
        HH, {Role.PROMPT: 12, Role.TOKEN: 6}, initial={Role.PROMPT: 4, Role.TOKEN: 2},
        **({"startup_s": 15.0} | overrides), prompt=FAST, token=FAST,
    )  # fmt: skip
    return simulate_autoscaled(HH, requests, options, DURATION)


@pytest.fixture(scope="module")
def result() -> AutoscaleResult:
    return run()


def test_a_step_is_parsed_and_triples_the_rate_in_its_window() -> None:
    assert parse_step("3x@600s+600s") == LoadStep(3.0, 600.0, 600.0)
    assert parse_step("2.5x@10+20") == LoadStep(2.5, 10.0, 20.0)
    with pytest.raises(ValueError):
        parse_step("3@600")
    base = [SimRequest(i * 0.5, 10, 5) for i in range(2000)]  # 2 per second for 1000 s
    out = stepped(base, [LoadStep(3.0, 100.0, 100.0)])
    times = [r.arrival_s for r in out]
    assert times == sorted(times) and len(out) == len(base)
    before = sum(1 for t in times if 0 <= t < 100)
    during = sum(1 for t in times if 100 <= t < 200)
    after = sum(1 for t in times if 200 <= t < 300)
    assert before == after == 200 and during == 600
    with pytest.raises(ValueError, match="overlap"):
        stepped(base, [LoadStep(2.0, 0.0, 50.0), LoadStep(2.0, 40.0, 10.0)])


def test_a_load_step_scales_prompt_machines_up_and_back_down(result: AutoscaleResult) -> None:
    prompt = [e for e in result.events if e.role == Role.PROMPT]
    ups = [e for e in prompt if e.after > e.before]
    downs = [e for e in prompt if e.after < e.before]
    assert ups and downs
    assert STEP.start_s <= ups[0].time_s < STEP.end_s  # up during the step
    assert downs[-1].time_s >= STEP.end_s  # and down after it
    counts = [c[Role.PROMPT.value] for _, c in result.timeline]
    assert max(counts) > counts[0] and counts[-1] < max(counts)


def test_no_request_is_lost_and_none_runs_where_it_should_not(result: AutoscaleResult) -> None:
    """Every request finishes; each went to machines that had started and were not draining,
    and a drained machine stopped only after its part of everything it was given was done."""
    records = result.sim.records
    assert result.sim.num_completed == len(records) > 0
    lives: dict[int, list] = {}
    for life in result.lives:
        lives.setdefault(life.machine_id, []).append(life)

    def life_at(machine_id: int, t: float):  # type: ignore[no-untyped-def]
        for life in lives[machine_id]:
            if life.active_s <= t and (life.draining_s is None or t < life.draining_s):
                return life
        raise AssertionError(f"request at {t} routed to machine {machine_id}, not routable")

    stopped = 0
    for record in records:
        # The prompt machine is done with it at its first token (its KV leaves), the token
        # machine at its last.
        for machine_id, done_there in ((record.prompt_machine, record.first_token_s),
                                       (record.token_machine, record.done_s)):  # fmt: skip
            life = life_at(machine_id, record.arrival_s)
            if life.stopped_s is not None:
                stopped += 1
                assert done_there <= life.stopped_s
    assert stopped  # some requests were on machines that drained and stopped


def test_events_are_counted_and_replica_seconds_follow_the_lives(result: AutoscaleResult) -> None:
    figures = summary(result, DURATION, [STEP])
    assert sum(figures["scale_events"].values()) == len(result.events) == len(result.timeline) - 1
    assert figures["completed"] == figures["requests"]
    fixed = 12 * DURATION  # the pool's prompt machines, all the time
    assert 0 < figures["replica_s"]["prompt"] < fixed
    for (t0, before), (_, after) in zip(result.timeline, result.timeline[1:], strict=False):
        assert before != after and t0 >= 0
    attained = figures["attainment"]
    assert {"ttft_p90", "tbt_p90", "ttft_within", "tbt_within", "met"} <= set(attained)


def test_the_same_seed_gives_the_same_run(result: AutoscaleResult) -> None:
    again = run()
    assert again.events == result.events
    assert [r.done_s for r in again.sim.records] == [r.done_s for r in result.sim.records]
    assert run(seed=1).sim.records != result.sim.records


def test_bad_scaling_options_are_refused() -> None:
    with pytest.raises(ValueError, match="not prompt's"):
        RoleScaling.from_kwargs(Role.PROMPT, {"targets": {"kv_fill": 0.8}})
    with pytest.raises(ValueError, match="targets"):
        RoleScaling.from_kwargs(Role.TOKEN, {"targets": {}})
    with pytest.raises(ValueError, match="initial"):
        default_options(HH, {Role.PROMPT: 4, Role.TOKEN: 4}, initial={Role.PROMPT: 5})
    with pytest.raises(ValueError, match="min_replicas"):
        default_options(HH, {Role.PROMPT: 4, Role.TOKEN: 4}, prompt={"min_replicas": 0})


def test_a_start_up_is_the_process_start_and_the_weights_from_host_memory_or_storage() -> None:
    weights = HH.model.weight_bytes
    model = StartupModel(process_s=5.0, host_gbps=70.0, storage_gbps=1.4)  # every node holds one
    assert model.seconds(weights, started_before=False) == pytest.approx(5 + weights / 70e9)
    first = StartupModel(5.0, 70.0, 1.4, host_copy="after_first_start")
    assert first.seconds(weights, started_before=False) == pytest.approx(5 + weights / 1.4e9)
    assert first.seconds(weights, started_before=True) == pytest.approx(5 + weights / 70e9)
    none = StartupModel(5.0, 70.0, 1.4, host_copy="none")
    assert none.seconds(weights, started_before=True) == pytest.approx(5 + weights / 1.4e9)
    # A policy file's `startup:` section, and a flat start-up (`flat_s`) in the model's place.
    options = default_options(HH, {Role.PROMPT: 4, Role.TOKEN: 4},
                              startup={"process_s": 5.0, "host_copy": "none"})  # fmt: skip
    assert options.startup == StartupModel(process_s=5.0, host_copy="none")
    assert options.startup.seconds(weights, True) == pytest.approx(5 + weights / 1e9 * 84 / 140)
    assert replace(options.startup, flat_s=60.0).seconds(weights, False) == 60.0
    with pytest.raises(ValueError, match="host_copy"):
        StartupModel(host_copy="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flat_s"):
        StartupModel(flat_s=-1.0)


def test_a_policy_files_startup_s_is_the_flat_start_up() -> None:
    """A policy YAML's top-level `startup_s` (what `--startup-s` sets) loads as the model's
    `flat_s`, beside a `startup:` section's knobs, and every start then takes it."""
    weights = HH.model.weight_bytes
    file = yaml.safe_load("startup_s: 60\nstartup: {process_s: 5.0, host_copy: none}\n")
    options = default_options(HH, {Role.PROMPT: 4, Role.TOKEN: 4}, **file)
    assert options.startup == StartupModel(process_s=5.0, host_copy="none", flat_s=60.0)
    assert options.startup.seconds(weights, started_before=False) == 60.0
    flat = default_options(HH, {Role.PROMPT: 4, Role.TOKEN: 4}, **yaml.safe_load("startup_s: 60"))
    assert flat.startup == StartupModel(flat_s=60.0)
    model = default_options(HH, {Role.PROMPT: 4, Role.TOKEN: 4}, startup_s=None)
    assert model.startup == StartupModel()  # None: the model


def test_machines_take_work_after_the_start_up_their_node_allows(result: AutoscaleResult) -> None:
    """The flat `startup_s` (15 s here) for every machine started by a decision; with the model
    and `after_first_start`, a node's first start reads storage, a later one host memory."""
    started = [life for life in result.lives if life.provisioned_s > 0]
    assert started and all(life.active_s - life.provisioned_s == 15.0 for life in started)
    model = StartupModel(process_s=2.0, host_gbps=140.0, storage_gbps=14.0,
                         host_copy="after_first_start")  # fmt: skip
    lives = run(startup_s=None, startup=model).lives
    seen: set[int] = {life.machine_id for life in lives if life.provisioned_s <= 0}
    for life in sorted(lives, key=lambda life: life.provisioned_s):
        if life.provisioned_s > 0:
            took = life.active_s - life.provisioned_s
            assert took == pytest.approx(3.0 if life.machine_id in seen else 12.0)
        seen.add(life.machine_id)
    assert any(life.provisioned_s > 0 for life in lives)


def test_the_command_reads_a_policy_file_and_ends_with_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "startup_s: 5\nprompt: {targets: {pending_prompt_tokens: 500}, upscale_after_s: 2}\n"
    )
    argv = ["autoscale", "--trace", str(TRACE), "--design", "Splitwise-HH", "--max", "6P3T",
            "--initial", "1P1T", "--rate", "4", "--duration", "90", "--step", "3x@30s+30s",
            "--policy", str(policy), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["completed"] == figures["requests"] > 0
    assert figures["scale_events"]["prompt"] >= 1  # 1 prompt machine, a 500-token target
    assert set(figures["replica_s"]) == {"prompt", "token"}
    assert len(figures["attainment_in_steps"]) == 1
    policy.write_text("prompt: {targets: {kv_fill: 0.5}}\n")
    with pytest.raises(ValueError, match="not prompt's"):
        main(argv)
