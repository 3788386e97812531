"""Machine types, the model, and Splitwise's cluster designs (Tables I and V) as dataclasses.

Costs and powers are normalized to a DGX-A100 (Table V). Table V gives an H100 token machine a
cost of 2.5x against 2.35x for an H100 prompt machine; we keep both as printed. Baseline-H100 is
not in Table V; it uses the prompt-machine H100 figures. Bandwidths are the InfiniBand links of
§VI-A (200 Gbps A100, 400 Gbps H100) and the non-overlapped layer-wise residuals measured there
(8 ms A100, 5 ms H100).

`PhaseMesh-CPU` is PhaseMesh's own local mesh (`deploy/local.yaml`: a prompt engine, and a token
engine with a 2-shard attention group) serving the tiny default model on one CPU machine, for
checking the simulator against the real mesh (`bench/sim_validation.py`). Its profile comes from
`bench/profile.py --hardware cpu-local-mesh` (`$PHASEMESH_PERF_PROFILE`); its KV pools are the
engines' block pools; its link is loopback ZeroMQ, modelled as 10 Gbps (`bench/transport.py`
measures the real one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from common.perf_model import (
    PROFILED_DECODE_CONTEXT,
    KVTransferModel,
    PerfModel,
    TransferMode,
    load_perf_model,
)
from common.roles import Role

DEFAULT_PROFILE = (
    Path(__file__).resolve().parents[2] / ".." / "shared" / "perf" / ("splitwise_perf_model.csv")
)


def profile_path() -> Path:
    """The GPU profile table: `$PHASEMESH_PERF_PROFILE`, else the shared Splitwise table."""
    return Path(os.environ.get("PHASEMESH_PERF_PROFILE", str(DEFAULT_PROFILE))).resolve()


@dataclass(frozen=True)
class ModelSpec:
    """What the simulator needs of the served model: its profile key and KV size.

    `decode_context`: the prompt size of the profile's batch sweep that gives the decode curve
    (about the contexts the simulated workload decodes at)."""

    name: str = "llama2-70b"
    tensor_parallel: int = 8
    weight_bytes: int = 140 * 10**9  # 70B parameters in fp16
    # 80 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes.
    kv_bytes_per_token: int = 80 * 8 * 128 * 2 * 2
    decode_context: int = PROFILED_DECODE_CONTEXT


LLAMA2_70B = ModelSpec()
# The tiny default model (common/model/default.py) in float32: 3.4 M parameters; 4 layers x 2 KV
# heads x 32 dims x (K and V) x 4 bytes per token. Its replays scale the Azure conversation trace's
# tokens by 1/16 (mean prompt 58 tokens), so decode runs at contexts near 64.
TINY = ModelSpec("tiny", 1, 4 * 3_400_000, 4 * 2 * 32 * 2 * 4, decode_context=64)


@dataclass(frozen=True)
class MachineType:
    """One DGX-class machine: its profile, cost, provisioned power and links."""

    name: str
    hardware: str  # the profile's `hardware` column
    cost: float
    power: float
    link_gbps: float
    layerwise_residual_s: float
    hbm_bytes: int = 8 * 80 * 10**9
    memory_utilization: float = 0.9
    kv_pool_tokens: int = 0  # a KV pool sized in blocks (PhaseMesh engines) instead of by HBM

    def kv_capacity_tokens(self, model: ModelSpec) -> int:
        if self.kv_pool_tokens:
            return self.kv_pool_tokens
        free = self.hbm_bytes * self.memory_utilization - model.weight_bytes
        return int(free // model.kv_bytes_per_token)


DGX_A100 = MachineType("DGX-A100", "a100-80gb", 1.0, 1.0, 200.0, 0.008)
DGX_H100 = MachineType("DGX-H100", "h100-80gb", 2.35, 1.75, 400.0, 0.005)
DGX_H100_TOKEN = replace(DGX_H100, cost=2.5)
DGX_H100_CAP = MachineType("DGX-H100-cap", "h100-80gb-pcap", 2.5, 1.23, 400.0, 0.005)
# deploy/local.yaml: the prompt engine's 512 blocks and the shard group's 1024 blocks of 16 tokens.
# The layer-wise residual is the last layer's KV of a 256-token prompt (128 KiB) over the link.
CPU_MESH_PROMPT = MachineType(
    "CPU-mesh-prompt", "cpu-local-mesh", 1.0, 1.0, 10.0, 1e-4, kv_pool_tokens=512 * 16
)
CPU_MESH_TOKEN = replace(CPU_MESH_PROMPT, name="CPU-mesh-token", kv_pool_tokens=1024 * 16)


@dataclass(frozen=True)
class Design:
    """A cluster design: its prompt and token machine types, or one type for a baseline."""

    name: str
    prompt_type: MachineType
    token_type: MachineType
    split: bool = True
    model: ModelSpec = LLAMA2_70B


DESIGNS: dict[str, Design] = {
    d.name: d
    for d in (
        Design("Baseline-A100", DGX_A100, DGX_A100, split=False),
        Design("Baseline-H100", DGX_H100, DGX_H100, split=False),
        Design("Splitwise-AA", DGX_A100, DGX_A100),
        Design("Splitwise-HH", DGX_H100, DGX_H100_TOKEN),
        Design("Splitwise-HA", DGX_H100, DGX_A100),
        Design("Splitwise-HHcap", DGX_H100, DGX_H100_CAP),
        Design("PhaseMesh-CPU", CPU_MESH_PROMPT, CPU_MESH_TOKEN, model=TINY),
    )
}


@dataclass(frozen=True)
class ClusterSpec:
    """A design with machine counts. A baseline's machines are all counted in `num_prompt`.
    `model` defaults to the design's."""

    design: Design
    num_prompt: int
    num_token: int = 0
    model: ModelSpec = None  # type: ignore[assignment]
    transfer_mode: TransferMode = TransferMode.AUTO

    def __post_init__(self) -> None:
        if self.model is None:
            object.__setattr__(self, "model", self.design.model)
        if self.num_prompt <= 0 or self.num_token < 0:
            raise ValueError("cluster: need at least one prompt (or baseline) machine")
        if self.design.split and self.num_token <= 0:
            raise ValueError(f"cluster: {self.design.name} needs token machines")

    @property
    def num_machines(self) -> int:
        return self.num_prompt + self.num_token

    @property
    def cost(self) -> float:
        d = self.design
        return self.num_prompt * d.prompt_type.cost + self.num_token * d.token_type.cost

    @property
    def power(self) -> float:
        d = self.design
        return self.num_prompt * d.prompt_type.power + self.num_token * d.token_type.power

    def machine_types(self) -> list[tuple[MachineType, Role]]:
        """Each machine's type and home pool, machine id = list index."""
        if not self.design.split:
            return [(self.design.prompt_type, Role.MIXED)] * self.num_prompt
        prompts = [(self.design.prompt_type, Role.PROMPT)] * self.num_prompt
        return prompts + [(self.design.token_type, Role.TOKEN)] * self.num_token

    def transfer_model(self) -> KVTransferModel:
        """Prompt-to-token link: the slower end's bandwidth and the larger residual."""
        p, t = self.design.prompt_type, self.design.token_type
        return KVTransferModel(
            bandwidth_bytes_s=min(p.link_gbps, t.link_gbps) * 1e9 / 8,
            kv_bytes_per_token=self.model.kv_bytes_per_token,
            layerwise_residual_s=max(p.layerwise_residual_s, t.layerwise_residual_s),
            mode=self.transfer_mode,
        )

    @property
    def label(self) -> str:
        if not self.design.split:
            return f"{self.design.name} ({self.num_prompt}P/T)"
        return f"{self.design.name} ({self.num_prompt}P, {self.num_token}T)"


@lru_cache(maxsize=32)
def perf_model_for(machine: MachineType, model: ModelSpec, path: str = "") -> PerfModel:
    """The fitted performance model of `machine` running `model` (cached per process)."""
    return load_perf_model(
        path or profile_path(),
        model.name,
        machine.hardware,
        model.tensor_parallel,
        decode_context=model.decode_context,
    )


def parse_cluster(text: str) -> ClusterSpec:
    """`Splitwise-HH:25P15T`, `Splitwise-HH:25,15` or `Baseline-H100:40` into a ClusterSpec."""
    name, _, counts = text.partition(":")
    if name not in DESIGNS:
        raise ValueError(f"unknown design {name!r}; known: {', '.join(DESIGNS)}")
    design = DESIGNS[name]
    parts = counts.upper().replace("P", ",").replace("T", "").replace(" ", "").split(",")
    numbers = [int(p) for p in parts if p]
    if design.split and len(numbers) != 2:
        raise ValueError(f"{name} needs prompt and token counts, e.g. {name}:25P15T")
    if not design.split and len(numbers) != 1:
        raise ValueError(f"{name} needs one machine count, e.g. {name}:40")
    return ClusterSpec(design, numbers[0], numbers[1] if design.split else 0)
