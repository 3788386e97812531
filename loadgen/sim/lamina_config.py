"""Lamina's decode clusters for the simulator: devices, the model's shape, and per-layer costs.

A Lamina cluster (§3-4) decodes with `replicas` model replicas, each a tensor-parallel group of
`compute_tp` compute devices (H100) holding the weights and running everything but attention, and
one attention group of `num_memory` memory devices (H20-class) holding every request's KV and
running attention, head-partitioned (§4.4: balanced) or request-partitioned. Its DOP is
(replicas x compute_tp, num_memory). The homogeneous baseline (vLLM on H100, `num_memory` = 0)
keeps KV and attention on its own tensor-parallel group.

Costs come from the measured profile: a replica's model part `t_m` is the profiled decode step at
that TP less its attention (`DenseDecodeModel`), and past the profile's largest batch grows at
the compute roofline (`Extrapolation`); attention `t_a` is the batch's KV bytes over the
attention devices' memory bandwidth (times the busiest device's excess when requests, not heads,
are partitioned: `lamina_placement.py`); the network is the bytes of q, k, v out and the attention
output back ((2 + 2/G) e d per token per layer, §3.2) over the slower end's NICs, plus a one-way
latency. Device figures and prices are Lamina's Table 1 (per chip, $/hour).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache

from common.perf_model import (
    DenseDecodeModel,
    dense_decode_model,
    load_perf_model,
    memory_bound_s,
)
from common.scheduling.lamina_pipeline import LayerCosts, default_replicas
from loadgen.sim.designs import LLAMA2_70B, ModelSpec, profile_path
from loadgen.sim.lamina_placement import Partition

# Lamina's Fig. 3: attention streams KV at more than 70% of the memory bandwidth, on H100 and H20.
ATTENTION_EFFICIENCY = 0.7
# Past the profile's largest batch (64) the model part grows as compute-bound GEMMs do (Lamina
# Fig. 2: compute-bound past ~100 requests): 2 FLOPs per parameter per request at this MFU.
DENSE_MFU = 0.5
# One-way latency of a small message between GPUs on two nodes: half of FHBN's 33 us ping-pong
# over 400 Gbps RoCE (§6.3, Fig. 13); NCCL's was 66.6 us.
NETWORK_LATENCY_S = 16.5e-6
# n = 1..4 when a cluster picks its own n (`num_batches` 0): the range of Lamina's Fig. 8.
MAX_AUTO_BATCHES = 4


@dataclass(frozen=True)
class Accelerator:
    """One chip: memory, bandwidth, dense FLOP/s, its NIC and price (Lamina Table 1).
    `hardware` is the profile table's name for it, for compute devices."""

    name: str
    hbm_bytes: int
    mem_bandwidth_bytes_s: float
    bf16_flops: float
    nic_gbps: float
    usd_per_hour: float
    hardware: str = ""
    memory_utilization: float = 0.9


H100 = Accelerator("H100", 80 * 10**9, 3.35e12, 989e12, 400.0, 11.06, "h100-80gb")
# H20's price is Lamina's estimate from relative system cost (Table 1 footnote).
H20 = Accelerator("H20", 96 * 10**9, 4.0e12, 148e12, 400.0, 4.63)


@dataclass(frozen=True)
class LaminaModel:
    """The model's shape as Lamina's analysis uses it (Table 2): LLaMA3-70B and Llama2-70B
    share it (80 layers, d 8192, GQA group 8), so the Llama2-70B profile stands in."""

    spec: ModelSpec = LLAMA2_70B
    num_layers: int = 80
    hidden: int = 8192
    gqa_group: int = 8
    dtype_bytes: int = 2
    num_kv_heads: int = 8

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return self.spec.kv_bytes_per_token // self.num_layers

    @property
    def q_bytes_per_token(self) -> int:
        return self.hidden * self.dtype_bytes  # q out; the attention output back is the same size

    @property
    def kv_out_bytes_per_token(self) -> int:
        return 2 * self.hidden // self.gqa_group * self.dtype_bytes

    @property
    def kv_proj_fraction(self) -> float:
        """K and V projections' share of a layer's weights, hence of its model time: the part of
        the slice q-early overlaps with attention."""
        per_layer = self.spec.weight_bytes / self.dtype_bytes / self.num_layers
        return 2 * self.hidden * self.hidden / self.gqa_group / per_layer


LLAMA_70B = LaminaModel()


class Extrapolation(StrEnum):
    """How the model part grows past the profile's largest batch."""

    ROOFLINE = "roofline"  # compute-bound GEMMs at DENSE_MFU of the group's FLOP/s
    PROFILE = "profile"  # the profile's last segment, continued


@lru_cache(maxsize=16)
def dense_model(
    compute: Accelerator,
    tp: int,
    model: LaminaModel = LLAMA_70B,
    extrapolation: Extrapolation = Extrapolation.ROOFLINE,
) -> DenseDecodeModel:
    """The model part of a decode step on a `tp`-chip group of `compute`, from the profile."""
    spec = model.spec
    decode = load_perf_model(
        profile_path(), spec.name, compute.hardware, tp, decode_context=spec.decode_context
    )
    profiled_kv = spec.decode_context * spec.kv_bytes_per_token
    per_request = memory_bound_s(
        profiled_kv, tp * compute.mem_bandwidth_bytes_s, ATTENTION_EFFICIENCY
    )
    slope = None
    if extrapolation is Extrapolation.ROOFLINE:
        num_params = spec.weight_bytes / model.dtype_bytes
        slope = 2 * num_params / (tp * compute.bf16_flops * DENSE_MFU)
    return dense_decode_model(decode, per_request, slope)


@dataclass(frozen=True)
class LaminaCluster:
    """A decode cluster: Lamina (`num_memory` > 0) or the homogeneous baseline (0).

    `num_batches` is n; `num_replicas` 0 takes Lamina's n - 1 (at least one). `num_batches` 0
    picks n (1..`MAX_AUTO_BATCHES`) for every stretch of the replay with
    `choose_num_batches` on `num_replicas` (default 1) fixed replicas, as a live engine would.
    `partition`: how the attention group splits the work (head-level needs the KV heads to
    divide evenly over the devices). The baseline runs one batch on one group."""

    compute_tp: int
    num_memory: int = 0
    num_batches: int = 1
    num_replicas: int = 0
    overlap: bool = True
    compute: Accelerator = H100
    memory: Accelerator = H20
    model: LaminaModel = LLAMA_70B
    latency_s: float = NETWORK_LATENCY_S
    extrapolation: Extrapolation = Extrapolation.ROOFLINE
    partition: Partition = Partition.HEAD
    replicas: int = field(init=False)

    def __post_init__(self) -> None:
        if self.compute_tp < 1 or self.num_memory < 0 or self.num_batches < 0:
            raise ValueError("lamina cluster: need compute_tp >= 1, num_memory >= 0, n >= 0")
        if self.num_memory == 0 and (self.num_batches != 1 or self.num_replicas > 1):
            raise ValueError("lamina cluster: the homogeneous baseline runs one batch, one group")
        heads = self.model.num_kv_heads
        if self.partition is Partition.HEAD and self.is_lamina and heads % self.num_memory:
            raise ValueError(
                f"lamina cluster: {heads} KV heads do not split over {self.num_memory} devices "
                "(use request-level partitioning)"
            )
        replicas = self.num_replicas or default_replicas(max(self.num_batches, 1))
        object.__setattr__(self, "replicas", replicas)
        weights_room = self.compute_tp * self.compute.hbm_bytes * self.compute.memory_utilization
        if weights_room < self.model.spec.weight_bytes:
            raise ValueError(
                f"lamina cluster: {self.compute_tp} x {self.compute.name} cannot hold the weights"
            )

    @property
    def is_lamina(self) -> bool:
        return self.num_memory > 0

    @property
    def label(self) -> str:
        if not self.is_lamina:
            return f"vLLM {self.compute_tp}x{self.compute.name}"
        dop = (self.replicas * self.compute_tp, self.num_memory)
        n = self.num_batches or "auto"
        by_request = " req" if self.partition is Partition.REQUEST else ""
        return f"Lamina DOP={dop} n={n}{by_request}"

    @property
    def usd_per_hour(self) -> float:
        chips = self.replicas * self.compute_tp * self.compute.usd_per_hour
        return chips + self.num_memory * self.memory.usd_per_hour

    def kv_capacity_tokens(self) -> int:
        """KV the cluster holds: the attention group's whole memory, or what the baseline's
        group has left beside the weights."""
        spec = self.model.spec
        if self.is_lamina:
            room = self.num_memory * self.memory.hbm_bytes * self.memory.memory_utilization
        else:
            room = self.compute_tp * self.compute.hbm_bytes * self.compute.memory_utilization
            room -= spec.weight_bytes
        return int(room // spec.kv_bytes_per_token)

    def layer_costs(
        self, batch_size: float, context_tokens: float, imbalance: float = 1.0
    ) -> LayerCosts:
        """One batch's costs per layer: `batch_size` requests holding `context_tokens` of KV,
        the busiest attention device holding `imbalance` x its even share."""
        m = self.model
        dense = dense_model(self.compute, self.compute_tp, m, self.extrapolation)
        model_s = dense(batch_size) / m.num_layers
        kv_bytes = context_tokens * m.kv_bytes_per_token_layer
        if not self.is_lamina:
            bandwidth = self.compute_tp * self.compute.mem_bandwidth_bytes_s
            attention_s = memory_bound_s(kv_bytes, bandwidth, ATTENTION_EFFICIENCY)
            return LayerCosts(model_s, attention_s)
        bandwidth = self.num_memory * self.memory.mem_bandwidth_bytes_s
        attention_s = memory_bound_s(kv_bytes * imbalance, bandwidth, ATTENTION_EFFICIENCY)
        compute_gbps = self.compute_tp * self.compute.nic_gbps
        nic_gbps = min(compute_gbps, self.num_memory * self.memory.nic_gbps)
        link_bytes_s = nic_gbps * 1e9 / 8
        return LayerCosts(
            model_s=model_s,
            attention_s=attention_s,
            q_wire_s=batch_size * m.q_bytes_per_token / link_bytes_s,
            kv_wire_s=batch_size * m.kv_out_bytes_per_token / link_bytes_s,
            out_wire_s=batch_size * m.q_bytes_per_token / link_bytes_s,
            latency_s=self.latency_s,
            kv_proj_s=model_s * m.kv_proj_fraction,
        )
