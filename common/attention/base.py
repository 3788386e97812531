"""The decode-attention interface every backend implements.

The engine, the attention shards and Neo's local/offloaded split all call decode attention through
`AttentionBackend.decode`. A backend returns `(out, lse)` so that partial results over disjoint
token ranges combine exactly (see `combine_partials`), and so head-sharded results simply
concatenate.

KV cache memory layout (one tensor pair per layer; the C++ kernel in csrc/ and the attention shards
read exactly this):

    key_cache[layer]   : [num_blocks, num_kv_heads, head_dim, block_size]  # K transposed
    value_cache[layer] : [num_blocks, num_kv_heads, block_size, head_dim]

Token `t` of a sequence lives in block `block_table[t // block_size]` at slot `t % block_size`.
K is stored `[head_dim][slot]` inside a block so that q·k over a block's slots is a sequence of
contiguous multiply-adds with no horizontal sums; V stays `[slot][head_dim]` so that the weighted
sum over slots streams whole rows. Each (block, kv_head) tile is contiguous, so a shard that owns a
range of KV heads owns whole tiles.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """Paged decode attention: one query token per sequence against that sequence's paged K/V."""

    name: str

    def decode(
        self,
        q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size]
        value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        context_lens: torch.Tensor,  # [num_seqs] int32: tokens [token_starts[i], context_lens[i])
        scale: float,
        token_starts: torch.Tensor | None = None,  # [num_seqs] int32, default all zeros
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `out [num_seqs, num_q_heads, head_dim]` float32 and `lse [num_seqs, num_q_heads]`
        float32 (natural log of the softmax denominator of the scaled scores). A sequence whose
        token range is empty gets `out = 0` and `lse = -inf`."""
        ...


def combine_partials(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly combine attention over two disjoint token ranges (flash-decoding's merge)."""
    lse = torch.logaddexp(lse1, lse2)  # [num_seqs, num_heads]
    # NOTE: where both sides are empty, lse is -inf and the weights would be NaN; zero them.
    w1 = torch.nan_to_num(torch.exp(lse1 - lse), nan=0.0).unsqueeze(-1)
    w2 = torch.nan_to_num(torch.exp(lse2 - lse), nan=0.0).unsqueeze(-1)
    return out1 * w1 + out2 * w2, lse
