"""The pure-torch reference decode attention over the paged cache.

Correct everywhere and slow: it gathers each sequence's blocks into contiguous K/V. The C++
kernel (`cpu_kernel.py`) is the default; this backend is the fallback and the tests' oracle.
"""

from __future__ import annotations

import torch


class TorchPagedAttention:
    """`AttentionBackend` in plain torch, one sequence at a time."""

    name = "torch"

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
        out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float32)
        lse = torch.full((num_seqs, num_heads), float("-inf"), dtype=torch.float32)
        for i in range(num_seqs):
            start = 0 if token_starts is None else int(token_starts[i])
            end = int(context_lens[i])
            if end <= start:
                continue
            blocks = block_tables[i, : (end + block_size - 1) // block_size].long()
            k = key_cache[blocks].permute(1, 0, 3, 2).reshape(num_kv_heads, -1, head_dim)
            v = value_cache[blocks].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
            k, v = k[:, start:end].float(), v[:, start:end].float()  # [Hkv, L, D]
            qi = q[i].float().view(num_kv_heads, group, head_dim)  # [Hkv, G, D]
            scores = torch.matmul(qi, k.transpose(1, 2)) * scale  # [Hkv, G, L]
            lse_i = torch.logsumexp(scores, dim=-1)  # [Hkv, G]
            probs = torch.exp(scores - lse_i.unsqueeze(-1))
            out[i] = torch.matmul(probs, v).reshape(num_heads, head_dim)
            lse[i] = lse_i.reshape(num_heads)
        return out, lse
