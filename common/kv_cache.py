"""The paged KV cache tensors of one process (an engine's local KV, or a shard's heads).

The layout is defined once, in `common/attention/base.py`: per layer,
key_cache [num_blocks, num_kv_heads, head_dim, block_size] and
value_cache [num_blocks, num_kv_heads, block_size, head_dim].
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack

from common.attention.cpu_kernel import extension
from common.host_memory import huge_page_zeros

_EXT = extension()


class KVCache:
    """Preallocated, pre-touched K/V pools for every layer, written through slot mappings."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        """`device`: where the pools live (an engine's device; None: the CPU)."""
        self.block_size = block_size
        self.device = device or torch.device("cpu")
        self.on_device = self.device.type != "cpu"
        key_shape = (num_layers, num_blocks, num_kv_heads, head_dim, block_size)
        value_shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        # NOTE: every page is touched now (a first touch mid-decode would stall its step); on the
        # CPU on huge pages, where the kernel walks tiles in block-table order (host_memory.py).
        if self.on_device:
            self.key = torch.zeros(key_shape, dtype=dtype, device=self.device)
            self.value = torch.zeros(value_shape, dtype=dtype, device=self.device)
        else:
            self.key = huge_page_zeros(key_shape, dtype)
            self.value = huge_page_zeros(value_shape, dtype)
        # Each layer's views, made once: indexing a 5-D tensor costs a microsecond or so, paid
        # several times per layer per step otherwise.
        self.key_layers: list[torch.Tensor] = list(self.key.unbind(0))
        self.value_layers: list[torch.Tensor] = list(self.value.unbind(0))

    @property
    def num_bytes(self) -> int:
        return 2 * self.key.numel() * self.key.element_size()

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store k/v [T, num_kv_heads, head_dim] at flat slots [T] of `layer`."""
        key, value = self.key_layers[layer], self.value_layers[layer]
        if (
            _EXT is not None
            and key.dtype == k.dtype == v.dtype == torch.float32
            and slot_mapping.dtype == torch.int64
        ):
            # One C++ pass (csrc/kv_write.cpp) instead of two advanced-index assignments.
            _EXT.write_kv(
                to_dlpack(key), to_dlpack(value), to_dlpack(k), to_dlpack(v),
                to_dlpack(slot_mapping.contiguous()),
            )  # fmt: skip
            return
        if self.on_device:  # KV landing from the host (or its own k/v, already there)
            slot_mapping, k, v = (t.to(self.device) for t in (slot_mapping, k, v))
        blocks, offsets = slot_mapping // self.block_size, slot_mapping % self.block_size
        # Advanced indices around a slice put the token dim first: [T, num_kv_heads, head_dim].
        self.key[layer, blocks, :, :, offsets] = k.to(self.key.dtype)
        self.value[layer, blocks, :, offsets, :] = v.to(self.value.dtype)

    def gather(
        self, layer: int, block_table: list[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read one request's k/v back as [num_tokens, num_kv_heads, head_dim] (for KV transfer)."""
        ids = torch.tensor(block_table, dtype=torch.long, device=self.device)
        num_kv_heads, head_dim = self.key.shape[2], self.key.shape[3]
        k = self.key[layer, ids].permute(0, 3, 1, 2)  # [n, block_size, Hkv, D]
        v = self.value[layer, ids].permute(0, 2, 1, 3)  # [n, block_size, Hkv, D]
        k = k.reshape(-1, num_kv_heads, head_dim)[:num_tokens]
        return k, v.reshape(-1, num_kv_heads, head_dim)[:num_tokens]
