"""KV a prompt engine keeps for its shards to pull (`kv_transfer: pull`, Lamina §5).

With pull, the prompt engine does not push a request's KV into its shards while they decode (a
push lands in the middle of their steps); it keeps each shard's slice here and announces it, and
each shard fetches it in a free period between decode steps (`services/shard/kv_puller.py`).

`KvHold` keeps pages per (request, head range) until they are pulled, within two bounds:

- **bytes**: a request whose KV would take the hold past `max_bytes` is not held at all (`put`
  says False on its first page, and for each later one): its sender pushes it instead, so a full
  hold slows nothing and loses nothing;
- **lease**: KV nobody pulls within `lease_s` of its first page is freed by `expire` (its shard
  died, or its request ended before the pull); a pull after that is answered with a miss, and the
  shard reports the request's KV lost, so its token engine ends it retryably.

Thread-safe: the engine loop puts, the hold server's thread takes and expires.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from common.protocol import KvPages

HOLD_LEASE_S = 30.0  # long enough for a shard to find a free period; short enough to come back
REFUSED_MEMORY = 4096  # how many requests the hold remembers it refused (their pages go on pushed)

HoldKey = tuple[str, int, int]  # (req_id, head_start, head_end)


@dataclass
class _Held:
    since: float
    num_bytes: int = 0
    num_layers: int = 0
    total_layers: int = 0
    pages: list[tuple[KvPages, torch.Tensor, torch.Tensor]] = field(default_factory=list)


class KvHold:
    """Held KV pages by (request, heads); see the module docstring."""

    def __init__(
        self,
        max_bytes: int,
        lease_s: float = HOLD_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes, self.lease_s, self.clock = max_bytes, lease_s, clock
        self._lock = threading.Lock()
        self._held: dict[HoldKey, _Held] = {}
        self._refused: OrderedDict[HoldKey, None] = OrderedDict()
        self.num_bytes = 0

    def put(self, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Keep `pages` (k/v [num_layers, num_tokens, heads, head_dim]); False: not held (the
        request's whole KV would not fit, judged on its first page), the caller pushes it."""
        key = (pages.req_id, pages.head_start, pages.head_end)
        nbytes = k.nbytes + v.nbytes
        with self._lock:
            if key in self._refused:
                return False
            held = self._held.get(key)
            if held is None:
                whole = nbytes * pages.total_layers // max(pages.num_layers, 1)
                if self.num_bytes + whole > self.max_bytes:
                    self._refuse(key)
                    return False
                held = self._held[key] = _Held(self.clock(), total_layers=pages.total_layers)
            # Copies: the sender's tensors are views of a prefill batch that is reused.
            held.pages.append((pages, k.clone(), v.clone()))
            held.num_layers += pages.num_layers
            held.num_bytes += nbytes
            self.num_bytes += nbytes
            return True

    def is_complete(self, req_id: str, head_start: int, head_end: int) -> bool:
        with self._lock:
            held = self._held.get((req_id, head_start, head_end))
            return held is not None and held.num_layers >= held.total_layers

    def take(
        self, req_id: str, head_start: int, head_end: int
    ) -> tuple[KvPages, torch.Tensor, torch.Tensor] | str:
        """All layers of a complete request's KV for those heads, as one page (the hold forgets
        it), or why not."""
        key = (req_id, head_start, head_end)
        with self._lock:
            held = self._held.get(key)
            if held is None:
                return "not held here (expired, ended, or never held)"
            if held.num_layers < held.total_layers:
                return "not complete yet"
            del self._held[key]
            self.num_bytes -= held.num_bytes
        pages = sorted(held.pages, key=lambda p: p[0].layer_start)
        k = torch.cat([p[1] for p in pages])  # [layers, tokens, heads, head_dim]
        v = torch.cat([p[2] for p in pages])
        header = msgspec.structs.replace(pages[0][0], layer_start=0, num_layers=k.shape[0])
        return header, k, v

    def drop(self, req_id: str) -> None:
        """Forget every head range of `req_id` (it ended before its pulls)."""
        with self._lock:
            for key in [key for key in self._held if key[0] == req_id]:
                self.num_bytes -= self._held.pop(key).num_bytes

    def expire(self) -> list[HoldKey]:
        """Free what nobody pulled within `lease_s`; returns those keys."""
        with self._lock:
            deadline = self.clock() - self.lease_s
            expired = [key for key, held in self._held.items() if held.since < deadline]
            for key in expired:
                self.num_bytes -= self._held.pop(key).num_bytes
            return expired

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _refuse(self, key: HoldKey) -> None:
        self._refused[key] = None
        while len(self._refused) > REFUSED_MEMORY:
            self._refused.popitem(last=False)


__all__ = ["HOLD_LEASE_S", "KvHold"]
