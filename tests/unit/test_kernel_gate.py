"""The kernel tests' gate: skip without the build, except in CI, where they fail."""

from __future__ import annotations

import pytest

from tests.kernel_gate import in_ci, kernel_gate, require_kernel_build


def test_outside_ci_a_missing_build_skips() -> None:
    mark = kernel_gate("not built", built=False, ci=False)
    assert mark.name == "skipif" and mark.args == (True,)
    assert kernel_gate("not built", built=True, ci=False).args == (False,)


def test_in_ci_a_missing_build_fails_every_kernel_test() -> None:
    mark = kernel_gate("not built", built=False, ci=True)
    assert mark.name == "usefixtures" and mark.args == ("kernel_must_be_built",)
    with pytest.raises(pytest.fail.Exception, match="not built"):
        require_kernel_build(False)
    require_kernel_build(True)  # a build: nothing to fail
    assert kernel_gate("built", built=True, ci=True).args == (False,)


def test_ci_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert in_ci()
    monkeypatch.setenv("CI", "")
    assert not in_ci()
