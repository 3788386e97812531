"""What a `LocalMesh` (local_mesh.py) starts: how many of each service, their KV capacity and the
knobs benches and tests turn."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """How many of each service, and their KV capacity."""

    model_path: str
    num_prompt: int = 1
    num_token: int = 1
    num_shards: int = 0  # in all; each token engine gets num_shards / num_token of them
    num_blocks: int = 512
    block_size: int = 16
    layer_wise_min_tokens: int = 256
    attention_backend: str = "auto"
    num_threads: int = 1
    token_engine_threads: int = 0  # a token engine's torch threads; 0: num_threads (as MeshArgs)
    # Pin each token engine and its shards to cores (core_pinning.py); prompt engines float.
    pin_decode_groups: bool = True
    # PHASEMESH_OTEL_EXPORTER for every service ("" keeps this process's environment);
    # `{service_id}` is replaced, so `jsonl:/tmp/t/{service_id}.jsonl` gives each its own file.
    otel_exporter: str = ""
    shard_reply_timeout_s: float = 30.0  # a token engine gives a silent shard link up after this
    shard_link_timeout_s: float = 10.0  # one try at a shard link (WorkerConfig's)
    enable_prefix_caching: bool = True  # prompt engines' (docs/prefix_caching.md)
    kv_over_ucx: bool = True  # KV pages over UCX links; off: over ZeroMQ (benches compare both)
    local_kv_blocks: int = 0  # token engines' local KV tier beside their shards (Neo); 0: none
    tier_policy: str = ""  # and who lives in it (common/scheduling/tiers.py)
    token_num_blocks: int = 0  # token engines' own KV blocks; 0: num_blocks (benches bound it)
    kv_transfer: str = "push"  # shards' KV pushed by prompt engines, or pulled by the shards
    shard_partition: str = "head"  # a group's shards split KV heads, or hold whole requests
    attention_overlap: bool = False  # token engines send q before k/v (Lamina 4.2.2)
    decode_lanes: int = 1  # staggered decode sub-batches per token engine (Lamina 4.3)
    # Model peers per token engine: its lanes' layer slices rotate over them (Lamina 4.3 over
    # replicas: with R = 1 + model_peers, decode_lanes = R + 1; services/engine/rotation.py).
    model_peers: int = 0

    def __post_init__(self) -> None:
        if self.num_prompt < 1 or self.num_token < 1:
            raise ValueError("a topology needs at least one prompt and one token engine")
        if self.num_shards % self.num_token:
            raise ValueError("num_shards must be a multiple of num_token (equal shard groups)")
        if self.token_engine_threads < 0:
            raise ValueError(f"token_engine_threads must be >= 0, got {self.token_engine_threads}")
        if self.decode_lanes < 1:
            raise ValueError(f"decode_lanes must be at least 1, got {self.decode_lanes}")
        if self.shard_partition == "request" and (self.attention_overlap or self.decode_lanes > 1):
            raise ValueError("shard_partition request runs without attention_overlap and lanes")
        if self.model_peers < 0:
            raise ValueError(f"model_peers must be at least 0, got {self.model_peers}")
        if self.model_peers and (not self.num_shards or self.shard_partition != "head"):
            raise ValueError("model_peers rotate decode lanes over a head-split shard group")

    @property
    def engine_threads(self) -> int:
        """A token engine's torch threads (`token_engine_threads`, else `num_threads`)."""
        return self.token_engine_threads or self.num_threads


__all__ = ["Topology"]
