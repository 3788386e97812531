"""An attention shard (Lamina): the paged KV cache of a range of KV heads, and decode attention.

`AttentionShard` is the plain in-process class: KV pages arrive from prompt engines (layer by
layer or all at once), per-layer decode batches arrive from its token engine, finished or aborted
requests are freed (`common/kv_ingress.py` lands the KV). `ShardWorker` (worker.py) runs it as a
process: a thread drains the KV-ingress socket
while the main thread answers the token engine's per-layer round trips, so KV for new requests
lands while decode runs.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from common.attention import AttentionBackend
from common.attention.base import combine_partials
from common.block_manager import BlockManager, NoFreeBlocksError
from common.config import ModelConfig
from common.engine.runner import pad_block_tables
from common.kv_cache import KVCache
from common.kv_ingress import KV_LEASE_S, TOMBSTONES, KvIngress, Landed
from common.protocol import AttendBatch, EngineStats, KvPages
from common.roles import Role

log = structlog.get_logger(__name__)

KV_WAIT_S = 30.0  # how long a decode step waits for KV still in flight before failing
GROW_WAIT_S = 1.0  # how long a step waits for room to grow its requests (frees in flight)
ENDED_GENERATION = sys.maxsize  # a request freed for good: every later generation is stale


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

    @classmethod
    def of_model(
        cls, mc: ModelConfig, head_start: int, head_end: int, num_blocks: int, block_size: int
    ) -> ShardSpec:
        """KV heads `head_start:head_end` of the model `mc` describes, in its dtype."""
        return cls(mc.num_hidden_layers, head_start, head_end, mc.num_queries_per_kv, mc.head_dim,
                   num_blocks, block_size, getattr(torch, mc.dtype), mc.head_dim**-0.5)  # fmt: skip

    @property
    def num_kv_heads(self) -> int:
        return self.head_end - self.head_start


@dataclass(frozen=True)
class _StepTables:
    step: int
    block_tables: torch.Tensor  # [N, max_blocks] int32
    context_lens: torch.Tensor  # [N] int32
    slot_mapping: torch.Tensor  # [N] where this step's k/v go
    failed: list[str]  # requests of the step whose rows point at the scratch block

    @property
    def prev_lens(self) -> torch.Tensor:
        """[N] int32: the tokens before this step's, which `attend_prev` covers."""
        return self.context_lens - 1


@dataclass(frozen=True)
class _PrevPartial:
    """One layer's attention over the previous tokens, waiting for the new token's k/v."""

    step: int
    layer: int
    q: torch.Tensor  # [N, Hq, D]
    out: torch.Tensor  # [N, Hq, D] float32
    lse: torch.Tensor  # [N, Hq] float32


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
        self.spec = spec
        self.backend = backend
        self.blocks = BlockManager(spec.num_blocks, spec.block_size)
        # One block more than the accounting knows: the scratch block a failed request's row
        # reads and writes, so that it never touches another request's KV.
        self.scratch_block = spec.num_blocks
        self.kv = KVCache(
            spec.num_layers,
            spec.num_blocks + 1,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
            spec.dtype,
        )
        # A request's KV is claimed (off its lease) when a decode step first names it: its token
        # engine frees it from then on.
        # New KV leaves free a block per request decoding here (`claimed`), the most the next
        # step's growth takes: a prompt whose hand-off its token engine has not counted yet must
        # not take the room that engine counted on (it is refused, and recomputed there).
        self.ingress = KvIngress(self.blocks, self.kv, lease_s, clock, receiver=shard_id,
                                 keep_free=lambda: len(self.ingress.claimed()))  # fmt: skip
        # One step's tables per lane (`AttendBatch.lane`): concurrent sub-batches of one engine.
        self._steps: dict[int, _StepTables] = {}
        self._prev: dict[int, _PrevPartial] = {}  # per lane, between ATTEND_PREV and ATTEND_NEW
        # Preempted requests' KV generations held (`KvPages.kv_generation`); ingress thread only.
        self._generations: OrderedDict[str, int] = OrderedDict()

    # -- KV ingress ----------------------------------------------------------------------------

    def receive_kv(self, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> Landed:
        """Store `pages` (k/v [num_layers, num_tokens, heads, head_dim]) for its request."""
        if (pages.head_start, pages.head_end) != (self.spec.head_start, self.spec.head_end):
            raise ValueError(
                f"KV for heads [{pages.head_start}, {pages.head_end}) sent to a shard holding "
                f"[{self.spec.head_start}, {self.spec.head_end})"
            )
        if pages.kv_generation and not self._new_generation(pages):
            return Landed.DROPPED  # an older generation's page, late
        if pages.ack_to and pages.layer_start == 0 and not self.blocks.has(pages.req_id):
            self.ingress.revive(pages.req_id)  # swapped out again after a swap-in freed it here
        landed = self.ingress.receive(pages, k, v)
        if landed is Landed.REFUSED:
            log.warning("KV refused: no free blocks", shard=self.shard_id, req_id=pages.req_id)
        return landed

    def _new_generation(self, pages: KvPages) -> bool:
        """A preempted request's KV recomputed (`KvPages.kv_generation`): its first page lifts the
        tombstone its preemption's free left, or replaces the older generation still held (that
        free has not come yet, and is ignored when it does). False: pages of an older one."""
        held = self._generations.get(pages.req_id, 0)
        if pages.kv_generation < held:
            return False
        if pages.kv_generation > held and pages.layer_start == 0:
            if self.blocks.has(pages.req_id):
                self.ingress.free(pages.req_id)
            self.ingress.revive(pages.req_id)
            self._generations[pages.req_id] = pages.kv_generation
        return True

    def free(self, req_id: str, kv_generation: int | None = None) -> None:
        """Free a request's KV (`FreeRequest`): a preemption's frees its generation only."""
        if kv_generation is None:  # no generation of it lands after this (a resume in flight)
            self._generations[req_id] = ENDED_GENERATION
            self._generations.move_to_end(req_id)
            while len(self._generations) > TOMBSTONES:
                self._generations.popitem(last=False)
            self.ingress.free(req_id)
        elif kv_generation >= self._generations.get(req_id, 0):
            self.ingress.free(req_id, coming_back=True)

    def read_kv(self, req_id: str, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's first `num_tokens` tokens of KV, every layer: k, v [layers, T, heads, D]
        (a swap-in). KeyError when this shard does not hold that much of it."""
        with self.ingress.lock:
            if not self.blocks.has(req_id) or not self.ingress.is_complete(req_id):
                raise KeyError(f"shard {self.shard_id} holds no KV of {req_id}")
            if not 0 < num_tokens <= self.blocks.num_tokens(req_id):
                raise KeyError(f"shard {self.shard_id} holds fewer than {num_tokens} tokens of "
                               f"{req_id}")  # fmt: skip
            table = self.blocks.block_table(req_id)
        layers = [self.kv.gather(layer, table, num_tokens) for layer in range(self.spec.num_layers)]
        return torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])

    def free_decoded(self) -> int:
        """Free every request that decode steps have named and nobody has freed yet (its token
        engine is gone, so no FreeRequest will come); returns how many were freed."""
        decoded = self.ingress.claimed()
        for req_id in decoded:
            self.free(req_id)
        self._steps.clear()
        self._prev.clear()
        return len(decoded)

    def expire_leases(self) -> list[str]:
        """Free KV whose hand-off never came (`KvIngress.expire_leases`); returns the ids."""
        return self.ingress.expire_leases()

    # -- decode ---------------------------------------------------------------------------------

    def attend(
        self, batch: AttendBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """Append this step's k/v for every request in the batch, then attend: (out, lse, the
        requests this shard could not attend for, whose rows are meaningless)."""
        step = self._tables(batch)
        self.kv.write(batch.layer, k, v, step.slot_mapping)
        out, lse = self._decode(batch.layer, q, step.block_tables, step.context_lens)
        return out, lse, step.failed

    def attend_prev(self, batch: AttendBatch, q: torch.Tensor) -> None:
        """Lamina 4.2.2, first half: attend q [N, Hq, D] over each request's tokens before this
        step's (its k/v are still being computed) and keep the partial for `attend_new`."""
        self._prev.pop(batch.lane, None)  # a half left by a failed layer is never combined
        step = self._tables(batch)
        out, lse = self._decode(batch.layer, q, step.block_tables, step.prev_lens)
        self._prev[batch.lane] = _PrevPartial(batch.step, batch.layer, q, out, lse)

    def attend_new(
        self, batch: AttendBatch, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """Second half: append the new token's k/v [N, Hkv, D], attend to it and combine it with
        the kept partial by the softmax denominators (ARCHITECTURE.md): the same (out, lse,
        failed) as `attend` with q, k, v at once."""
        prev = self._prev.pop(batch.lane, None)
        if prev is None or (prev.step, prev.layer) != (batch.step, batch.layer):
            raise ValueError(f"new k/v for step {batch.step} layer {batch.layer} lane "
                             f"{batch.lane} without its query")  # fmt: skip
        step = self._steps[batch.lane]
        self.kv.write(batch.layer, k, v, step.slot_mapping)
        out_new, lse_new = new_token_partial(prev.q, k, v, self.spec.scale)
        out, lse = combine_partials(prev.out, prev.lse, out_new, lse_new)
        return out, lse, step.failed

    def _tables(self, batch: AttendBatch) -> _StepTables:
        """The step's tables for the batch's lane: built on layer 0, reused by the other layers."""
        step = self._steps.get(batch.lane)
        if step is None or batch.layer == 0 or step.step != batch.step:
            step = self._steps[batch.lane] = self._prepare_step(batch)
        return step

    def _wait_room(self, req_id: str, num_tokens: int, deadline: float) -> bool:
        """Whether `req_id` can grow to `num_tokens` by `deadline` (time.monotonic(): frees
        landing meanwhile)."""
        return self.ingress.lock.wait_for(
            lambda: self.blocks.can_grow(req_id, num_tokens),
            timeout=max(deadline - time.monotonic(), 0.0),
        )

    def _decode(
        self, layer: int, q: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.decode(
            q, self.kv.key[layer], self.kv.value[layer], block_tables, context_lens,
            self.spec.scale,
        )  # fmt: skip

    def _prepare_step(self, batch: AttendBatch) -> _StepTables:
        """Block tables and slots for a step, built once on layer 0 and reused by every layer."""
        if not batch.req_ids:
            raise ValueError(f"step {batch.step} starts at layer {batch.layer} without req_ids")
        # A request this shard cannot attend for (its KV refused, missing, or out of room to
        # grow) fails alone: its row points at the scratch block and it is named in `failed`.
        failed: list[str] = []
        grow_deadline = time.monotonic() + GROW_WAIT_S  # for the whole step, not per request
        with self.ingress.lock:
            for req_id, ctx in zip(batch.req_ids, batch.context_lens, strict=True):
                # Its KV up to the token before this step's (fewer: an older generation).
                if not self.ingress.wait_complete(req_id, KV_WAIT_S, ctx - 1):
                    why = "refused (no room)" if self.ingress.was_refused(req_id) else "missing"
                    log.warning("request's KV unusable", shard=self.shard_id, req_id=req_id,
                                why=why)  # fmt: skip
                    failed.append(req_id)
                    continue
                self.ingress.claim(req_id)
                # The token engine preempts before the shards run out, but its frees travel
                # apart from its steps: room they free is waited for, a bounded while.
                if not self._wait_room(req_id, ctx, grow_deadline):
                    log.warning("no room to grow", shard=self.shard_id, req_id=req_id)
                    failed.append(req_id)
                    continue
                self.blocks.grow(req_id, ctx)
            unusable = set(failed)
            tables, context_lens, slots = [], [], []
            for req_id, ctx in zip(batch.req_ids, batch.context_lens, strict=True):
                if req_id in unusable:  # one token's worth of the scratch block
                    tables.append([self.scratch_block])
                    context_lens.append(1)
                    slots.append(self.scratch_block * self.spec.block_size)
                else:
                    tables.append(self.blocks.block_table(req_id))
                    context_lens.append(ctx)
                    slots.append(self.blocks.slot(req_id, ctx - 1))
        return _StepTables(
            batch.step,
            pad_block_tables(tables),  # one tensor op, not one per row: this is on the step's path
            torch.tensor(context_lens, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.long),
            failed,
        )

    # -- reporting ------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        with self.ingress.lock:
            return EngineStats(
                self.shard_id,
                Role.SHARD,
                self.blocks.num_used_blocks,
                self.blocks.num_blocks,
                len(self.blocks.req_ids()),
                list(self.ingress.events),
            )


def new_token_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [N, Hq, D] over one token per row, k/v [N, Hkv, D] (grouped query heads):
    out [N, Hq, D] float32 is that token's v, lse [N, Hq] float32 its scaled score."""
    n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    qg = q.float().view(n, k.shape[1], group, head_dim)  # [N, Hkv, group, D]
    lse = torch.einsum("nhgd,nhd->nhg", qg, k.float()).reshape(n, num_heads) * scale
    out = v.float().unsqueeze(2).expand(n, k.shape[1], group, head_dim).reshape(q.shape)
    return out, lse


__all__ = ["AttentionShard", "NoFreeBlocksError", "ShardSpec"]
