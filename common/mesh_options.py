"""The mesh's options: one frozen type from the serve config's `args.mesh` to every worker.

`MeshOptions` is what `deploy/*.yaml` writes under `mesh:`, what `LocalMesh`'s `Topology` carries,
and what each worker receives whole in its `WorkerConfig` (msgspec encodes it on the wire as is).
Every rule between options is written once, in `__post_init__`; a new switch is one field here
and the code that reads it.

Validation: `msgspec.convert(raw, MeshOptions)` checks types, bounds and the rules and names the
field at fault; `services/app_args.py` turns its error into the YAML edge's pydantic error.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from common.roles import Role
from common.scheduling.cluster import PoolThresholds
from common.scheduling.home_roles import HomeRoleThresholds
from common.scheduling.tiers import is_neo, tier_policy

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]

# How `device` is spelled (common/device.py resolves it): written here, beside the option, so that
# the options (and the router, which reads them) never import torch.
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
# Re-runs of one request on other replicas when its engines or shards die (token replay).
MAX_MIGRATIONS = 5
# KV-aware routing: a prompt engine's pending tokens less this x the prompt's prefix it caches.
PREFIX_ROUTING_WEIGHT = 1.0


class _Options(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class HomeRoleOptions(_Options, frozen=True):
    """Homes that follow the queue mix (common/scheduling/home_roles.py, docs/mesh.md): a fill
    gap of `shift` held `hold_s` moves one engine's home a step toward the busy side, one of at
    most `settle` held as long moves it back; one move per `cooldown_s`."""

    shift: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    settle: Annotated[float, msgspec.Meta(ge=0)] = 0.1
    hold_s: Seconds = 30.0
    cooldown_s: Seconds = 120.0

    def __post_init__(self) -> None:
        self.thresholds()  # raises ValueError where the rules between them fail

    def thresholds(self) -> HomeRoleThresholds:
        return HomeRoleThresholds(self.shift, self.settle, self.hold_s, self.cooldown_s)


class PoolOptions(_Options, frozen=True):
    """Splitwise's pools (docs/serving.md): when JSQ's best engine counts as full, so that an
    engine of the other pool is lent to the mixed pool, and how long a loan lasts unrenewed."""

    prompt_tokens: Positive = 8192  # a prompt engine's pending prompt tokens
    decode_tokens: NonNegative = 1 << 62  # a token engine's running decode tokens
    min_free_kv_tokens: NonNegative = 0  # KV left where the request would decode
    lease_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0  # a lent engine goes home unrenewed
    home_roles: HomeRoleOptions | None = None  # None: every engine keeps its deployed home
    # Lent work only where it stalls no one (`PoolThresholds`): a prefill onto an engine running
    # at most this many decode tokens, a decode onto one with at most this many pending prompt
    # tokens (unbounded: Splitwise's lending).
    lend_prefill_max_decode: NonNegative = 1 << 62
    lend_decode_max_pending: NonNegative = 1 << 62

    def thresholds(self) -> PoolThresholds:
        homes = self.home_roles.thresholds() if self.home_roles is not None else None
        return PoolThresholds(
            prompt_tokens=self.prompt_tokens, decode_tokens=self.decode_tokens,
            min_free_kv_tokens=self.min_free_kv_tokens, role_lease_s=self.lease_s,
            home_roles=homes, lend_prefill_max_decode=self.lend_prefill_max_decode,
            lend_decode_max_pending=self.lend_decode_max_pending,
        )  # fmt: skip


class MeshOptions(_Options, frozen=True):
    """The mesh deployments' knobs (`topology: mesh`): KV sizes, batching, shard groups, the
    papers' switches, sockets and fault bounds. Every worker reads the fields of its role."""

    # -- sizes and batching (every engine) --
    shards_per_group: NonNegative = 2  # shards per token engine; 0: local attention
    num_blocks: Positive = 512  # each engine's own KV
    token_num_blocks: NonNegative = 0  # token engines' own KV; 0: num_blocks
    shard_num_blocks: Positive = 1024  # each shard's KV (its heads only)
    block_size: Positive = 16
    max_num_batched_tokens: Positive = 2048
    # A prefill longer than this runs a chunk a step, with decode steps between (no step of an
    # engine waits behind more; services/engine/prefill_chunks.py).
    prefill_chunk_tokens: Positive = 512
    max_num_seqs: Positive = 64
    max_preemptions: NonNegative = 2  # the mixed policy's preemption cap
    starvation_s: Seconds = 1.0  # and its aging (common/scheduling/mixed.py)
    attention_backend: str = "auto"
    # Where prompt, token and mixed engines compute (common/device.py): auto (CUDA when the
    # replica sees a GPU), cpu, cuda or cuda:N. Shards and model peers stay on the host. On Ray,
    # a `cuda*` device gives each engine replica `engine_num_gpus` GPUs (fractional: engines share
    # one); with `auto` they get none, so Ray hides the GPUs and `auto` is the CPU.
    device: Annotated[str, msgspec.Meta(pattern=DEVICE_PATTERN)] = "auto"
    engine_num_gpus: Annotated[float, msgspec.Meta(gt=0, le=8)] = 0.5
    num_threads: Positive = 1  # torch threads per replica
    # A token engine's torch threads (None: num_threads). It blocks on its shards once per layer,
    # so more threads pay only if they sleep meanwhile: its replica needs OMP_WAIT_POLICY=passive
    # and OMP_NUM_THREADS to match (its runtime_env, as deploy/local.yaml; docs/mesh.md).
    token_engine_threads: Positive | None = None
    enable_prefix_caching: bool = True  # prompt and mixed engines; docs/prefix_caching.md
    # A CPU engine's load-ready weights, written once per node and mapped by every later replica
    # (common/model/weight_cache.py): `auto` (<PHASEMESH_CACHE>/weights), an absolute
    # directory (e.g. under /dev/shm), or `off` (each replica converts and packs its own).
    weight_cache: Annotated[str, msgspec.Meta(pattern=r"^(auto|off|/.*)$")] = "auto"

    # -- Splitwise: KV from prompt to token engines --
    layer_wise_min_tokens: Positive = 256  # prompts this long ship KV layer by layer (§IV-C)
    # How prefill KV reaches shards: pushed while prefilling, or held by the prompt engine and
    # pulled by the shards between decode steps (docs/kv_pull.md).
    kv_transfer: Literal["push", "pull"] = "push"
    kv_hold_bytes: Positive = 1 << 30  # `pull`: what one prompt engine holds for shards to pull
    # KV pages over UCX links; off: over ZeroMQ (the benches compare both).
    kv_over_ucx: bool = True

    # -- Lamina: the shard group's decode round trip --
    # How a shard group splits KV: by KV heads, or whole requests per shard (by KV bytes load).
    shard_partition: Literal["head", "request"] = "head"
    # q leaves for the shards before k/v are computed (Lamina 4.2.2), and a step's sharded rows run
    # as this many staggered sub-batches (4.3; `auto`: one lane for the first steps, then the n
    # the step breakdown prices best, common/scheduling/lane_choice.py).
    attention_overlap: bool = False
    decode_lanes: Positive | Literal["auto"] = 1
    # Lamina 4.3 over model replicas: each token engine claims this many model peers and rotates
    # its lanes' layer slices over them (R = 1 + model_peers; decode_lanes R + 1 keeps each busy).
    model_peers: NonNegative = 0

    # -- Neo: a local KV tier beside a token engine's shards --
    local_kv_blocks: NonNegative = 0  # its budget in blocks; 0: all decode KV on the shards
    tier_policy: str = ""  # who lives in it (common/scheduling/tiers.py: fill_local, alternate:N)

    # -- the router --
    prefix_routing_weight: Annotated[float, msgspec.Meta(ge=0)] = PREFIX_ROUTING_WEIGHT
    max_migrations: NonNegative = MAX_MIGRATIONS
    pools: PoolOptions = msgspec.field(default_factory=PoolOptions)

    # -- sockets, secrets and fault bounds --
    host: str | None = None  # where sockets bind; None: this node's IP as Ray knows it
    # Signs the UCX hellos and keys the CURVE sockets (hex); None: the application's registry
    # holds one, drawn by its first replica (services/mesh/registry.py `agree_key`).
    key: Annotated[str, msgspec.Meta(pattern=r"^([0-9a-f]{2}){16,}$")] | None = None
    shard_wait_s: Seconds = 60.0  # a token engine waits this long for a shard group at start
    drain_s: Seconds = 20.0  # a leaving engine finishes its requests this long
    shard_reply_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0  # a silent shard link
    shard_link_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0  # one try at a link
    # A request at the router that gets no output for this long is re-run elsewhere from its
    # tokens (its engine dropped it, or its router was stopped while the engine gave up on it).
    progress_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    # A token engine whose head-split shard group lost a shard keeps the group's requests this
    # long for a replacement and the rebuild of the lost heads (Lamina §5; docs/failures.md);
    # past it, or at 0, they migrate. Below `progress_timeout_s`: the router must not re-run a
    # request that is being rebuilt.
    shard_rebuild_wait_s: Seconds = 20.0

    def __post_init__(self) -> None:
        if not is_neo(self.tier_policy):  # Neo's needs its cost tables: the engine builds it
            tier_policy(self.tier_policy)  # raises ValueError naming an unknown one
        by_request = self.shard_partition == "request"
        if by_request and (self.attention_overlap or self.decode_lanes != 1):
            # NOTE: the by-request round trip has one part and one lane (runner.py).
            raise ValueError(
                "shard_partition request runs without attention_overlap and with decode_lanes 1 "
                "(its round trip has one part and one lane)"
            )
        if self.model_peers and (by_request or not self.shards_per_group):
            raise ValueError(
                "model_peers rotate decode lanes over a head-split shard group: they need "
                "shards_per_group > 0 and shard_partition head"
            )
        if by_request and self.local_kv_blocks:
            raise ValueError(
                "local_kv_blocks is a tier beside head-split shards: shard_partition request "
                "has none"
            )
        if self.shard_rebuild_wait_s >= self.progress_timeout_s:
            raise ValueError(
                "shard_rebuild_wait_s must be below progress_timeout_s: the router would re-run "
                "requests still waiting for their rebuild"
            )

    def threads_of(self, role: Role) -> int:
        """Torch threads of a mesh replica of this role."""
        if role == Role.TOKEN and self.token_engine_threads is not None:
            return self.token_engine_threads
        return self.num_threads

    def blocks_of(self, role: Role) -> int:
        """An engine's own KV blocks in this role."""
        return self.token_num_blocks or self.num_blocks if role == Role.TOKEN else self.num_blocks

    @property
    def engine_gpus(self) -> float:
        """GPUs Ray gives each prompt or token engine replica: `engine_num_gpus` on a `cuda*`
        device, none otherwise."""
        return self.engine_num_gpus if self.device.startswith("cuda") else 0.0

    @property
    def auto_lanes(self) -> bool:
        return self.decode_lanes == "auto"

    @property
    def num_decode_lanes(self) -> int:
        """Lanes a decode step starts with (`auto` starts at one and chooses from measurements)."""
        return 1 if self.decode_lanes == "auto" else self.decode_lanes


def mesh_options(raw: object) -> MeshOptions:
    """`raw` (a mapping from YAML, or options already) as `MeshOptions`; ValueError naming the
    field at fault."""
    if isinstance(raw, MeshOptions):
        return raw
    try:
        return msgspec.convert(raw, MeshOptions)
    except msgspec.ValidationError as exc:
        raise ValueError(f"mesh options: {exc}") from exc


__all__ = ["MAX_MIGRATIONS", "PREFIX_ROUTING_WEIGHT", "MeshOptions", "PoolOptions", "mesh_options"]
