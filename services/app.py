"""The Ray Serve application: thin deployments around the plain service classes.

The only module that imports `ray.serve`. `build_app(args)` is the application builder named by
`import_path: services.app:build_app` in `deploy/*.yaml`; `args` is validated by `AppArgs`.

Topologies (`args.topology`):
- `local`: the `Router` deployment holds a `LocalEngineBackend` (one mixed engine, in-process).
  Complete and testable on one machine.
- `mesh`: `Router` plus `PromptEngine`, `TokenEngine` and `AttentionShard` deployments; the router
  reaches the engines over ZeroMQ. Lands with the mesh services (issue 4): add the three
  deployments below and a branch in `_make_backend`.

Admission bounds are `user_config` on the Router deployment (`max_num_requests`,
`max_pending_prompt_tokens`), so `serve deploy` of an edited value applies without a restart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application

from common.engine.core import LLMEngine
from common.model.default import PRESETS, default_model_path
from services.backend import AdmissionLimits, GenerationBackend, LocalEngineBackend
from services.router import Router

log = structlog.get_logger(__name__)

# Every deployment name a serve config may override; the mesh ones are bound by `topology: mesh`.
DEPLOYMENT_NAMES = ("Router", "PromptEngine", "TokenEngine", "AttentionShard")


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineArgs(_Args):
    """The in-process engine's KV cache and batching (`topology: local`)."""

    num_blocks: int = Field(default=1024, ge=1)
    block_size: int = Field(default=16, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    attention_backend: str = "auto"


class AppArgs(_Args):
    """The `args:` of a PhaseMesh application in a serve config."""

    model: str = "tiny"  # a preset of the random default model, or a model folder
    served_model_name: str | None = None  # the `model` clients send; default: `model`'s name
    topology: Literal["local", "mesh"] = "local"
    engine: EngineArgs = Field(default_factory=EngineArgs)

    def model_path(self) -> Path:
        return default_model_path(self.model) if self.model in PRESETS else Path(self.model)

    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


def _make_backend(args: AppArgs) -> GenerationBackend:
    if args.topology == "local":
        e = args.engine
        engine = LLMEngine.from_path(
            args.model_path(),
            num_blocks=e.num_blocks,
            block_size=e.block_size,
            max_num_batched_tokens=e.max_num_batched_tokens,
            max_num_seqs=e.max_num_seqs,
            attention_backend=e.attention_backend,
        )
        return LocalEngineBackend(engine)
    raise ValueError("topology 'mesh' needs the mesh deployments (issue 4); use 'local'")


@serve.deployment(name="Router", max_ongoing_requests=512, health_check_period_s=5)
@serve.ingress()
class RouterDeployment:
    """HTTP ingress: the OpenAI API of `services.router.Router` over the configured backend."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = AppArgs.model_validate(args)
        self.backend = _make_backend(self.args)
        self.router = Router(self.backend, self.args.model_path(), self.args.model_name())
        log.info("router ready", model=self.router.model_name, topology=self.args.topology)

    def __serve_build_asgi_app__(self) -> Any:
        return self.router.app

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply `user_config` (admission bounds) in place, without restarting the replica."""
        limits = AdmissionLimits(**user_config)
        if isinstance(self.backend, LocalEngineBackend):
            self.backend.limits = limits
        log.info("admission limits", **user_config)

    def check_health(self) -> None:
        if not self.backend.ready():
            raise RuntimeError("the generation backend is not ready")

    def __del__(self) -> None:
        if isinstance(self.backend, LocalEngineBackend):
            self.backend.shutdown()


def build_app(args: dict[str, Any]) -> Application:
    """The application builder: `import_path: services.app:build_app` in a serve config."""
    parsed = AppArgs.model_validate(args)  # fail at deploy time, before any replica starts
    if parsed.topology != "local":
        raise ValueError("topology 'mesh' needs the mesh deployments (issue 4); use 'local'")
    return RouterDeployment.bind(parsed.model_dump())  # type: ignore[attr-defined]
