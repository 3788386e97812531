"""Every bench runs as printed, `python bench/NAME.py`: as a script, Python puts bench/ (not the
repository) first on sys.path, so a module-level `from bench.x import y` needs the script to put
the repository there first. The smoke runs import the benches as modules of the `bench` package
(tests/bench_runs.py), which hides a script that cannot import its own package; this runs each
script's module level the way the interpreter does for `python bench/NAME.py`, all in one
process (one torch import), without running its `main()`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"

# One child: for each script, sys.path as `python bench/NAME.py` makes it (bench/ first, no
# repository), the `bench` package forgotten, then the script's module level under a name that is
# not "__main__". It prints {script: error or null}.
CHILD = r"""
import json, runpy, sys, traceback
bench, repo, scripts = sys.argv[1], sys.argv[2], sys.argv[3:]
base = [p for p in sys.path[1:] if p not in ("", repo)]
errors = {}
for script in scripts:
    sys.path[:] = [bench, *base]
    for name in [m for m in sys.modules if m == "bench" or m.startswith("bench.")]:
        del sys.modules[name]
    try:
        runpy.run_path(script, run_name="__bench_script_check__")
        errors[script] = None
    except BaseException as exc:
        errors[script] = "".join(traceback.format_exception_only(exc)).strip()
print(json.dumps(errors))
"""


# Runs under llama.cpp's own environment (bench/llamacpp_env.sh), which this one lacks.
OTHER_ENVIRONMENT = {"llamacpp_worker.py"}


def bench_scripts() -> list[Path]:
    """bench/*.py that run as programs (they have a `__main__` guard); the rest are modules."""
    return sorted(
        p
        for p in BENCH.glob("*.py")
        if '__name__ == "__main__"' in p.read_text() and p.name not in OTHER_ENVIRONMENT
    )


def test_every_bench_script_imports_as_run_from_the_repository() -> None:
    scripts = bench_scripts()
    assert len(scripts) > 10, scripts  # the glob found the benches
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(BENCH), str(REPO), *map(str, scripts)],
        cwd="/", capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(errors) == set(map(str, scripts))
    failed = {Path(s).name: e for s, e in errors.items() if e}
    assert not failed, failed
