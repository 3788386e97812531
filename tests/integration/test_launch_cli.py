"""`python -m services.launch`, run exactly as the README prints it: a local mesh of real processes
(one prompt engine, one token engine, two attention shards) serves its demo request and stops."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_readme_launch_command_serves_the_demo_request(tiny_model_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    assert "python -m services.launch --prompt 1 --token 1 --shards 2" in readme
    command = [sys.executable, "-m", "services.launch", "--prompt", "1", "--token", "1"]
    command += ["--shards", "2", "--model", str(tiny_model_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    match = re.search(r"demo request: (\d+) tokens .*finish: (\w+)", done.stdout)
    assert match is not None, done.stdout
    assert match.groups() == ("16", "length")
    # Every service answered its stats after the request: two engines and two shards.
    assert done.stdout.count("EngineStats(") == 4, done.stdout
