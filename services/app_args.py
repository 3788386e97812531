"""The `args:` of a PhaseMesh application in a serve config, validated at the YAML edge (pydantic):
`AppArgs`, with the in-process engine's (`EngineArgs`) and the mesh's (`MeshOptions`,
common/mesh_options.py, the one type every mesh worker receives). `services/app.py` builds the
deployments from them (and re-exports these names); nothing here imports `ray.serve`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer

from common.config import KvCacheDtype, env
from common.mesh_options import DEVICE_PATTERN, MeshOptions, mesh_options
from common.model.default import PRESETS, default_model_path
from services.offline.options import OfflineOptions


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class EngineArgs(_Args):
    """The in-process engine's KV cache and batching (`topology: local`)."""

    num_blocks: int = Field(default=1024, ge=1)
    block_size: int = Field(default=16, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    max_preemptions: int = Field(default=2, ge=0)  # the mixed policy's preemption cap
    starvation_s: float = Field(default=1.0, ge=0)  # and its aging (common/scheduling/mixed.py)
    # Greedy decode iterations per engine call while nothing else waits (vLLM's name; docs/
    # serving.md#decode-steps-per-call): tokens then stream that many at a time.
    num_scheduler_steps: int = Field(default=1, ge=1)
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True  # docs/prefix_caching.md
    # The KV cache's dtype: auto (the model's), float32 or bfloat16 (docs/serving.md#the-kv-cache).
    kv_cache_dtype: KvCacheDtype = "auto"
    # Where the engine computes (common/device.py): auto (CUDA when the Router's replica sees a
    # GPU: give it `num_gpus` in its ray_actor_options), cpu, cuda or cuda:N.
    device: str = Field(default="auto", pattern=DEVICE_PATTERN)
    # Torch threads the engine decodes on; None: every core of the machine but one (the router
    # and Ray's proxy need it). Set here because Ray sets OMP_NUM_THREADS to the Router's num_cpus.
    num_threads: int | None = Field(default=None, ge=1)


def offline_options(raw: object) -> OfflineOptions | None:
    if raw is None or isinstance(raw, OfflineOptions):
        return raw
    try:
        return msgspec.convert(raw, OfflineOptions)
    except msgspec.ValidationError as exc:
        raise ValueError(f"offline options: {exc}") from exc


OfflineField = Annotated[
    OfflineOptions | None,
    BeforeValidator(offline_options),
    PlainSerializer(lambda v: None if v is None else msgspec.to_builtins(v)),
]


# The mesh's options, validated here by `mesh_options` (a bad value is a pydantic error naming
# `mesh` and the field at fault) and dumped as plain builtins: `build_app` binds the dump.
MeshField = Annotated[
    MeshOptions,
    BeforeValidator(mesh_options),
    PlainSerializer(msgspec.to_builtins, return_type=dict),
]


class AppArgs(_Args):
    """The `args:` of a PhaseMesh application in a serve config."""

    model: str = "tiny"  # a preset of the random default model, or a model folder
    served_model_name: str | None = None  # the `model` clients send; default: `model`'s name
    topology: Literal["local", "mesh"] = "local"
    # The context one request may use (prompt + output), at most the model's; None: the model's.
    max_model_len: int | None = Field(default=None, ge=1)
    # Clients must send `Authorization: Bearer <key>` (401 otherwise; /health stays open). None:
    # $PHASEMESH_API_KEY on the router's node, else the API is open (the local demo's default).
    api_key: str | None = None
    require_api_key: bool = False  # refuse to start a router without a key (clusters)
    # Tokens per streamed chunk (vLLM's and SGLang's `stream_interval`; the first token and a
    # request's end always go at once), and a cap on how long a token is held (0: none); 1 and
    # 0: one chunk per engine step. `services.router.streams.StreamInterval`.
    stream_interval: int = Field(default=1, ge=1)
    stream_interval_s: float = Field(default=0.0, ge=0)
    # The Batch API's state (files, batches, each line's outcome): a path is an SQLite file each
    # Router replica opens itself (one node, or a shared volume); `ray:<path>` is that file on
    # the Ray head node's disk behind one named actor every Router of the cluster reaches
    # (services/router/ray_batch_store.py); None: no Batch API.
    batch_store: str | None = "~/.cache/phasemesh/batches.sqlite"
    # Seesaw's offline group behind the Batch API (its own deployment; services/offline/); None:
    # batches run through the online API only.
    offline: OfflineField = None
    # The router's GET /metrics: series named `vllm:...` (vLLM's names: its dashboards read
    # them unchanged) or `phasemesh:...` (docs/observability.md). Ray's agent and OTLP keep
    # `phasemesh_...` either way.
    metrics_names: Literal["vllm", "phasemesh"] = "vllm"
    # An unknown request body field is a 400 naming it; false: ignored, logged once per name and
    # listed back in the response's X-Ignored-Fields header (services/router/request_fields.py).
    strict_fields: bool = False
    engine: EngineArgs = Field(default_factory=EngineArgs)
    mesh: MeshField = Field(default_factory=MeshOptions)

    def model_path(self) -> Path:
        return default_model_path(self.model) if self.model in PRESETS else Path(self.model)

    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def resolved_api_key(self) -> str | None:
        """The key clients must send, read where the router runs; raises if one is required and
        none is set."""
        key = self.api_key or env("API_KEY") or None
        if key is None and self.require_api_key:
            raise ValueError(
                "require_api_key is set but no API key is: set PHASEMESH_API_KEY in the router's "
                "environment (runtime_env env_vars) or `api_key` in the app's args"
            )
        return key


__all__ = ["AppArgs", "EngineArgs", "MeshField"]
