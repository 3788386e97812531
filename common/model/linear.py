"""The model's projections, with their weights packed once for oneDNN.

`F.linear` runs the process's BLAS (MKL), which repacks the weight on every call. At decode
shapes (one to a few dozen rows against a few hundred thousand weights) that repacking is most of
the work, and on AMD CPUs MKL also leaves AVX-512 unused. oneDNN's matmul on a weight reordered
once at load (the layout torch.compile's CPU freezing pass uses) runs the tiny model's projections
2-2.9x faster at 8 and 32 rows on this machine's Zen 4 (bench/engine.py prints the breakdown).
Its result rows do not depend on the batch's other rows, as greedy parity across batch
compositions wants.

`PackedLinear` is an `nn.Linear` (same `weight` parameter and state_dict name, so checkpoints,
`transformers`-style access and the loader's checks are unchanged) with a packed copy beside it,
made by `pack()` after the weights are final: a weight changed later must be packed again.
Without a packed copy (never packed, oneDNN missing, a dtype it does not take, or
PHASEMESH_PACKED_WEIGHTS=0 at load) it is `F.linear`. The copy doubles the projections' memory.

`forward_rows(x, start, end)` is `forward`'s outputs start..end alone (Lamina's early q computes
the fused QKV's q rows before its k/v rows). A packed projection packs each row slice it is asked
for on first use, a copy of those rows beside the fused one: oneDNN cannot run a column range of
a packed weight, and `F.linear` on the slice (MKL, repacking every call) cost the early-q step
its packed speed-up. Packing on first use keeps the memory off every engine that never splits:
for attention_overlap that is one more copy of the QKV weights (`small`: 3.9 MB a layer, 47 MB
float32 in all), packed when the engine starts (`pack_rows`, `LlamaDecoderLayer.pack_halves`;
~0.1 s on `small`) or else on the first overlapped step. On this machine's oneDNN a slice's
outputs equal the fused ones bitwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Which weight dtypes get a packed copy: oneDNN's float32 and bfloat16 matmuls.
_PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Below this many rows, MKL's GEMM on the column-major weight beats oneDNN's fixed call cost
# (measured at 1 row: 64 vs 84 us for the tiny model's five projections on 2 threads).
# NOTE: not raised for Intel CPUs, where MKL runs AVX-512: on a 2-vCPU Xeon (Emerald Rapids,
# 2026-11-26) MKL ran four of the tiny model's five projections 1.2-2x faster than the packed
# weights at 8 rows (the LM head about even; oneDNN 1.2-1.6x faster at 32 rows), and there
# bench/engine.py's batch 8 stayed under 2x transformers (1.70-1.75). But MKL's rows from a call
# of 10 rows or fewer are not bitwise the same rows of a 40-row call, where oneDNN's are
# (test_a_row_does_not_depend_on_its_batch_mates): a request's greedy tokens would then depend
# on how many others share its step.
MIN_PACKED_ROWS = 2


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Linear):
    """A bias-free projection x @ weight.T, through a oneDNN-packed weight once `pack()` ran."""

    # NOTE: plain attributes, not buffers: an opaque oneDNN tensor has no state_dict form, and
    # nn.Module's __getattr__ (parameters, buffers) costs about a microsecond a lookup.
    packed: torch.Tensor | None = None
    dense: torch.Tensor | None = None  # `weight` itself, reachable without __getattr__
    rows_hint = 32
    # Row slices (start, end) of the weight packed on their own by `forward_rows`; reset by
    # `pack()` so that they follow the weight.
    packed_rows: dict[tuple[int, int], torch.Tensor] | None = None

    def pack(self, rows_hint: int = 32) -> None:
        """Reorder the weight for oneDNN (`rows_hint`: the row count to tune the layout for; any
        row count runs). A no-op where oneDNN or the dtype is not supported."""
        weight = self.weight.detach()
        self.dense, self.rows_hint, self.packed_rows = weight, rows_hint, {}
        if onednn_available() and weight.dtype in _PACKED_DTYPES and self.bias is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)

    def unpack(self) -> None:
        """Back to F.linear: drop the packed copies (the row slices' too)."""
        self.packed, self.packed_rows = None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] (x may be any 2-D view)."""
        if self.packed is not None and x.dim() == 2 and x.shape[0] >= MIN_PACKED_ROWS:
            if x.dtype != self.packed.dtype:
                x = x.to(self.packed.dtype)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight if self.dense is None else self.dense)

    def forward_rows(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """x [T, in] -> [T, end - start]: `forward(x)[:, start:end]` without the other rows' work.
        Packed where the whole weight is (the slice packed on its first call)."""
        if self.packed is not None and x.dim() == 2 and x.shape[0] >= MIN_PACKED_ROWS:
            packed = self._packed_slice(start, end)
            if x.dtype != packed.dtype:
                x = x.to(packed.dtype)
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return F.linear(x, (self.weight if self.dense is None else self.dense)[start:end])

    def pack_rows(self, start: int, end: int) -> None:
        """Pack the row slice `forward_rows(x, start, end)` runs on now rather than on its first
        call. A no-op where the whole weight is not packed."""
        if self.packed is not None:
            self._packed_slice(start, end)

    def _packed_slice(self, start: int, end: int) -> torch.Tensor:
        if self.packed_rows is None:
            self.packed_rows = {}
        packed = self.packed_rows.get((start, end))
        if packed is None:
            if not 0 <= start < end <= self.out_features:
                raise ValueError(f"rows {start}:{end} outside a weight of {self.out_features}")
            rows = self.weight.detach()[start:end].contiguous()
            packed = torch.ops.mkldnn._reorder_linear_weight(rows, self.rows_hint)
            self.packed_rows[(start, end)] = packed
        return packed

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ weight.T, the add fused into the matmul where packed."""
        if self.packed is not None and x.dim() == 2 and x.shape[0] >= MIN_PACKED_ROWS:
            if residual.dtype == self.packed.dtype and x.dtype == self.packed.dtype:
                return torch.ops.mkldnn._linear_pointwise.binary(
                    x, residual, self.packed, None, "add"
                )
        return residual + self.forward(x)


def unpack_linears(module: nn.Module) -> None:
    """Drop every packed copy under `module`: back to F.linear (benchmarks compare the two)."""
    for sub in module.modules():
        if isinstance(sub, PackedLinear):
            sub.unpack()


def pack_linears(module: nn.Module, rows_hint: int = 32) -> int:
    """Pack every `PackedLinear` under `module`; return how many got a oneDNN copy."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, PackedLinear):
            sub.pack(rows_hint)
            count += sub.packed is not None
    return count
