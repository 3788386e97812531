"""Prompt logprobs (`echo` + `logprobs`) in bounded chunks: against a float64 reference of the
whole prompt's logits, and the chunk bound held whatever the prompt's length."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import common.engine.runner as runner_module
from common.engine.core import LLMEngine
from common.protocol import TokenLogprobs
from common.sampling_params import SamplingParams
from tests.conftest import random_prompts

NUM_TOP = 4


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> LLMEngine:
    return LLMEngine.from_path(tiny_model_path, num_blocks=64, enable_prefix_caching=False)


def prompt_logprobs(engine: LLMEngine, prompt: list[int]) -> list[TokenLogprobs]:
    engine.add_request("echo", prompt, SamplingParams(max_tokens=1, prompt_logprobs=NUM_TOP))
    outputs = [out for out in engine.step() if out.req_id == "echo"]
    while engine.has_unfinished():
        engine.step()
    assert outputs[0].prompt_logprobs is not None
    return outputs[0].prompt_logprobs


def recorded_rows(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every logits computation the model makes from here on."""
    rows: list[int] = []
    compute = engine.model.compute_logits

    def recording(x: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return compute(x)

    monkeypatch.setattr(engine.model, "compute_logits", recording)
    return rows


@pytest.mark.parametrize("length", [2, 37, 300])
def test_prompt_logprobs_match_float64_reference(engine: LLMEngine, length: int) -> None:
    prompt = random_prompts([length], engine.model_config.vocab_size, seed=length)[0]
    got = prompt_logprobs(engine, prompt)
    with torch.inference_mode():
        logits = engine.model.forward_prefill(torch.tensor(prompt), [length])  # [T, vocab]
    reference = torch.log_softmax(logits.double(), dim=-1)[:-1]  # position i predicts i + 1
    assert len(got) == length - 1
    for i, lp in enumerate(got):
        assert lp.logprob == pytest.approx(float(reference[i, prompt[i + 1]]), abs=1e-4)
        top = reference[i].topk(NUM_TOP)
        assert torch.allclose(torch.tensor(lp.top_logprobs, dtype=torch.float64), top.values,
                              atol=1e-4)  # fmt: skip
        assert lp.top_logprobs == tuple(sorted(lp.top_logprobs, reverse=True))


def test_prompt_logprobs_hold_a_bounded_chunk(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt many chunks long never has more than a chunk of positions' logits at once, and
    its values are the unchunked ones."""
    prompt = random_prompts([203], engine.model_config.vocab_size, seed=5)[0]
    monkeypatch.setattr(runner_module, "PROMPT_LOGPROBS_CHUNK", 10**9, raising=False)
    whole = prompt_logprobs(engine, prompt)
    monkeypatch.setattr(runner_module, "PROMPT_LOGPROBS_CHUNK", 7, raising=False)
    rows = recorded_rows(engine, monkeypatch)
    chunked = prompt_logprobs(engine, prompt)
    assert rows and max(rows) <= 7
    assert len(chunked) == len(whole) == len(prompt) - 1
    for a, b in zip(chunked, whole, strict=True):
        assert a.top_ids == b.top_ids
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)
