"""The simulator's optional mypyc build (loadgen/sim/compiled.py): the same results as the pure
Python modules, used only while it matches the sources, never mixed with them in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.sim import compiled

REPO = Path(__file__).resolve().parents[2]
# Runs in a fresh interpreter: `enable` must come before anything imports a hot module.
EQUIVALENCE = """
import json, sys
from loadgen.sim import compiled
enabled = compiled.enable()
from tests.unit import test_sim_equivalence as equivalence
frozen = json.loads(equivalence.FIXTURE.read_text())
names = sys.argv[1:]
print(json.dumps({
    "enabled": enabled,
    "compiled": {m: compiled.is_compiled(m) for m in compiled.HOT_MODULES},
    "equal": {n: equivalence.run_scenario(n) == frozen[n] for n in names},
}))
"""


def run_fresh(env: dict[str, str], *names: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", EQUIVALENCE, *names],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def test_a_build_counts_only_while_its_stamp_matches_the_sources(tmp_path: Path) -> None:
    assert not compiled.is_current(tmp_path)  # no build
    (tmp_path / "STAMP").write_text("0" * 64 + "\n")  # a build of other sources
    assert not compiled.is_current(tmp_path)
    (tmp_path / "STAMP").write_text(compiled.sources_stamp() + "\n")
    assert compiled.is_current(tmp_path)


def test_enable_never_mixes_with_modules_already_imported(tmp_path: Path) -> None:
    import loadgen.sim.simulator  # noqa: F401  (pure Python, as in every test process)

    (tmp_path / "STAMP").write_text(compiled.sources_stamp() + "\n")
    before = list(sys.modules["loadgen.sim"].__path__)
    assert not compiled.enable(tmp_path)
    assert list(sys.modules["loadgen.sim"].__path__) == before


def test_switched_off_the_simulator_runs_pure_python() -> None:
    got = run_fresh({"PHASEMESH_SIM_COMPILED": "0"})  # (its results: test_sim_equivalence.py)
    assert got["enabled"] is False
    assert not any(got["compiled"].values())


@pytest.mark.skipif(not compiled.is_current(), reason="no current build: make sim-compiled")
def test_the_compiled_simulator_gives_the_frozen_results_request_by_request() -> None:
    names = ["split_overload", "preemptions", "prefix_routing", "shared_host", "large_cluster"]
    got = run_fresh({}, *names)
    assert got["enabled"] is True
    assert all(got["compiled"].values()), got["compiled"]
    assert got["equal"] == dict.fromkeys(names, True)


def test_importing_the_cli_leaves_the_modules_pure_python() -> None:
    """Tests import `loadgen.sim.__main__` for its `main`: only running it as the program may
    switch to the compiled build, never a test process that happens to import it first."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys, loadgen.sim.__main__ as cli; "
         "print(cli.COMPILED, 'loadgen.sim.simulator' in sys.modules, "
         "sys.modules['loadgen.sim.simulator'].__file__.endswith('.py'))"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert done.stdout.split() == ["False", "True", "True"]
