"""Convert a Llama GGUF file (llama.cpp's format) into a Hugging Face folder PhaseMesh loads.

Reads with the `gguf` package alone: tensors are dequantized with its `dequantize` (Q4_1, Q8_0,
any type it knows) and renamed to Hugging Face's names; Q and K are un-permuted (llama.cpp's
converter interleaves each head's rotary halves, see `unpermute`); the tokenizer is rebuilt as a
byte-level BPE `tokenizer.json` from the vocabulary and merges in the metadata, with the chat
template in `tokenizer_config.json`. No lm_head in the file means tied embeddings.

`python -m common.model.gguf_convert FILE.gguf FOLDER [--dtype bfloat16]` converts one file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.constants import TokenType
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

DTYPES = ("float32", "bfloat16")

# llama.cpp's tensor names -> Hugging Face's ({} is the layer index).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# `tokenizer.ggml.pre` -> the pre-tokenizer llama.cpp applies for it (llama-vocab.cpp's regexes):
# SmolLM splits digits one by one before GPT-2's byte-level split.
_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
_PRE_TOKENIZERS = {
    "gpt-2": _BYTE_LEVEL,
    "default": _BYTE_LEVEL,
    "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _BYTE_LEVEL]),
}


class GGUFError(ValueError):
    """A GGUF file this converter cannot turn into a Llama folder."""


class GGUFModel:
    """One GGUF file's metadata and tensors, read lazily (numpy memory-maps the file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = GGUFReader(str(self.path))
        self.arch = self.field("general.architecture")
        if self.arch != "llama":
            raise GGUFError(f"{self.path}: architecture {self.arch!r}, only llama converts")

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value as plain Python (`default` when the file lacks it)."""
        f = self.reader.get_field(key)
        return default if f is None else f.contents()

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def tensors(self) -> Iterator[ReaderTensor]:
        return iter(self.reader.tensors)


def hf_config(gguf: GGUFModel, dtype: str) -> dict[str, Any]:
    """A Llama `config.json` from the GGUF's `llama.*` metadata."""
    hidden, heads = gguf.arch_field("embedding_length"), gguf.arch_field("attention.head_count")
    tied = not any(t.name == "output.weight" for t in gguf.tensors())
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": len(gguf.field("tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": gguf.arch_field("feed_forward_length"),
        "num_hidden_layers": gguf.arch_field("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": gguf.arch_field("attention.head_count_kv", heads),
        "head_dim": gguf.arch_field("rope.dimension_count", hidden // heads),
        "max_position_embeddings": gguf.arch_field("context_length"),
        # float32 metadata: 1e-5 arrives as 9.9999997e-06; round back to what was written.
        "rms_norm_eps": float(f"{gguf.arch_field('attention.layer_norm_rms_epsilon'):.6g}"),
        "rope_theta": float(gguf.arch_field("rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "bos_token_id": gguf.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf.field("tokenizer.ggml.eos_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }


def unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: its converter reorders each head's rows from Hugging
    Face's [first rotary half, second half] to interleaved pairs (GGML's rotary convention);
    PhaseMesh's rotary, like Hugging Face's, rotates halves."""
    rows = weight.shape[0]
    head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return head.swapaxes(1, 2).reshape(weight.shape)  # [rows, in]


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise GGUFError(f"tensor {gguf_name} has no Hugging Face Llama counterpart")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def hf_tensors(gguf: GGUFModel, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, un-permuted where needed, cast to the config's dtype,
    under its Hugging Face name."""
    dtype = getattr(torch, config["torch_dtype"])
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out: dict[str, torch.Tensor] = {}
    for t in gguf.tensors():
        # GGUF lists dims innermost first; numpy's (and torch's) order is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape))
        weight = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        kind = t.name.split(".")[-2]
        if t.name.startswith("blk.") and kind in heads:
            weight = unpermute(weight, heads[kind])
        out[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(weight)).to(dtype)
    return out


def gguf_tokenizer(gguf: GGUFModel) -> tuple[HFTokenizer, dict[str, Any]]:
    """The byte-level BPE tokenizer in the metadata, and its `tokenizer_config.json`."""
    if gguf.field("tokenizer.ggml.model") != "gpt2":
        raise GGUFError(f"{gguf.path}: only byte-level BPE (gpt2) tokenizers convert")
    pre = gguf.field("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"{gguf.path}: unknown pre-tokenizer {pre!r}")
    tokens: list[str] = gguf.field("tokenizer.ggml.tokens")
    types: list[int] = gguf.field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in gguf.field("tokenizer.ggml.merges")]
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]
    tok.decoder = decoders.ByteLevel()
    # Control tokens are special (never produced from text); user-defined ones are plain added.
    added = [
        AddedToken(t, special=kind == TokenType.CONTROL, normalized=False)
        for t, kind in zip(tokens, types, strict=True)
        if kind in (TokenType.CONTROL, TokenType.USER_DEFINED)
    ]
    tok.add_tokens(added)

    def named(key: str) -> str | None:
        token_id = gguf.field(f"tokenizer.ggml.{key}_token_id")
        return None if token_id is None else tokens[token_id]

    bos = named("bos")
    add_bos = bool(gguf.field("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        bos_id = tokens.index(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
        )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "model_max_length": gguf.arch_field("context_length"),
        "chat_template": gguf.field("tokenizer.chat_template"),
    }
    for key in ("bos", "eos", "unknown", "padding"):
        name = {"unknown": "unk", "padding": "pad"}.get(key, key)
        if (text := named(key)) is not None:
            config[f"{name}_token"] = text
    return tok, {k: v for k, v in config.items() if v is not None}


def convert_gguf(gguf_path: str | Path, folder: str | Path, dtype: str = "float32") -> Path:
    """Write `folder` (config, weights, tokenizer, chat template) from a Llama GGUF, atomically:
    a folder appears whole or not at all, and a concurrent writer's folder wins."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    folder = Path(folder)
    gguf = GGUFModel(gguf_path)
    config = hf_config(gguf, dtype)
    tokenizer, tokenizer_config = gguf_tokenizer(gguf)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file(hf_tensors(gguf, config), str(tmp / "model.safetensors"), {"format": "pt"})
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    try:
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "model.safetensors").is_file():
            raise
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description="Convert a Llama GGUF file to a HF folder.")
    parser.add_argument("gguf", type=Path)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    args = parser.parse_args()
    print(convert_gguf(args.gguf, args.folder, args.dtype))


if __name__ == "__main__":
    main()
