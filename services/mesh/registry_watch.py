"""A thread that follows the registry by its long poll (`Registry.wait_change`), not by a timer.

A reader of the registry (a router's membership, a token engine's shard-group keeper) is called
with the live entries each time they change, at once, and otherwise only as often as something
time-driven needs it: while a decision waits on the clock (an absence to confirm, a lease to
renew: `busy()`, and for `settle_s` after each change, while the absences a change starts are
confirmed) every `busy_s`, else every `idle_s`. An idle mesh then costs one registry call per
`idle_s` per reader instead of one per `busy_s`.

Faults: a registry that does not answer (stopped, restarting) raises from the call; the watch
logs it and asks again after `busy_s`, keeping the reader's last view. A reader that raises is
logged and called again at the next change or timeout (a dead thread would stop it for good).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from services.mesh.registry import ServiceEntry

log = structlog.get_logger(__name__)

IDLE_S = 2.0  # the long poll's timeout while nothing waits on the clock (bounds `stop` too)

WaitChange = Callable[[str, float], tuple[str, list[ServiceEntry]]]


class RegistryWatch:
    """Calls `on_view(version, entries)` on a daemon thread named `name` (see the module
    docstring), from `start()` until `stop()`, then `on_exit()` on the same thread."""

    def __init__(
        self,
        name: str,
        wait_change: WaitChange,
        on_view: Callable[[str, list[ServiceEntry]], None],
        *,
        busy_s: float,
        settle_s: float,
        idle_s: float = IDLE_S,
        busy: Callable[[], bool] = lambda: False,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        self.wait_change = wait_change
        self.on_view = on_view
        self.busy_s, self.settle_s, self.idle_s = busy_s, settle_s, idle_s
        self.busy = busy
        self.on_exit = on_exit
        self.version = ""  # no version yet: the first call answers at once
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._settle_until = 0.0
        self._last: list[ServiceEntry] | None = None

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """No call after the current wait; wait up to `timeout_s` for the thread (a long poll in
        flight ends by its timeout, at most `idle_s`)."""
        self.stopped.set()
        if timeout_s is not None:
            self.thread.join(timeout_s)

    def wait_s(self) -> float:
        """How long the next long poll may wait for a change."""
        if time.monotonic() < self._settle_until or self.busy():
            return self.busy_s
        return self.idle_s

    def _run(self) -> None:
        try:
            while not self.stopped.is_set():
                try:
                    version, entries = self.wait_change(self.version, self.wait_s())
                except Exception as exc:  # noqa: BLE001 - the registry may be restarting
                    log.warning("registry wait failed", thread=self.thread.name, error=repr(exc))
                    self.stopped.wait(self.busy_s)
                    continue
                if self.stopped.is_set():
                    break
                self.version = version
                if entries != self._last:
                    self._last = entries
                    self._settle_until = time.monotonic() + self.settle_s
                try:
                    self.on_view(version, entries)
                except Exception:  # noqa: BLE001 - the next change or timeout calls again
                    log.exception("registry view failed", thread=self.thread.name)
        finally:
            if self.on_exit is not None:
                self.on_exit()
