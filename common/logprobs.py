"""Log probabilities for the API's `logprobs`: of the model's raw distribution.

NOTE: like vLLM's default (`logprobs_mode="raw_logprobs"`), these are log_softmax of the model's
logits, before logit_bias, penalties, temperature or any cut: what the model thinks of a token,
whatever the request's sampling parameters did with it. best_of ranks its candidates by their sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.protocol import TokenLogprobs


def token_logprobs(
    logits: torch.Tensor, chosen_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """logits [R, vocab] -> per row the chosen id's logprob, its rank (1: the most likely) and
    the `num_top[row]` best ones."""
    if not chosen_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, vocab]
    chosen = torch.tensor(list(chosen_ids), dtype=torch.long, device=logits.device)[:, None]
    chosen_col = logprobs.gather(1, chosen)  # [R, 1]
    chosen_lps = chosen_col[:, 0].tolist()
    ranks = ((logprobs > chosen_col).sum(dim=-1) + 1).tolist()
    k = min(max(num_top, default=0), logprobs.shape[-1])
    top_ids: list[list[int]] = [[] for _ in chosen_lps]
    top_lps: list[list[float]] = [[] for _ in chosen_lps]
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprobs(lp, tuple(top_ids[r][:n]), tuple(top_lps[r][:n]), ranks[r])
        for r, (lp, n) in enumerate(zip(chosen_lps, num_top, strict=True))
    ]
