"""One `serve run deploy/local.yaml` for every module of this package (Ray start-up is the slow
part of an e2e test: ~45 s of a 2-core machine each time), and the single-process reference.

The order matters and is set here (`LAST`): `test_self_healing.py` SIGKILLs replicas (Serve
restarts them), so it runs after every test that wants a mesh that never lost a process; the
loadgen test that SIGKILLs the whole server runs after everything.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.tokenizer import Tokenizer
from tests.e2e.serve_process import ServeRun, served

# Tests that run after the rest of the package, in this order (node ids under this folder).
LAST = (
    "test_self_healing.py::",
    "test_loadgen_replay.py::test_server_killed_mid_replay_ends_with_an_error_report",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Moves `LAST` to the end of this package's tests, keeping every other test in place."""
    here = [i for i, item in enumerate(items) if item.path.parent == Path(__file__).parent]

    def rank(item: pytest.Item) -> int:
        local_id = item.nodeid.split("local_serve/", 1)[1]
        return next((n + 1 for n, prefix in enumerate(LAST) if local_id.startswith(prefix)), 0)

    ordered = sorted((items[i] for i in here), key=rank)  # stable: the rest keep their order
    for i, item in zip(here, ordered, strict=True):
        items[i] = item


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeRun]:
    with served("local.yaml", tmp_path_factory.mktemp("serve")) as run:
        yield run


@pytest.fixture(scope="package")
def reference() -> tuple[LLMEngine, Tokenizer]:
    """`LLMEngine` on the served model: the tiny preset (`served` pins it over deploy/local.yaml's
    SmolLM2, `make run`'s model)."""
    path = default_model_path("tiny")
    return LLMEngine.from_path(path, num_blocks=256), Tokenizer(path)
