"""A timer thread: one call every `interval_s` until stopped.

For work with no event to block on: a heartbeat, or reading another process's state (child
processes, a registry without a long poll). The registry heartbeat (`Membership`), the local
mesh's supervisor and a router's membership read without the registry's long poll each run on
one; readers of the registry actor wait on its changes instead (`registry_watch.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


class Ticker:
    """Calls `tick()` every `interval_s` on a daemon thread named `name`, from `start()` until
    `stop()`, then `on_exit()` (if given) on the same thread: it closes what only the ticks use,
    ZeroMQ sockets say, which belong to one thread. A tick that raises is logged and the next one
    tries again: a dead thread would stop the work for good. Failures a tick expects (a registry
    restarting) it catches itself."""

    def __init__(
        self,
        name: str,
        interval_s: float,
        tick: Callable[[], None],
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.tick = tick
        self.on_exit = on_exit
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """No tick after the current one; wait up to `timeout_s` for it (None: do not wait, as a
        tick stopping its own ticker must not)."""
        self.stopped.set()
        if timeout_s is not None:
            self.thread.join(timeout_s)

    def _run(self) -> None:
        try:
            # NOTE: a timer (Event.wait), not a poll of shared state: see the module docstring.
            while not self.stopped.wait(self.interval_s):
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - keep ticking; the next tick may apply
                    log.exception("tick failed", thread=self.thread.name)
        finally:
            if self.on_exit is not None:
                self.on_exit()
