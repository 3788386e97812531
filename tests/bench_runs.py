"""How the suite runs a bench as a user would and reads its verdict: the last stdout line, one JSON
object with figures, `targets` and a `targets_met` map (tests/integration/test_bench_smoke.py,
tests/e2e/local_serve/)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.launch.core_pinning import pin_this_process

REPO = Path(__file__).resolve().parents[1]


def last_json(command: list[str], timeout_s: float = 300.0) -> dict[str, Any]:
    """Runs `python COMMAND` from the repository root; its last stdout line, parsed."""
    done = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def launched_as(command: list[str]) -> Iterator[None]:
    """This process as `python COMMAND` would start: `sys.argv` the command line, the script's
    folder importable (appended: `bench/profile.py` must not hide the standard library's); then
    what a bench changes in its process for itself put back (core affinity, torch's threads, the
    environment)."""
    saved = (sys.argv, list(sys.path), dict(os.environ), os.sched_getaffinity(0),
             torch.get_num_threads())  # fmt: skip
    sys.argv = list(command)
    sys.path.append(str(REPO / Path(command[0]).parent))
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        os.environ.clear()
        os.environ.update(saved[2])
        pin_this_process(sorted(saved[3]))  # every thread: a bench pins them all
        torch.set_num_threads(saved[4])


def run_bench(command: list[str]) -> dict[str, Any]:
    """`python COMMAND` (bench/NAME.py and its flags) as the bench's `main()` in this process;
    its last stdout line, parsed. A fresh interpreter would import torch again, and a LocalMesh
    bench would start a fork server of its own: seconds of CPU each, most of a tiny run.

    A bench that raises, or exits (argparse's `SystemExit` on a wrong flag), fails the test with
    its error; one that hangs is stopped by the test's timeout, and its meshes close in its own
    `finally`. A bench that changes this process in a way `launched_as` does not put back (its
    tracer provider, say) must run with `last_json` instead: a process of its own."""
    out = io.StringIO()
    with launched_as(command), contextlib.redirect_stdout(out):
        importlib.import_module(f"bench.{Path(command[0]).stem}").main()
    return json.loads(out.getvalue().strip().splitlines()[-1])


def assert_figures_and_targets(result: dict[str, Any]) -> None:
    """The house rule for a bench's last line: figures, `targets`, and a `targets_met` map of
    booleans (or `None`: not judged in this run) on stated targets only."""
    targets, met = result["targets"], result["targets_met"]
    assert targets and isinstance(met, dict) and met
    assert set(met) <= set(targets)  # every verdict is on a stated target
    assert all(verdict is None or isinstance(verdict, bool) for verdict in met.values())
    figures = {k: v for k, v in result.items() if k not in ("targets", "targets_met")}
    assert any(isinstance(v, int | float | dict) and v not in (0, {}) for v in figures.values())
