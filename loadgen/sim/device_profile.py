"""A device profile: what the simulator's Lamina and Neo models cost a GPU engine's step with, in
one JSON format for the measured GPU profiles and for a device run.

A profile holds the three tables of Neo's cost model (seconds, all layers) and what Lamina's
pipeline adds to them:

- `dense_s` by batch tokens: a decode step's non-attention part on the device (T_l; Lamina's t_m
  times the layers);
- `device_attention_s` by context tokens: decode attention over KV in device memory (T_ga);
- `host_attention_s` by context tokens: decode attention over KV in host memory by the host's
  attention shards (T_ca; Lamina's t_a on its memory devices);
- the crossing between them: `host_link_bytes_s` one way and `host_link_latency_s` per message;
- the model's sizes (layers, q bytes per token per layer, KV bytes per token, the K/V projections'
  share of the dense part), the two tiers' KV room in tokens, and a price per hour for the device
  group and for the host group.

Two writers, one reader (`read_profile`):
- `splitwise_profile` derives one from the shared Splitwise table (`../shared/perf`, A100 and H100
  running Llama2-70B), as `neo_replay`'s machines do: T_l and T_ga from the decode sweeps, T_ca
  the host's memory bandwidth (`NEO_MACHINES`), the link their PCIe;
- `bench/device_profile.py` measures one on a device (bench/device_check.sh writes it to
  `$OUT/device_profile.json`), so a device run's profile drops in unchanged.

A file that is not this format (another `format`, a missing field, a table with fewer than two
points or x's not increasing) raises ValueError naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from common.perf_model import PiecewiseLinear
from loadgen.sim.designs import LLAMA2_70B
from loadgen.sim.lamina_config import H20, LLAMA_70B
from loadgen.sim.neo_replay import NEO_MACHINES

FORMAT = "phasemesh-device-profile/1"
TABLES = ("dense_s", "device_attention_s", "host_attention_s")
# Splitwise Table I: a DGX-A100 costs $17.6/h, a DGX-H100 $38/h (8 GPUs each).
DGX_USD_PER_GPU_HOUR = {"a100-80gb": 17.6 / 8, "h100-80gb": 38.0 / 8}
# The host group is priced as Lamina prices its memory devices against its compute devices
# (Table 1: H20 $4.63/h per H100's $11.06/h), per device of the slice it serves.
HOST_PRICE_RATIO = H20.usd_per_hour / 11.06
# One way across PCIe for a small message (a layer's q of a batch): the order of a
# cudaMemcpyAsync launch and completion.
PCIE_LATENCY_S = 10e-6


@dataclass(frozen=True)
class DeviceProfile:
    """One device group with its host's attention shards (see the module docstring)."""

    name: str
    source: str
    num_layers: int
    q_bytes_per_token: int  # one layer's q; the attention output back is as large
    kv_bytes_per_token: int  # all layers, K and V
    kv_proj_fraction: float  # K and V projections' share of the dense part (q-early overlap)
    device_kv_tokens: int  # the device's KV room: the GPU memory budget
    host_kv_tokens: int  # the host shards' KV room
    dense_s: PiecewiseLinear
    device_attention_s: PiecewiseLinear
    host_attention_s: PiecewiseLinear
    host_link_bytes_s: float
    host_link_latency_s: float
    device_usd_h: float
    host_usd_h: float

    def __post_init__(self) -> None:
        if min(self.num_layers, self.q_bytes_per_token, self.kv_bytes_per_token) <= 0:
            raise ValueError(f"device profile {self.name!r}: model sizes must be positive")
        if self.device_kv_tokens <= 0 or self.host_kv_tokens < 0:
            raise ValueError(f"device profile {self.name!r}: need device KV room > 0")
        if self.host_link_bytes_s <= 0 or min(self.device_usd_h, self.host_usd_h) <= 0:
            raise ValueError(f"device profile {self.name!r}: link and prices must be positive")
        if not 0 <= self.kv_proj_fraction < 1:
            raise ValueError(f"device profile {self.name!r}: kv_proj_fraction not in [0, 1)")

    @property
    def kv_bytes_per_token_layer(self) -> float:
        return self.kv_bytes_per_token / self.num_layers

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for name in TABLES:
            table = getattr(self, name)
            data[name] = {"xs": list(table.xs), "ys": list(table.ys)}
        return {"format": FORMAT, **data}


def profile_from_json(data: dict[str, Any], origin: str = "profile") -> DeviceProfile:
    """A `DeviceProfile` from its JSON object; ValueError naming `origin` when it is not one."""
    if data.get("format") != FORMAT:
        raise ValueError(f"{origin}: format {data.get('format')!r}, expected {FORMAT!r}")
    names = [f.name for f in fields(DeviceProfile)]
    missing = [n for n in names if n not in data]
    if missing:
        raise ValueError(f"{origin}: missing {', '.join(missing)}")
    values = {n: data[n] for n in names}
    try:
        for name in TABLES:
            table = data[name]
            values[name] = PiecewiseLinear(tuple(map(float, table["xs"])),
                                           tuple(map(float, table["ys"])))  # fmt: skip
        return DeviceProfile(**values)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{origin}: {error}") from error


def read_profile(path: str | os.PathLike[str]) -> DeviceProfile:
    """The profile in `path` (a JSON object, or a bench's output whose last line is one holding
    it under `device_profile`)."""
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        data = json.loads(text.splitlines()[-1] if text else "")
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from error
    if isinstance(data, dict) and "device_profile" in data:
        data = data["device_profile"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return profile_from_json(data, str(path))


def write_profile(profile: DeviceProfile, path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile.to_json(), f)


def splitwise_profile(machine: str) -> DeviceProfile:
    """The profile of `neo_replay.NEO_MACHINES[machine]` (a TP slice of A100s or H100s serving
    Llama2-70B, with its host) from the shared Splitwise table."""
    m = NEO_MACHINES[machine]
    costs = m.costs(LLAMA2_70B)
    lamina = LLAMA_70B
    device_usd_h = m.tensor_parallel * DGX_USD_PER_GPU_HOUR[m.hardware]
    return DeviceProfile(
        name=machine,
        source=f"splitwise_perf_model.csv ({m.hardware}, TP={m.tensor_parallel})",
        num_layers=lamina.num_layers,
        q_bytes_per_token=lamina.q_bytes_per_token,
        kv_bytes_per_token=LLAMA2_70B.kv_bytes_per_token,
        kv_proj_fraction=lamina.kv_proj_fraction,
        device_kv_tokens=m.local_kv_tokens(LLAMA2_70B),
        host_kv_tokens=m.host_kv_bytes // LLAMA2_70B.kv_bytes_per_token,
        dense_s=costs.linear_s_by_tokens,
        device_attention_s=costs.local_attention_s_by_context,
        host_attention_s=costs.offload_attention_s_by_context,
        host_link_bytes_s=m.pcie_bytes_s,
        host_link_latency_s=PCIE_LATENCY_S,
        device_usd_h=device_usd_h,
        host_usd_h=device_usd_h * HOST_PRICE_RATIO,
    )


def with_device_kv_tokens(profile: DeviceProfile, tokens: int) -> DeviceProfile:
    """The same profile at another GPU memory budget (tokens of KV)."""
    return replace(profile, device_kv_tokens=tokens)


__all__ = [
    "FORMAT",
    "HOST_PRICE_RATIO",
    "DeviceProfile",
    "profile_from_json",
    "read_profile",
    "splitwise_profile",
    "with_device_kv_tokens",
    "write_profile",
]
