"""The fused layer ops (csrc/layer_ops.cpp) against float64 torch references, fresh inputs."""

from __future__ import annotations

import pytest
import torch

from common.model import layer_ops
from tests.kernel_gate import kernel_gate

pytestmark = kernel_gate("csrc extension not built")


def reference_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


# 13 and 5: rows off the kernel's 8 partial sums of squares (the tail goes to them too)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (32, 256), (7, 768), (3, 13), (2, 5)])
def test_rms_norm_and_add_rms_norm_match_float64(rows, hidden):
    x, y, w = torch.randn(rows, hidden) * 3, torch.randn(rows, hidden), torch.rand(hidden) + 0.5
    out = layer_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out.double(), reference_rms(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    total, normed = layer_ops.add_rms_norm(x, y, w, 1e-6)
    assert torch.equal(total, x + y)
    torch.testing.assert_close(normed.double(), reference_rms(x + y, w, 1e-6), rtol=1e-5, atol=1e-6)


def test_rotary_rotates_only_the_named_heads_in_place():
    tokens, heads, rotated, head_dim, max_pos = 5, 6, 4, 32, 64
    rows = torch.randn(tokens, heads * head_dim)
    positions = torch.randint(0, max_pos, (tokens,))
    angles = torch.rand(max_pos, head_dim // 2).double() * 6
    cos64 = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin64 = torch.cat([angles.sin(), angles.sin()], dim=-1)
    x = rows.double().view(tokens, heads, head_dim)
    half = head_dim // 2
    rotate_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    c, s = cos64[positions].unsqueeze(1), sin64[positions].unsqueeze(1)
    expected = torch.where(
        torch.arange(heads).view(1, heads, 1) < rotated, x * c + rotate_half * s, x
    )
    layer_ops.rotate_heads_(rows, rotated, head_dim, positions, cos64.float(), sin64.float())
    torch.testing.assert_close(rows.double().view_as(x), expected, rtol=1e-5, atol=1e-5)


def test_rotary_refuses_a_position_outside_the_tables():
    rows, table = torch.zeros(2, 64), torch.zeros(8, 32)
    with pytest.raises(ValueError, match="position 8 outside"):
        layer_ops.rotate_heads_(rows, 2, 32, torch.tensor([0, 8]), table, table)


def test_kv_write_of_strided_views_lands_in_the_paged_layout():
    from common.kv_cache import KVCache

    layers, blocks, block_size, heads, dim, tokens = 2, 9, 4, 2, 8, 7
    cache = KVCache(layers, blocks, block_size, heads, dim, torch.float32)
    qkv = torch.randn(tokens, (3 + 2 * heads) * dim)  # k and v as views of a fused row
    k = qkv[:, 3 * dim : (3 + heads) * dim].view(tokens, heads, dim)
    v = qkv[:, (3 + heads) * dim :].view(tokens, heads, dim)
    slots = torch.randperm(blocks * block_size)[:tokens]
    cache.write(1, k, v, slots)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(cache.key[1, block, :, :, offset], k[t])
        assert torch.equal(cache.value[1, block, :, offset, :], v[t])
    assert cache.key[0].abs().sum() == 0 and cache.value[0].abs().sum() == 0
    with pytest.raises(ValueError, match="slot 36 outside"):
        cache.write(0, k[:1], v[:1], torch.tensor([36]))


@pytest.mark.parametrize("rows, inter", [(1, 16), (32, 768), (3, 37)])
def test_silu_and_mul_matches_float64(rows, inter):
    x = torch.randn(rows, 2 * inter) * 4
    x[0, 0], x[0, 1] = -100.0, 100.0  # exp's saturation on both sides
    gate, up = x.double().chunk(2, dim=-1)
    expected = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(layer_ops.silu_and_mul(x).double(), expected, rtol=1e-5, atol=1e-6)
