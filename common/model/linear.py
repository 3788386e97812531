"""The model's projections, with their weights packed once at load.

`F.linear` runs the process's BLAS (MKL), which repacks the weight on every call, and the rows of
its calls of 10 rows or fewer are not bitwise the same rows of a larger call (it changes kernels
with the row count): a request's greedy tokens would depend on how many others share its step.
Two packed paths avoid both:

- float32 (the default): the csrc extension's GEMM (`csrc/linear_kernel.h`) on a weight packed
  into column panels. Every output is one FMA chain over the inputs in order, whatever the row
  count or thread split, so a row's result depends on that row alone by construction. Its call
  overhead is small (oneDNN through torch sets its primitive up again on every call), which at
  decode row counts makes it faster than both oneDNN and MKL (bench/engine.py prints the breakdown).
- bfloat16 and int8 weights (`weight_dtype`, below): the same GEMM on panels of bfloat16, or of
  int8 with one float32 scale per output channel (symmetric, max |w| / 127 of the channel,
  quantized here at pack time from the float32 or bfloat16 weight). The weight is widened to
  float32 in registers and activations stay float32 (nothing is rounded but the weight itself):
  at decode row counts a projection reads its weight once a step, so the bytes per weight set
  its time. Where the extension predates these panels (no `linear_weight_dtypes`), bfloat16
  takes oneDNN and int8 stays float32, each with a logged note.
- bfloat16 products (`set_matmul_precision("medium")`, or PHASEMESH_MATMUL_PRECISION=medium at
  load; the words are torch's `set_float32_matmul_precision`'s): the bfloat16 panels multiply x
  rounded to bfloat16, once per call and row, through `vdpbf16ps` where the CPU has AVX512_BF16
  (llama.cpp's BF16 and GPU servers compute so). From 8 rows on the tile is held by its
  multiplies, not by the weight's bytes, and each instruction then does twice the products. A
  row's bits still depend on that row alone; other CPUs run the same arithmetic as FMAs, the
  same bits. Process-wide, read by every call; float32 and int8 weights are not affected.
- bfloat16 without those panels, or float32 without the extension: oneDNN's matmul on a weight
  reordered once (the layout torch.compile's CPU freezing pass uses); its rows do not depend on
  the batch either.

The packed weight's dtype is `pack(weight_dtype=...)`'s: "float32", "bfloat16" or "int8" (the
loader's `weight_dtype`, or PHASEMESH_WEIGHT_DTYPE), by default the weight's own dtype. Outputs
are in the `weight` parameter's dtype (the model's), whatever the packed copy's.

`PackedLinear` is an `nn.Linear` (same `weight` parameter and state_dict name, so checkpoints,
`transformers`-style access and the loader's checks are unchanged) with a packed copy beside it,
made by `pack()` after the weights are final: a weight changed later must be packed again.
Without a packed copy (never packed, neither path available, a dtype neither takes, or
PHASEMESH_PACKED_WEIGHTS=0 at load) it is `F.linear`. The copy doubles the projections' memory.

`forward_rows(x, start, end)` is `forward`'s outputs start..end alone (Lamina's early q computes
the fused QKV's q rows before its k/v rows). The kernel runs a slice that starts on a panel
boundary on the fused panels themselves; any other slice, and any oneDNN slice (oneDNN cannot run
a column range of a packed weight), gets a packed copy of its own rows on first use (`pack_rows`,
`LlamaDecoderLayer.pack_halves` do it at start-up). Packing on first use keeps the memory off
every engine that never splits. A slice's outputs equal the fused ones to 1e-5, the contract
(the kernel's bitwise, by construction).

The kernel's calls split their panels over the extension's own worker pool (csrc/thread_pool.h:
workers awake through a step's calls, asleep when the engine idles, never waited for), and
`post_attention` runs a decode step's O projection, residual, norm and MLP as one call: at batch
1 a step reads each weight once, and what it pays beyond those reads is per call.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import structlog
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.dlpack import to_dlpack

from common.attention.cpu_kernel import extension
from common.model import layer_ops

log = structlog.get_logger(__name__)

_EXT = extension()
# Columns per weight panel of the extension's GEMM (0: no GEMM in this build).
PANEL_WIDTH: int = _EXT.linear_panel_width() if hasattr(_EXT, "linear_panel_width") else 0
# The panel dtypes this build's GEMM takes (an older build: float32 alone).
KERNEL_WEIGHT_DTYPES: tuple[str, ...] = (
    tuple(_EXT.linear_weight_dtypes())
    if hasattr(_EXT, "linear_weight_dtypes")
    else ("float32",) * (PANEL_WIDTH > 0)
)
WEIGHT_DTYPES = ("float32", "bfloat16", "int8")
_PANEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
_INT8_MAX = 127

# Which weight dtypes get a oneDNN copy: its float32 and bfloat16 matmuls.
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# Below this many rows, MKL's GEMM on the column-major weight beats oneDNN's fixed call cost
# (a single row is too little work to pay for it). The kernel's panels take every row count.
MIN_PACKED_ROWS = 2
_F32 = torch.float32


# How the GEMM multiplies bfloat16 weights (set_matmul_precision).
MATMUL_PRECISIONS = ("highest", "medium")


def set_matmul_precision(precision: str) -> None:
    """How every later projection on bfloat16 panels multiplies, process-wide: "highest" widens
    the weight to float32 and keeps x float32 (the default); "medium" rounds x to bfloat16 and
    multiplies in bfloat16 pairs (faster where the multiplies, not the weight's bytes, hold a
    call: 8 rows and more). Raises ValueError on another word, RuntimeError on "medium" with an
    extension that predates it."""
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"unknown matmul precision {precision!r}: {', '.join(MATMUL_PRECISIONS)}")
    if not hasattr(_EXT, "set_matmul_precision"):
        if precision != "highest":
            raise RuntimeError(
                "this build of the csrc extension has no bfloat16 products: `make kernel`"
            )
        return
    _EXT.set_matmul_precision(precision)


def get_matmul_precision() -> str:
    """The process's matmul precision for bfloat16 panels ("highest" or "medium")."""
    return _EXT.matmul_precision() if hasattr(_EXT, "matmul_precision") else "highest"


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """`set_matmul_precision(precision)` for the block, the previous one restored after."""
    previous = get_matmul_precision()
    set_matmul_precision(precision)
    try:
        yield
    finally:
        set_matmul_precision(previous)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def kernel_gemm_available(weight_dtype: str = "float32") -> bool:
    """True when the csrc extension's panel GEMM takes weights of `weight_dtype`."""
    return weight_dtype in KERNEL_WEIGHT_DTYPES


def pack_panels(weight: torch.Tensor, width: int = PANEL_WIDTH) -> torch.Tensor:
    """weight [out, in] -> panels [ceil(out / W), in, W] (W = `width`, the GEMM's panel width):
    panel p holds outputs p*W .. p*W+W-1 as [in][W] elements, the last one zero-padded.

    bfloat16 panels hold their rows in pairs: rows k and k + 1 (k even) as [W][2], each column's
    two weights side by side, and an odd `in`'s last row as it is. The kernel then widens two
    rows from one load with two plain ALU ops (linear_kernel.h), where a row alone takes a
    widening shuffle per vector, on the port the FMAs need; the FMA order, and so the bits, are
    the same."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // width)
    padded = weight.new_zeros(num_panels * width, in_features)
    padded[:out_features] = weight
    panels = padded.view(num_panels, width, in_features).transpose(1, 2).contiguous()
    if weight.dtype == torch.bfloat16:
        paired = in_features - in_features % 2
        pairs = panels[:, :paired].view(num_panels, paired // 2, 2, width).transpose(2, 3)
        panels[:, :paired] = pairs.contiguous().view(num_panels, paired, width)
    return panels


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q int8 [out, in], scales float32 [out]) with weight ~ q * scales[:,
    None]: symmetric per output channel, scale = max |w| / 127 (an all-zero channel: scale 1,
    q 0), round to nearest; the error of each weight is at most scale / 2."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / _INT8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scales


def _noted_fallback(weight_dtype: str, instead: str) -> None:
    """Log, once per process and dtype, that this build's GEMM lacks `weight_dtype` panels."""
    if weight_dtype not in _NOTED:
        _NOTED.add(weight_dtype)
        log.warning(
            "csrc extension has no panels of this weight dtype (rebuild: make kernel)",
            weight_dtype=weight_dtype, instead=instead,
        )  # fmt: skip


_NOTED: set[str] = set()


_PACKINGS = itertools.count(1)
_pack_generation = 0


def pack_generation() -> int:
    """A number that changes whenever any projection is packed or unpacked: what holds the
    packed tensors elsewhere (common/model/fused_decode.py) rebuilds when it does."""
    return _pack_generation


def _packed_anew() -> None:
    global _pack_generation
    _pack_generation = next(_PACKINGS)


class PackedLinear(nn.Linear):
    """A bias-free projection x @ weight.T, through a packed weight once `pack()` ran."""

    # NOTE: plain attributes, not buffers: a packed copy has no state_dict form of its own, and
    # nn.Module's __getattr__ (parameters, buffers) costs about a microsecond a lookup.
    panels: torch.Tensor | None = None  # the extension GEMM's column panels (float32/bf16/int8)
    scales: torch.Tensor | None = None  # int8 panels' per-column scales [num_panels * W]
    packed: torch.Tensor | None = None  # oneDNN's reordered weight
    dense: torch.Tensor | None = None  # `weight` itself, reachable without __getattr__
    rows_hint = 32
    weight_dtype = "float32"  # the packed copy's (pack's `weight_dtype`)
    out_dtype = _F32  # the outputs': the `weight` parameter's, set by pack()
    # Row slices (start, end) of the weight packed on their own by `forward_rows` (panels and
    # their scales, or a oneDNN weight, as the whole is); reset by `pack()` so that they follow
    # the weight.
    packed_rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def pack(
        self, rows_hint: int = 32, backend: str = "auto", weight_dtype: str | None = None
    ) -> None:
        """Pack the weight: the extension's panels where it is built and takes the weight dtype,
        else oneDNN (`rows_hint`: the row count oneDNN tunes its layout for; any row count runs).
        `weight_dtype` ("float32", "bfloat16", "int8"; None: the weight's own) is the packed
        copy's: the weight is cast, or quantized per output channel, once here. `backend`
        "kernel" or "onednn" asks for one path only (benchmarks compare them). A no-op where the
        asked path is missing or does not take the dtype."""
        if backend not in ("auto", "kernel", "onednn"):
            raise ValueError(f"unknown backend {backend!r}: auto, kernel or onednn")
        if weight_dtype is not None and weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"unknown weight dtype {weight_dtype!r}: {', '.join(WEIGHT_DTYPES)}")
        weight = self._unpacked(rows_hint)
        if self.bias is not None or weight.dtype not in _ONEDNN_DTYPES:
            return
        if weight_dtype is None:
            weight_dtype = "bfloat16" if weight.dtype == torch.bfloat16 else "float32"
        if backend != "onednn" and not kernel_gemm_available(weight_dtype):
            fallback = "bfloat16" if weight_dtype == "bfloat16" else "float32"
            if weight_dtype != "float32":
                _noted_fallback(weight_dtype, f"{fallback} weights, oneDNN or float32 panels")
            weight_dtype = fallback
        self.weight_dtype = weight_dtype
        if backend != "onednn" and kernel_gemm_available(weight_dtype):
            self.panels, self.scales = self._make_panels(weight)
        elif backend != "kernel" and onednn_available() and weight_dtype != "int8":
            packed_weight = weight.to(_PANEL_DTYPES[weight_dtype])
            self.packed = torch.ops.mkldnn._reorder_linear_weight(packed_weight, rows_hint)

    def _unpacked(self, rows_hint: int) -> torch.Tensor:
        """No packed copy yet, the weight as it is now; returns that weight. Every packing and
        adoption starts here, so the pack generation moves with each."""
        _packed_anew()
        weight = self.weight.detach()
        self.dense, self.rows_hint, self.packed_rows = weight, rows_hint, {}
        self.panels = self.scales = self.packed = None
        self.out_dtype = weight.dtype
        return weight

    def adopt_panels(
        self, weight_dtype: str, panels: torch.Tensor, scales: torch.Tensor | None
    ) -> None:
        """Take the kernel panels (and int8 scales) that `pack(weight_dtype=...)` made of this
        very weight before, instead of packing again: a weight cache's (weight_cache.py). The
        caller vouches that they are that weight's; the binding checks their shapes."""
        self._unpacked(PackedLinear.rows_hint)
        self.weight_dtype, self.panels, self.scales = weight_dtype, panels, scales

    def _make_panels(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Panels of `weight` [out, in] (all of it or a row slice) in the packed dtype, and the
        int8 panels' scales, zero-padded to the panels' columns."""
        if self.weight_dtype != "int8":
            return pack_panels(weight.to(_PANEL_DTYPES[self.weight_dtype])), None
        q, scales = quantize_int8(weight)
        panels = pack_panels(q)
        padded = scales.new_zeros(panels.shape[0] * panels.shape[2])
        padded[: scales.shape[0]] = scales
        return panels, padded

    @property
    def is_packed(self) -> bool:
        return self.panels is not None or self.packed is not None

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed weight a step reads (panels and scales, or oneDNN's copy; the
        dense weight where unpacked)."""
        if self.panels is not None:
            scales = 0 if self.scales is None else self.scales.nbytes
            return self.panels.nbytes + scales
        weight = self.packed if self.packed is not None else self.weight
        return weight.nelement() * weight.element_size()

    def unpack(self) -> None:
        """Back to F.linear: drop the packed copies (the row slices' too)."""
        _packed_anew()
        self.panels, self.scales, self.packed, self.packed_rows = None, None, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] (x may be any 2-D view)."""
        if self.panels is not None and x.dim() == 2:
            return _kernel_linear(
                x, self.panels, self.scales, 0, self.out_features, None, self.out_dtype
            )
        if self.packed is not None and x.dim() == 2 and x.shape[0] >= MIN_PACKED_ROWS:
            return _onednn_linear(x, self.packed, self.out_dtype)
        return F.linear(x, self.weight if self.dense is None else self.dense)

    def forward_rows(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """x [T, in] -> [T, end - start]: `forward(x)[:, start:end]` without the other rows' work.
        Packed where the whole weight is (a slice off a panel boundary, or any oneDNN slice,
        packed on its first call)."""
        if self.panels is not None and x.dim() == 2:
            if start % PANEL_WIDTH == 0 and 0 <= start < end <= self.out_features:
                first = start // PANEL_WIDTH
                return _kernel_linear(
                    x, self.panels, self.scales, first, end - start, None, self.out_dtype
                )
            panels, scales = self._packed_slice(start, end)
            return _kernel_linear(x, panels, scales, 0, end - start, None, self.out_dtype)
        if self.packed is not None and x.dim() == 2 and x.shape[0] >= MIN_PACKED_ROWS:
            return _onednn_linear(x, self._packed_slice(start, end)[0], self.out_dtype)
        return F.linear(x, (self.weight if self.dense is None else self.dense)[start:end])

    def pack_rows(self, start: int, end: int) -> None:
        """Pack the row slice `forward_rows(x, start, end)` runs on now rather than on its first
        call. A no-op where the whole weight is not packed, or where the kernel runs the slice on
        the whole weight's panels."""
        if self.panels is not None and start % PANEL_WIDTH == 0:
            return
        if self.is_packed:
            self._packed_slice(start, end)

    def _packed_slice(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.packed_rows is None:
            self.packed_rows = {}
        packed = self.packed_rows.get((start, end))
        if packed is None:
            if not 0 <= start < end <= self.out_features:
                raise ValueError(f"rows {start}:{end} outside a weight of {self.out_features}")
            rows = self.weight.detach()[start:end].contiguous()
            if self.panels is not None:
                packed = self._make_panels(rows)
            else:
                rows = rows.to(_PANEL_DTYPES[self.weight_dtype])
                packed = (torch.ops.mkldnn._reorder_linear_weight(rows, self.rows_hint), None)
            self.packed_rows[(start, end)] = packed
        return packed

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """A gate|up projection and the MLP's activation: silu(gate) * up [T, out / 2] of
        `forward(x)` = gate | up. Where the kernel's panels hold it and the halves split on a
        panel boundary, in one call: each thread activates the columns it just computed (no
        output crosses cores, no second call), the same values as the two steps."""
        inter = self.out_features // 2
        if (
            self.panels is not None
            and x.dim() == 2
            and self.out_features % 2 == 0
            and inter % PANEL_WIDTH == 0
        ):
            x_in = _kernel_input(x)
            gate_up = torch.empty(x_in.shape[0], self.out_features, dtype=_F32)
            act = torch.empty(x_in.shape[0], inter, dtype=_F32)
            _EXT.linear_silu_and_mul(
                to_dlpack(x_in), to_dlpack(self.panels), to_dlpack(gate_up), to_dlpack(act),
                torch.get_num_threads(), **_scales_arg(self.scales),
            )  # fmt: skip
            return act if self.out_dtype == _F32 else act.to(self.out_dtype)
        return layer_ops.silu_and_mul(self.forward(x))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ weight.T, the add fused into the matmul where packed."""
        if self.panels is not None and x.dim() == 2:
            if residual.dtype == _F32 and residual.shape == (x.shape[0], self.out_features):
                return _kernel_linear(
                    x, self.panels, self.scales, 0, self.out_features, residual, self.out_dtype
                )
        elif self.packed is not None and x.dim() == 2 and x.shape[0] >= MIN_PACKED_ROWS:
            if residual.dtype == self.packed.dtype and x.dtype == self.packed.dtype:
                return torch.ops.mkldnn._linear_pointwise.binary(
                    x, residual, self.packed, None, "add"
                )
        return residual + self.forward(x)


# Up to this many rows the decoder layer's post-attention half runs as one extension call (its
# intermediates in the calling thread's scratch, which grows with the rows): decode steps, where
# the Python between the separate calls is a share of the step; larger steps take the calls.
POST_ATTENTION_MAX_ROWS = 64


def post_attention(
    x: torch.Tensor,
    attn: torch.Tensor,
    o_proj: PackedLinear,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: PackedLinear,
    down: PackedLinear,
) -> torch.Tensor | None:
    """x + o, then its MLP (o = `o_proj(attn)`, the MLP `down(silu(gate) * up)` of the sum's
    RMSNorm) in one extension call with the bits of the separate ones, or None where it does not
    apply (the caller makes the calls): the three projections on the kernel's float32-output
    panels, x, attn and the norm float32 [T, H] / [T, in] / [H], T <= POST_ATTENTION_MAX_ROWS,
    and a build that has the call."""
    if (
        o_proj.panels is None
        or gate_up.panels is None
        or down.panels is None
        or not _HAS_POST_ATTENTION
        or x.dim() != 2
        or x.shape[0] > POST_ATTENTION_MAX_ROWS
        or x.dtype != _F32
        or attn.dtype != _F32
        or norm_weight.dtype != _F32
        or o_proj.out_dtype != _F32
        or down.in_features % PANEL_WIDTH
    ):
        return None
    out = torch.empty_like(x)
    _EXT.post_attention(
        to_dlpack(x.contiguous()), to_dlpack(attn.contiguous()), to_dlpack(o_proj.panels),
        _dlpack_or_none(o_proj.scales), to_dlpack(norm_weight), eps, to_dlpack(gate_up.panels),
        _dlpack_or_none(gate_up.scales), to_dlpack(down.panels), _dlpack_or_none(down.scales),
        to_dlpack(out), torch.get_num_threads(),
    )  # fmt: skip
    return out


_HAS_POST_ATTENTION = hasattr(_EXT, "post_attention")


def _dlpack_or_none(t: torch.Tensor | None) -> object:
    return None if t is None else to_dlpack(t)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """oneDNN's matmul on a reordered weight; x of another dtype is cast to the packed weight's,
    the output to `out_dtype`."""
    if x.dtype != packed.dtype:
        x = x.to(packed.dtype)
    out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _kernel_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    scales: torch.Tensor | None,
    panel_start: int,
    out_features: int,
    residual: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The extension's GEMM: x [T, in] -> [T, out_features] (+ residual), outputs from panel
    `panel_start` on, in `out_dtype` (the kernel computes in float32: x of another dtype is cast
    first, as oneDNN's path does). The binding checks every shape."""
    x_in = _kernel_input(x)
    out = torch.empty(x_in.shape[0], out_features, dtype=_F32)
    res = None if residual is None else to_dlpack(residual.contiguous())
    _EXT.linear(
        to_dlpack(x_in), to_dlpack(panels), to_dlpack(out), res, panel_start,
        torch.get_num_threads(), **_scales_arg(scales),
    )  # fmt: skip
    return out if out_dtype == _F32 else out.to(out_dtype)


def _scales_arg(scales: torch.Tensor | None) -> dict[str, object]:
    """The GEMM's `scales` keyword for int8 panels; none otherwise (a build that predates the
    low-precision panels takes no such keyword)."""
    return {} if scales is None else {"scales": to_dlpack(scales)}


def _kernel_input(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel takes it: float32 (another dtype is cast, as oneDNN's path does), rows
    contiguous."""
    if x.dtype != _F32:
        x = x.to(_F32)
    return x if x.is_contiguous() else x.contiguous()


def unpack_linears(module: nn.Module) -> None:
    """Drop every packed copy under `module`: back to F.linear (benchmarks compare the two)."""
    for sub in module.modules():
        if isinstance(sub, PackedLinear):
            sub.unpack()


def pack_linears(
    module: nn.Module, rows_hint: int = 32, backend: str = "auto", weight_dtype: str | None = None
) -> int:
    """Pack every `PackedLinear` under `module` (`backend` and `weight_dtype` as
    `PackedLinear.pack` takes them); return how many got a packed copy."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, PackedLinear):
            sub.pack(rows_hint, backend, weight_dtype)
            count += sub.is_packed
    return count


def packed_weight_bytes(module: nn.Module) -> int:
    """Bytes of projection weights one decode step reads: every `PackedLinear` under `module`
    (a tied head counted once, as the weight it packs)."""
    return sum(sub.packed_bytes for sub in module.modules() if isinstance(sub, PackedLinear))
