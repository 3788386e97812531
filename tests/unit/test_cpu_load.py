"""`bench/cpu_load.BurstLoad` (the `neighbor` path's synthetic load) and how `bench/serve_report`
turns the in-process engine's ratios beside it into each served run's `ratio_bound`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.cpu_load import BurstLoad
from bench.host_cpu import process_cpu_s
from bench.serve_report import bound_reachable, interpolate, neighbor_bounds


def test_a_load_burns_cpu_in_its_own_processes_and_stops_with_the_block() -> None:
    with BurstLoad(0.2) as load:
        pids = [proc.pid for proc in load._running]
        assert len(pids) == 2 and os.getpid() not in pids
        before = sum(process_cpu_s(p) for p in pids)
        time.sleep(1.5)
        burned = sum(process_cpu_s(p) for p in pids) - before
        # 0.3 s on a quiet machine; a busy one gives the bursts less, never more than asked
        # for by much (each sleeps between bursts).
        assert 0.0 < burned < 1.0
    assert not any(Path(f"/proc/{p}").exists() for p in pids)


@pytest.mark.parametrize("cores", [0.0, 2.0, -0.1])
def test_a_load_each_process_cannot_give_is_refused(cores: float) -> None:
    with pytest.raises(ValueError, match="each needs"):
        BurstLoad(cores)


def test_interpolate_follows_the_polyline_and_extends_its_last_segment() -> None:
    points = [(0.0, 1.0), (0.1, 0.9), (0.3, 0.7)]
    assert interpolate(points, 0.0) == 1.0
    assert interpolate(points, 0.05) == pytest.approx(0.95)
    assert interpolate(points, 0.2) == pytest.approx(0.8)
    assert interpolate(points, 0.5) == pytest.approx(0.5)  # past the last point, along it


def test_each_local_figure_gets_the_bound_at_its_own_others_cores() -> None:
    results = {
        "inprocess_beside_0.1": {8: {"tok_s": 90.0, "ratio": 0.9}, 32: {"ratio": 0.8}},
        "inprocess_beside_0.2": {8: {"tok_s": 70.0, "ratio": 0.7}, 32: {"ratio": 0.6}},
        "local_direct_plain": {8: {"others_cores": 0.15}, 32: {"others_cores": 0.05}},
        "local_direct": {8: {"tok_s": 1.0}},  # no others_cores measured: no bound
        "mesh_direct": {32: {"others_cores": 0.1}},  # the mesh has no in-process engine thread
    }
    neighbor_bounds(results)
    assert results["local_direct_plain"][8]["ratio_bound"] == pytest.approx(0.8)
    assert results["local_direct_plain"][32]["ratio_bound"] == pytest.approx(0.9)
    assert "ratio_bound" not in results["local_direct"][8]
    assert "ratio_bound" not in results["mesh_direct"][32]


def test_the_bound_says_where_no_front_end_could_meet_the_local_target() -> None:
    results = {
        "local_direct_plain": {8: {"ratio_bound": 0.9}, 32: {"ratio_bound": 0.8}, 1: {}},
        "local_direct": {32: {"ratio": 0.3}},  # no bound measured: nothing said
    }
    assert bound_reachable(results, "_plain") == {"batch8": True, "batch32": False}
    assert bound_reachable(results) == {}


def test_a_load_whose_parent_is_killed_stops_by_itself(tmp_path: Path) -> None:
    """A benchmark killed outright (SIGKILL: no `__exit__`) must not leave CPU burners behind."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "from bench.cpu_load import BurstLoad\n"
        "with BurstLoad(0.2) as load:\n"
        "    print(*[p.pid for p in load._running], flush=True)\n"
        "    time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    burners = [int(p) for p in parent.stdout.readline().split()]
    assert len(burners) == 2 and all(Path(f"/proc/{p}").exists() for p in burners)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while any(_running(p) for p in burners) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(p) for p in burners)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by init, but not at once)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
