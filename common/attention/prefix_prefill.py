"""Prefill attention for prompts that start after a cached prefix (docs/prefix_caching.md).

A sequence whose first `start` tokens are cached computes q/k/v for the rest only; its keys and
values for the whole context are then read back from the paged cache (where this step's were just
written), and each new query attends causally over them: query i sits at position start + i.
Correctness first: a gather per such sequence, as `KVCache.gather` does for KV transfer. A
sequence with nothing cached takes the fresh-prompt path unchanged, so a run without hits is the
very same computation as without prefix caching.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model.llama import causal_attention


def gather_context(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `num_tokens` keys and values from one layer's paged cache, as
    [num_tokens, Hkv, D] each. Layout: key [blocks, Hkv, D, bs], value [blocks, Hkv, bs, D]."""
    block_size = key_cache.shape[-1]
    ids = block_table[: -(-num_tokens // block_size)].long()
    num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[2]
    k = key_cache[ids].permute(0, 3, 1, 2).reshape(-1, num_kv_heads, head_dim)  # [n*bs, Hkv, D]
    v = value_cache[ids].permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)  # [n*bs, Hkv, D]
    return k[:num_tokens], v[:num_tokens]


def prefix_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    inputs_seq_lens: list[int],
    starts: list[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens -> out [T, Hq, D]. `starts[i]`: cached
    tokens before sequence i's new ones; its context must be in the cache already (written).
    A cache of a narrower dtype than k/v (a bfloat16 KV cache under a float32 model): this
    step's k/v are attended to as the cache holds them, rounded, as every decode step and every
    prefix hit reads them, so a prompt prefilled again (a recompute, a replayed request)
    continues as it did."""
    if key_cache.element_size() < k.element_size():
        k, v = k.to(key_cache.dtype).to(k.dtype), v.to(value_cache.dtype).to(v.dtype)
    if not any(starts):
        return causal_attention(q, k, v, inputs_seq_lens, scale)
    out = torch.empty_like(q)
    begin = 0
    for i, (seq_len, start) in enumerate(zip(inputs_seq_lens, starts, strict=True)):
        end = begin + seq_len
        if start == 0:
            out[begin:end] = causal_attention(
                q[begin:end], k[begin:end], v[begin:end], [seq_len], scale
            )
        else:
            ks, vs = gather_context(key_cache, value_cache, block_tables[i], start + seq_len)
            # Query j (position start + j) sees keys 0 .. start + j.
            mask = torch.ones(seq_len, start + seq_len, dtype=torch.bool, device=q.device)
            mask = mask.tril(diagonal=start)
            o = F.scaled_dot_product_attention(
                q[begin:end].transpose(0, 1), ks.to(q.dtype).transpose(0, 1),
                vs.to(q.dtype).transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True,
            )  # fmt: skip
            out[begin:end] = o.transpose(0, 1)  # [L, Hq, D]
        begin = end
    return out


def with_cached_prefixes(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: list[int],
    starts: list[int],
    block_tables: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """This step's k/v [T, Hkv, D] widened to each sequence's whole context (its cached prefix
    read back from the cache), with the new per-sequence lengths: what a prompt engine ships, since
    the receiver holds none of the prefix. Unchanged when nothing was cached."""
    if not any(starts):
        return k, v, seq_lens
    ks, vs = [], []
    begin = 0
    for i, (seq_len, start) in enumerate(zip(seq_lens, starts, strict=True)):
        if start:
            k_ctx, v_ctx = gather_context(key_cache, value_cache, block_tables[i], start + seq_len)
            ks.append(k_ctx.to(k.dtype))
            vs.append(v_ctx.to(v.dtype))
        else:
            ks.append(k[begin : begin + seq_len])
            vs.append(v[begin : begin + seq_len])
        begin += seq_len
    lens = [s + n for s, n in zip(starts, seq_lens, strict=True)]
    return torch.cat(ks), torch.cat(vs), lens
