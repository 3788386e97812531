"""A decoder layer's small elementwise steps, fused in C++ where the csrc extension is built.

At decode shapes every torch op costs microseconds of dispatch, and RMSNorm, RoPE and SwiGLU are
several ops each, paid per layer per step (bench/engine.py prints the step's breakdown). These
functions take the extension's one-pass versions for contiguous float32 tensors and fall back to
the torch formulas, which are the reference, for anything else (bfloat16, an unbuilt extension).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack

from common.attention.cpu_kernel import extension

_EXT = extension()
_F32 = torch.float32


def _fused(*tensors: torch.Tensor) -> bool:
    # NOTE: a plain loop, not all() over a generator: this runs several times per layer per step.
    if _EXT is None:
        return False
    for t in tensors:
        if t.dtype != _F32 or not t.is_contiguous():
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> x / rms(x) * weight (normalized in float32, as transformers does)."""
    if x.dim() == 2 and _fused(x, weight):
        out = torch.empty_like(x)
        _EXT.rms_norm(to_dlpack(x), to_dlpack(weight), to_dlpack(out), eps)
        return out
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: (x + y, rms_norm(x + y))."""
    if x.dim() == 2 and _fused(x, y, weight):
        total, normed = torch.empty_like(x), torch.empty_like(x)
        _EXT.add_rms_norm(
            to_dlpack(x), to_dlpack(y), to_dlpack(weight), to_dlpack(total), to_dlpack(normed), eps
        )
        return total, normed
    total = x + y
    return total, rms_norm(total, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate | up) -> silu(gate) * up [T, I]: the SwiGLU activation in one pass."""
    if x.dim() == 2 and _fused(x):
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        _EXT.silu_and_mul(to_dlpack(x), to_dlpack(out))
        return out
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_heads_(
    rows: torch.Tensor,
    num_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
) -> None:
    """Rotate, in place, the first `num_heads` heads of each row of `rows` [T, W] by its position
    (RoPE: x * cos + rotate_half(x) * sin, tables [max_pos, head_dim])."""
    if _fused(rows, cos_table, sin_table) and positions.dtype == torch.int64:
        _EXT.rotary(
            to_dlpack(rows), num_heads, head_dim, to_dlpack(positions.contiguous()),
            to_dlpack(cos_table), to_dlpack(sin_table),
        )  # fmt: skip
        return
    heads = rows[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    cos = cos_table[positions].unsqueeze(1).to(rows.dtype)  # [T, 1, head_dim]
    sin = sin_table[positions].unsqueeze(1).to(rows.dtype)
    half = head_dim // 2
    rotated_half = torch.cat([-heads[..., half:], heads[..., :half]], dim=-1)
    heads.copy_(heads * cos + rotated_half * sin)
