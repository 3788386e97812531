"""Moving one decode request's KV between a token engine's two tiers (Neo §3): its own local KV
and its attention-shard group. `KvSwaps` does the moves; which request moves when is a pure
`TierPolicy`'s call (common/scheduling/tiers.py), made by the engine's `KvTiers` (`kv_tiers.py`).

- swap-out (local -> shards): the request's local KV (every layer, the tokens it computed) goes
  to every shard of the group, layer by layer, each shard its heads (as `KvShipper` splits them),
  over UCX, with `KvPages.ack_to` set: each shard answers `KvSwapAck` once all layers landed.
  The local copy is freed only when every shard has acknowledged; a refusal (no room) or a shard
  lost before then ends the request (retryably), and its local copy goes with it.
- swap-in (shards -> local): local blocks are reserved first, then each shard is asked
  (`FetchKv`) to send its heads back, one `KvPages` per layer, and drops its copy as it does (a
  move: a later swap-out then cannot race a free); when all have landed the request joins the
  local scheduler.

Consistency with the step: a moving request is in no step (it sits out from the moment its move
starts until its last page or ack is in), so the KV being moved never changes while it moves.
Other requests step on; the move travels on other threads (the KV sender, the shards' ingress)
and lands between steps. On a GPU engine the local tier is device memory: a swap-out's layer
leaves it through `HostStaging` (pinned host copies, one wait per layer) before the send, and a
swap-in's pages are written into the device cache from host memory; a copy that fails raises
in the step loop as any step error does, before anything of that layer was sent. A move that
does not finish within `SWAP_TIMEOUT_S` (a shard died or stopped reading) ends its request
retryably: the router re-runs it from its tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from common.block_manager import BlockManager
from common.device import HostStaging
from common.kv_cache import KVCache
from common.protocol import FetchKv, KvPages, KvSwapAck, ShardAddress
from common.scheduling.batching import Sequence
from common.scheduling.tiers import Tier
from services.engine.kv_shipper import KvSend
from services.engine.outbox import Outbox

# A swap whose acks or pages are not all in by then has lost a shard (or its socket): the request
# ends retryably. Generous: a swap is a few layers of one request's KV over loopback UCX.
SWAP_TIMEOUT_S = 10.0


@dataclass
class Move:
    """One request's KV on its way to `to`; `pending` is what has still to come: the head ranges
    not yet acknowledged (swap-out), or the (layer, head_start) pages not yet landed (swap-in)."""

    seq: Sequence
    to: Tier
    started: float
    num_tokens: int  # the tokens of KV moved (those it computed: all but its last)
    reserve_tokens: int  # its whole length, for the destination's accounting
    shards: tuple[ShardAddress, ...]
    pending: set[tuple[int, int]] = field(default_factory=set)


class KvSwaps:
    """The moves in flight of one token engine; see the module docstring. `reply_to` is the
    engine's UCX KV listener, where shards send acks and fetched pages."""

    def __init__(
        self, blocks: BlockManager, cache: KVCache, kv_send: KvSend, reply_to: str
    ) -> None:
        self.blocks, self.cache = blocks, cache
        self.staging = HostStaging(cache.device)
        self.kv_send, self.reply_to = kv_send, reply_to
        self.moving: dict[str, Move] = {}
        self.num_swaps = {Tier.LOCAL: 0, Tier.OFFLOADED: 0}  # moves finished, by destination

    def swap_out(
        self, seq: Sequence, shards: Seq[ShardAddress], reserve_tokens: int, now: float
    ) -> None:
        """Ship `seq`'s local KV to `shards`; its blocks stay held here until `on_ack` says all
        shards have it. The caller has taken `seq` out of its scheduler (not freed)."""
        num_tokens = seq.num_tokens - 1
        move = Move(seq, Tier.OFFLOADED, now, num_tokens, reserve_tokens, tuple(shards))
        move.pending = {(s.head_start, s.head_end) for s in shards}
        self.moving[seq.req_id] = move
        table = self.blocks.block_table(seq.req_id)
        num_layers = self.cache.key.shape[0]
        for layer in range(num_layers):  # layer by layer: each message is one layer's pages
            k, v = self.cache.gather(layer, table, num_tokens)  # [T, Hkv, D]
            if self.staging.on_device:  # the shards keep it in host memory
                k, v = self.staging.to_host(k, v)
            for s in shards:
                header = KvPages(
                    seq.req_id, layer, 1, num_tokens, s.head_start, s.head_end, num_layers,
                    sent_at=time.monotonic(), reserve_tokens=reserve_tokens, ack_to=self.reply_to,
                )  # fmt: skip
                heads = slice(s.head_start, s.head_end)
                self.kv_send(s, header, k[None, :, heads].clone(), v[None, :, heads].clone())

    def swap_in(self, seq: Sequence, shards: Seq[ShardAddress], now: float) -> Outbox:
        """Reserve `seq`'s local blocks and ask each shard for its heads back. The caller checked
        there is room (the tier policy's budget) and took `seq` out of the sharded rows."""
        num_tokens = seq.num_tokens - 1
        self.blocks.allocate(seq.req_id, seq.num_tokens)  # NoFreeBlocksError: nothing changed
        move = Move(seq, Tier.LOCAL, now, num_tokens, seq.num_tokens, tuple(shards))
        num_layers = self.cache.key.shape[0]
        move.pending = {(layer, s.head_start) for layer in range(num_layers) for s in shards}
        self.moving[seq.req_id] = move
        fetch = FetchKv(seq.req_id, num_tokens, self.reply_to)
        return Outbox(frees=[(s.kv_endpoint, fetch) for s in shards])

    def on_ack(self, ack: KvSwapAck) -> Move | None:
        """A shard's answer to a swap; the move when it is complete (all shards acknowledged;
        the local copy is then freed). Raises `SwapFailed` when the shard could not take it."""
        move = self.moving.get(ack.req_id)
        if move is None:  # ended meanwhile (aborted, timed out): nothing waits for it
            return None
        if ack.error:
            raise SwapFailed(f"a shard could not take part in its KV swap: {ack.error}")
        if move.to is not Tier.OFFLOADED:
            return None
        move.pending.discard((ack.head_start, ack.head_end))
        if move.pending:
            return None
        del self.moving[ack.req_id]
        self.blocks.free(ack.req_id)  # the shards have it all: the local copy goes
        self.num_swaps[Tier.OFFLOADED] += 1
        return move

    def on_pages(self, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> Move | None:
        """One fetched layer of one shard's heads; the move when all have landed. Pages that do
        not match the fetch raise ValueError before anything is written."""
        move = self.moving[pages.req_id]
        key = (pages.layer_start, pages.head_start)
        expected = (1, move.num_tokens, pages.head_end - pages.head_start, self.cache.key.shape[3])
        heads = {(s.head_start, s.head_end) for s in move.shards}
        if (
            move.to is not Tier.LOCAL
            or key not in move.pending
            or pages.num_layers != 1
            or (pages.head_start, pages.head_end) not in heads
            or tuple(k.shape) != expected
            or tuple(v.shape) != expected
        ):
            raise ValueError(f"swap-in pages of {pages.req_id} do not match its fetch: layer "
                             f"{pages.layer_start}, heads [{pages.head_start}, {pages.head_end}),"
                             f" k {tuple(k.shape)}; expected {expected}")  # fmt: skip
        device, dtype = self.cache.device, self.cache.key.dtype
        slots = torch.tensor(self.blocks.slots(pages.req_id, 0, move.num_tokens), device=device)
        blocks, offsets = slots // self.cache.block_size, slots % self.cache.block_size
        h = slice(pages.head_start, pages.head_end)
        # Advanced indices around slices put the token dim first: [T, h, D], as k[0] is.
        self.cache.key[pages.layer_start, blocks, h, :, offsets] = k[0].to(device, dtype)
        self.cache.value[pages.layer_start, blocks, h, offsets, :] = v[0].to(device, dtype)
        move.pending.discard(key)
        if move.pending:
            return None
        del self.moving[pages.req_id]
        self.num_swaps[Tier.LOCAL] += 1
        return move

    def is_swapping_in(self, req_id: str) -> bool:
        move = self.moving.get(req_id)
        return move is not None and move.to is Tier.LOCAL

    def expired(self, now: float) -> list[str]:
        return [r for r, m in self.moving.items() if now - m.started > SWAP_TIMEOUT_S]

    def drop(self, req_id: str) -> None:
        """The request ended mid-move: forget the move and free its local blocks (the copy a
        swap-out still held, or the room a swap-in reserved). The caller frees the shards'."""
        if self.moving.pop(req_id, None) is not None:
            self.blocks.free(req_id)


class SwapFailed(RuntimeError):
    """A shard refused or could not serve a swap: the request ends alone, retryably."""


__all__ = ["SWAP_TIMEOUT_S", "KvSwaps", "Move", "SwapFailed"]
