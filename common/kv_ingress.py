"""Where KV computed elsewhere lands: one object for a token engine's own cache and a shard's heads.

A prompt engine ships each request's KV as `KvPages` (all layers in one message, or layer by layer,
Splitwise §IV-C). `KvIngress` allocates the request's blocks on its first page, writes each page's
layers through the request's slots, counts the layers landed and says when all have. Around that it
keeps the three rules that make KV arriving from another process safe to hold:

- **tombstones**: a request freed here (finished or aborted) is remembered, so a page arriving after
  it ended (an abort racing a transfer) is dropped instead of allocating blocks nobody frees;
- **leases**: KV that nobody claims within `lease_s` of its arrival is freed by `expire_leases`.
  Its hand-off never came (its prompt engine died, or its token engine refused or lost it), so no
  free would either. Whoever will free the request claims it (`claim`): a token engine when the
  hand-off arrives, a shard when a decode step first names it;
- **refusals**: a request whose KV does not fit is refused, not a crash: its blocks stay free, its
  later pages are dropped and `receive` says `REFUSED`, so its hand-off can fail alone. On a shard
  "fits" means the tokens shipped (`KvPages.reserve_tokens`); decode steps grow them, and the
  token engine preempts before the shards run out (services/engine/admission.py). On a token
  engine, "fits" also leaves free the blocks its running requests may still grow into
  (`keep_free`), so landing KV never takes the room a decode step needs.

Thread-safe for one ingress thread (`receive`, `free`, `expire_leases`) and one decode thread
(`claim`, `wait_complete`); `lock` also guards `blocks` for the decode thread's own growth.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from common.block_manager import BlockManager, NoFreeBlocksError
from common.kv_cache import KVCache
from common.protocol import KvEvent, KvPages
from common.telemetry.batch_spans import KvReceiveSpans

# KV that lands but that nobody claims within this bound is freed: long enough for a hand-off
# queued behind a full shard group, short enough that a lost one's KV comes back (docs/failures.md).
KV_LEASE_S = 120.0
# How many ended request ids to remember (tombstones): far more than can be in flight at once.
TOMBSTONES = 4096


class Landed(enum.Enum):
    """What one `receive` did with its pages."""

    DROPPED = "dropped"  # the request had ended here, or was refused before: nothing kept
    PARTIAL = "partial"  # stored; more layers are to come
    COMPLETE = "complete"  # stored; every layer of the request's KV is here now
    REFUSED = "refused"  # no room for the request's KV: nothing kept, later pages dropped


class KvIngress:
    """Lands shipped KV in a `KVCache` through a `BlockManager`; see the module docstring."""

    def __init__(
        self,
        blocks: BlockManager,
        cache: KVCache,
        lease_s: float = KV_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
        receiver: str = "",
        keep_free: Callable[[], int] | None = None,
    ) -> None:
        self.blocks, self.cache = blocks, cache
        # Blocks a new request's KV must leave free (its owner's reservations); called on the
        # thread that calls `receive`.
        self.keep_free = keep_free
        # Pages that carry a trace context (`KvPages.traceparent`) get a `kv.receive` span.
        self.spans = KvReceiveSpans(receiver)
        self.lease_s, self.clock = lease_s, clock
        self.lock = threading.Condition()
        self.events: deque[KvEvent] = deque(maxlen=256)
        self.num_layers = cache.key.shape[0]  # every request's KV has this many (`_check`)
        self._layers: dict[str, int] = {}  # req_id -> layers landed so far
        self._unclaimed: dict[str, float] = {}  # req_id -> when its first page came
        self._claimed: set[str] = set()
        self._ended: OrderedDict[str, Landed] = OrderedDict()  # DROPPED (freed) or REFUSED
        self._reviving: set[str] = set()  # of `_ended`: freed for a preemption, KV coming back

    def receive(self, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> Landed:
        """Store `pages` (k/v [num_layers, num_tokens, heads, head_dim]) for its request.
        Pages that do not fit this cache's geometry raise ValueError before anything is kept."""
        self._check(pages, k, v)
        with self.lock:
            if (ended := self._ended.get(pages.req_id)) is not None:
                return ended
            self.events.append(KvEvent("received", pages.req_id, pages.layer_start, self.clock(),
                                       pages.sent_at))  # fmt: skip
            if not self.blocks.has(pages.req_id):
                try:
                    self._allocate(pages)
                except NoFreeBlocksError:
                    self._end(pages.req_id, Landed.REFUSED)
                    self.lock.notify_all()  # a decode step waiting for it fails now, not later
                    return Landed.REFUSED
                if pages.req_id not in self._claimed:
                    self._unclaimed[pages.req_id] = self.clock()
            slots = torch.tensor(self.blocks.slots(pages.req_id, 0, pages.num_tokens))
        # Written outside the lock: the decode thread never reads a request before it is complete.
        for i in range(pages.num_layers):
            self.cache.write(pages.layer_start + i, k[i], v[i], slots)
        with self.lock:
            if pages.req_id in self._ended:
                return Landed.DROPPED  # freed while its layers were being written
            done = self._layers.get(pages.req_id, 0) + pages.num_layers
            self._layers[pages.req_id] = done
            if done >= self.num_layers:
                self.lock.notify_all()
        if pages.traceparent:
            layers = (pages.layer_start, pages.layer_start + pages.num_layers)
            heads = (pages.head_start, pages.head_end)
            complete = done >= self.num_layers
            self.spans.landed(pages.req_id, pages.traceparent, layers, heads,
                              k.nbytes + v.nbytes, complete)  # fmt: skip
        return Landed.COMPLETE if done >= self.num_layers else Landed.PARTIAL

    def _allocate(self, pages: KvPages) -> None:
        num_tokens = max(pages.num_tokens, pages.reserve_tokens)
        kept = self.keep_free() if self.keep_free is not None else 0
        if self.blocks.blocks_needed(num_tokens) > self.blocks.num_free_blocks - kept:
            raise NoFreeBlocksError(f"request {pages.req_id}: {kept} free blocks are reserved")
        self.blocks.allocate(pages.req_id, num_tokens)

    def _check(self, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> None:
        num_layers, _, num_heads, head_dim, _ = self.cache.key.shape
        shape = (pages.num_layers, pages.num_tokens, num_heads, head_dim)
        layers_ok = 0 <= pages.layer_start and pages.layer_start + pages.num_layers <= num_layers
        if not (
            layers_ok
            and pages.total_layers == num_layers
            and pages.num_tokens > 0
            and tuple(k.shape) == tuple(v.shape) == shape
            and k.dtype.is_floating_point
            and v.dtype.is_floating_point
        ):
            raise ValueError(
                f"KV pages of {pages.req_id} do not fit this cache: layers "
                f"[{pages.layer_start}, +{pages.num_layers}) of {pages.total_layers}, k "
                f"{tuple(k.shape)} {k.dtype}, v {tuple(v.shape)}; expected {shape} of "
                f"{num_layers} layers"
            )

    def is_complete(self, req_id: str) -> bool:
        with self.lock:
            return self._layers.get(req_id, 0) >= self.num_layers

    def wait_complete(self, req_id: str, timeout: float, min_tokens: int = 0) -> bool:
        """Whether all of `req_id`'s KV landed within `timeout` (KV and the decode step that needs
        it travel on different sockets; the step may win the race), holding `min_tokens` at
        least (fewer: an older generation, the new one still on its way). A request freed for a
        preemption is waited for too: its next generation is coming (`free`)."""

        def landed() -> bool:
            held = self.blocks.has(req_id) and self.blocks.num_tokens(req_id) >= min_tokens
            return self.is_complete(req_id) and held

        with self.lock:
            done = self.lock.wait_for(
                lambda: landed() or (req_id in self._ended and req_id not in self._reviving),
                timeout=timeout,
            )
            return bool(done) and landed()

    def claim(self, req_id: str) -> None:
        """Whoever will free `req_id` knows of it now: its KV is no longer on a lease."""
        with self.lock:
            self._claimed.add(req_id)
            self._unclaimed.pop(req_id, None)

    def claimed(self) -> list[str]:
        with self.lock:
            return list(self._claimed)

    def was_refused(self, req_id: str) -> bool:
        with self.lock:
            return self._ended.get(req_id) is Landed.REFUSED

    def has_ended(self, req_id: str) -> bool:
        """Freed or refused here: anything still arriving for it is to be dropped."""
        with self.lock:
            return req_id in self._ended

    def free(self, req_id: str, coming_back: bool = False) -> None:
        """The request ended: its blocks go back and later pages for it are dropped.
        `coming_back`: it was preempted, and its KV will be shipped again (`revive`)."""
        with self.lock:
            self.blocks.free(req_id)
            self._end(req_id, Landed.DROPPED)
            if coming_back:
                self._reviving.add(req_id)
            self.lock.notify_all()  # a decode step may wait for room to grow

    def revive(self, req_id: str) -> None:
        """Take KV for an ended `req_id` again: its token engine swaps it back here (Neo), or
        recomputed it after a preemption. A swap racing the request's abort lands after its
        free then: the lease frees it."""
        with self.lock:
            self._ended.pop(req_id, None)
            self._reviving.discard(req_id)

    def forget(self, req_id: str) -> None:
        """Stop tracking `req_id`'s landing; its blocks now belong to whoever decodes it."""
        with self.lock:
            for table in (self._layers, self._unclaimed):
                table.pop(req_id, None)
            self._claimed.discard(req_id)

    def expire_leases(self) -> list[str]:
        """Free KV that nobody claimed within `lease_s` of its arrival; returns those ids."""
        with self.lock:
            deadline = self.clock() - self.lease_s
            expired = [r for r, since in self._unclaimed.items() if since < deadline]
            for req_id in expired:
                self.free(req_id)
            return expired

    def _end(self, req_id: str, how: Landed) -> None:
        self.forget(req_id)
        self._reviving.discard(req_id)
        self.spans.ended(req_id)
        self._ended[req_id] = how
        self._ended.move_to_end(req_id)
        while len(self._ended) > TOMBSTONES:
            self._ended.popitem(last=False)


__all__ = ["KV_LEASE_S", "KvIngress", "Landed"]
