"""One request's failure is that request's alone (ARCHITECTURE.md, failure semantics): the sampler
is total for every parameter set validation accepts, and a request whose sampling raises ends
alone while its batch-mates produce exactly the tokens they would have without it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import common.sampling
from common.engine.core import LLMEngine
from common.sampling import Sampler
from common.sampling_params import SamplingParams
from tests.conftest import random_prompts

valid_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 64),
    temperature=st.one_of(st.just(0.0), st.floats(5e-324, 1e-3), st.floats(0.0, 100.0)),
    top_p=st.floats(5e-324, 1.0, exclude_min=False).filter(lambda x: x > 0),
    top_k=st.one_of(st.just(-1), st.integers(1, 5000)),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
)


@settings(max_examples=300, deadline=None)
@given(
    params=valid_params,
    logits=st.lists(st.floats(-1e30, 1e30), min_size=1, max_size=64),
    index=st.integers(0, 10_000),
)
def test_the_sampler_always_returns_a_token(
    params: SamplingParams, logits: list[float], index: int
) -> None:
    row = torch.tensor([logits], dtype=torch.float32)
    out = Sampler().sample(row, [params], [index])
    tokens, failures = out.token_ids, out.failures
    assert failures == {}
    assert 0 <= tokens[0] < len(logits)


def test_seeded_draws_depend_on_seed_and_position_only() -> None:
    # What a migrated request relies on: its next draw depends on nothing but these.
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(0)).repeat(3, 1)
    p = SamplingParams(temperature=1.0, seed=7)
    mates = [SamplingParams(temperature=1.0), p, p]
    together = Sampler().sample(logits, mates, [0, 5, 5]).token_ids
    alone = Sampler().sample(logits[:1], [p], [5]).token_ids
    assert together[1] == together[2] == alone[0]
    draws = {Sampler().sample(logits[:1], [p], [i]).token_ids[0] for i in range(20)}
    assert len(draws) > 1  # the position moves the stream on


@pytest.fixture(scope="module")
def engine(tiny_model_path) -> LLMEngine:
    return LLMEngine.from_path(tiny_model_path, num_blocks=512)


def test_a_request_whose_sampling_raises_ends_alone(engine: LLMEngine, monkeypatch) -> None:
    prompts = random_prompts([9, 17, 30, 12, 44, 8, 25, 60, 14], 2048, seed=70)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reference = engine.generate(prompts[:8], greedy)
    real = common.sampling._sample_row

    def poisoned(logits, p, gen, top):  # a stand-in for any per-request sampling fault
        if p.seed == 666:
            raise FloatingPointError("poisoned row")
        return real(logits, p, gen, top)

    monkeypatch.setattr(common.sampling, "_sample_row", poisoned)
    for i, prompt in enumerate(prompts[:8]):
        engine.add_request(f"g{i}", prompt, greedy)
    engine.add_request("poison", prompts[8], SamplingParams(max_tokens=20, seed=666))
    outputs: dict[str, list[int]] = {f"g{i}": [] for i in range(8)}
    errors: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                errors[out.req_id] = out.error
            else:
                outputs[out.req_id] += out.new_token_ids
    assert list(errors) == ["poison"] and "poisoned row" in errors["poison"]
    assert [outputs[f"g{i}"] for i in range(8)] == reference
    assert engine.blocks.num_used_blocks == 0


def test_a_request_longer_than_the_kv_cache_ends_at_its_capacity(tiny_model_path) -> None:
    """A cache smaller than the model's context caps every request at what it holds: a request
    asking for more ends with "length" there, as at the model's context, instead of being
    preempted forever (or running an empty batch)."""
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=8, block_size=16)  # 128 tokens
    assert engine.max_model_len == 128
    prompt = random_prompts([21], engine.model_config.vocab_size, seed=3)[0]
    engine.add_request("long", prompt, SamplingParams(max_tokens=2027, ignore_eos=True,
                                                      temperature=0.0))  # fmt: skip
    engine.add_request("short", prompt, SamplingParams(max_tokens=5, ignore_eos=True,
                                                       temperature=0.0))  # fmt: skip
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    long = [o for o in outputs if o.req_id == "long"]
    assert long[-1].finish_reason is not None and long[-1].finish_reason.value == "length"
    assert sum(len(o.new_token_ids) for o in long) == 128 - 21
    assert engine.blocks.num_used_blocks == 0
