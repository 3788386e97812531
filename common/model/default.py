"""The default model: a seeded random Llama written in Hugging Face format on first use.

No weights can be downloaded on these machines, so PhaseMesh writes its own. The weights are
scaled so that layers matter (unit-variance projections) and logits are peaked (a wide LM head):
nearly flat logits would let float rounding flip greedy argmaxes in parity tests.

`python -m common.model.default [--preset tiny|small]` writes the model if missing and prints
its folder. `PHASEMESH_MODEL` points the whole project at another folder (a real checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from common.config import env
from common.tokenizer import BOS, EOS, EOT, LLAMA3_CHAT_TEMPLATE, build_byte_level_bpe

# A preset is a Llama shape, one row a preset: what it is for in its comment.
PRESET_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "max_position_embeddings")  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    name: dict(zip(PRESET_KEYS, shape, strict=True))
    for name, shape in {
        "tiny": (2048, 256, 768, 4, 8, 2, 4096),  # for a few CPU cores: 3.4 M parameters
        "small": (8192, 768, 2048, 12, 12, 4, 8192),  # for benchmarks: about 100 M parameters
    }.items()
}
FORMAT_VERSION = 1  # bump when the written folder changes, so caches are rebuilt


def cache_root() -> Path:
    return Path(env("CACHE") or Path.home() / ".cache" / "phasemesh")


def hf_config(preset: dict[str, Any], seed: int) -> dict[str, Any]:
    """A Llama `config.json` for a preset (any keys of `LlamaConfig` may be overridden)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": [2, 5],  # <|end_of_text|>, <|eot_id|>
        "torch_dtype": "float32",
        "attention_bias": False,
        "mlp_bias": False,
        "phasemesh_seed": seed,
    }
    return config | preset


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights under Hugging Face names: unit-variance projections, a peaked LM head."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) * (gain / in_f**0.5)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    weights = {"model.embed_tokens.weight": torch.randn(config["vocab_size"], h, generator=gen)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": linear(heads * d, h),
            p + "self_attn.k_proj.weight": linear(kv_heads * d, h),
            p + "self_attn.v_proj.weight": linear(kv_heads * d, h),
            p + "self_attn.o_proj.weight": linear(h, heads * d),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": linear(inter, h),
            p + "mlp.up_proj.weight": linear(inter, h),
            p + "mlp.down_proj.weight": linear(h, inter),
        }
    weights["model.norm.weight"] = norm()
    if not config.get("tie_word_embeddings"):
        # Logit std ~ 8: top-two gaps far above float32 rounding.
        weights["lm_head.weight"] = linear(config["vocab_size"], h, gain=8.0)
    return weights


def write_random_llama(folder: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Write config, weights, tokenizer and chat template to `folder` atomically."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
    tokenizer = build_byte_level_bpe(config["vocab_size"], seed)
    config = config | {
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": [tokenizer.token_to_id(EOS), tokenizer.token_to_id(EOT)],
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_weights(config, seed), str(tmp / "model.safetensors"), {"format": "pt"})
    tokenizer.save(str(tmp / "tokenizer.json"))
    tokenizer_config = {"bos_token": BOS, "eos_token": EOS, "chat_template": LLAMA3_CHAT_TEMPLATE}
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    try:
        os.rename(tmp, folder)  # atomic: a concurrent writer's folder wins, ours is dropped
    except OSError:
        if not (folder / "model.safetensors").is_file():
            raise
    return folder


def default_model_path(preset: str = "tiny", seed: int = 0) -> Path:
    """`PHASEMESH_MODEL` if set, else the cached random `preset` model, written on first use."""
    override = env("MODEL")
    if override:
        return Path(override)
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose from {', '.join(PRESETS)}")
    folder = cache_root() / "models" / f"random-llama-{preset}-s{seed}-v{FORMAT_VERSION}"
    if not (folder / "model.safetensors").is_file():
        write_random_llama(folder, hf_config(PRESETS[preset], seed), seed)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the default random model if missing.")
    parser.add_argument("--preset", default=env("MODEL_PRESET") or "tiny", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(default_model_path(args.preset, args.seed))


if __name__ == "__main__":
    main()
