"""The `args:` of a PhaseMesh application in a serve config, validated at the YAML edge (pydantic):
`AppArgs`, with the in-process engine's (`EngineArgs`), the mesh's (`MeshArgs`) and Splitwise's
pools' (`PoolArgs`). `services/app.py` builds the deployments from them (and re-exports these
names); nothing here imports `ray.serve`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.config import env
from common.model.default import PRESETS, default_model_path
from common.roles import Role
from common.scheduling.cluster import PoolThresholds
from common.scheduling.tiers import tier_policy
from services.router.mesh_client import MAX_MIGRATIONS, PREFIX_ROUTING_WEIGHT


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineArgs(_Args):
    """The in-process engine's KV cache and batching (`topology: local`)."""

    num_blocks: int = Field(default=1024, ge=1)
    block_size: int = Field(default=16, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    max_preemptions: int = Field(default=2, ge=0)  # the mixed policy's preemption cap
    starvation_s: float = Field(default=1.0, ge=0)  # and its aging (common/scheduling/mixed.py)
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True  # docs/prefix_caching.md
    # Torch threads the engine decodes on; None: every core of the machine but one (the router
    # and Ray's proxy need it). Set here because Ray sets OMP_NUM_THREADS to the Router's num_cpus.
    num_threads: int | None = Field(default=None, ge=1)


class PoolArgs(_Args):
    """Splitwise's pools (docs/serving.md): when JSQ's best engine counts as full, so that an
    engine of the other pool is lent to the mixed pool, and how long a loan lasts unrenewed."""

    prompt_tokens: int = Field(default=8192, ge=1)  # a prompt engine's pending prompt tokens
    decode_tokens: int = Field(default=1 << 62, ge=0)  # a token engine's running decode tokens
    min_free_kv_tokens: int = Field(default=0, ge=0)  # KV left where the request would decode
    lease_s: float = Field(default=10.0, gt=0)  # a lent engine goes home this long unrenewed

    def thresholds(self) -> PoolThresholds:
        return PoolThresholds(
            prompt_tokens=self.prompt_tokens, decode_tokens=self.decode_tokens,
            min_free_kv_tokens=self.min_free_kv_tokens, role_lease_s=self.lease_s,
        )  # fmt: skip


class MeshArgs(_Args):
    """The mesh deployments (`topology: mesh`): KV sizes, batching, shard groups, sockets."""

    shards_per_group: int = Field(default=2, ge=0)  # shards per token engine; 0: local attention
    num_blocks: int = Field(default=512, ge=1)  # each engine's own KV
    shard_num_blocks: int = Field(default=1024, ge=1)  # each shard's KV (its heads only)
    block_size: int = Field(default=16, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    max_preemptions: int = Field(default=2, ge=0)  # the mixed policy's preemption cap
    starvation_s: float = Field(default=1.0, ge=0)  # and its aging (common/scheduling/mixed.py)
    layer_wise_min_tokens: int = Field(default=256, ge=1)
    attention_backend: str = "auto"
    num_threads: int = Field(default=1, ge=1)  # torch threads per replica
    # A token engine's torch threads (None: num_threads). It blocks on its shards once per layer,
    # so more threads pay only if they sleep meanwhile: its replica needs OMP_WAIT_POLICY=passive
    # and OMP_NUM_THREADS to match (its runtime_env, as deploy/local.yaml; docs/mesh.md).
    token_engine_threads: int | None = Field(default=None, ge=1)
    enable_prefix_caching: bool = True  # prompt and mixed engines; docs/prefix_caching.md
    # How prefill KV reaches shards: pushed while prefilling, or held by the prompt engine and
    # pulled by the shards between decode steps (docs/kv_pull.md).
    kv_transfer: Literal["push", "pull"] = "push"
    # How a shard group splits KV: by KV heads, or whole requests per shard (by KV bytes load).
    shard_partition: Literal["head", "request"] = "head"
    # `kv_transfer: pull`: what one prompt engine holds for shards to pull, in bytes.
    kv_hold_bytes: int = Field(default=1 << 30, ge=1)
    # Token engines' decode round trip (docs/mesh.md): q leaves for the shards before k/v are
    # computed (Lamina 4.2.2), and a step's sharded rows run as this many staggered sub-batches
    # (4.3; Lamina's n is 2 or 3; `auto`: one lane for the first steps, then the n their measured
    # breakdown prices best, common/scheduling/lane_choice.py). Both need `shard_partition: head`.
    attention_overlap: bool = False
    decode_lanes: int | Literal["auto"] = 1
    # Lamina 4.3 over model replicas: each token engine claims this many `ModelPeer` replicas
    # and rotates its lanes' layer slices over them (R = 1 + model_peers replicas; decode_lanes
    # R + 1 keeps each busy). The ModelPeer deployment needs token engines x model_peers
    # replicas. 0: none (no ModelPeer deployment). Needs shards, split by head.
    model_peers: int = Field(default=0, ge=0)
    # Neo's local KV tier beside a token engine's shards: its budget in blocks (0: none, all
    # decode KV on the shards) and who lives in it (`fill_local` or `alternate:<period>`).
    local_kv_blocks: int = Field(default=0, ge=0)
    tier_policy: str = ""
    # KV-aware routing: a prompt engine's pending tokens less this x the prompt's prefix it
    # caches; 0: plain JSQ (docs/prefix_caching.md).
    prefix_routing_weight: float = Field(default=PREFIX_ROUTING_WEIGHT, ge=0)
    host: str | None = None  # where sockets bind; None: this node's IP as Ray knows it
    shard_wait_s: float = Field(default=60.0, ge=0)  # a token engine waits this long for shards
    drain_s: float = Field(default=20.0, ge=0)  # an engine finishes its requests this long
    # Re-runs of one request on other replicas when its engines or shards die (token replay).
    max_migrations: int = Field(default=MAX_MIGRATIONS, ge=0)
    pools: PoolArgs = Field(default_factory=PoolArgs)
    # Signs the UCX hellos between engines and shards and keys the CURVE sockets (hex); None: the
    # application's registry holds one, drawn by its first replica, shared by every replica of
    # every later deploy (services/mesh/registry.py `agree_key`).
    key: str | None = Field(default=None, pattern=r"^([0-9a-f]{2}){16,}$")

    @field_validator("tier_policy")
    @classmethod
    def _known_tier_policy(cls, spec: str) -> str:
        tier_policy(spec)  # raises ValueError for an unknown one
        return spec

    @field_validator("decode_lanes")
    @classmethod
    def _some_lanes(cls, lanes: int | str) -> int | str:
        if lanes != "auto" and int(lanes) < 1:
            raise ValueError(f"decode_lanes must be at least 1 or auto, got {lanes}")
        return lanes

    def threads_of(self, role: Role) -> int:
        """Torch threads of a mesh replica of this role."""
        if role == Role.TOKEN and self.token_engine_threads is not None:
            return self.token_engine_threads
        return self.num_threads

    def worker_decode_lanes(self) -> int:
        """`WorkerConfig.decode_lanes`: 0 is auto."""
        return 0 if self.decode_lanes == "auto" else int(self.decode_lanes)

    @model_validator(mode="after")
    def _partition_fits_round_trip(self) -> MeshArgs:
        # NOTE: the workers refuse these too (WorkerConfig), but only once a replica starts.
        if self.shard_partition == "request" and (self.attention_overlap or self.decode_lanes != 1):
            raise ValueError(
                "shard_partition request runs without attention_overlap and with decode_lanes 1 "
                "(its round trip has one part and one lane)"
            )
        if self.model_peers and (self.shard_partition == "request" or not self.shards_per_group):
            raise ValueError(
                "model_peers rotate decode lanes over a head-split shard group: they need "
                "shards_per_group > 0 and shard_partition head"
            )
        if self.shard_partition == "request" and self.local_kv_blocks:
            raise ValueError(
                "local_kv_blocks is a tier beside head-split shards: shard_partition request "
                "has none"
            )
        return self


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
    engine: EngineArgs = Field(default_factory=EngineArgs)
    mesh: MeshArgs = Field(default_factory=MeshArgs)

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


__all__ = ["AppArgs", "EngineArgs", "MeshArgs", "PoolArgs"]
