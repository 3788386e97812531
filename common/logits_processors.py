"""The logits processors of OpenAI's and vLLM's sampling parameters, batched over rows.

Each takes the logits of the rows that use a processor ([R, vocab] float32, changed in place or
returned) and the rows' parameters, and does one tensor op per processor for the whole batch,
never a Python loop over the vocabulary. The formulas are vLLM's (`vllm/model_executor/layers/
utils.py` `apply_penalties`, v1's `min_p` and `logit_bias`), which are OpenAI's for the penalties:

- `logit_bias`: logit[id] += bias.
- `allowed_token_ids` (vLLM): every other token's logit is -inf.
- `bad_words` (vLLM, as token sequences): a sequence's last token is -inf wherever the output so
  far ends with the tokens before it (a one-token word: always).
- `repetition_penalty` (HF/vLLM), over prompt and output tokens: a seen token's logit is divided
  by the penalty when positive, multiplied by it when not.
- `frequency_penalty`, `presence_penalty` (OpenAI), over output tokens only:
  logit -= frequency * count + presence * (count > 0).
- `min_p`: drop tokens whose probability (after temperature) is below min_p * the top one's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.sampling_params import SamplingParams

# A request's tokens so far, as the engines keep them: (prompt ids, output ids).
History = tuple[Sequence[int], Sequence[int]]


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """logits [R, vocab] += each row's bias: one sparse (row, id, value) index_put."""
    rows = [r for r, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return
    ids = [token_id for p in params for token_id, _ in p.logit_bias]
    values = [bias for p in params for _, bias in p.logit_bias]
    d = logits.device  # where the logits are: the CPU, or a device engine's GPU
    index = (torch.tensor(rows, device=d), torch.tensor(ids, device=d))
    logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=d), accumulate=True)


def apply_allowed_tokens(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """logits [R, vocab]: rows with `allowed_token_ids` keep those ids' logits, the rest -inf."""
    rows = [r for r, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return
    d = logits.device
    keep = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=d)  # [A, vocab]
    row_index = [k for k, r in enumerate(rows) for _ in params[r].allowed_token_ids]
    ids = [t for r in rows for t in params[r].allowed_token_ids]
    keep[torch.tensor(row_index, device=d), torch.tensor(ids, device=d)] = True
    index = torch.tensor(rows, device=d)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))


def apply_bad_words(
    logits: torch.Tensor, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]]
) -> None:
    """logits [R, vocab]: each row's banned next tokens (its `bad_words` whose prefix ends its
    output `outputs[r]`) to -inf. A word is a few tokens: plain Python, no vocabulary loop."""
    rows: list[int] = []
    ids: list[int] = []
    for r, p in enumerate(params):
        for word in p.bad_words:
            prefix = word[:-1]
            if not prefix or tuple(outputs[r][-len(prefix) :]) == prefix:
                rows.append(r)
                ids.append(word[-1])
    if rows:
        d = logits.device
        logits[torch.tensor(rows, device=d), torch.tensor(ids, device=d)] = float("-inf")


def token_counts(
    token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> torch.Tensor:
    """[R, vocab] counts of each row's ids: one scatter_add over the ids padded with `vocab_size`
    (a column past the vocabulary, dropped after)."""
    width = max(max((len(ids) for ids in token_ids), default=0), 1)
    # NOTE: one tensor built from padded lists: a copy per row costs a torch call each.
    padded = torch.tensor([[*ids, *[vocab_size] * (width - len(ids))] for ids in token_ids],
                          dtype=torch.long, device=device)  # fmt: skip
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=dtype, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=dtype))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[History]
) -> torch.Tensor:
    """The repetition, frequency and presence penalties of every row at once ([R, vocab])."""
    num_rows, vocab_size = logits.shape
    d = logits.device
    output_counts = token_counts([h[1] for h in histories], vocab_size, logits.dtype, d)
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=d)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = output_counts > 0
        seen |= token_counts([h[0] for h in histories], vocab_size, logits.dtype, d) > 0
        penalty = torch.where(seen, repetition[:, None], 1.0)  # [R, vocab]
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=d)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=d)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).to(logits.dtype)


def min_p_mask(
    logits: torch.Tensor, min_p: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """[R, vocab] True where a token falls below min_p * the top probability at the row's
    temperature (those tokens are dropped before top-k/top-p)."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)  # [R, vocab]
    return probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
