"""Shared fixtures: the default tiny model, a second random config, and the HF reference."""

from __future__ import annotations

import os

# NOTE: before torch loads its OpenMP runtime, which reads this once; the processes the tests
# start inherit it. Two test workers and the servers they start share the machine's cores, and
# OpenMP's default wait spins a thread through every gap between parallel regions on a core
# another process needs. The suite asserts no speed; it only finishes sooner.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.attention.cpu_kernel import kernel_available
from common.model.default import default_model_path, hf_config, write_random_llama
from common.telemetry import configure_telemetry
from tests.kernel_gate import require_kernel_build

# A second architecture: other head counts (GQA 2:1, head_dim 32), Llama-3 rope scaling with a
# short original context so the scaling is exercised, a large rope_theta, tied embeddings.
SECOND_CONFIG = dict(
    vocab_size=1024, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
    num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=1024,
    rope_theta=500000.0, tie_word_embeddings=True,
    rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    },
)  # fmt: skip


E2E = "tests/e2e"  # each module (tests/e2e/local_serve: its package) starts a Ray cluster
# e2e modules that are units of their own, run after every other module by whichever worker is
# free first, largest first: each starts its own `serve run` and nothing in them depends on the
# machine being quiet. The rest of tests/e2e (the local_serve package's one server, the
# autoscaling modules whose short holds a second Ray cluster could stretch) is one unit, run first.
E2E_LAST = ("tests/e2e/test_bench_served.py", "tests/e2e/test_api_fuzz.py")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def xdist_scope(nodeid: str) -> str:
    """The unit a pytest-xdist worker takes whole: the test's module, or every e2e test but
    `E2E_LAST`'s."""
    module = module_of(nodeid)
    return E2E if module.startswith(E2E + "/") and module not in E2E_LAST else module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`E2E_LAST`'s modules after every other test, in its order; the rest keep theirs."""

    def rank(item: pytest.Item) -> int:
        module = module_of(item.nodeid)
        return E2E_LAST.index(module) + 1 if module in E2E_LAST else 0

    items.sort(key=rank)  # stable


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs two pytest-xdist workers. Each takes whole modules, so that a module's
    server or mesh starts once, and one worker takes every e2e module, first and one after
    another: each starts a Ray cluster (tens of seconds of CPU), and two at once on CI's two cores
    slowed both by a third, while the other worker runs the rest. That unit alone outlasted all
    the rest together, so `E2E_LAST`'s modules go out last, each to whichever worker is free
    first: the workers end nearer together. The local_serve package keeps the order its
    conftest.py sets (its one server is killed last).

    NOTE: a scheduler of our own rather than `--dist loadgroup`, whose groups pytest-xdist 3.8
    marks by rewriting `item._nodeid`, which pytest 9 no longer reads (every test then went its
    own way). Units go out in collection order (tests/e2e first, `E2E_LAST` last), not reordered
    by their number of tests, which would send the e2e unit after the largest unit-test modules."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:  # what LoadFileScheduling overrides too
            return xdist_scope(nodeid)

        def _reschedule(self, node: Any) -> None:
            # xdist hands a worker its next unit while it still has two tests to run; an
            # `E2E_LAST` unit waits until the worker has one left. Otherwise the first worker
            # near its end took every one of them while the other finished its modules and then
            # had nothing left to do. Never at one: a worker runs a test only once it knows the
            # next (or is told to stop), so it would wait forever.
            waiting = next(iter(self.workqueue), None)
            if waiting in E2E_LAST and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

        def remove_node(self, node: Any) -> str | None:
            # A worker died: xdist puts every unit it had back in the queue, finished ones too.
            # A finished unit goes out again as no test at all, so the worker given it, with
            # its one test left, would wait forever for more (tests/unit/test_xdist_scope.py).
            workload = self.assigned_work.get(node, {})
            for scope in [scope for scope, unit in workload.items() if all(unit.values())]:
                del workload[scope]
            return super().remove_node(node)

    return ModuleScheduling(config, log)


@pytest.fixture
def kernel_must_be_built() -> None:
    """Used by `tests.kernel_gate` in CI: a kernel test fails if the extension is not built."""
    require_kernel_build(kernel_available())


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return default_model_path("tiny")


@pytest.fixture(scope="session")
def second_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "second"
    return write_random_llama(folder, hf_config(SECOND_CONFIG, seed=7), seed=7)


@pytest.fixture(scope="session", params=["tiny", "second"])
def model_path(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_model_path")


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Skip the first few ids: they are special tokens (BOS, EOS, chat headers).
    return [torch.randint(8, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="session")
def span_exporter() -> InMemorySpanExporter:
    """The spans this test process exports (telemetry is configured once per process)."""
    telemetry = configure_telemetry("tests", exporter="memory")
    if telemetry.span_exporter is not None:
        return telemetry.span_exporter
    # Something configured this process first: listen on its provider instead.
    exporter = InMemorySpanExporter()
    telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
def spans(span_exporter: InMemorySpanExporter) -> Iterator[InMemorySpanExporter]:
    """`span_exporter`, empty at the start of the test and cleared after it."""
    span_exporter.clear()
    yield span_exporter
    span_exporter.clear()
