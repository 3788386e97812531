"""`bench/serve.py`'s in-process and `neighbor` paths as a user runs them (no Ray): the last line
is one JSON object with the in-process engine's figures beside each synthetic load, and every
figure a ratio against the engine alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.usefixtures("tiny_model_path")  # the bench loads the tiny preset's folder
def test_the_neighbor_path_reports_the_engine_beside_each_load() -> None:
    command = [sys.executable, "bench/serve.py", "--paths", "inprocess", "neighbor",
               "--batches", "2", "--tokens", "8", "--neighbor-cores", "0.2", "0.4"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for cores in ("0.2", "0.4"):
        beside = results[f"inprocess_beside_{cores}"]["2"]
        assert beside["tok_s"] > 0 and beside["ratio"] > 0
        assert beside["ratio"] == pytest.approx(
            beside["tok_s"] / results["inprocess_tok_s_best"]["2"]
        )
    assert "targets_met" in results and "inprocess_end" in results
