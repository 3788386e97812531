"""`KvNews`: which requests' KV landed whole on this shard, or was lost here, since the shard
last told its token engine (`AttendResult.kv_landed`, `kv_lost`).

Written by the ingress and puller threads, drained by the main thread into its next reply (any
layer of any step) or into the answer to an idle token engine's `KvReadyQuery`. Bounded: a shard
with no token engine linked keeps only the latest news.
"""

from __future__ import annotations

import threading
from collections import deque

MAX_NEWS = 4096


class KvNews:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._landed: deque[str] = deque(maxlen=MAX_NEWS)
        self._lost: deque[str] = deque(maxlen=MAX_NEWS)

    def landed(self, req_id: str) -> None:
        with self._cond:
            self._landed.append(req_id)
            self._cond.notify_all()

    def lost(self, req_id: str) -> None:
        with self._cond:
            self._lost.append(req_id)
            self._cond.notify_all()

    def drain(self, wait_s: float = 0.0) -> tuple[list[str], list[str]]:
        """(landed, lost) since the last drain, waiting up to `wait_s` for some if there is none."""
        if wait_s <= 0 and not self._landed and not self._lost:
            # Nearly every reply of a decode step: nothing new, and no lock taken for it (the
            # writers only append; news that lands just after this look goes with the next).
            return [], []
        with self._cond:
            if wait_s > 0:
                self._cond.wait_for(lambda: bool(self._landed or self._lost), timeout=wait_s)
            news = list(self._landed), list(self._lost)
            self._landed.clear()
            self._lost.clear()
            return news


__all__ = ["KvNews"]
