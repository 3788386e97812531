"""Greedy-output comparison with vLLM's `check_logprobs_close` tolerance.

Two correct implementations may pick different argmaxes where the top two logits are within
float rounding of each other. A divergence passes only if the reference's gap between its top two
logits at that position is under `GAP_TOLERANCE`; after an accepted divergence the rest of the
sequence is not compared (the contexts differ from then on).
"""

from __future__ import annotations

import os

import torch

GAP_TOLERANCE = 1e-4


def load_hf(path, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    """`transformers`' own LlamaForCausalLM on the same folder, set never to stop at EOS."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Reference greedy tokens from `transformers` generate, never stopping at EOS."""
    out = hf_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=num_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def assert_greedy_close(hf_model, prompt: list[int], ours: list[int], ref: list[int]) -> None:  # type: ignore[no-untyped-def]
    assert len(ours) == len(ref), f"lengths differ: {len(ours)} vs {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a == b:
            continue
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + ref[:i]])).logits[0, -1].float()
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < GAP_TOLERANCE, (
            f"token {i}: ours {a}, reference {b}; reference top-2 gap {gap:.3g} is not a near-tie"
        )
        return


def assert_outputs_greedy_close(
    model_path: str | os.PathLike[str],
    prompts: list[list[int]],
    ours: list[list[int]],
    reference: list[list[int]],
) -> None:
    """Every output equals its reference, or diverges only at a near-tie (`assert_greedy_close`);
    `transformers` is loaded only when one differs."""
    mismatched = [i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b]
    if mismatched:  # float ties across a different batch split may flip a token
        hf = load_hf(model_path)
        for i in mismatched:
            assert_greedy_close(hf, prompts[i], ours[i], reference[i])
