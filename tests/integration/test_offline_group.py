"""Seesaw's offline group: 2 worker processes over torch.distributed (gloo), a shared-memory KV
buffer, pipeline-parallel prefill and tensor-parallel decode. Greedy outputs equal the
single-process engine's, for every mode, including jobs that cross many stage transitions."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.engine.core import LLMEngine
from common.sampling import SamplingParams
from services.offline.group import MODES, OfflineGroup, OfflineGroupError

PROMPTS = [[(7 * i + j) % 2000 + 5 for j in range(3 + i % 9)] for i in range(14)]
MAX_TOKENS = [4 + i % 7 for i in range(14)]


@pytest.fixture(scope="module")
def expected(tiny_model_path: Path) -> list[list[int]]:
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=256)
    return [engine.generate([p], SamplingParams(temperature=0, max_tokens=m))[0]
            for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]  # fmt: skip


@pytest.fixture(scope="module")
def group(tiny_model_path: Path) -> Iterator[OfflineGroup]:
    # A buffer of 4 and 3 decode slots: 14 requests cross the PP/TP boundary many times.
    with OfflineGroup(tiny_model_path, 2, num_buffer_slots=4, num_decode_slots=3,
                      max_len=64) as g:  # fmt: skip
        yield g


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_gives_the_single_process_greedy_tokens(
    group: OfflineGroup, expected: list[list[int]], mode: str
) -> None:
    outputs, stats = group.generate(PROMPTS, MAX_TOKENS, mode=mode)
    assert outputs == expected
    assert stats.num_tokens == sum(len(o) for o in expected)
    assert stats.num_prefills >= 4 and stats.num_decode_steps > 0
    if mode == "seesaw":
        # Transitions only when the buffer filled or emptied: far fewer than prefill-first's.
        assert stats.num_transitions >= 2
        _, eager = group.generate(PROMPTS, MAX_TOKENS, mode="prefill_first")
        assert stats.num_transitions < eager.num_transitions


def test_a_request_that_does_not_fit_is_refused_before_anything_runs(group: OfflineGroup) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        group.generate([[5] * 60], [10])


def test_a_killed_worker_fails_the_job_instead_of_hanging(group: OfflineGroup) -> None:
    """Last in this module: it breaks the module's group."""
    group.result_timeout_s = 30
    os.kill(group.procs[1].pid, signal.SIGKILL)  # type: ignore[arg-type]
    with pytest.raises(OfflineGroupError):
        group.generate([[5, 6, 7]], [3])
