"""A bfloat16 KV cache under a float32 model (`kv_cache_dtype`, vLLM's option): half the bytes for
the same blocks; the fused decode layers give the stages' tokens on it, several steps a call the
single steps' tokens, a cached prefix the uncached tokens; its tokens stay close to a float32
cache's; a value it does not know is refused."""

from __future__ import annotations

import random

import pytest
import torch

from common.config import CacheConfig
from common.engine.core import LLMEngine
from common.model.linear import POST_ATTENTION_MAX_ROWS
from common.sampling_params import SamplingParams


def _prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 50))] for _ in range(count)]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)


def test_a_bfloat16_cache_holds_the_same_blocks_in_half_the_bytes(tiny_model_path):
    f32 = LLMEngine.from_path(tiny_model_path, num_blocks=32)
    bf16 = LLMEngine.from_path(tiny_model_path, num_blocks=32, kv_cache_dtype="bfloat16")
    assert f32.runner.kv_cache.key.dtype == torch.float32
    assert bf16.runner.kv_cache.key.dtype == bf16.runner.kv_cache.value.dtype == torch.bfloat16
    assert bf16.runner.kv_cache.num_bytes * 2 == f32.runner.kv_cache.num_bytes
    assert bf16.model.model.embed_tokens.weight.dtype == torch.float32  # the model is unchanged


def test_fused_steps_and_several_a_call_give_the_stages_tokens(tiny_model_path):
    """On a bfloat16 cache: the fused decode layers (the default) against the stages one by
    one, and eight greedy iterations a call against one: the same tokens."""
    engines = [
        LLMEngine.from_path(tiny_model_path, num_blocks=64, kv_cache_dtype="bfloat16",
                            num_scheduler_steps=steps)
        for steps in (1, 1, 8)
    ]  # fmt: skip
    engines[1].runner.fuse_decode = False
    prompts = _prompts(engines[0].model_config.vocab_size, 4)
    fused, stages, stepped = (e.generate(prompts, GREEDY) for e in engines)
    assert engines[0].runner._fused is not None and engines[1].runner._fused is None
    assert fused == stages == stepped


def test_its_tokens_stay_close_to_a_float32_caches(tiny_model_path):
    """Rounding each k/v to bfloat16 moves the logits a little: the first tokens agree with a
    float32 cache's, and the chosen tokens' logprobs stay within 0.05 while they do."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = []
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine.from_path(tiny_model_path, num_blocks=64, kv_cache_dtype=dtype)
        for i, prompt in enumerate(_prompts(engine.model_config.vocab_size, 3, seed=1)):
            engine.add_request(str(i), prompt, params)
        outputs: dict[str, list] = {}
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.req_id, []).extend(
                    zip(out.new_token_ids, out.logprobs, strict=True)
                )
        runs.append(outputs)
    for req_id, f32 in runs[0].items():
        bf16 = runs[1][req_id]
        assert [t for t, _ in f32[:4]] == [t for t, _ in bf16[:4]], req_id
        for (t32, lp32), (t16, lp16) in zip(f32, bf16, strict=True):
            if t32 != t16:
                break
            assert abs(lp32.logprob - lp16.logprob) < 0.05, req_id


def test_a_cached_prefix_and_a_batch_over_the_fused_rows(tiny_model_path):
    """A prompt whose prefix the bfloat16 cache holds (prefix caching) generates the tokens it
    generates uncached; a decode batch wider than the fused layers take runs the stages on it."""
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=256, kv_cache_dtype="bfloat16")
    fresh = LLMEngine.from_path(tiny_model_path, num_blocks=256, kv_cache_dtype="bfloat16",
                                enable_prefix_caching=False)  # fmt: skip
    vocab = engine.model_config.vocab_size
    prompt = _prompts(vocab, 1, seed=2)[0] + list(range(3, 40))  # more than two whole blocks
    first = engine.generate([prompt], GREEDY)
    assert engine.generate([prompt], GREEDY) == first == fresh.generate([prompt], GREEDY)
    assert engine.blocks.num_hit_tokens >= 32
    wide = _prompts(vocab, POST_ATTENTION_MAX_ROWS + 1, seed=3)
    outputs = engine.generate(wide, GREEDY)
    assert [len(o) for o in outputs] == [GREEDY.max_tokens] * len(wide)


def test_preempted_and_recomputed_requests_continue_as_they_did(tiny_model_path):
    """A cache too small for every request: preempted requests are prefilled again from their
    tokens and continue with the tokens a roomy cache gives (the prefill attends to its own k/v
    rounded as the cache holds them, as the decode steps before it did)."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, detokenize=False)
    tight = LLMEngine.from_path(tiny_model_path, num_blocks=10, kv_cache_dtype="bfloat16")
    roomy = LLMEngine.from_path(tiny_model_path, num_blocks=256, kv_cache_dtype="bfloat16")
    prompts = _prompts(tight.model_config.vocab_size, 3, seed=4)
    assert tight.generate(prompts, params) == roomy.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0


def test_a_kv_cache_dtype_it_does_not_know_is_refused():
    from pydantic import ValidationError

    from services.app_args import EngineArgs

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16"):
        CacheConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="float16")  # type: ignore[arg-type]
    assert EngineArgs(kv_cache_dtype="bfloat16").model_dump()["kv_cache_dtype"] == "bfloat16"
