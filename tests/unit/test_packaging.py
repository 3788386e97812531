"""Packaging: the console scripts resolve to working callables, the loadgen-only libraries stay out
of the server's dependencies and imports, and the Dockerfile builds the image deploy/rayservice.yaml
runs (checked by reading it: no registry is reachable to build it here).
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from services import serve_cli

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
LOADGEN_ONLY = {"httpx", "tqdm", "matplotlib"}


def pin(name: str) -> str:
    """The `==` version of a dependency of the package."""
    [spec] = [d for d in PROJECT["dependencies"] if d.startswith(f"{name}==")]
    return spec.split("==", 1)[1]


def test_console_scripts_resolve_to_their_mains() -> None:
    scripts = PROJECT["scripts"]
    assert set(scripts) == {"phasemesh", "phasemesh-loadgen"}
    for target in scripts.values():
        module, attr = target.split(":")
        assert callable(getattr(importlib.import_module(module), attr))
    loadgen_main = importlib.import_module("loadgen.cli").main
    with pytest.raises(SystemExit) as help_exit:
        loadgen_main(["--help"])
    assert help_exit.value.code == 0


def test_phasemesh_serve_prepares_the_named_models_and_runs_serve(tmp_path: Path) -> None:
    local = yaml.safe_load((ROOT / "deploy/local.yaml").read_text())
    assert serve_cli.named_presets(local) == ["smollm2"]
    config = {"applications": [{"args": {}}, {"args": {"model": "/some/folder"}},
                               {"args": {"model": "small"}}, {}]}  # fmt: skip
    assert serve_cli.named_presets(config) == ["tiny", "small"]  # `model`'s default is tiny
    argv, env = serve_cli.serve_command(Path("deploy/local.yaml"), direct_ingress=True)
    assert Path(argv[0]).name == "serve"
    assert argv[1:] == ["run", "--address", "local", "deploy/local.yaml"]
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    _, env = serve_cli.serve_command(Path("x.yaml"), direct_ingress=False)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
    # The Makefile's `run` starts Serve with the same switches.
    makefile = (ROOT / "Makefile").read_text()
    for name, value in (serve_cli.DIRECT_INGRESS_ENV | serve_cli.QUIET_RUNTIME_ENV).items():
        assert f"{name}={value}" in makefile
        assert env[name] == value or name in os.environ  # the caller's own setting wins
    assert serve_cli.main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    args = serve_cli.build_parser().parse_args(["serve"])
    assert args.config == serve_cli.DEFAULT_CONFIG and args.direct_ingress


def test_loadgen_libraries_are_an_extra_the_server_never_imports() -> None:
    names = {re.split(r"[<>=\[ ]", d)[0] for d in PROJECT["dependencies"]}
    assert not names & LOADGEN_ONLY
    extras = PROJECT["optional-dependencies"]
    assert {re.split(r"[<>=]", d)[0] for d in extras["loadgen"]} == LOADGEN_ONLY
    assert "phasemesh[loadgen]" in extras["test"]
    importers = []
    for folder in ("common", "services"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    modules = [node.module or ""]
                else:
                    continue
                if any(m.split(".")[0] in LOADGEN_ONLY for m in modules):
                    importers.append(str(path.relative_to(ROOT)))
    assert importers == []


def test_the_app_module_and_the_mesh_router_import_neither_torch_nor_ucxx() -> None:
    """Every replica and `serve run` itself import `services.app`; a mesh Router needs no engine,
    nor does the offline group's replica (its worker processes compute). Each role's modules are
    imported in its own replica, so these starts and `serve run`'s skip torch's and ucxx's
    imports (seconds of CPU each, on every start and scale-up)."""
    code = ("import sys, services.app, services.router.mesh_client, services.router.server, "
            "services.offline.service; "
            "print(sorted(m for m in ('torch', 'ucxx') if m in sys.modules))")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert run.stdout.strip() == "[]"


def dockerfile_steps() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]  # type: ignore[misc]


def test_dockerfile_builds_the_image_rayservice_runs() -> None:
    steps = dockerfile_steps()
    assert steps[0] == ("FROM", f"rayproject/ray:{pin('ray[serve]')}-py311")
    runs = [args for op, args in steps if op == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if f"torch=={pin('torch')}" in r)
    assert "download.pytorch.org/whl/cpu" in runs[torch_at]  # the CPU build, pinned
    package_at = next(i for i, r in enumerate(runs) if "pip install --no-cache-dir . " in r + " ")
    assert torch_at < package_at  # torch first: the package's own pin would pull CUDA's
    assert "--no-build-isolation ./csrc" in runs[package_at]  # the kernel, on that torch
    copied = {
        src for op, args in steps if op == "COPY" for src in args.split()[:-1]
        if not src.startswith("--")
    }  # fmt: skip
    found = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in found}
    assert packages | {"pyproject.toml", PROJECT["readme"], "csrc"} <= copied
    assert all((ROOT / src).exists() for src in copied)
    ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line and not line.startswith("#")]  # fmt: skip
    assert not [src for src in copied for pattern in ignored if fnmatch.fnmatch(src, pattern)]
    # The tag every pod of the RayService runs, and the README's build command, name this image.
    tag = f"phasemesh:{PROJECT['version']}"
    images = re.findall(r"image:\s*(\S+)", (ROOT / "deploy/rayservice.yaml").read_text())
    assert images and set(images) == {tag}
    assert f"docker build -t {tag} ." in (ROOT / "README.md").read_text()


def test_the_installed_packages_carry_their_bytecode() -> None:
    """What every Ray worker and Serve replica imports starts from bytecode the install wrote
    (`make install`'s `--compile-bytecode`; pip writes it by default): where
    PYTHONDONTWRITEBYTECODE is set, Python never writes it, and each process would compile them
    from source at its start. A venv made before the Makefile did so: `make clean install`."""
    import fastapi
    import pydantic
    import ray
    import ray.serve
    import zmq

    for module in (ray, ray.serve, fastapi, pydantic, zmq):
        source = str(module.__file__)
        assert Path(importlib.util.cache_from_source(source)).is_file(), source


def test_every_kernel_source_keys_uvs_cache_of_the_built_kernel() -> None:
    """`make kernel` reinstalls ./csrc through uv, which reuses its cached wheel while the cache
    keys are unchanged: a source file outside them would be edited and rebuilt from the old code."""
    csrc = ROOT / "csrc"
    keys = tomllib.loads((csrc / "pyproject.toml").read_text())["tool"]["uv"]["cache-keys"]
    patterns = [key["file"] for key in keys]
    sources = [p.name for p in csrc.iterdir() if p.suffix in {".cpp", ".h", ".txt", ".toml"}]
    assert "fragment_kernel.h" in sources and "CMakeLists.txt" in sources
    uncovered = [s for s in sources if not any(fnmatch.fnmatch(s, p) for p in patterns)]
    assert not uncovered, f"csrc sources outside uv's cache keys: {uncovered}"
