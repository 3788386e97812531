"""What a launcher tells a worker, and what the worker reports back when ready.

`role_config` and `shard_config` build each worker's `WorkerConfig` from one its mesh's workers
share: `LocalMesh` (services/launch) and the Serve replicas (services/mesh) both start workers
through them, so a shard's heads or an engine's threads are worked out in one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from common.mesh_options import MeshOptions
from common.protocol import ShardAddress
from common.roles import Role
from common.transport.zmq_auth import CurveKeys


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's identity and place in the mesh, with the mesh's options whole (`options`: its
    knobs, the same for every worker of a mesh). Built by `role_config` and `shard_config`, which
    `LocalMesh` and the Serve replicas both use."""

    service_id: str
    role: Role = Role.MIXED  # what the worker runs: an engine in this role, or a shard
    model_path: str
    ready_endpoint: str
    host: str = "127.0.0.1"  # where its sockets bind
    num_threads: int = 1  # its torch threads (`MeshOptions.threads_of` its role)
    cpus: list[int] = []  # the cores to run on (services/launch/core_pinning.py); empty: any
    shards: list[ShardAddress] = []  # token engines: their shard group
    head_start: int = 0  # shards: the KV heads they hold
    head_end: int = 0
    shard_slot: int = -1  # shards: their place in a group, where heads do not say it
    served_model_name: str = ""  # the `model_name` label of metrics; default: the folder's name
    # The mesh's secret (hex): every UCX hello between its services is signed with it, and every
    # ZeroMQ socket is a CURVE server or client with keys derived from it, so a peer without it is
    # dropped before anything it sent is read (common/transport/ucx_handshake.py, zmq_auth.py).
    mesh_key: str
    # Token engines: their model peers' UCX link addresses (hex), replicas 1.. of Lamina 4.3's
    # rotation (services/engine/rotation.py); lanes' layer slices rotate over them.
    model_peers: list[str] = []
    options: MeshOptions = msgspec.field(default_factory=MeshOptions)

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


def role_config(base: WorkerConfig, role: Role, service_id: str, **instance: Any) -> WorkerConfig:
    """`base` (what a mesh's workers share) as worker `service_id` in `role`, on its role's torch
    threads; `instance`: the rest of its own fields (cpus, shards, model peers)."""
    threads = base.options.threads_of(role)
    return msgspec.structs.replace(
        base, service_id=service_id, role=role, num_threads=threads, **instance
    )


def shard_heads(num_kv_heads: int, options: MeshOptions, slot: int) -> tuple[int, int]:
    """The KV heads [start, end) the shard in `slot` of a group holds: its slice of the heads, or
    every head where the group splits by request. Raises if the heads do not split evenly."""
    if options.shard_partition == "request":
        return 0, num_kv_heads
    num_slots = max(options.shards_per_group, 1)
    if num_kv_heads % num_slots:
        raise ValueError(f"{num_kv_heads} KV heads do not split over {num_slots} shards")
    width = num_kv_heads // num_slots
    return slot * width, (slot + 1) * width


def shard_config(
    base: WorkerConfig, service_id: str, slot: int, num_kv_heads: int, **instance: Any
) -> WorkerConfig:
    """`base` as the attention shard `service_id` in `slot` of its group (`shard_heads`)."""
    head_start, head_end = shard_heads(num_kv_heads, base.options, slot)
    return role_config(
        base, Role.SHARD, service_id, head_start=head_start, head_end=head_end, shard_slot=slot,
        **instance,
    )  # fmt: skip


class WorkerReady(msgspec.Struct, frozen=True):
    service_id: str
    role: Role
    command_endpoint: str = ""
    kv_endpoint: str = ""
    control_endpoint: str = ""
    load_endpoint: str = ""
    link_address: str = ""  # shards: their UCX worker address (hex), where token engines link
    kv_address: str = ""  # receivers: their KV listener's UCX worker address (hex); "": ZeroMQ
