"""One `serve run deploy/local.yaml` for every module of this package (Ray start-up is the slow
part of an e2e test: ~30 s of a 2-core machine each time), and the single-process reference.

Modules run in name order; `test_self_healing.py` SIGKILLs replicas, so it comes last (its name
sorts last) and the others see a mesh that has never lost a process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.tokenizer import Tokenizer
from tests.e2e.serve_process import ServeRun, served


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeRun]:
    with served("local.yaml", tmp_path_factory.mktemp("serve")) as run:
        yield run


@pytest.fixture(scope="package")
def reference() -> tuple[LLMEngine, Tokenizer]:
    """`LLMEngine` on the served model (`served_model_name: tiny` in deploy/local.yaml)."""
    path = default_model_path("tiny")
    return LLMEngine.from_path(path, num_blocks=256), Tokenizer(path)
