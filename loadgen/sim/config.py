"""Machine types, the model, and Splitwise's cluster designs (Tables I and V) as dataclasses.

Costs and powers are normalized to a DGX-A100 (Table V). Table V gives an H100 token machine a
cost of 2.5x against 2.35x for an H100 prompt machine; we keep both as printed. Baseline-H100 is
not in Table V; it uses the prompt-machine H100 figures. Bandwidths are the InfiniBand links of
§VI-A (200 Gbps A100, 400 Gbps H100) and the non-overlapped layer-wise residuals measured there
(8 ms A100, 5 ms H100).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from common.perf_model import KVTransferModel, PerfModel, TransferMode, load_perf_model
from common.scheduling.cluster import Pool

DEFAULT_PROFILE = (
    Path(__file__).resolve().parents[2] / ".." / "shared" / "perf" / ("splitwise_perf_model.csv")
)


def profile_path() -> Path:
    """The GPU profile table: `$PHASEMESH_PERF_PROFILE`, else the shared Splitwise table."""
    return Path(os.environ.get("PHASEMESH_PERF_PROFILE", str(DEFAULT_PROFILE))).resolve()


@dataclass(frozen=True)
class ModelSpec:
    """What the simulator needs of the served model: its profile key and KV size."""

    name: str = "llama2-70b"
    tensor_parallel: int = 8
    weight_bytes: int = 140 * 10**9  # 70B parameters in fp16
    # 80 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes.
    kv_bytes_per_token: int = 80 * 8 * 128 * 2 * 2


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

    def kv_capacity_tokens(self, model: ModelSpec) -> int:
        free = self.hbm_bytes * self.memory_utilization - model.weight_bytes
        return int(free // model.kv_bytes_per_token)


DGX_A100 = MachineType("DGX-A100", "a100-80gb", 1.0, 1.0, 200.0, 0.008)
DGX_H100 = MachineType("DGX-H100", "h100-80gb", 2.35, 1.75, 400.0, 0.005)
DGX_H100_TOKEN = replace(DGX_H100, cost=2.5)
DGX_H100_CAP = MachineType("DGX-H100-cap", "h100-80gb-pcap", 2.5, 1.23, 400.0, 0.005)


@dataclass(frozen=True)
class Design:
    """A cluster design: its prompt and token machine types, or one type for a baseline."""

    name: str
    prompt_type: MachineType
    token_type: MachineType
    split: bool = True


DESIGNS: dict[str, Design] = {
    d.name: d
    for d in (
        Design("Baseline-A100", DGX_A100, DGX_A100, split=False),
        Design("Baseline-H100", DGX_H100, DGX_H100, split=False),
        Design("Splitwise-AA", DGX_A100, DGX_A100),
        Design("Splitwise-HH", DGX_H100, DGX_H100_TOKEN),
        Design("Splitwise-HA", DGX_H100, DGX_A100),
        Design("Splitwise-HHcap", DGX_H100, DGX_H100_CAP),
    )
}


@dataclass(frozen=True)
class ClusterSpec:
    """A design with machine counts. A baseline's machines are all counted in `num_prompt`."""

    design: Design
    num_prompt: int
    num_token: int = 0
    model: ModelSpec = ModelSpec()
    transfer_mode: TransferMode = TransferMode.AUTO

    def __post_init__(self) -> None:
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

    def machine_types(self) -> list[tuple[MachineType, Pool]]:
        """Each machine's type and home pool, machine id = list index."""
        if not self.design.split:
            return [(self.design.prompt_type, Pool.MIXED)] * self.num_prompt
        prompts = [(self.design.prompt_type, Pool.PROMPT)] * self.num_prompt
        return prompts + [(self.design.token_type, Pool.TOKEN)] * self.num_token

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
        path or profile_path(), model.name, machine.hardware, model.tensor_parallel
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
