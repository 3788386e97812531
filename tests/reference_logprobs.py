"""Reference log probabilities straight from the model: log_softmax of a full-sequence forward
(`LlamaForCausalLM.forward_prefill`), with no engine, cache or sampler involved."""

from __future__ import annotations

import torch

from common.model.llama import LlamaForCausalLM

# How far a served log probability may sit from this reference. The mesh computes in float32 along
# other paths than one full-sequence prefill: a prompt engine's prefill that may start from cached
# prefix blocks, then decode steps whose attention is split across shards and merged; each sums in
# another order, so the logits differ in their last bits and a log probability by some 1e-4. A wrong
# token, position or distribution moves it by orders of magnitude more.
MESH_LOGPROB_ATOL = 1e-3


@torch.inference_mode()
def sequence_logprobs(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """[T, vocab]: row i is the model's log-distribution of token i + 1 given tokens 0..i."""
    logits = model.forward_prefill(torch.tensor(token_ids), [len(token_ids)])
    return torch.log_softmax(logits.double(), dim=-1)


def expected_token_logprobs(
    model: LlamaForCausalLM, prompt_ids: list[int], output_ids: list[int], num_top: int
) -> list[tuple[float, list[int], list[float]]]:
    """Per output token: (its logprob, the top `num_top` ids, their logprobs)."""
    table = sequence_logprobs(model, prompt_ids + output_ids)
    rows = []
    for i, token_id in enumerate(output_ids):
        row = table[len(prompt_ids) - 1 + i]
        top = row.topk(num_top)
        rows.append((float(row[token_id]), top.indices.tolist(), top.values.tolist()))
    return rows
