"""The model and the engine against Hugging Face `transformers` on the same weights."""

from __future__ import annotations

import pytest
import torch

from common.engine.core import LLMEngine
from common.model.loader import load_model
from common.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.parity import assert_greedy_close, hf_greedy, load_hf

PROMPT_LENGTHS = [3, 11, 16, 17, 40, 64, 97, 150]


def test_prefill_logits_match_transformers(model_path):
    ours, hf = load_model(model_path), load_hf(model_path)
    lengths = [1, 9, 33, 120]
    prompts = random_prompts(lengths, ours.config.vocab_size, seed=1)
    with torch.inference_mode():
        packed = ours.forward_prefill(torch.tensor(sum(prompts, [])), lengths)
        expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert packed.shape == expected.shape
    torch.testing.assert_close(packed, expected, atol=1e-4, rtol=0)


def test_default_model_logits_are_peaked(tiny_model_path):
    """Random weights must not give near-flat logits, or greedy parity would be luck."""
    model = load_model(tiny_model_path)
    prompt = random_prompts([64], model.config.vocab_size, seed=2)[0]
    with torch.inference_mode():
        top2 = model.forward_prefill(torch.tensor(prompt), [64]).topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).median()) > 0.1


def test_continuous_batching_greedy_matches_transformers(model_path):
    """8 prompts of different lengths; half join mid-stream while others are decoding."""
    engine = LLMEngine.from_path(model_path, num_blocks=256, max_num_batched_tokens=128)
    hf = load_hf(model_path)
    prompts = random_prompts(PROMPT_LENGTHS, engine.model_config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    joins = {0: [0, 1, 2, 3], 5: [4, 5], 20: [6], 41: [7]}  # step -> prompts joining then
    step = 0
    while step in joins or engine.has_unfinished() or step < max(joins):
        for i in joins.get(step, []):
            engine.add_request(str(i), prompts[i], params)
            outputs[str(i)] = []
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
        step += 1
    for i, prompt in enumerate(prompts):
        ours = outputs[str(i)]
        assert len(ours) == 64
        assert_greedy_close(hf, prompt, ours, hf_greedy(hf, prompt, 64))


def test_preemption_and_recompute_keep_greedy_output(tiny_model_path):
    """With too few KV blocks the youngest is preempted and recomputed; outputs stay exact."""
    prompts = random_prompts([30, 45, 60], 2048, seed=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = LLMEngine.from_path(tiny_model_path, num_blocks=64).generate(prompts, params)
    tight = LLMEngine.from_path(tiny_model_path, num_blocks=14)
    tight_out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        tight.add_request(str(i), p, params)
        tight_out[str(i)] = []
    while tight.has_unfinished():
        for out in tight.step():
            tight_out[out.req_id].extend(out.new_token_ids)
    assert tight.scheduler.num_preemptions > 0
    assert [tight_out[str(i)] for i in range(3)] == roomy
    assert tight.blocks.num_free_blocks == 14


def test_save_pretrained_folder_loads_unchanged(tmp_path):
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    HFLlama(config).eval().save_pretrained(tmp_path)
    hf, ours = load_hf(tmp_path), load_model(tmp_path)
    ids = torch.randint(0, 300, (1, 20))
    with torch.inference_mode():
        torch.testing.assert_close(
            ours.forward_prefill(ids[0], [20]), hf(ids).logits[0], atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_bfloat16_runs_close_to_transformers(tiny_model_path, dtype):
    ours, hf = load_model(tiny_model_path, "bfloat16"), load_hf(tiny_model_path, dtype)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    prompt = random_prompts([24], 2048, seed=5)[0]
    with torch.inference_mode():
        a = ours.forward_prefill(torch.tensor(prompt), [24])
        b = hf(torch.tensor([prompt])).logits[0].float()
    # bf16 keeps ~3 significant digits; compare the distributions, not the bits.
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99
