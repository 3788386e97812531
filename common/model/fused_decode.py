"""A decode step's decoder layers as one extension call (csrc/decoder_layer.cpp).

At batch 1 a step reads each weight once, and what it pays beyond those reads is per call: the
layer's separate calls (norm, QKV projection, RoPE, the k/v write, paged attention, and
`linear.post_attention`) and the Python between them are a share of a small model's step. Here
each layer's weights and KV caches are checked and held once (`FusedDecoderLayer`), a step's
shared inputs once per step (`DecodeStep`), and every layer runs in one `decode_layers` call:
each layer through the same C++ functions, in the same order and on the same thread counts as
the separate calls, so the outputs have their bits (tests/unit/test_fused_decode.py). Where the
LM head is on float32-output panels too (`FusedLmHead`), the same call ends with the final norm
and the LM head (`run_logits`): the logits have the bits of `compute_logits`.

It applies (`FusedDecode.build`, then `FusedDecode.takes` per step) to a local decode step of a
float32 model on the CPU: the kernel attention backend on float32 or bfloat16 KV caches (a
bfloat16 cache's new k/v rounded as `KVCache.write` rounds them), every projection
on the extension's panels (any weight dtype) with float32 outputs, at most
`POST_ATTENTION_MAX_ROWS` rows. Anything else (no extension or an older build, the torch
backend, oneDNN or unpacked weights, prefill, a larger step) runs the layers'
stages one by one, which stay the reference.

Faults: shapes, positions, slots and block ids are checked before anything is written, and a
bad one raises ValueError as the separate calls do (a slot or block id out of range would
otherwise write or read outside the caches); the k/v of layers before a failing block-id check
are written, as with the separate calls. A head without logits, logits of another shape, or a
head whose panels are not the LM head's shape raise ValueError before any layer runs (the
last at build: the step then takes `compute_logits` after the layers). Weights packed again
after `build` (a new `linear.pack_generation()`) make `current` False, and the runner builds
anew: the held arrays keep the old tensors alive meanwhile, so a stale object reads old
weights, never freed memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.dlpack import to_dlpack

from common.attention.cpu_kernel import CpuKernelAttention, extension
from common.kv_cache import KVCache
from common.model import linear
from common.model.linear import PANEL_WIDTH, POST_ATTENTION_MAX_ROWS, PackedLinear
from common.model.llama import LlamaDecoderLayer, LlamaForCausalLM

_EXT = extension()
_F32, _I32, _I64 = torch.float32, torch.int32, torch.int64


def available() -> bool:
    """True when this build of the extension has the fused layer."""
    return hasattr(_EXT, "decode_layers")


def _kv_dtypes() -> tuple[torch.dtype, ...]:
    """The KV cache dtypes this build's fused layers take (bfloat16 caches: each new k/v rounded
    as `KVCache.write` rounds it)."""
    return (_F32, torch.bfloat16) if getattr(_EXT, "fused_bfloat16_kv", False) else (_F32,)


def _on_float32_panels(*projections: PackedLinear) -> bool:
    for p in projections:
        if p.panels is None or p.out_dtype != _F32:
            return False
    return True


def _fused_head(model: LlamaForCausalLM) -> Any | None:
    """The extension's `FusedLmHead` (final norm and LM head), or None where it does not apply
    (the LM head off float32-output panels, a norm weight not float32) or this build lacks it."""
    norm, head = model.model.norm, model.lm_head
    if (
        not hasattr(_EXT, "FusedLmHead")
        or not _on_float32_panels(head)
        or norm.weight.dtype != _F32
        or not norm.weight.is_contiguous()
    ):
        return None
    scales = None if head.scales is None else to_dlpack(head.scales)
    try:
        return _EXT.FusedLmHead(
            to_dlpack(norm.weight.detach()), norm.eps, to_dlpack(head.panels), scales,  # type: ignore[arg-type]
            head.out_features,
        )  # fmt: skip
    except ValueError:  # panels of another shape than the head's: compute_logits after the layers
        return None


def _fused_layer(
    layer: LlamaDecoderLayer, key_cache: torch.Tensor, value_cache: torch.Tensor, isa: str
) -> Any | None:
    """The extension's `FusedDecoderLayer` of one layer, or None where it does not apply."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if (
        not _on_float32_panels(attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        or mlp.intermediate_size % PANEL_WIDTH
        or any(w.dtype != _F32 or not w.is_contiguous() for w in norms)
    ):
        return None

    def scales(p: PackedLinear) -> object:
        return None if p.scales is None else to_dlpack(p.scales)

    panels = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    qkv, o, gate_up, down = ((to_dlpack(p.panels), scales(p)) for p in panels)  # type: ignore[arg-type]
    return _EXT.FusedDecoderLayer(
        to_dlpack(norms[0].detach()), layer.input_layernorm.eps, *qkv,
        attn.num_heads, attn.num_kv_heads, *o,
        to_dlpack(norms[1].detach()), layer.post_attention_layernorm.eps, *gate_up, *down,
        to_dlpack(key_cache), to_dlpack(value_cache), isa,
    )  # fmt: skip


class FusedDecode:
    """One runner's decoder layers as the extension's fused layers, over its KV cache."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        layers: list[Any],
        backend: CpuKernelAttention,
        head: Any | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.layers = layers
        self.backend = backend
        self.head = head  # `FusedLmHead`, or None: the caller computes the logits
        self.generation = linear.pack_generation()
        rotary = model.model.rotary
        self.cos, self.sin = rotary.cos, rotary.sin

    @classmethod
    def build(
        cls, model: LlamaForCausalLM, kv_cache: KVCache, backend: object
    ) -> FusedDecode | None:
        """The fused layers of `model` over `kv_cache`, or None where any layer, the cache or
        the backend does not take them (module docstring)."""
        if (
            not available()
            or not isinstance(backend, CpuKernelAttention)
            or kv_cache.on_device
            or kv_cache.key.dtype not in _kv_dtypes()
            or model.model.rotary.cos.dtype != _F32
            or model.model.embed_tokens.weight.dtype != _F32
        ):
            return None
        layers = []
        for i, layer in enumerate(model.layers):
            fused = _fused_layer(
                layer, kv_cache.key_layers[i], kv_cache.value_layers[i], backend.isa
            )
            if fused is None:
                return None
            layers.append(fused)
        return cls(model, kv_cache, layers, backend, _fused_head(model))

    @property
    def greedy(self) -> bool:
        """Whether `run_greedy` applies: the LM head is fused, and this build has the call."""
        return self.head is not None and hasattr(_EXT, "decode_greedy")

    def current(self, kv_cache: KVCache) -> bool:
        """Whether these layers still hold what a step over `kv_cache` needs: False once any
        projection was packed again since `build`, or for another cache."""
        return self.generation == linear.pack_generation() and kv_cache is self.kv_cache

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether a decode step with hidden states x [T, hidden] runs fused."""
        return (
            x.dtype == _F32
            and x.dim() == 2
            and x.shape[0] <= POST_ATTENTION_MAX_ROWS
            and x.is_contiguous()
        )

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] (contiguous, overwritten) through every layer; returns it. One row per
        sequence: positions and slots [T] int64, block tables [T, max_blocks] and context
        lengths [T] int32 (the new token counted); other integer dtypes are converted. With
        `logits` [T, vocab] float32 (only where `head` is set), the same call then writes the
        LM head's logits of the final norm of x there (`compute_logits`' bits)."""
        step = _EXT.DecodeStep(
            to_dlpack(_dense(positions, _I64)), to_dlpack(self.cos), to_dlpack(self.sin),
            to_dlpack(_dense(slot_mapping, _I64)), to_dlpack(_dense(block_tables, _I32)),
            to_dlpack(_dense(context_lens, _I32)), self.model.scale,
        )  # fmt: skip
        threads = torch.get_num_threads()
        attention_threads = self.backend.num_threads or threads
        # NOTE: the head's arguments only when asked: a build without the head takes none.
        head = () if logits is None else (self.head, to_dlpack(logits))
        _EXT.decode_layers(
            self.backend.workspace, step, self.layers, to_dlpack(x), to_dlpack(x), threads,
            attention_threads, *head,
        )  # fmt: skip
        return x

    def run_logits(self, x: torch.Tensor, *step: torch.Tensor) -> torch.Tensor:
        """`run(x, *step)` with the final norm and the LM head in the same call: float32 logits
        [T, vocab]. Only where `head` is set."""
        assert self.head is not None, "no fused LM head: run(), then compute_logits"
        logits = torch.empty(x.shape[0], self.model.lm_head.out_features, dtype=_F32)
        self.run(x, *step, logits=logits)
        return logits

    def run_greedy(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Greedy decode steps in one call (only where `head` is set): token ids [S, T] int64,
        step s's row the argmax of its logits, the embedding of `token_ids` [T] feeding step 0
        and each step's tokens the next. Step s's positions, slots and context lengths are row s
        of `positions`, `slot_mapping` [S, T] and `context_lens` [S, T]; `block_tables` [T,
        max_blocks] holds every step's blocks. Each step is `run_logits` and the sampler's
        greedy argmax (numpy's: the first maximum, or the first NaN)."""
        assert self.head is not None, "no fused LM head: greedy steps need it"
        num_steps, rows = positions.shape
        steps = _EXT.DecodeSteps(
            to_dlpack(_dense(positions, _I64)), to_dlpack(self.cos), to_dlpack(self.sin),
            to_dlpack(_dense(slot_mapping, _I64)), to_dlpack(_dense(block_tables, _I32)),
            to_dlpack(_dense(context_lens, _I32)), self.model.scale,
        )  # fmt: skip
        hidden = self.model.model.embed_tokens.weight
        x = torch.empty(rows, hidden.shape[1], dtype=_F32)
        logits = torch.empty(rows, self.model.lm_head.out_features, dtype=_F32)
        tokens = torch.empty(num_steps, rows, dtype=_I64)
        threads = torch.get_num_threads()
        _EXT.decode_greedy(
            self.backend.workspace, steps, self.layers, self.head, to_dlpack(hidden.detach()),
            to_dlpack(_dense(token_ids, _I64)), to_dlpack(x), to_dlpack(logits),
            to_dlpack(tokens), threads, self.backend.num_threads or threads,
        )  # fmt: skip
        return tokens


def _dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous tensor of `dtype` (itself where it is one)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()
