"""The Ray Serve application: thin deployments around the plain service classes.

The only module that imports `ray.serve`. `build_app(args)` is the application builder named by
`import_path: services.app:build_app` in `deploy/*.yaml`; `args` is validated by `AppArgs`.

Topologies (`args.topology`):
- `local`: the `Router` deployment holds an `InProcessEngineClient` (one mixed engine, in-process).
  Complete and testable on one machine.
- `mesh`: `Router` plus `PromptEngine`, `TokenEngine` and `AttentionShard` deployments (and
  `ModelPeer` with `mesh.model_peers` > 0: Lamina 4.3's rotation over model replicas), each
  replica running its worker on a thread (`services.mesh.replica`) and registering its sockets in
  the application's registry actor (`services.mesh.registry`). The router's `MeshEngineClient`
  reaches the engines over ZeroMQ; the data path never goes through Ray. Scaling a deployment
  (`num_replicas` in a `serve deploy`) adds or removes replicas from routing without
  restarting the others.

Admission bounds are `user_config` on the Router deployment (`max_num_requests`,
`max_pending_prompt_tokens`), so `serve deploy` of an edited value applies without a restart.

Every replica configures telemetry for its process (exporter from `PHASEMESH_OTEL_EXPORTER`,
default none) and structlog; its metrics also go to Ray's metrics agent (docs/observability.md).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Literal

import ray
import structlog
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.serve import Application

from common.config import env
from common.engine.core import LLMEngine
from common.model.default import PRESETS, default_model_path
from common.roles import Role
from common.scheduling.cluster import PoolThresholds
from common.scheduling.tiers import tier_policy
from common.telemetry import Metrics, configure_logging, configure_telemetry
from common.transport.zmq_auth import CurveKeys
from common.worker_config import WorkerConfig
from services.mesh.registry import RayRegistry
from services.mesh.replica import (
    MeshReplica,
    base_worker_config,
    replace_cfg,
    start_engine,
    start_model_peer,
    start_shard,
)
from services.router.engine_client import EngineClient, InProcessEngineClient, machine_threads
from services.router.mesh_client import MAX_MIGRATIONS, PREFIX_ROUTING_WEIGHT, MeshEngineClient
from services.router.server import Router
from services.router.streams import AdmissionLimits, StreamInterval

log = structlog.get_logger(__name__)

# Every deployment name a serve config may override; the mesh ones are bound by `topology: mesh`,
# and the model peers' only with `mesh.model_peers` > 0.
DEPLOYMENT_NAMES = ("Router", "PromptEngine", "TokenEngine", "AttentionShard")
MODEL_PEER_DEPLOYMENT = "ModelPeer"


def deployment_names(topology: str, model_peers: int = 0) -> tuple[str, ...]:
    """The deployments `build_app` binds for a topology: what a serve config may name."""
    if topology != "mesh":
        return ("Router",)
    return DEPLOYMENT_NAMES + ((MODEL_PEER_DEPLOYMENT,) if model_peers else ())


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
    # Signs the UCX hellos between engines and shards (hex); None: `build_app` draws one per
    # deploy, which every replica of the application shares.
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


def _make_client(args: AppArgs, replica_id: str) -> EngineClient:
    if args.topology == "local":
        e = args.engine
        engine = LLMEngine.from_path(
            args.model_path(),
            num_blocks=e.num_blocks,
            block_size=e.block_size,
            max_num_batched_tokens=e.max_num_batched_tokens,
            max_num_seqs=e.max_num_seqs,
            attention_backend=e.attention_backend,
            enable_prefix_caching=e.enable_prefix_caching,
            max_preemptions=e.max_preemptions,
            starvation_s=e.starvation_s,
        )
        return InProcessEngineClient(engine, num_threads=e.num_threads or machine_threads())
    registry = RayRegistry.for_app(serve.get_replica_context().app_name)
    return MeshEngineClient(
        args.model_path(),
        registry.live,
        auth=CurveKeys.from_mesh_key(args.mesh.key or ""),
        host=_bind_host(args.mesh),
        block_size=args.mesh.block_size,
        max_migrations=args.mesh.max_migrations,
        prefix_routing_weight=args.mesh.prefix_routing_weight,
        pool_thresholds=args.mesh.pools.thresholds(),
        metrics=Metrics(model_name=args.model_name(), engine=replica_id),
    )


def _bind_host(mesh: MeshArgs) -> str:
    return mesh.host or ray.util.get_node_ip_address()


def _worker_config(args: AppArgs) -> WorkerConfig:
    m = args.mesh
    return base_worker_config(
        str(args.model_path()), _bind_host(m), block_size=m.block_size, num_blocks=m.num_blocks,
        max_num_batched_tokens=m.max_num_batched_tokens, max_num_seqs=m.max_num_seqs,
        max_preemptions=m.max_preemptions, starvation_s=m.starvation_s,
        layer_wise_min_tokens=m.layer_wise_min_tokens, attention_backend=m.attention_backend,
        num_threads=m.num_threads, shard_num_blocks=m.shard_num_blocks,
        enable_prefix_caching=m.enable_prefix_caching, served_model_name=args.model_name(),
        mesh_key=m.key or "", kv_transfer=m.kv_transfer, shard_partition=m.shard_partition,
        kv_hold_bytes=m.kv_hold_bytes, attention_overlap=m.attention_overlap,
        decode_lanes=m.worker_decode_lanes(), local_kv_blocks=m.local_kv_blocks,
        tier_policy=m.tier_policy,
    )  # fmt: skip


def _service_id(role: str) -> str:
    return f"{role}-{serve.get_replica_context().replica_id.unique_id}"


def _configure_observability(service_name: str, service_id: str) -> None:
    """Once per replica process: OpenTelemetry (exporter from the environment) and structlog."""
    configure_telemetry(service_name, instance_id=service_id)
    configure_logging()


@serve.deployment(name="Router", max_ongoing_requests=512, health_check_period_s=5)
@serve.ingress()
class RouterDeployment:
    """HTTP ingress: `services.router.server.Router` over the configured engine client."""

    def __init__(self, args: dict[str, Any], *mesh_services: Any) -> None:
        # `mesh_services`: handles of the mesh deployments, bound only so that they belong to this
        # application; the router finds their replicas through the registry, not through Serve.
        self.args = AppArgs.model_validate(args)
        replica_id = _service_id("router")
        _configure_observability("router", replica_id)
        self.client = _make_client(self.args, replica_id)
        self.client.streams.interval = StreamInterval(
            self.args.stream_interval, self.args.stream_interval_s
        )
        self.router = Router(
            self.client, self.args.model_path(), self.args.model_name(), replica_id,
            max_model_len=self.args.max_model_len, api_key=self.args.resolved_api_key(),
        )  # fmt: skip
        log.info("router ready", model=self.router.model_name, topology=self.args.topology)

    def __serve_build_asgi_app__(self) -> Any:
        return self.router.app

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply `user_config` (admission bounds) in place, without restarting the replica."""
        self.client.streams.limits = AdmissionLimits(**user_config)
        log.info("admission limits", **user_config)

    def check_health(self) -> None:
        # NOTE: the mesh router's own threads, not the engines': engines that are still starting
        # make /health say 503, but must not get the router restarted.
        if not self.client.alive():
            raise RuntimeError("the router's engine client stopped")

    def __del__(self) -> None:
        client = getattr(self, "client", None)  # absent if the constructor failed
        if client is not None:
            client.shutdown()


class _MeshService:
    """A mesh replica (engine or shard) under Serve: start, health, drain on shutdown."""

    role = Role.MIXED  # set by each deployment

    def __init__(self, args: dict[str, Any]) -> None:
        parsed = AppArgs.model_validate(args)
        self.drain_s = parsed.mesh.drain_s
        registry = RayRegistry.for_app(serve.get_replica_context().app_name)
        base, mesh = _worker_config(parsed), parsed.mesh
        service_id = _service_id(self.role)
        _configure_observability(replace_cfg(base, role=self.role).telemetry_name, service_id)
        if self.role == Role.SHARD:
            self.replica: MeshReplica = start_shard(
                service_id, registry, base, mesh.shards_per_group
            )
        elif self.role == Role.MODEL_PEER:
            self.replica = start_model_peer(service_id, registry, base)
        else:
            self.replica = start_engine(
                self.role, service_id, registry, base, mesh.shards_per_group, mesh.shard_wait_s,
                mesh.model_peers,
            )  # fmt: skip

    def check_health(self) -> None:
        self.replica.check_health()

    def __del__(self) -> None:
        replica = getattr(self, "replica", None)  # absent if the constructor failed
        if replica is not None:
            replica.shutdown(self.drain_s)


# Work reaches these over ZeroMQ, not through Serve: Serve's graceful shutdown sees them idle, so
# they drain their own requests in `__del__` within `graceful_shutdown_timeout_s`.
_MESH_OPTIONS: dict[str, Any] = dict(
    health_check_period_s=2, health_check_timeout_s=10, graceful_shutdown_timeout_s=30
)


@serve.deployment(name="PromptEngine", ray_actor_options={"num_cpus": 0.5}, **_MESH_OPTIONS)
class PromptEngineDeployment(_MeshService):
    """Prefill (Splitwise's prompt machine)."""

    role = Role.PROMPT


@serve.deployment(name="TokenEngine", ray_actor_options={"num_cpus": 0.5}, **_MESH_OPTIONS)
class TokenEngineDeployment(_MeshService):
    """Decode against a claimed shard group, or with local attention when none is free."""

    role = Role.TOKEN


@serve.deployment(name="AttentionShard", ray_actor_options={"num_cpus": 0.25}, **_MESH_OPTIONS)
class AttentionShardDeployment(_MeshService):
    """Paged KV and decode attention for a slice of KV heads (Lamina's memory devices)."""

    role = Role.SHARD


@serve.deployment(name=MODEL_PEER_DEPLOYMENT, ray_actor_options={"num_cpus": 0.5}, **_MESH_OPTIONS)
class ModelPeerDeployment(_MeshService):
    """A replica of the model's weights running a token engine's lanes' layer slices (Lamina 4.3;
    claimed by one token engine through the registry). Stateless: a lost one is replaced by
    Serve and claimed again; meanwhile its engine runs the slices itself."""

    role = Role.MODEL_PEER


def build_app(args: dict[str, Any]) -> Application:
    """The application builder: `import_path: services.app:build_app` in a serve config."""
    parsed = AppArgs.model_validate(args)  # fail at deploy time, before any replica starts
    if parsed.mesh.key is None:
        parsed.mesh.key = secrets.token_hex(32)
    bound = parsed.model_dump()
    if parsed.topology == "local":
        return RouterDeployment.bind(bound)  # type: ignore[attr-defined]
    deployments: list[Any] = [
        PromptEngineDeployment,
        TokenEngineDeployment,
        AttentionShardDeployment,
    ]
    if parsed.mesh.model_peers:
        deployments.append(ModelPeerDeployment)
    mesh = [d.bind(bound) for d in deployments]
    return RouterDeployment.bind(bound, *mesh)  # type: ignore[attr-defined]
