"""The tree's layers, checked from the source (`ast`, module-level imports, `TYPE_CHECKING`
blocks left out): `common/` imports neither `services/` nor `loadgen/` (no upward imports), only
`services/app.py` imports `ray.serve`, and no module imports itself through others (no cycles).
docs/structure.md describes the layers; this keeps them true."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "services", "loadgen")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path) -> set[str]:
    """What the module imports when it loads: its top-level imports, outside TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node]:
            if isinstance(sub, ast.Import):
                names.update(alias.name for alias in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                names.add(sub.module)
                names.update(f"{sub.module}.{alias.name}" for alias in sub.names)
    return names


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: {i for i in top_level_imports(path) if i in modules} - {name}
            for name, path in modules.items()}  # fmt: skip


def test_common_imports_nothing_above_it() -> None:
    upward = {
        (name, target)
        for name, targets in graph().items() if name.startswith("common")
        for target in targets if target.split(".")[0] in ("services", "loadgen")
    }  # fmt: skip
    assert not upward


def test_only_the_app_imports_ray_serve() -> None:
    users = {
        name for name, path in project_modules().items()
        if any(i == "ray.serve" or i.startswith("ray.serve.") for i in top_level_imports(path))
    }  # fmt: skip
    assert users <= {"services.app"}


def test_no_import_cycles() -> None:
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(edges.get(name, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles[:5]
