"""The mesh's members as the router sees them: the registry, followed on one thread.

On Ray the thread waits on the registry's long poll (`wait_change`, `services.mesh.registry_watch`):
a change arrives at once, and an idle mesh costs one call per `IDLE_S`; while a decision waits on
the clock (an absence to confirm, a lent engine's lease) it asks every `refresh_s`. Without a long
poll (a `list_services` alone: tests' narrowed views) it reads every `refresh_s`.

Each read sets the engines the scheduler places on (ready ones, and the shards: a group with a shard
the registry lost is not placed on), the load endpoints the inbox subscribes to, and the pools (an
idle router returns what it borrowed, renews the rest). An engine a request runs on that stays
absent from the registry `ABSENT_CONFIRM_S` has left (`services.mesh.absence`): the attempts on it
are lost (`EngineLost`: their requests migrate), and the router's sockets to engines that left
are closed (`prune_links`). A failed read keeps the last view (the registry actor may be
restarting). docs/failures.md has the whole model."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import structlog

from common.telemetry import Metrics, bind_request
from services.mesh.absence import ABSENT_CONFIRM_S, Absences
from services.mesh.registry import ServiceEntry
from services.mesh.registry_watch import RegistryWatch, WaitChange
from services.mesh.ticker import Ticker
from services.router.cluster_scheduler import ClusterScheduler
from services.router.mesh_inbox import MeshInbox
from services.router.mesh_requests import EngineLost, MeshRequests

log = structlog.get_logger(__name__)

REFRESH_S = 0.5


class _Watch(Protocol):
    """`Ticker` (reads on a timer) or `RegistryWatch` (the long poll)."""

    thread: threading.Thread

    def stop(self, timeout_s: float | None = None) -> None: ...


class MeshMembership:
    """The registry's last view (`services`, under the requests' lock) and the watch thread."""

    def __init__(
        self,
        list_services: Callable[[], list[ServiceEntry]],
        requests: MeshRequests,
        scheduler: ClusterScheduler,
        inbox: MeshInbox,
        send_role_changes: Callable[[], None],
        *,
        refresh_s: float = REFRESH_S,
        metrics: Metrics | None = None,
        prune_links: Callable[[set[str], float], None] | None = None,
        wait_change: WaitChange | None = None,
    ) -> None:
        """`prune_links(live, now)`: given the command endpoints the registry lists, close the
        sockets to the others once they have been missing long enough. `wait_change`: the
        registry's long poll (the module docstring); None: read `list_services` on a timer."""
        self.list_services = list_services
        self.requests = requests
        self.scheduler = scheduler
        self.inbox = inbox
        self.send_role_changes = send_role_changes
        self.metrics = metrics
        self.prune_links = prune_links
        self.services: list[ServiceEntry] = []
        self._absences = Absences()  # engines of our requests the registry lacks
        # A dead thread would get the router replaced: the watch outlives a failed refresh.
        self._watch: _Watch
        if wait_change is None:
            self._watch = Ticker("mesh-watch", refresh_s, self.refresh)
        else:
            # After a change, a refresh_s pace until the absences it started are confirmed.
            self._watch = RegistryWatch(
                "mesh-watch", wait_change, self._on_view, busy_s=refresh_s,
                settle_s=ABSENT_CONFIRM_S + 2 * refresh_s, busy=self._lent,
            )  # fmt: skip
        self.thread = self._watch.thread  # the caller starts and joins it

    def live_ids(self) -> set[str]:
        with self.requests.lock:
            return {e.service_id for e in self.services}

    def close(self) -> None:
        """Stop the watch thread after its current read (the caller joins it)."""
        self._watch.stop()

    def refresh(self) -> None:
        """Read `list_services` and apply it (absences confirmed over `ABSENT_CONFIRM_S`)."""
        try:
            entries = self.list_services()
        except Exception as exc:  # noqa: BLE001 - keep the last view; the registry may restart
            log.warning("registry read failed", error=repr(exc))
            return
        self._apply(entries)

    def _on_view(self, version: str, entries: list[ServiceEntry]) -> None:
        """A long poll's answer, applied as a read's (absences confirmed over time: a registry
        that restarted, or was itself stopped past the heartbeat age, forgets live replicas
        until their next heartbeats)."""
        self._apply(entries)

    def _lent(self) -> bool:
        """An engine is lent to another pool: its lease is renewed (or it goes home) by the
        clock."""
        with self.requests.lock:
            homes = {e.service_id: str(e.role) for e in self.services}
        return any(pool != homes.get(sid, pool) for sid, pool in self.scheduler.pools().items())

    def _apply(self, entries: list[ServiceEntry]) -> None:
        # Ready engines, and the shards (a group with a shard the registry lost is not placed on).
        self.scheduler.set_engines([e for e in entries if e.state == "ready"])
        self.inbox.load_endpoints = frozenset(e.load_endpoint for e in entries if e.load_endpoint)
        self.scheduler.rebalance()  # an idle router returns what it borrowed, renews the rest
        self.send_role_changes()
        if self.metrics is not None:
            self.metrics.set_pool_sizes(Counter(self.scheduler.pools().values()))
        with self.requests.lock:
            before = {e.service_id for e in self.services}
            self.services = entries
        now = {e.service_id for e in entries}
        if now != before:
            log.info("mesh membership", joined=sorted(now - before), left=sorted(before - now),
                     ready=self.scheduler.can_place())  # fmt: skip
        clock = time.monotonic()
        if self.prune_links is not None:
            self.prune_links({e.command_endpoint for e in entries if e.command_endpoint}, clock)
        self._fail_orphans(self._confirmed_gone(now, clock))

    def _confirmed_gone(self, live_ids: set[str], now: float) -> set[str]:
        """Engines of our requests absent from the registry for `ABSENT_CONFIRM_S`: a registry
        actor that restarted knows no one until each replica's next heartbeat re-registers it,
        and that must not make every request in flight migrate off healthy engines."""
        return self._absences.gone(self.requests.engine_ids(), live_ids, now)

    def _fail_orphans(self, gone: set[str]) -> None:
        """Tell requests whose token engine left, or whose prompt engine left before the token
        engine took over, that their attempt is lost (they migrate); once per attempt."""
        for req_id, engine_id, traceparent in self.requests.lose_attempts(gone):
            with bind_request(req_id, traceparent=traceparent):
                log.error("engine left mid-request", engine=engine_id)
            wire_id = self.requests.wire_id(req_id)
            self.requests.deliver(
                wire_id, EngineLost(f"engine {engine_id} stopped responding", wire_id)
            )
