"""The offline group's options, its buffer's shapes and the checks made before any worker starts,
torch-free: the app's arguments (`offline:`), the Router and the group's own process read them;
the workers compute with them.

`MODES` names the configurations the Seesaw paper compares (services/offline/group.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from common.config import ModelConfig
from common.scheduling.seesaw import Schedule

# mode: (prefill sharding, decode sharding, schedule)
MODES: dict[str, tuple[str, str, Schedule]] = {
    "seesaw": ("pp", "tp", Schedule.TRANSITION_MINIMIZING),
    "tp": ("tp", "tp", Schedule.PREFILL_FIRST),
    "pp": ("pp", "pp", Schedule.PREFILL_FIRST),
    "prefill_first": ("pp", "tp", Schedule.PREFILL_FIRST),
    "decode_first": ("pp", "tp", Schedule.DECODE_FIRST),
}


class OfflineOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The app args' `offline:`: the group's size and room (None there: no offline group)."""

    workers: int = 2
    buffer_slots: int = 64  # requests whose prefilled KV the shared buffer holds
    decode_slots: int = 16  # requests decoding at once
    max_len: int = 1024  # prompt + output of one request
    mode: str = "seesaw"
    threads_per_worker: int = 1

    def __post_init__(self) -> None:
        if self.workers < 1 or self.buffer_slots < 1 or self.decode_slots < 1:
            raise ValueError("offline: workers, buffer_slots and decode_slots must be >= 1")
        if self.max_len < 2 or self.threads_per_worker < 1:
            raise ValueError("offline: max_len must be >= 2 and threads_per_worker >= 1")
        if self.mode not in MODES:
            raise ValueError(f"offline: mode must be one of {sorted(MODES)}")


def check_shardable(config: ModelConfig, k: int) -> None:
    """ValueError unless `k` workers split the model's layers, KV heads and MLP width evenly."""
    c = config
    for name, n in (("num_hidden_layers", c.num_hidden_layers),
                    ("num_key_value_heads", c.num_key_value_heads),
                    ("intermediate_size", c.intermediate_size)):  # fmt: skip
        if n % k:
            raise ValueError(f"{name} = {n} does not split over {k} workers")


@dataclass(frozen=True)
class KvShape:
    """The buffer's and the decode slots' sizes (tokens per request: `max_len`)."""

    num_buffer_slots: int
    num_decode_slots: int
    max_len: int

    def buffer_shape(self, c: ModelConfig) -> tuple[int, ...]:
        return (self.num_buffer_slots, c.num_hidden_layers, 2, c.num_key_value_heads,
                self.max_len, c.head_dim)  # fmt: skip

    def buffer_bytes(self, c: ModelConfig) -> int:
        return math.prod(self.buffer_shape(c)) * 4  # float32
