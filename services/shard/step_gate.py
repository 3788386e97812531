"""`StepGate`: a shard's free periods between decode steps, for pulling KV (Lamina §5).

The main thread marks a step from its layer 0 to its last layer (`start_step`, `end_step`); the
KV puller lands a pulled request only outside a step (`free_period`), and a step that arrives
while a landing is in progress waits for it (one request's KV, never more). So a decode step is
never slowed mid-layer by KV arriving, and never waits at layer 0 for a newcomer's KV: the token
engine only names a request in a step once every shard said its KV landed.

A step its token engine abandoned (a fault, a dead link) would hold the gate shut: the main thread
ends it when its link falls idle (`end_step` on a receive timeout) or closes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class StepGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_step = False
        self._landing = False

    def start_step(self) -> None:
        """Layer 0 of a step arrived: wait for a landing in progress, then keep the next out."""
        with self._cond:
            self._cond.wait_for(lambda: not self._landing)
            self._in_step = True

    def end_step(self) -> None:
        with self._cond:
            self._in_step = False
            self._cond.notify_all()

    @contextmanager
    def free_period(self) -> Iterator[None]:
        """Wait until no step is in progress, and keep the next one waiting while inside."""
        with self._cond:
            self._cond.wait_for(lambda: not self._in_step)
            self._landing = True
        try:
            yield
        finally:
            with self._cond:
                self._landing = False
                self._cond.notify_all()


__all__ = ["StepGate"]
