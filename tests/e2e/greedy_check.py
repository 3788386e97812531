"""Comparing served greedy *text* with the single-process engine's tokens, near-ties allowed.

The API returns text, not token ids. Equal text passes. Otherwise the first reference token whose
text no longer continues ours is where the two diverged; that divergence passes only if it is a
near-tie in `transformers`' logits (`tests/parity.py`: vLLM's `check_logprobs_close` rule). After
an accepted divergence the rest is not compared (the contexts differ from then on).
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.tokenizer import Tokenizer
from tests.parity import GAP_TOLERANCE, load_hf


def assert_text_greedy_close(
    ours: str, prompt_ids: list[int], ref_ids: list[int], tokenizer: Tokenizer, model_path: Path
) -> None:
    if ours == tokenizer.decode(ref_ids):
        return
    diverged = next(
        (i for i in range(len(ref_ids)) if not ours.startswith(tokenizer.decode(ref_ids[: i + 1]))),
        len(ref_ids),
    )
    assert diverged < len(ref_ids), f"ours {ours!r} runs past the reference"
    hf = load_hf(model_path)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + ref_ids[:diverged]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < GAP_TOLERANCE, (
        f"text diverged at reference token {diverged} (ours {ours!r}, reference "
        f"{tokenizer.decode(ref_ids)!r}); reference top-2 gap {gap:.3g} is not a near-tie"
    )
