"""Where the csrc extension is not built, its tests skip, except in CI (`CI=true`, as `.ci/run`
sets): there a missing build fails every test that needs it, so a broken build cannot pass as a
row of skips."""

from __future__ import annotations

import os

import pytest

from common.attention.cpu_kernel import kernel_available


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def kernel_gate(
    reason: str, built: bool | None = None, ci: bool | None = None
) -> pytest.MarkDecorator:
    """The `pytestmark` of a module whose tests need the extension (`built` / `ci`: for tests
    of this gate; None asks the extension and the environment)."""
    built = kernel_available() if built is None else built
    ci = in_ci() if ci is None else ci
    if not built and ci:
        return pytest.mark.usefixtures("kernel_must_be_built")
    return pytest.mark.skipif(not built, reason=reason)


def require_kernel_build(built: bool) -> None:
    """What `kernel_must_be_built` does: fail, loudly, when the extension is missing."""
    if not built:
        pytest.fail("CI=true and the csrc extension is not built: the build is broken "
                    "(it would be skipped outside CI)", pytrace=False)  # fmt: skip
