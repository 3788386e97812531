"""`bench/serve.py --mesh-args`: a setting of deploy/local.yaml's `mesh:` changed for one run, and
refused at once (not after minutes of benching and a server that never comes up) when wrong."""

from __future__ import annotations

import pytest

from bench import serve, serve_engine


def parse(monkeypatch: pytest.MonkeyPatch, *argv: str) -> dict:
    monkeypatch.setattr("sys.argv", ["serve.py", *argv])
    return serve.parse_args().mesh_args


def test_mesh_args_change_the_files_and_keep_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse(monkeypatch) == {}
    change = parse(monkeypatch, "--mesh-args", '{"token_engine_threads": 1}')
    assert change == {"token_engine_threads": 1}
    merged = serve.yaml_mesh_args() | change
    assert merged["token_engine_threads"] == 1 and merged["shards_per_group"] == 2


@pytest.mark.parametrize(
    "value, error",
    [
        ('{"token_engine_threads": 0}', ">= 1 - at `$.token_engine_threads`"),
        ('{"no_such_switch": 1}', "no_such_switch"),
        ("[1]", "a JSON object of mesh args"),
        ('{"decode_lanes": "many"}', "decode_lanes"),
        ("{not json", "invalid loads value"),
    ],
)
def test_wrong_mesh_args_are_refused_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str, error: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(monkeypatch, "--mesh-args", value)
    assert exit_info.value.code == 2
    assert error in capsys.readouterr().err


def test_environ_sets_for_the_processes_started_meanwhile_then_restores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The `mesh_processes` path starts its launcher with the token engine's OpenMP wait policy;
    the served paths after it must not inherit it."""
    import os

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with serve_engine.environ(OMP_WAIT_POLICY="passive", OMP_NUM_THREADS="1"):
        assert os.environ["OMP_WAIT_POLICY"] == "passive" and os.environ["OMP_NUM_THREADS"] == "1"
    assert "OMP_WAIT_POLICY" not in os.environ and os.environ["OMP_NUM_THREADS"] == "2"
    with pytest.raises(RuntimeError), serve_engine.environ(OMP_WAIT_POLICY="passive"):
        raise RuntimeError("a path that fails")
    assert "OMP_WAIT_POLICY" not in os.environ


def test_a_fresh_process_gets_the_environment_asked_and_this_one_keeps_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    monkeypatch.delenv("PHASEMESH_BENCH_PROBE", raising=False)
    probe = "PHASEMESH_BENCH_PROBE"
    assert serve_engine.in_fresh_process(os.getenv, probe, env={probe: "passive"}) == "passive"
    assert "PHASEMESH_BENCH_PROBE" not in os.environ
    assert serve_engine.in_fresh_process(os.getenv, "PHASEMESH_BENCH_PROBE") is None


def test_the_mesh_is_compared_with_its_processes_alone_and_beside_the_idle_served_mesh() -> None:
    """`served_over_baselines`: the served mesh over its processes without Ray and over the same
    processes beside the idle served mesh, and those over the processes alone, per batch that
    both sides ran; a side that did not run gives no ratio."""
    from bench.serve_report import served_over_baselines

    results = {
        "mesh_direct_plain": {8: {"tok_s": 60.0}, 32: {"tok_s": 80.0}},
        "mesh_processes_plain": {32: {"tok_s": 100.0}},
        "mesh_processes_beside_served_plain": {32: {"tok_s": 85.0}},
    }
    ratios = served_over_baselines(results)
    assert ratios["mesh_direct_plain_over_processes"] == {32: pytest.approx(0.8)}
    assert ratios["mesh_direct_plain_over_beside_served"] == {32: pytest.approx(80 / 85)}
    assert ratios["mesh_processes_beside_served_over_alone"] == {32: pytest.approx(0.85)}
    del results["mesh_processes_beside_served_plain"]
    assert set(served_over_baselines(results)) == {"mesh_direct_plain_over_processes"}


def test_the_local_engine_is_compared_with_the_engine_beside_the_idle_served_local() -> None:
    """Each mode of the served `local` over the in-process engine run beside it while it idled."""
    from bench.serve_report import served_over_baselines

    results = {
        "local_direct": {8: {"tok_s": 70.0}},
        "local_direct_plain": {8: {"tok_s": 80.0}},
        "engine_beside_served": {8: {"tok_s": 100.0}, 32: {"tok_s": 200.0}},
    }
    ratios = served_over_baselines(results)
    assert ratios == {
        "local_direct_over_engine_beside_served": {8: pytest.approx(0.7)},
        "local_direct_plain_over_engine_beside_served": {8: pytest.approx(0.8)},
    }


def test_the_processes_beside_the_served_mesh_need_the_served_mesh(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mesh_processes_beside_served` runs while the served mesh is up: without `mesh` in the
    paths it would silently not run, so it is refused before anything starts."""
    with pytest.raises(SystemExit) as exit_info:
        parse(monkeypatch, "--paths", "inprocess", "mesh_processes_beside_served")
    assert exit_info.value.code == 2
    assert "add mesh" in capsys.readouterr().err
    parse(monkeypatch, "--paths", "mesh", "mesh_processes_beside_served")  # accepted
    with pytest.raises(SystemExit):
        parse(monkeypatch, "--paths", "inprocess", "mesh", "engine_beside_served")
    assert "add local" in capsys.readouterr().err
    parse(monkeypatch, "--paths", "inprocess", "local", "engine_beside_served")


def test_a_path_the_bench_does_not_have_is_refused_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A misspelt path would otherwise run nothing for it and say nothing."""
    with pytest.raises(SystemExit) as exit_info:
        parse(monkeypatch, "--paths", "inprocess", "mesh_procesess")
    assert exit_info.value.code == 2
    assert "invalid choice: 'mesh_procesess'" in capsys.readouterr().err


def test_each_served_path_gets_the_path_asked_to_run_beside_it_and_no_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`beside_served`: the path of `BESIDE_SERVED` that needs the served path, when asked for."""
    monkeypatch.setattr("sys.argv", ["serve.py", "--paths", "inprocess", "local", "mesh",
                                     "engine_beside_served"])  # fmt: skip
    args = serve.parse_args()
    ran: list[tuple] = []
    monkeypatch.setattr(serve, "in_process", lambda *a: ran.append(a) or {8: {"tok_s": 5.0}})
    results: dict = {}
    assert serve.beside_served(args, "mesh", results, {8: 10.0}, [8], 16) is None
    run = serve.beside_served(args, "local", results, {8: 10.0}, [8], 16)
    assert run is not None and not ran  # nothing runs until the served path calls it
    run()
    assert ran == [(args.preset, [8], 16)]
    assert results == {"engine_beside_served": {8: {"tok_s": 5.0}}}
