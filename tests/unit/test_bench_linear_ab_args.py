"""`bench/linear_ab.py` refuses a row count no call can have before it builds either tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_rows_below_one_are_refused_before_any_build(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "bench/linear_ab.py", str(tmp_path / "a"), str(tmp_path / "b"),
         "--rows", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--rows 0" in done.stderr  # parse time: no tree was built (that takes minutes)
