"""Configuration: frozen dataclasses checked in `__post_init__`, and the `PHASEMESH_` environment.

Pydantic lives only at the YAML/HTTP edge (services/app.py, services/router/openai_api.py);
everything inside the engine takes these plain dataclasses.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

ENV_PREFIX = "PHASEMESH_"


def env(name: str, default: str | None = None) -> str | None:
    """Read `PHASEMESH_<name>`: the one place environment variables are looked up."""
    return os.environ.get(ENV_PREFIX + name, default)


def cache_root() -> Path:
    """PhaseMesh's node-local cache (models, weight caches, downloads): PHASEMESH_CACHE, else
    ~/.cache/phasemesh."""
    return Path(env("CACHE") or Path.home() / ".cache" / "phasemesh")


def cache_dir(setting: str) -> Path | None:
    """`MeshOptions.weight_cache` as a directory: `auto` -> `<cache root>/weights`, `off` ->
    None, anything else is the directory itself."""
    if setting == "off":
        return None
    return cache_root() / "weights" if setting == "auto" else Path(setting)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """The Llama architecture hyper-parameters, read from a Hugging Face `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"model config: {name} must be positive, got {getattr(self, name)}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"model config: dtype must be float32 or bfloat16, got {self.dtype!r}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], dtype: str | None = None) -> ModelConfig:
        """Build from a parsed `config.json`; unknown keys are ignored, missing ones named."""
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"]
        required += ["num_attention_heads"]
        missing = [k for k in required if k not in raw]
        if missing:
            raise ValueError(f"config.json is missing {', '.join(missing)}")
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=dtype or _dtype_name(raw.get("torch_dtype") or raw.get("dtype")),
        )

    @classmethod
    def from_folder(cls, folder: str | Path, dtype: str | None = None) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        return cls.from_hf_dict(json.loads(path.read_text()), dtype)


def _rope_theta(raw: dict[str, Any]) -> float:
    # transformers >= 4.5x moved rope_theta into `rope_parameters`; accept both spellings.
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"config.json: unsupported rope_scaling type {kind!r} (supported: llama3)")
    return RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _dtype_name(raw: str | None) -> str:
    return "bfloat16" if raw == "bfloat16" else "float32"


KvCacheDtype = Literal["auto", "float32", "bfloat16"]  # CacheConfig.kv_cache_dtype
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: `num_blocks` blocks of `block_size` tokens per layer."""

    block_size: int = 16
    num_blocks: int = 1024
    # Reuse the K/V of full blocks of earlier prompts' shared prefixes (docs/prefix_caching.md).
    enable_prefix_caching: bool = True
    # The cache's element type (vLLM's `kv_cache_dtype`): `auto` is the model's; `bfloat16` under
    # a float32 model holds twice the tokens in the same bytes and halves decode attention's
    # reads, each k/v rounded to bfloat16 as it is written (CPU engines).
    kv_cache_dtype: KvCacheDtype = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")  # fmt: skip
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Machine-level batching (Splitwise §IV-B): prompt batches capped at 2048 tokens, and the
    mixed policy's preemption cap and aging (common/scheduling/mixed.py)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_preemptions: int = 2  # a request preempted this often is preempted only as a last resort
    starvation_s: float = 1.0  # a preempted request waiting this long goes before new prompts
    # Decode iterations one forward call may run for a batch of greedy rows while nothing else
    # waits (vLLM's `num_scheduler_steps`; `LLMEngine.step`): the per-step Python is paid once
    # for them, and a request's tokens come that many at a time.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if self.max_preemptions < 0 or self.starvation_s < 0:
            raise ValueError("max_preemptions and starvation_s must be >= 0")
        if self.num_scheduler_steps < 1:
            raise ValueError("num_scheduler_steps must be >= 1")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine process needs besides the weights."""

    model_path: str
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: str | None = None  # None: the checkpoint's own dtype
    attention_backend: str = "auto"  # auto | cpu_kernel | torch | device_paged
    device: str = "auto"  # auto | cpu | cuda[:N] (common/device.py)
    # Load-ready weights (common/model/weight_cache.py), as `MeshOptions.weight_cache`: auto,
    # off or a directory; off here: a single process has no second replica to share them with.
    weight_cache: str = "off"
