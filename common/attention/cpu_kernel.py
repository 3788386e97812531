"""The C++ paged decode-attention kernel (csrc/) as an `AttentionBackend`.

The extension `phasemesh_attention_kernel` is a torch-free nanobind module built by
`pip install --no-build-isolation ./csrc` (see csrc/pyproject.toml for why). It takes tensors
through DLPack, so torch tensors pass in without copies. When it is not built, `kernel_available()`
is False and `common.attention.select_backend` falls back to the torch reference.

What the kernel adds over the interface in `base.py`:
- `out`/`lse` may be preallocated and are then written in place (no per-step allocation);
- `kv_head_start`/`kv_head_end` restrict the call to a range of KV heads: only those heads' query
  rows of `out`/`lse` are written, so head shards can fill one shared output;
- `num_threads` (default `torch.get_num_threads()`) threads split the work by (sequence, KV head,
  context chunk) and merge the chunks exactly by log-sum-exp. The threads are the extension's own
  pool, shared with the projections' GEMM (csrc/thread_pool.h): they spin `pool_spin_us()` after a
  call, then sleep, and a call never waits for a worker that is asleep or off its core;
- the flash-decoding scratch lives in the backend object and is reused across calls.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
from torch.utils.dlpack import to_dlpack

_ISAS = ("auto", "avx512", "avx2", "avx2_w16", "generic")


def _load_extension() -> ModuleType | None:
    try:
        return importlib.import_module("phasemesh_attention_kernel")
    except ImportError:
        return None


_EXTENSION = _load_extension()


def extension() -> Any:
    """The compiled module (it also holds the fused layer ops and the projections' GEMM), or None
    when it is not built."""
    return _EXTENSION


def kernel_available() -> bool:
    """True when the compiled kernel can be imported."""
    return _EXTENSION is not None


def supported_isas() -> list[str]:
    """The kernel ISAs this CPU runs, best first; empty when the kernel is not built."""
    return list(_EXTENSION.supported_isas()) if _EXTENSION is not None else []


def prefetch_target() -> str | None:
    """The cache level, `l1` or `l2`, the kernel prefetches K/V tiles into on this CPU's cores;
    None when the kernel is not built."""
    return _EXTENSION.attention_prefetch_target() if _EXTENSION is not None else None


class CpuKernelAttention:
    """Paged decode attention on CPU through the csrc kernel (float32/bfloat16 K/V, GQA).

    Thread-safe: concurrent calls on one instance are serialized (they share scratch); the GIL
    is released while the kernel runs.
    """

    name = "cpu_kernel"

    def __init__(self, num_threads: int | None = None, isa: str = "auto") -> None:
        if _EXTENSION is None:
            raise RuntimeError(
                "the csrc kernel is not built: pip install --no-build-isolation ./csrc"
            )
        if isa not in _ISAS:
            raise ValueError(f"isa must be one of {_ISAS}, got {isa!r}")
        self.num_threads = num_threads
        self.isa = isa
        self._kernel: Any = _EXTENSION.PagedDecodeKernel()

    @property
    def workspace(self) -> Any:
        """The extension's kernel object with this backend's scratch (the fused decoder layer,
        common/model/fused_decode.py, runs its attention on it)."""
        return self._kernel

    def decode(
        self,
        q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim] float32 or bfloat16
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size]
        value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        context_lens: torch.Tensor,  # [num_seqs] int32
        scale: float,
        token_starts: torch.Tensor | None = None,  # [num_seqs] int32
        *,
        out: torch.Tensor | None = None,  # [num_seqs, num_q_heads, head_dim] float32
        lse: torch.Tensor | None = None,  # [num_seqs, num_q_heads] float32
        kv_head_start: int = 0,
        kv_head_end: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend one query token per sequence to its tokens `[token_starts[i], context_lens[i])`.

        Returns `(out, lse)` as in `AttentionBackend.decode`; an empty token range gives out 0 and
        lse -inf. K/V caches must be contiguous and share one dtype. Rows of query heads outside
        `[kv_head_start, kv_head_end)` are left untouched (uninitialized when `out` is new).
        Raises ValueError on shapes, dtypes, lengths or block ids the caches cannot hold.
        """
        num_seqs, num_q_heads, head_dim = q.shape
        if out is None:
            out = torch.empty(num_seqs, num_q_heads, head_dim, dtype=torch.float32)
        if lse is None:
            lse = torch.empty(num_seqs, num_q_heads, dtype=torch.float32)
        threads = self.num_threads if self.num_threads is not None else torch.get_num_threads()
        # NOTE: DLPack capsules, not the tensors: nanobind would call Tensor.__dlpack__, a Python
        # method costing several times what to_dlpack, the C entry point, costs per tensor.
        self._kernel.decode(
            to_dlpack(q.contiguous()),
            to_dlpack(key_cache),
            to_dlpack(value_cache),
            to_dlpack(_as_int32(block_tables)),
            to_dlpack(_as_int32(context_lens)),
            None if token_starts is None else to_dlpack(_as_int32(token_starts)),
            to_dlpack(out),
            to_dlpack(lse),
            float(scale),
            kv_head_start,
            -1 if kv_head_end is None else kv_head_end,
            threads,
            self.isa,
        )
        return out, lse


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()
