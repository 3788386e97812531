"""An attention shard (Lamina): the paged KV cache of a range of KV heads, and decode attention.

`AttentionShard` is the plain in-process class: KV pages arrive from prompt engines (layer by
layer or all at once), per-layer decode batches arrive from its token engine, finished or aborted
requests are freed. `serve_shard` runs it as a process: a thread drains the KV-ingress socket
while the main thread answers the token engine's per-layer round trips, so KV for new requests
lands while decode runs.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from common.attention import AttentionBackend
from common.block_manager import BlockManager, NoFreeBlocksError
from common.engine.runner import pad_block_tables
from common.kv_cache import KVCache
from common.protocol import AttendBatch, EngineStats, KvEvent, KvPages

log = structlog.get_logger(__name__)

# How many finished/aborted request ids to remember, so that KV pages arriving after a request
# was freed (an abort racing a transfer) are dropped instead of leaking blocks.
_TOMBSTONES = 4096


# KV that lands here but that no decode step names within this bound is freed (a lease): long
# enough for a hand-off queued behind a full shard group, short enough that a lost one's KV comes
# back. See docs/failures.md.
KV_LEASE_S = 120.0


@dataclass(frozen=True)
class ShardSpec:
    """Geometry of one shard: which KV heads of which model it holds, and how much KV."""

    num_layers: int
    head_start: int
    head_end: int
    num_queries_per_kv: int
    head_dim: int
    num_blocks: int
    block_size: int
    dtype: torch.dtype
    scale: float

    @property
    def num_kv_heads(self) -> int:
        return self.head_end - self.head_start


@dataclass(frozen=True)
class _StepTables:
    step: int
    block_tables: torch.Tensor  # [N, max_blocks] int32
    context_lens: torch.Tensor  # [N] int32
    slot_mapping: torch.Tensor  # [N] where this step's k/v go


class AttentionShard:
    """Owns KV blocks for its heads and answers per-layer decode attention. Thread-safe for one
    ingress thread (`receive_kv`, `free`) plus one decode thread (`attend`)."""

    def __init__(
        self,
        shard_id: str,
        spec: ShardSpec,
        backend: AttentionBackend,
        lease_s: float = KV_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shard_id = shard_id
        self.lease_s = lease_s
        self.clock = clock
        self._leased: dict[str, float] = {}  # KV no decode step has claimed yet: when it came
        self.spec = spec
        self.backend = backend
        self.blocks = BlockManager(spec.num_blocks, spec.block_size)
        self.kv = KVCache(
            spec.num_layers,
            spec.num_blocks,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
            spec.dtype,
        )
        self._lock = threading.Condition()
        self._layers_received: dict[str, int] = {}  # req_id -> layers of KV landed so far
        self._complete: set[str] = set()
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._step: _StepTables | None = None
        self._decoded: set[str] = set()  # requests some decode step has named since their KV came
        self.kv_events: deque[KvEvent] = deque(maxlen=256)

    # -- KV ingress ----------------------------------------------------------------------------

    def receive_kv(self, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `pages` (k/v [num_layers, num_tokens, heads, head_dim]) for its request."""
        if (pages.head_start, pages.head_end) != (self.spec.head_start, self.spec.head_end):
            raise ValueError(
                f"KV for heads [{pages.head_start}, {pages.head_end}) sent to a shard holding "
                f"[{self.spec.head_start}, {self.spec.head_end})"
            )
        with self._lock:
            if pages.req_id in self._tombstones:
                return
            self.kv_events.append(
                KvEvent("received", pages.req_id, pages.layer_start, time.monotonic())
            )
            if not self.blocks.has(pages.req_id):
                self.blocks.allocate(pages.req_id, pages.num_tokens)
                if pages.req_id not in self._decoded:
                    self._leased[pages.req_id] = self.clock()
            slots = self._slots(pages.req_id, 0, pages.num_tokens)
        for i in range(pages.num_layers):
            self.kv.write(pages.layer_start + i, k[i], v[i], slots)
        with self._lock:
            done = self._layers_received.get(pages.req_id, 0) + pages.num_layers
            self._layers_received[pages.req_id] = done
            if done >= pages.total_layers:
                self._complete.add(pages.req_id)
                self._lock.notify_all()

    def free(self, req_id: str) -> None:
        with self._lock:
            self._leased.pop(req_id, None)
            self._decoded.discard(req_id)
            self.blocks.free(req_id)
            self._layers_received.pop(req_id, None)
            self._complete.discard(req_id)
            self._tombstones[req_id] = None
            while len(self._tombstones) > _TOMBSTONES:
                self._tombstones.popitem(last=False)

    def free_decoded(self) -> int:
        """Free every request that decode steps have named and nobody has freed yet (its token
        engine is gone, so no FreeRequest will come); returns how many were freed."""
        with self._lock:
            decoded = list(self._decoded)
        for req_id in decoded:
            self.free(req_id)
        self._step = None
        return len(decoded)

    def expire_leases(self) -> list[str]:
        """Free KV that no decode step has claimed within `lease_s` of its arrival: its hand-off
        never came (its prompt engine died, or its token engine refused or lost it), so no
        FreeRequest will either. Returns the freed request ids."""
        with self._lock:
            deadline = self.clock() - self.lease_s
            expired = [r for r, since in self._leased.items() if since < deadline]
        for req_id in expired:
            self.free(req_id)
        return expired

    # -- decode ---------------------------------------------------------------------------------

    def attend(
        self, batch: AttendBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's k/v for every request in the batch, then attend (out, lse)."""
        step = self._step
        if step is None or batch.layer == 0 or step.step != batch.step:
            step = self._step = self._prepare_step(batch)
        self.kv.write(batch.layer, k, v, step.slot_mapping)
        return self.backend.decode(
            q,
            self.kv.key[batch.layer],
            self.kv.value[batch.layer],
            step.block_tables,
            step.context_lens,
            self.spec.scale,
        )

    def _prepare_step(self, batch: AttendBatch) -> _StepTables:
        """Block tables and slots for a step, built once on layer 0 and reused by every layer."""
        if not batch.req_ids:
            raise ValueError(f"step {batch.step} starts at layer {batch.layer} without req_ids")
        with self._lock:
            for req_id in batch.req_ids:
                self._wait_for_kv(req_id)
            self._decoded.update(batch.req_ids)
            for req_id in batch.req_ids:  # claimed: the token engine frees it from now on
                self._leased.pop(req_id, None)
            for req_id, ctx in zip(batch.req_ids, batch.context_lens, strict=True):
                self.blocks.grow(req_id, ctx)
            tables = [self.blocks.block_table(r) for r in batch.req_ids]
            pairs = zip(batch.req_ids, batch.context_lens, strict=True)
            slots = [self.blocks.slot(r, ctx - 1) for r, ctx in pairs]
        return _StepTables(
            batch.step,
            pad_block_tables(tables),  # one tensor op, not one per row: this is on the step's path
            torch.tensor(batch.context_lens, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.long),
        )

    def _wait_for_kv(self, req_id: str) -> None:
        # KV and the decode batch travel on different sockets; the batch may win the race.
        if not self._lock.wait_for(lambda: req_id in self._complete, timeout=30.0):
            raise TimeoutError(f"shard {self.shard_id}: KV of {req_id} did not arrive in 30 s")

    def _slots(self, req_id: str, start: int, end: int) -> torch.Tensor:
        table = torch.tensor(self.blocks.block_table(req_id), dtype=torch.long)
        positions = torch.arange(start, end)
        return table[positions // self.spec.block_size] * self.spec.block_size + (
            positions % self.spec.block_size
        )

    # -- reporting ------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                self.shard_id,
                "shard",
                self.blocks.num_used_blocks,
                self.blocks.num_blocks,
                len(self.blocks.req_ids()),
                list(self.kv_events),
            )


__all__ = ["AttentionShard", "NoFreeBlocksError", "ShardSpec"]
