"""Paged decode attention for engines on a GPU: batched, with no host synchronisation.

Every sequence's blocks are gathered through its block table in one indexing op per K and V
([N, Hkv, W * block_size, D], W the table's width), masked to its token range, and attended with
two batched matmuls and a float32 softmax. Its shapes depend on (N, W) alone and it reads nothing
back to the host, so a decode step that uses it can be captured in a CUDA graph
(`common/engine/decode_graphs.py`) at bucketed (N, W).

NOTE: not FlexAttention over the paged cache: FlexAttention (and torch's paged-attention helper
over it) reads K and V as [H, tokens, D] rows of one physical tensor, and this project's KV
layout (base.py: K transposed inside each block, heads inside blocks) is not such a view; a
second, device-only layout would have to be kept equal to it in every writer (KV ingress, prefix
prefill, swaps). The gather reads the batch's blocks twice (gather, then attend), which a
dedicated kernel would not; it is exact and runs on CPU and CUDA alike, so the CPU tests check
the paged logic against a float64 reference.
"""

from __future__ import annotations

import torch


class DevicePagedAttention:
    """`AttentionBackend` for device engines (and any engine: it is plain torch)."""

    name = "device_paged"

    def decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        token_starts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[3]
        group = num_heads // num_kv_heads
        width = block_tables.shape[1]
        span = width * block_size
        ids = block_tables.long()  # [N, W]
        # [N, W, Hkv, D, bs] -> [N, Hkv, W * bs, D]
        k = key_cache[ids].permute(0, 2, 1, 4, 3).reshape(num_seqs, num_kv_heads, span, head_dim)
        v = value_cache[ids].permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, span, head_dim)
        qg = q.view(num_seqs, num_kv_heads, group, head_dim).to(k.dtype)
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [N, Hkv, G, S]
        pos = torch.arange(span, device=q.device)
        valid = pos[None, :] < context_lens.to(q.device, torch.long)[:, None]  # [N, S]
        if token_starts is not None:
            valid &= pos[None, :] >= token_starts.to(q.device, torch.long)[:, None]
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        # Slots outside the range weigh 0, but 0 * inf is NaN: a reused block may hold what an
        # earlier request left there, so they are zeroed, not merely weighed 0.
        v = v.masked_fill(~valid[:, None, :, None], 0.0)
        lse = torch.logsumexp(scores, dim=-1)  # [N, Hkv, G]; -inf where the range is empty
        # An empty range's probabilities are NaN (-inf - -inf): zero, so its output is 0.
        probs = torch.nan_to_num(torch.exp(scores - lse.unsqueeze(-1)), nan=0.0)
        out = torch.matmul(probs.to(v.dtype), v).float()  # [N, Hkv, G, D]
        return out.reshape(num_seqs, num_heads, head_dim), lse.reshape(num_seqs, num_heads)


__all__ = ["DevicePagedAttention"]
