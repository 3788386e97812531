"""`Engine` is assembled from mixins (faults.py, tiering.py, kv_news.py, prefill_ship.py,
token_output.py, reports.py), some of which declare another part's methods as stubs that raise
`NotImplementedError`. A stub in a base earlier in the MRO than the real method shadows it: the
engine then fails on its first prefill or fault. This checks, without loading a model, that every
method the engine resolves is a real one."""

from __future__ import annotations

import ast
import inspect
import textwrap

from services.engine.engine import Engine


def is_stub(function: object) -> bool:
    """A method whose whole body is `raise NotImplementedError` (a docstring aside)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))  # type: ignore[arg-type]
    body = [s for s in tree.body[0].body if not isinstance(s, ast.Expr)]  # type: ignore[attr-defined]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    name = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(name, ast.Name) and name.id == "NotImplementedError"


def test_no_mixin_stub_shadows_a_real_method() -> None:
    shadowed = []
    for name in dir(Engine):
        owner = next(k for k in Engine.__mro__ if name in vars(k))
        function = vars(owner)[name]
        if owner.__module__.startswith("services.engine") and inspect.isfunction(function):
            if is_stub(function):
                shadowed.append(f"{owner.__name__}.{name}")
    assert not shadowed, f"stubs the engine would call instead of the real methods: {shadowed}"


def test_the_check_sees_a_stub() -> None:
    class Stubbed:
        def _emit(self) -> None:
            raise NotImplementedError  # another mixin's

    assert is_stub(Stubbed._emit) and not is_stub(Engine._emit)
