"""`bench/serve.py`'s in-process path as a user runs it (no Ray): the table, and a last line that
is one JSON object with the engine's figures of both its runs, their best, and the targets (unmet
ones None: no served path ran)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.usefixtures("tiny_model_path")  # the bench loads the tiny preset's folder
def test_the_in_process_path_reports_its_best_run_and_the_targets() -> None:
    command = [sys.executable, "bench/serve.py", "--paths", "inprocess", "--batches", "1", "2",
               "--tokens", "8"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-3].split() == ["tok/s", "(ratio)", "batch", "1", "batch", "2"]
    results = json.loads(lines[-1])
    for batch in ("1", "2"):
        runs = [results["inprocess"][batch]["tok_s"], results["inprocess_end"][batch]["tok_s"]]
        assert min(runs) > 0
        assert results["inprocess_tok_s_best"][batch] == max(runs)
    assert (
        set(results["targets"]) == set(results["targets_met"]) == set(results["targets_met_plain"])
    )
    assert all(met is None for met in results["targets_met"].values())
    assert {"vendor", "family", "model", "isa"} <= set(results["cpu"])
