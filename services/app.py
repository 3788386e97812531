"""The Ray Serve application: thin deployments around the plain service classes.

The only module that imports `ray.serve`. `build_app(args)` is the application builder named by
`import_path: services.app:build_app` in `deploy/*.yaml`; `args` is validated by `AppArgs`
(`services/app_args.py`).

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

import asyncio
import hashlib
import json
import os
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ray
import structlog
from ray import serve
from ray.serve import Application

from common.config import ModelConfig, cache_dir
from common.mesh_options import MeshOptions
from common.roles import Role
from common.telemetry import Metrics, configure_logging, configure_telemetry
from common.telemetry.prometheus import PrometheusSink
from common.transport.zmq_auth import CurveKeys
from common.worker_config import WorkerConfig, role_config
from services.app_args import AppArgs, EngineArgs
from services.mesh.autoscaling import AGE, RateMeter, engine_stats, shard_stats
from services.mesh.ray_registry import RayRegistry
from services.mesh.registry import RegistryClient
from services.offline.options import OfflineOptions, check_shardable
from services.offline.service import OfflineService
from services.router.engine_client import (
    EngineClient,
    InProcessEngineClient,
    machine_threads,
    usable_cores,
)
from services.router.mesh_client import MeshEngineClient
from services.router.server import Router
from services.router.streams import AdmissionLimits, StreamInterval

# NOTE: each deployment imports its role's modules when its replica starts, not here: every
# replica imports this module, and the Router's (`topology: mesh`), the offline group's (its worker
# processes compute) and `serve run`'s own process then never import torch, ucxx or the engines:
# their starts, a scale-up's included, skip seconds of imports and hold less memory.
if TYPE_CHECKING:
    from common.engine.core import LLMEngine
    from services.mesh.replica import MeshReplica

log = structlog.get_logger(__name__)

# Every deployment name a serve config may override; the mesh ones are bound by `topology: mesh`,
# and the model peers' only with `mesh.model_peers` > 0.
DEPLOYMENT_NAMES = ("Router", "PromptEngine", "TokenEngine", "AttentionShard")
MODEL_PEER_DEPLOYMENT = "ModelPeer"
OFFLINE_DEPLOYMENT = "OfflineGroup"


def deployment_names(topology: str, model_peers: int = 0, offline: bool = False) -> tuple[str, ...]:
    """The deployments `build_app` binds for a topology: what a serve config may name."""
    extra = (OFFLINE_DEPLOYMENT,) if offline else ()
    if topology != "mesh":
        return ("Router", *extra)
    return DEPLOYMENT_NAMES + ((MODEL_PEER_DEPLOYMENT,) if model_peers else ()) + extra


def _make_client(args: AppArgs, replica_id: str, metrics: Metrics) -> EngineClient:
    if args.topology == "local":
        e = args.engine

        def build() -> LLMEngine:  # on the engine's thread (`InProcessEngineClient`: why)
            from common.engine.core import LLMEngine

            # The engine's options are `from_path`'s keywords; the threads are the client's.
            return LLMEngine.from_path(args.model_path(), **e.model_dump(exclude={"num_threads"}))

        threads = e.num_threads or machine_threads()
        _check_openmp(os.environ, threads, "Router")
        return InProcessEngineClient(build=build, num_threads=threads, engine_id=replica_id)
    registry = RayRegistry.for_app(serve.get_replica_context().app_name)
    return MeshEngineClient(
        args.model_path(),
        registry.live,
        auth=CurveKeys.from_mesh_key(_mesh_key(args.mesh, registry)),
        host=_bind_host(args.mesh),
        block_size=args.mesh.block_size,
        max_migrations=args.mesh.max_migrations,
        progress_timeout_s=args.mesh.progress_timeout_s,
        prefix_routing_weight=args.mesh.prefix_routing_weight,
        pool_thresholds=args.mesh.pools.thresholds(),
        metrics=metrics,
        wait_change=registry.wait_change,  # membership by the registry's long poll
    )


def _check_openmp(
    env: Mapping[str, str],
    engine_threads: int,
    deployment: str,
    waits_on_shards: bool = False,
    cores: int | None = None,
) -> bool:
    """Warn (and say False) where this process's OpenMP settings will cost its engine tokens.
    libgomp reads them once, at load, and Ray starts a replica with `OMP_NUM_THREADS` = its
    `num_cpus` unless its runtime_env says otherwise:
    - `OMP_NUM_THREADS` below the engine's threads: libgomp then waits between parallel regions
      in a way that costs a multi-threaded engine a large share of its tokens (docs/serving.md);
    - a token engine whose threads take every core (`cores`: this process's) and that waits on
      its shards every layer, with OpenMP's default wait (spinning): its idle threads spin
      through every wait on the cores its shards need (docs/mesh.md)."""
    omp_num_threads = env.get("OMP_NUM_THREADS", "")
    ok = True
    if omp_num_threads.isdigit() and int(omp_num_threads) < engine_threads:
        log.warning(
            "OMP_NUM_THREADS is below the engine's torch threads: decoding will be slower; "
            f"give the {deployment} deployment OMP_NUM_THREADS (or num_cpus) equal to them",
            omp_num_threads=int(omp_num_threads), engine_threads=engine_threads,
        )  # fmt: skip
        ok = False
    cores = cores if cores is not None else usable_cores()
    spins = env.get("OMP_WAIT_POLICY", "").lower() != "passive"
    if waits_on_shards and 1 < engine_threads and cores <= engine_threads and spins:
        log.warning(
            "this token engine's threads take every core and spin on them while it waits on "
            f"its shards: set OMP_WAIT_POLICY=passive in the {deployment} deployment's "
            "runtime_env (deploy/local.yaml)",
            engine_threads=engine_threads, cores=cores,
        )  # fmt: skip
        ok = False
    return ok


def _bind_host(mesh: MeshOptions) -> str:
    return mesh.host or ray.util.get_node_ip_address()


def _mesh_key(mesh: MeshOptions, registry: RegistryClient) -> str:
    """The args' key, or else the one the application's registry holds (the first replica to ask
    proposes a fresh one): the same for every replica of every deploy of the application."""
    return mesh.key or registry.agree_key(secrets.token_hex(32))


def _worker_config(args: AppArgs, mesh_key: str) -> WorkerConfig:
    """What every mesh worker of the application shares: `role_config` and `shard_config`
    (common/worker_config.py) make each replica's own from it."""
    return WorkerConfig(
        service_id="", model_path=str(args.model_path()), ready_endpoint="",
        host=_bind_host(args.mesh), served_model_name=args.model_name(), mesh_key=mesh_key,
        options=args.mesh,
    )  # fmt: skip


def _generation(args: dict[str, Any]) -> str:
    """The application's version, the same in every replica of one deploy: a digest of its args
    (`build_app` binds one dict to every deployment; a `serve deploy` that changes them replaces
    every mesh replica, and token engines then claim only shards and peers of their own)."""
    canonical = json.dumps(args, sort_keys=True, default=str).encode()
    return hashlib.sha256(canonical).hexdigest()[:16]


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

    def __init__(self, args: dict[str, Any], *mesh_services: Any, offline: Any = None) -> None:
        # `mesh_services`: handles of the mesh deployments, bound only so that they belong to this
        # application; the router finds their replicas through the registry, not through Serve.
        self.args = AppArgs.model_validate(args)
        replica_id = _service_id("router")
        _configure_observability("router", replica_id)
        # /metrics: one registry for the router's series and its mesh client's (migrations, pools).
        prometheus = PrometheusSink(self.args.metrics_names)
        metrics = Metrics(model_name=self.args.model_name(), engine=replica_id,
                          prometheus=prometheus)  # fmt: skip
        self.client = _make_client(self.args, replica_id, metrics)
        self.client.streams.interval = StreamInterval(
            self.args.stream_interval, self.args.stream_interval_s
        )
        self.router = Router(
            self.client, self.args.model_path(), self.args.model_name(), replica_id,
            max_model_len=self.args.max_model_len, api_key=self.args.resolved_api_key(),
            batch_store=self.args.batch_store,
            offline=None if offline is None else ServedOffline(offline, self.args.offline),
            prometheus=prometheus,
            strict_fields=self.args.strict_fields,
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
        mesh = parsed.mesh
        self.drain_s = mesh.drain_s
        registry = RayRegistry.for_app(serve.get_replica_context().app_name)
        base = _worker_config(parsed, _mesh_key(mesh, registry))
        service_id = _service_id(self.role)
        waits_on_shards = self.role == Role.TOKEN and mesh.shards_per_group > 0
        _check_openmp(os.environ, mesh.threads_of(self.role),
                      serve.get_replica_context().deployment, waits_on_shards)  # fmt: skip
        own = role_config(base, self.role, service_id)
        _configure_observability(own.telemetry_name, service_id)
        generation = _generation(args)
        self.started_at = time.monotonic()
        self.arrivals = RateMeter(self.started_at)  # its prompt tokens' arrival rate
        from services.mesh.replica import start_engine, start_model_peer, start_shard

        if self.role == Role.SHARD:
            self.replica: MeshReplica = start_shard(service_id, registry, base, generation)
        elif self.role == Role.MODEL_PEER:
            self.replica = start_model_peer(service_id, registry, base, generation)
        else:
            self.replica = start_engine(self.role, service_id, registry, base, generation)

    def check_health(self) -> None:
        self.replica.check_health()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling hook: this replica's load (services/mesh/autoscaling.py)."""
        age_s = time.monotonic() - self.started_at
        # NOTE: imported here, not at the top (the Router's replica imports this module and needs
        # neither), nor cached: Serve calls this every few seconds, and a repeat import is a
        # sys.modules lookup.
        from services.engine.worker import EngineWorker
        from services.shard.worker import ShardWorker

        worker = self.replica.worker.worker
        if isinstance(worker, ShardWorker):
            blocks = worker.shard.blocks  # NOTE: racy reads of two ints, for a load figure
            return shard_stats(blocks.num_used_blocks, blocks.num_blocks, age_s)
        if isinstance(worker, EngineWorker):
            return engine_stats(worker.last_load, age_s, self.arrivals, time.monotonic())
        return {AGE: age_s}

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


class ServedOffline:
    """The offline group's deployment as the router's `OfflineBackend`."""

    def __init__(self, handle: Any, options: OfflineOptions | None) -> None:
        assert options is not None
        self.handle, self.max_len = handle, options.max_len

    async def generate(self, prompts: list[list[int]], max_tokens: list[int],
                       job_id: str) -> list[list[int] | None]:  # fmt: skip
        return await self.handle.generate.remote(prompts, max_tokens, job_id)  # type: ignore[no-any-return]

    async def cancel(self, job_id: str) -> None:
        await self.handle.cancel.remote(job_id)


# The offline group scales to zero: no replica while no batch job runs (an idle Ray worker costs
# a process's memory and its core's wake-ups, 100 a second, whether or not it has work), one
# started by a job's first call (Serve's cold start: a call that finds no replica asks for one at
# once), gone OFFLINE_IDLE_S after its last call ended. A batch waits those seconds of start-up
# once; it has a day (`completion_window`). At most one replica: a job's cancel must reach the
# replica running it.
OFFLINE_IDLE_S = 60.0
OFFLINE_AUTOSCALING: dict[str, Any] = {
    "min_replicas": 0, "initial_replicas": 0, "max_replicas": 1, "target_ongoing_requests": 1,
    "upscale_delay_s": 0.0, "downscale_delay_s": OFFLINE_IDLE_S,
}  # fmt: skip


@serve.deployment(name=OFFLINE_DEPLOYMENT, ray_actor_options={"num_cpus": 0},
                  autoscaling_config=OFFLINE_AUTOSCALING, health_check_period_s=10,
                  graceful_shutdown_timeout_s=5)  # fmt: skip
class OfflineGroupDeployment:
    """Seesaw's offline group (services/offline/): one replica owning its k worker processes,
    which the Router's Batch API runs plain greedy batches on; none while no job runs."""

    def __init__(self, args: dict[str, Any]) -> None:
        parsed = AppArgs.model_validate(args)
        assert parsed.offline is not None
        self.service = OfflineService.start(
            parsed.model_path(), parsed.offline, weight_cache=cache_dir(parsed.mesh.weight_cache)
        )

    async def generate(self, prompts: list[list[int]], max_tokens: list[int],
                       job_id: str | None = None) -> list[list[int] | None]:  # fmt: skip
        return await asyncio.to_thread(self.service.generate, prompts, max_tokens, job_id)

    async def cancel(self, job_id: str) -> None:
        """A batch's cancel: its job ends at its next step (its finished lines are kept)."""
        self.service.cancel(job_id)

    def check_health(self) -> None:
        if not self.service.healthy():
            raise RuntimeError("an offline worker process died")

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.close()


def _with_gpus(deployment: Any, num_gpus: float) -> Any:
    """An engine deployment with `num_gpus` per replica (fractional: replicas share a GPU), as
    `mesh.device: cuda*` asks; unchanged without. A serve config's own `ray_actor_options` for
    it replace these whole: deploy/gpu.yaml states `num_gpus` there as well."""
    if not num_gpus:
        return deployment
    return deployment.options(
        ray_actor_options={**deployment.ray_actor_options, "num_gpus": num_gpus}
    )


def build_app(args: dict[str, Any]) -> Application:
    """The application builder: `import_path: services.app:build_app` in a serve config."""
    parsed = AppArgs.model_validate(args)  # fail at deploy time, before any replica starts
    bound = parsed.model_dump()
    extra: dict[str, Any] = {}
    model_config = parsed.model_path() / "config.json"
    if parsed.offline is not None and model_config.is_file():  # a preset not written yet: later
        # Refused here, not in a replica that would restart forever.
        check_shardable(ModelConfig.from_folder(parsed.model_path()), parsed.offline.workers)
    if parsed.offline is not None:
        extra["offline"] = OfflineGroupDeployment.bind(bound)  # type: ignore[attr-defined]
    if parsed.topology == "local":
        return RouterDeployment.bind(bound, **extra)  # type: ignore[attr-defined]
    deployments: list[Any] = [
        *(_with_gpus(d, parsed.mesh.engine_gpus) for d in (PromptEngineDeployment,
                                                           TokenEngineDeployment)),
        AttentionShardDeployment,
    ]  # fmt: skip
    if parsed.mesh.model_peers:
        deployments.append(ModelPeerDeployment)
    mesh = [d.bind(bound) for d in deployments]
    return RouterDeployment.bind(bound, *mesh, **extra)  # type: ignore[attr-defined]


# `AppArgs` and its parts live in app_args.py; tests and tools import them from here as well.
__all__ = [
    "DEPLOYMENT_NAMES",
    "AppArgs",
    "EngineArgs",
    "MeshOptions",
    "build_app",
    "deployment_names",
]
