"""Token-equality of the single-process engine with prefix caching on and off: shared prefixes of
many lengths (block-aligned, mid-block, fully cached), one batch, preemption and aborts."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.engine.core import LLMEngine
from common.sampling_params import SamplingParams
from tests.conftest import random_prompts

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model_path: Path) -> list[list[int]]:
    """A base prompt, then prompts sharing its first n tokens for n across block boundaries."""
    base, *tails = random_prompts([40] + [7] * 12, 500, seed=11)
    shared = [0, 3, 4, 5, 8, 15, 16, 17, 31, 32]
    return [base, base[:32], base[:30]] + [
        base[:n] + t for n, t in zip(shared, tails, strict=False)
    ]


def _engine(path: Path, cache: bool, num_blocks: int = 256) -> LLMEngine:
    return LLMEngine.from_path(
        path, num_blocks=num_blocks, block_size=BS, enable_prefix_caching=cache
    )


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path, prompts: list[list[int]]) -> list[list[int]]:
    engine = _engine(tiny_model_path, cache=False)
    return [engine.generate([p], GREEDY)[0] for p in prompts]


def test_one_at_a_time_reuses_and_matches(tiny_model_path, prompts, reference):
    engine = _engine(tiny_model_path, cache=True)
    assert [engine.generate([p], GREEDY)[0] for p in prompts] == reference
    hit = engine.blocks.num_hit_tokens
    # The base's 40 tokens, then: base[:32] reuses 28 (its last block is recomputed), base[:30]
    # reuses 28, and each shared prompt its full blocks of the base.
    assert hit == 28 + 28 + sum(n // BS * BS for n in [0, 3, 4, 5, 8, 15, 16, 17, 31, 32])


def test_one_batch_matches(tiny_model_path, prompts, reference):
    engine = _engine(tiny_model_path, cache=True)
    engine.generate(prompts[:1], GREEDY)  # warm the cache with the base prompt
    assert engine.generate(prompts, GREEDY) == reference
    assert engine.blocks.num_hit_tokens > 40


def test_preemption_matches(tiny_model_path, prompts, reference):
    # 40 blocks of 4: the 13 prompts cannot all decode at once; the youngest are recomputed.
    engine = _engine(tiny_model_path, cache=True, num_blocks=40)
    engine.generate(prompts[:1], GREEDY)
    assert engine.generate(prompts, GREEDY) == reference
    assert engine.scheduler.num_preemptions > 0 and engine.blocks.num_hit_tokens > 40
    engine.blocks.audit()


def test_aborts_leave_the_cache_reusable(tiny_model_path, prompts, reference):
    engine = _engine(tiny_model_path, cache=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()  # one prefill batch: every prompt's blocks are computed
    for i in range(0, len(prompts), 2):
        assert engine.abort(f"r{i}")
    engine.blocks.audit()
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
    for i in range(1, len(prompts), 2):
        assert outputs[f"r{i}"][-5:] == reference[i][1:]  # the first token came in the first step
    assert engine.generate(prompts, GREEDY) == reference  # again, now mostly from the cache
    assert engine.blocks.num_used_blocks == 0
    engine.blocks.audit()
