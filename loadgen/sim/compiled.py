"""The simulator's hot modules compiled with mypyc, optional: the same source, about twice as fast.

`python -m loadgen.sim.compiled build` (`make sim-compiled`, part of `make install`) compiles
`HOT_MODULES` (the event loop, the machines, the policies it shares with the live mesh, the
arrivals' generator) into `build/sim-compiled/`, beside a stamp of the sources it compiled.
`enable()` (called by `python -m loadgen.sim` before it imports them) puts that build ahead of
the sources, only while the stamp matches the sources as they are now; everything else, the live
mesh and the tests included, imports the pure-Python modules, which stay the reference.

Failures: no compiler or mypyc, or a failed build: `build` exits non-zero and `make install`
goes on (pure Python). Sources edited since the build (a stale stamp), a build for another
Python, `PHASEMESH_SIM_COMPILED=0`, or a hot module already imported in pure Python: `enable`
returns False and the simulator runs pure Python; it never mixes the two in one process.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = REPO / "build" / "sim-compiled"
HOT_MODULES = (
    "common.scheduling.mixed",
    "common.scheduling.load_board",
    "common.scheduling.cluster",
    "loadgen.sim.machine",
    "loadgen.sim.simulator",
    "loadgen.sim.workload",
)
# The packages whose search path the build joins (each hot module's parent).
PACKAGES = ("common.scheduling", "loadgen.sim")
# What the compiled code was type-checked against: the hot modules and the project modules they
# import. A change to any of them makes the build stale.
STAMPED = (
    *(name.replace(".", "/") + ".py" for name in HOT_MODULES),
    "common/roles.py",
    "common/kv_events.py",
    "common/perf_model.py",
    "common/config.py",
    "common/scheduling/home_roles.py",
    "loadgen/sim/designs.py",
    "loadgen/sim/prefix_cache.py",
    "loadgen/sim/shared_cpu.py",
    "loadgen/traces.py",
)
GROUP = "loadgen.sim.hot"  # the shared library's name (loadgen/sim/hot__mypyc.*.so)


def sources_stamp(root: Path = REPO) -> str:
    """A digest of the stamped sources and the interpreter they are compiled for."""
    digest = hashlib.sha256(sys.version.encode())
    for relative in STAMPED:
        digest.update(relative.encode())
        digest.update((root / relative).read_bytes())
    return digest.hexdigest()


def is_current(build_dir: Path = BUILD_DIR) -> bool:
    """Whether `build_dir` holds a build of the sources as they are now."""
    stamp = build_dir / "STAMP"
    return stamp.is_file() and stamp.read_text().strip() == sources_stamp()


def enable(build_dir: Path = BUILD_DIR) -> bool:
    """Import the hot modules from the compiled build from now on, if it is current and none of
    them is imported yet; False (pure Python) otherwise."""
    if os.environ.get("PHASEMESH_SIM_COMPILED", "1") == "0":
        return False
    if any(name in sys.modules for name in HOT_MODULES) or not is_current(build_dir):
        return False
    for package in PACKAGES:
        module = importlib.import_module(package)
        module.__path__.insert(0, str(build_dir / package.replace(".", "/")))
    return True


def is_compiled(module_name: str) -> bool:
    """Whether an imported module runs compiled (an extension module, not its .py)."""
    return not str(sys.modules[module_name].__file__).endswith(".py")


def build(build_dir: Path = BUILD_DIR) -> None:
    """Compile `HOT_MODULES` into `build_dir` (replacing what is there) and stamp it."""
    from mypyc.build import mypycify
    from setuptools import Distribution

    stamp = sources_stamp()
    paths = [name.replace(".", "/") + ".py" for name in HOT_MODULES]
    with tempfile.TemporaryDirectory() as scratch:
        cwd = os.getcwd()
        os.chdir(REPO)  # mypy names the modules from their paths
        try:
            extensions = mypycify(
                paths, opt_level="3", group_name=GROUP, target_dir=f"{scratch}/c", verbose=False
            )
            dist = Distribution({"name": "phasemesh-sim-compiled", "ext_modules": extensions})
            command = dist.get_command_obj("build_ext")
            command.build_lib = f"{scratch}/lib"  # type: ignore[attr-defined]
            command.build_temp = f"{scratch}/obj"  # type: ignore[attr-defined]
            dist.run_command("build_ext")
        finally:
            os.chdir(cwd)
        shutil.rmtree(build_dir, ignore_errors=True)
        shutil.copytree(f"{scratch}/lib", build_dir)
    (build_dir / "STAMP").write_text(stamp + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loadgen.sim.compiled", description=__doc__)
    parser.add_argument("command", choices=("build", "check"))
    args = parser.parse_args()
    if args.command == "build":
        build()
    current = is_current()
    print(f"{BUILD_DIR}: {'current' if current else 'missing or stale'}")
    return 0 if current else 1


if __name__ == "__main__":
    raise SystemExit(main())
