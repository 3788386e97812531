"""Load a Hugging Face Llama folder (`config.json`, `*.safetensors`, `tokenizer.json`).

Tensors are read by their Hugging Face names, checked against the shapes the config implies, and
fused on the way in (gpt-fast's load hook): q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`.
Projection weights are then stored column-major (see `column_major`) and get a packed copy (the
extension's GEMM panels, oneDNN's layout where those are missing: `common.model.linear`), in the
weight dtype asked for (`weight_dtype`, else PHASEMESH_WEIGHT_DTYPE: float32, bfloat16, or int8
with per-output-channel scales; by default the model's dtype; another value fails the load,
naming the choices). PHASEMESH_MATMUL_PRECISION=medium makes bfloat16 panels multiply
bfloat16-rounded activations, process-wide (`common.model.linear.set_matmul_precision`). Errors
name the folder and the missing or mismatched tensor. With a `weight_cache` directory, the ready
model's bytes are written once and mapped by later loads (`common/model/weight_cache.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open

from common.config import ModelConfig, env
from common.model.linear import PackedLinear, pack_linears, set_matmul_precision
from common.model.llama import LlamaForCausalLM
from common.model.weight_cache import cache_key as weight_cache_key
from common.model.weight_cache import load_or_build

log = structlog.get_logger(__name__)

# Present in some checkpoints, derived rather than learned: safe to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A model folder whose tensors do not match its config."""


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor names and shapes a Llama checkpoint with this config holds."""
    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        }
    return shapes


def _weight_files(folder: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it (one file or a sharded index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {folder}")
    names: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names |= {name: path for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    return names


def _read_tensors(folder: Path, files: dict[str, Path]) -> Iterator[tuple[str, torch.Tensor]]:
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for name, path in files.items():
            if not path.is_file():
                raise CheckpointError(f"{folder}: tensor {name} points to missing file {path.name}")
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            yield name, handles[path].get_tensor(name)


def load_hf_state(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Read and check every tensor; return them by Hugging Face name, in the config's dtype."""
    expected = expected_shapes(config)
    dtype = getattr(torch, config.dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in _read_tensors(folder, _weight_files(folder)):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints still store the head; the embedding wins
        if name not in expected:
            raise CheckpointError(f"{folder}: unexpected tensor {name} for this config.json")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"{folder}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"config.json implies {expected[name]}"
            )
        tensors[name] = tensor.to(dtype)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{folder}: missing tensor {', '.join(missing[:3])}{more}")
    return tensors


def fuse_projections(hf: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to PhaseMesh's fused modules."""
    fused = dict(hf)
    for i in range(num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        parts = [fused.pop(a + f"{p}_proj.weight") for p in "qkv"]
        fused[a + "qkv_proj.weight"] = torch.cat(parts, dim=0)
        gate, up = fused.pop(m + "gate_proj.weight"), fused.pop(m + "up_proj.weight")
        fused[m + "gate_up_proj.weight"] = torch.cat([gate, up], dim=0)
    return fused


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix, its storage laid out as [in, out] (so `weight.t()` is contiguous).

    NOTE: `F.linear(x, w)` computes x @ w.T. With w row-major, MKL runs a transposed-B GEMM, which
    at decode shapes (a few dozen rows) and more than one thread is several times slower than the
    plain GEMM it runs when w.T is contiguous (on one thread the two are about even). Same values,
    same memory, same state_dict names: only the strides move.
    """
    return weight.t().contiguous().t()


def load_model(
    folder: str | Path,
    dtype: str | None = None,
    weight_dtype: str | None = None,
    device: torch.device | None = None,
    weight_cache: Path | None = None,
) -> LlamaForCausalLM:
    """Build a `LlamaForCausalLM` from a Hugging Face folder, ready for inference. `dtype`: the
    model's (activations' and stored weights'); `weight_dtype`: the projections' packed copy's
    (None: PHASEMESH_WEIGHT_DTYPE, else the model's). `device`: where it computes (None: the
    CPU); on a GPU, bfloat16 unless `dtype` says otherwise, and plain `F.linear` (no packing:
    the packed copies are the CPU GEMM's). `weight_cache`: a directory of load-ready weights on
    the CPU (`weight_cache.py`: the first load writes them, later ones map them; the same bytes
    either way); None: none."""
    folder = Path(folder)
    if device is not None and device.type != "cpu":
        return load_for_device(folder, dtype, device)
    weight_dtype = weight_dtype or env("WEIGHT_DTYPE") or None
    if precision := env("MATMUL_PRECISION"):
        set_matmul_precision(precision)
    if weight_cache is None:
        return build_model(folder, dtype, weight_dtype)
    config = ModelConfig.from_folder(folder, dtype)
    key = weight_cache_key(folder, config, weight_dtype, env("PACKED_WEIGHTS", "1") != "0")
    return load_or_build(
        weight_cache, folder, key, lambda: build_model(folder, dtype, weight_dtype)
    )


def build_model(folder: Path, dtype: str | None, weight_dtype: str | None) -> LlamaForCausalLM:
    """`load_model` on the CPU from the checkpoint itself: read, fuse, lay out, pack."""
    config = ModelConfig.from_folder(folder, dtype)
    state = fuse_projections(load_hf_state(folder, config), config.num_hidden_layers)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Tied heads share the embedding's storage; load_state_dict(assign=True) keeps that tie.
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for name in [n for n in state if n.endswith("_proj.weight") or n == "lm_head.weight"]:
        if name != "lm_head.weight" or not config.tie_word_embeddings:  # the embedding gathers rows
            state[name] = column_major(state[name])
    model.load_state_dict(state, strict=True, assign=True)
    # Last: the packed copies must see the final weights. They double the projections' memory:
    # PHASEMESH_PACKED_WEIGHTS=0 keeps one copy (plain F.linear, slower at decode shapes).
    if env("PACKED_WEIGHTS", "1") != "0":
        pack_linears(model, weight_dtype=weight_dtype)
    log.info(
        "model loaded", folder=str(folder), layers=config.num_hidden_layers, dtype=config.dtype,
        weight_dtype=weight_dtype or config.dtype,
    )  # fmt: skip
    return model.eval().requires_grad_(False)


def load_for_device(
    folder: str | Path, dtype: str | None, device: torch.device
) -> LlamaForCausalLM:
    """`load_model` on a GPU: the checkpoint in bfloat16, row-major, moved to `device` whole (the
    RoPE tables too). On the CPU it is the GPU engine's numerics (unpacked bfloat16 `F.linear`,
    the torch layer ops), which the CPU tests check against transformers.

    NOTE: bfloat16 only: the fused layer ops and the KV write take their C++ paths for float32
    tensors without looking at the device (a check per op would cost the CPU engine's steps), so
    a float32 model on a GPU would hand device memory to CPU code."""
    if dtype not in (None, "bfloat16"):
        raise ValueError(f"a model on {device} runs in bfloat16, not {dtype}")
    folder = Path(folder)
    config = ModelConfig.from_folder(folder, "bfloat16")
    state = fuse_projections(load_hf_state(folder, config), config.num_hidden_layers)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device)
    for sub in model.modules():
        if isinstance(sub, PackedLinear):
            sub.dense = sub.weight.detach()  # F.linear on it, reached without __getattr__
    log.info("model loaded", folder=str(folder), layers=config.num_hidden_layers,
             dtype=config.dtype, device=str(device))  # fmt: skip
    return model.eval().requires_grad_(False)
