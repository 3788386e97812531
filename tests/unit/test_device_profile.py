"""The simulator's device profiles (loadgen/sim/device_profile.py) and the Lamina and Neo
directions they give (loadgen/sim/device_directions.py): the Splitwise table's A100 and H100
slices, the JSON a device run writes read back unchanged, and malformed files refused."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from loadgen.sim.__main__ import main as sim_main
from loadgen.sim.device_directions import directions, neo_served
from loadgen.sim.device_profile import (
    FORMAT,
    read_profile,
    splitwise_profile,
    write_profile,
)


@pytest.fixture(scope="module")
def profiles() -> dict[str, object]:
    return {name: splitwise_profile(name) for name in ("A100x2", "H100x2")}


def test_splitwise_profiles_carry_the_measured_costs(profiles: dict) -> None:
    a100, h100 = profiles["A100x2"], profiles["H100x2"]
    # The H100 slice steps faster than the A100 one at every profiled batch (Splitwise Table IV).
    for tokens in (1, 8, 32, 64):
        assert 0 < h100.dense_s(tokens) < a100.dense_s(tokens)
    for p in (a100, h100):
        # Host attention reads KV at the host's bandwidth: slower per token than the GPU's.
        assert p.host_attention_s(8192) > p.device_attention_s(8192) > 0
        assert 0 < p.device_kv_tokens < p.host_kv_tokens
        assert p.device_usd_h > p.host_usd_h > 0


def test_a_profile_round_trips_through_its_json(profiles: dict, tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    write_profile(profiles["H100x2"], path)
    assert json.loads(path.read_text())["format"] == FORMAT
    assert read_profile(path) == profiles["H100x2"]
    # A bench's output whose last line holds it under `device_profile` reads the same.
    bench_out = tmp_path / "bench.log"
    line = json.dumps({"device_profile": profiles["H100x2"].to_json(), "targets": {}})
    bench_out.write_text("probing...\n" + line + "\n")
    assert read_profile(bench_out) == profiles["H100x2"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format="other/1"), "format"),
        (lambda d: d.pop("dense_s"), "missing dense_s"),
        (lambda d: d["host_attention_s"].update(xs=[1.0]), "two knots"),
        (lambda d: d.update(device_kv_tokens=0), "device KV room"),
    ],
)
def test_a_malformed_profile_is_refused(profiles: dict, tmp_path: Path, edit, message) -> None:
    data = profiles["A100x2"].to_json()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        read_profile(path)


def test_the_papers_directions_from_the_measured_costs(profiles: dict) -> None:
    for p in profiles.values():
        r = directions(p, context=1024)
        lamina, neo = r["lamina"], r["neo"]
        # Lamina Fig. 8/10: more batches in flight buy more tokens per $ than one.
        assert lamina["best_n"] > 1 and lamina["best_over_n1"] > 1
        # Neo Fig. 6: at the same TBT bound and GPU budget, offload serves more, faster.
        assert neo["offload"]["batch"] > neo["gpu_only"]["batch"] > 0
        assert neo["tokens_s_gain"] > 1
        assert neo["offload"]["tbt_ms"] <= r["tbt_bound_ms"]
    # With room for everything on the GPU, offload has nothing to add.
    roomy = replace(profiles["H100x2"], device_kv_tokens=profiles["H100x2"].host_kv_tokens)
    assert directions(roomy, context=1024)["neo"]["tokens_s_gain"] == pytest.approx(1.0)


def test_the_gpu_only_arm_never_offloads(profiles: dict) -> None:
    p = profiles["A100x2"]
    fits = p.device_kv_tokens // (1024 + 16)
    assert neo_served(p, fits, 1024, offload=False)[0] == fits
    assert neo_served(p, fits + 5, 1024, offload=False)[0] < fits + 5  # preempts, serves fewer


def test_the_devices_command_reads_a_device_run(profiles, tmp_path, capsys) -> None:
    path = tmp_path / "device_profile.json"
    write_profile(replace(profiles["A100x2"], name="a device run"), path)
    assert sim_main(["devices", "--profiles", "H100x2", str(path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["profiles"]) == {"H100x2", "a device run"}
    assert set(result["targets_met"]) == set(result["targets"])
    assert result["targets_met"]["a device run:neo_batch_gain"] is True
