"""What the launcher tells a worker process, and what the worker reports back when ready."""

from __future__ import annotations

from pathlib import Path

import msgspec

from common.protocol import ShardAddress
from common.roles import Role
from common.transport.zmq_auth import CurveKeys


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    service_id: str
    role: Role = Role.MIXED  # what the worker runs: an engine in this role, or a shard
    model_path: str
    ready_endpoint: str
    host: str = "127.0.0.1"
    block_size: int = 16
    num_blocks: int = 1024
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_preemptions: int = 2  # the mixed policy's preemption cap (common/scheduling/mixed.py)
    starvation_s: float = 1.0  # and its aging
    layer_wise_min_tokens: int = 256
    attention_backend: str = "auto"
    num_threads: int = 1
    cpus: list[int] = []  # the cores to run on (services/launch/core_pinning.py); empty: any
    shards: list[ShardAddress] = []  # token engines: their shard group
    shard_num_blocks: int = 0
    head_start: int = 0  # shards: the KV heads they hold
    head_end: int = 0
    served_model_name: str = ""  # the `model_name` label of metrics; default: the folder's name
    # The mesh's secret (hex): every UCX hello between its services is signed with it, and every
    # ZeroMQ socket is a CURVE server or client with keys derived from it, so a peer without it is
    # dropped before anything it sent is read (common/transport/ucx_handshake.py, zmq_auth.py).
    mesh_key: str
    shard_reply_timeout_s: float = 30.0  # token engines: a shard link that stays silent this long
    # Token engines: one try at linking to a shard waits this long for its answer (at start,
    # tries go on until SHARD_LINK_START_DEADLINE_S: a shard starved of CPU answers late).
    shard_link_timeout_s: float = 10.0
    enable_prefix_caching: bool = True  # prompt and mixed engines (docs/prefix_caching.md)
    # Receivers (token and mixed engines, shards): take KV pages over UCX (a `KvReceiver`, its
    # address in `WorkerReady.kv_address`) or, off, on the ZeroMQ KV-ingress socket as before.
    # Senders follow what each receiver publishes. The one switch between the two paths.
    kv_over_ucx: bool = True
    # Token engines with a shard group: Neo's local KV tier, its budget in blocks (0: none, all
    # decode KV on the shards) and the policy that places requests in the two tiers
    # (`common.scheduling.tiers.tier_policy`: fill_local, or alternate:<period> for tests).
    local_kv_blocks: int = 0
    tier_policy: str = ""
    # How a request's KV reaches its shard group: "push" (the prompt engine ships it while it
    # prefills) or "pull" (the prompt engine holds it, bounded by `kv_hold_bytes` and a lease,
    # and announces it; each shard pulls it between decode steps; the token engine admits the
    # request once every shard has it). Read by prompt engines (hold) and token engines (admit).
    kv_transfer: str = "push"
    kv_hold_bytes: int = 1 << 30
    # How a shard group splits KV: "head" (each shard a slice of KV heads of every request) or
    # "request" (each shard all heads of the requests placed on it, Lamina Fig. 9a).
    shard_partition: str = "head"
    shard_slot: int = -1  # shards: their place in a group, where heads do not say it
    # Token engines' decode round trip (services/engine/runner.py): q leaves before k/v are
    # computed (Lamina 4.2.2), and a step's sharded rows run as this many staggered lanes (4.3;
    # 0: auto, chosen from the first steps' measured breakdown: services/engine/lanes.py).
    attention_overlap: bool = False
    decode_lanes: int = 1
    # Token engines: their model peers' UCX link addresses (hex), replicas 1.. of Lamina 4.3's
    # rotation (services/engine/rotation.py); lanes' layer slices rotate over them.
    model_peers: list[str] = []

    def __post_init__(self) -> None:
        if self.kv_transfer not in ("push", "pull"):
            raise ValueError(f"kv_transfer must be push or pull, got {self.kv_transfer!r}")
        if self.shard_partition not in ("head", "request"):
            raise ValueError(f"shard_partition must be head or request, got "
                             f"{self.shard_partition!r}")  # fmt: skip
        if self.decode_lanes < 0:
            raise ValueError(f"decode_lanes must be >= 1, or 0 for auto, got {self.decode_lanes}")
        if self.shard_partition == "request" and (self.attention_overlap or self.decode_lanes != 1):
            # NOTE: the by-request round trip (runner._attend_by_request) has one part and lane.
            raise ValueError("shard_partition request runs without attention_overlap and lanes")
        if self.model_peers and self.shard_partition == "request":
            raise ValueError("model_peers rotate lanes over a head-partitioned shard group only")

    @property
    def curve_keys(self) -> CurveKeys:
        return CurveKeys.from_mesh_key(self.mesh_key)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name

    @property
    def telemetry_name(self) -> str:
        """`service.name` of this worker's telemetry: prompt-engine, token-engine, ..."""
        if self.role == Role.MODEL_PEER:
            return "model-peer"
        return "attention-shard" if self.role == Role.SHARD else f"{self.role}-engine"


class WorkerReady(msgspec.Struct, frozen=True):
    service_id: str
    role: str
    command_endpoint: str = ""
    kv_endpoint: str = ""
    control_endpoint: str = ""
    load_endpoint: str = ""
    link_address: str = ""  # shards: their UCX worker address (hex), where token engines link
    kv_address: str = ""  # receivers: their KV listener's UCX worker address (hex); "": ZeroMQ
