"""Discovery for the mesh on Ray: who is up, where its sockets are, and which shards are whose.

Each engine and shard replica registers a `ServiceEntry` (its ZeroMQ endpoints, UCX link address,
KV heads) in a `Registry` and heartbeats every `HEARTBEAT_INTERVAL_S`; an entry that misses
heartbeats for `max_age_s` is gone. Routers follow `live()` and route only to `ready` entries, so
replicas added by scaling join routing and dead ones leave it, with nothing restarted.

Shard groups. A shard takes a head-range *slot* when it starts (the slot with the fewest live
shards, so 2 shards of a 2-slot group take slots 0 and 1). A token engine claims one ready,
unclaimed shard per slot, atomically; a claim ends with its shard or with its token engine (a
`ShardWorker` frees a departed engine's requests and accepts the next engine's link). A token
engine's entry lists what it holds (`shards`, `peers`), and registering it claims those again: a
restarted registry actor, which starts empty, has the claims back as soon as each token engine
re-registers at its next heartbeat, and hands none of them to another engine.

Generations. Each entry carries its application's `generation` (a digest of the args it was
deployed with). A token engine claims only shards and model peers of its own generation: during a
rolling update (`serve deploy` with changed args, which replaces every mesh replica) a new token
engine never links to an old shard or peer that Serve is about to stop, or that holds another
model; it waits for, or later claims, its own generation's.

Model peers (Lamina 4.3's rotation, services/engine/rotation.py). A peer registers ready with its
UCX `link_address`; a token engine claims up to its number of peers among the ready, unclaimed
ones, keeping those it holds (`claim_peers`). Unlike a shard group, a partial set is useful (each
peer is one more replica in the rotation), so a claim takes what there is; the engine's keeper
claims again until it has them all. A claim ends with the peer or with its token engine.

Watching. Every change of the live entries (one registered, changed, unregistered or expired)
bumps the registry's `version`; `wait_change(version, timeout_s)` returns as soon as the version
moves past the caller's (or at the timeout) with the live entries. A router's membership waits
there instead of reading the registry on a timer: a change reaches it at once, and an idle mesh
costs no reads. An entry expires while nobody calls: a waiter wakes at the next expiry deadline
and expires it itself. Heartbeats change no entry, so they wake no waiter.

`Registry` is a plain class (unit-testable, injected clock; its methods take one lock, since the
actor serves a long wait beside heartbeats on threads of its own); on Ray it runs as a named
detached actor, one per Serve application, created by whichever replica comes first
(`ray_registry.py`). A `LocalMesh` keeps one in its own process, without Ray.
"""

from __future__ import annotations

import functools
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ParamSpec, Protocol, TypeVar

import structlog

from common.protocol import ShardAddress
from common.roles import Role
from services.mesh.ticker import Ticker

log = structlog.get_logger(__name__)

MAX_HEARTBEAT_AGE_S = 5.0  # failure detection: an entry not heard from this long is gone
# Tied to that bound, not faster: an entry outlives two lost or late beats, and beating more
# often would notice a dead replica no sooner (each beat is an actor call: an idle mesh's cost).
# Readers confirm an absence over a beat and a second (`absence.py`): with a router's long poll
# a dead replica's requests migrate 5 + 2.5 s after its last beat, as with 1 s beats and 0.5 s
# reads before.
HEARTBEAT_INTERVAL_S = 1.5

P = ParamSpec("P")
R = TypeVar("R")


def _locked(method: Callable[P, R]) -> Callable[P, R]:
    """`method` under its registry's lock (the actor's threads, a `LocalMesh`'s callers)."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with args[0]._changed:  # type: ignore[attr-defined]
            return method(*args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class ServiceEntry:
    """One replica as the registry knows it, by its role (its deployment's).

    `state`: starting (not routable; a shard holding its slot), ready, or draining (finishes what
    it has, takes nothing new). Token engines list their shard group in `shards` as
    `ShardAddress`es; empty means local attention. `peers`: the model peers it holds, by id.
    `generation`: the application version it belongs to (module docstring).
    """

    role: Role
    service_id: str
    state: str = "starting"
    command_endpoint: str = ""
    kv_endpoint: str = ""
    control_endpoint: str = ""
    load_endpoint: str = ""
    link_address: str = ""
    kv_address: str = ""  # where prompt engines send it KV pages over UCX (`WorkerReady`)
    head_start: int = 0
    head_end: int = 0
    slot: int = -1  # shards: which head range of a group
    shards: tuple[ShardAddress, ...] = ()
    peers: tuple[str, ...] = ()
    generation: str = ""

    @property
    def is_engine(self) -> bool:
        return Role(self.role).is_engine

    def shard_address(self) -> ShardAddress:
        """How a token engine and prompt engines reach this shard."""
        return ShardAddress(
            self.kv_endpoint,
            self.head_start,
            self.head_end,
            self.link_address,
            self.service_id,
            self.kv_address,
        )


class Registry:
    """Entries with heartbeat times, head-range slots and shard claims; see the module docstring."""

    def __init__(
        self, max_age_s: float = MAX_HEARTBEAT_AGE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_age_s = max_age_s
        self.clock = clock
        self.entries: dict[str, ServiceEntry] = {}
        self.last_seen: dict[str, float] = {}
        self.claimed_by: dict[str, str] = {}  # shard or model peer id -> token engine id
        self.mesh_key: str | None = None  # the application's, when its args set none
        # `wait_change`'s version: this registry's own id (a restarted actor's differs, so no
        # reader takes its count for the old one's), and a count of changes of the live entries.
        self.epoch = secrets.token_hex(4)
        self.num_changes = 0
        self._changed = threading.Condition()  # the lock of every method; notified on a change

    @_locked
    def register(self, entry: ServiceEntry) -> None:
        """Add or replace an entry (a replica re-registers when its state changes). A token
        engine's entry claims the shards and peers it lists, unless another engine holds them."""
        if self.entries.get(entry.service_id) != entry:
            self._bump()
        self.entries[entry.service_id] = entry
        self.last_seen[entry.service_id] = self.clock()
        for held in [s.service_id for s in entry.shards] + list(entry.peers):
            self.claimed_by.setdefault(held, entry.service_id)

    @_locked
    def heartbeat(self, service_id: str) -> bool:
        """Refresh an entry; False if the registry does not know it (expired, or a new registry)."""
        self._expire()
        if service_id not in self.entries:
            return False
        self.last_seen[service_id] = self.clock()
        return True

    @_locked
    def unregister(self, service_id: str) -> None:
        if service_id in self.entries:
            self._bump()
        self.entries.pop(service_id, None)
        self.last_seen.pop(service_id, None)
        self.claimed_by.pop(service_id, None)
        for shard_id, owner in list(self.claimed_by.items()):
            if owner == service_id:  # a token engine left: its shards and peers serve the next
                del self.claimed_by[shard_id]

    @_locked
    def live(self) -> list[ServiceEntry]:
        """Every entry heard from within `max_age_s`, in registration order."""
        self._expire()
        return list(self.entries.values())

    @property
    def version(self) -> str:
        """`<epoch>:<changes>`: equal for two reads of one registry with no change between."""
        return f"{self.epoch}:{self.num_changes}"

    def wait_change(self, since: str, timeout_s: float) -> tuple[str, list[ServiceEntry]]:
        """(version, `live()`) once the version differs from `since` (at once if it does: ""
        for a first read), or at `timeout_s`. Entries whose heartbeats stop expire meanwhile:
        the wait wakes at the next expiry deadline to drop them, which is a change."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                self._expire()
                left = deadline - time.monotonic()
                if self.version != since or left <= 0:
                    return self.version, list(self.entries.values())
                # NOTE: the injected clock measures ages; real time paces the wait.
                self._changed.wait(min(left, self._next_expiry_s()))

    @_locked
    def take_shard_slot(self, entry: ServiceEntry, num_slots: int) -> int:
        """Register a starting shard in the slot with the fewest live shards (draining ones are
        leaving: not counted); return the slot."""
        self._expire()
        counts = [0] * num_slots
        for other in self.entries.values():
            serving = other.state != "draining"
            if other.role == Role.SHARD and serving and 0 <= other.slot < num_slots:
                counts[other.slot] += 1
        slot = min(range(num_slots), key=lambda s: (counts[s], s))
        self.register(replace(entry, slot=slot))
        return slot

    @_locked
    def claim_group(self, token_id: str, num_slots: int) -> list[ServiceEntry] | None:
        """One ready shard per slot for `token_id`, atomically; None if no full group.

        A shard `token_id` already holds keeps its slot (a group that lost one shard is made
        whole again with a replacement, not rebuilt); other slots take an unclaimed shard.
        """
        self._expire()
        group: list[ServiceEntry] = []
        for slot in range(num_slots):
            free = [e for e in self._shards() if e.slot == slot and self._claimable(e, token_id)]
            if not free:
                return None
            free.sort(key=lambda e: self.claimed_by.get(e.service_id) != token_id)
            group.append(free[0])
        for shard in group:
            self.claimed_by[shard.service_id] = token_id
        return group

    @_locked
    def claim_peers(self, token_id: str, num_peers: int) -> list[ServiceEntry]:
        """Up to `num_peers` ready model peers for `token_id`: the ones it holds first (in
        registration order), then unclaimed ones; each is claimed. Fewer (or none) if no more
        are free: the caller claims again later."""
        self._expire()
        peers = [e for e in self.entries.values() if e.role == Role.MODEL_PEER]
        usable = [e for e in peers if self._claimable(e, token_id)]
        usable.sort(key=lambda e: self.claimed_by.get(e.service_id) != token_id)  # stable
        claimed = usable[:num_peers]
        for peer in claimed:
            self.claimed_by[peer.service_id] = token_id
        return claimed

    @_locked
    def agree_key(self, proposed: str) -> str:
        """The application's mesh key: the first one proposed, for the registry's life. Replicas
        of every version of the application then share one key (a key drawn per deploy would
        split a rolling update into two meshes that cannot talk)."""
        if self.mesh_key is None:
            self.mesh_key = proposed
        return self.mesh_key

    @_locked
    def shard_census(self) -> tuple[int, int]:
        """(live shards, live shards no token engine has claimed), starting ones included."""
        self._expire()
        shards = self._shards()
        return len(shards), sum(e.service_id not in self.claimed_by for e in shards)

    def _shards(self) -> list[ServiceEntry]:
        return [e for e in self.entries.values() if e.role == Role.SHARD]

    def _claimable(self, entry: ServiceEntry, token_id: str) -> bool:
        owner = self.claimed_by.get(entry.service_id, token_id)
        token = self.entries.get(token_id)  # None: a caller that never registered (in-process)
        same_generation = token is None or token.generation == entry.generation
        return entry.state == "ready" and owner == token_id and same_generation

    def _expire(self) -> None:
        now = self.clock()
        for service_id, seen in list(self.last_seen.items()):
            if now - seen > self.max_age_s:
                log.warning("replica stopped heartbeating", service_id=service_id)
                self.unregister(service_id)

    def _next_expiry_s(self) -> float:
        """Seconds until the oldest entry expires (at least a little: a clock tick's rounding
        must not spin the wait); a long while when there is none."""
        if not self.last_seen:
            return self.max_age_s
        oldest = min(self.last_seen.values())
        return max(oldest + self.max_age_s - self.clock(), 0.0) + 0.01

    def _bump(self) -> None:
        self.num_changes += 1
        self._changed.notify_all()


class RegistryClient(Protocol):
    """What replicas and launchers call on a registry: the plain `Registry` in-process (the local
    launcher), or `RayRegistry` for the application's actor."""

    def register(self, entry: ServiceEntry) -> None: ...

    @_locked
    def heartbeat(self, service_id: str) -> bool: ...

    def unregister(self, service_id: str) -> None: ...

    def live(self) -> list[ServiceEntry]: ...

    def wait_change(self, since: str, timeout_s: float) -> tuple[str, list[ServiceEntry]]: ...

    def take_shard_slot(self, entry: ServiceEntry, num_slots: int) -> int: ...

    def claim_group(self, token_id: str, num_slots: int) -> list[ServiceEntry] | None: ...

    def claim_peers(self, token_id: str, num_peers: int) -> list[ServiceEntry]: ...

    def agree_key(self, proposed: str) -> str: ...

    def shard_census(self) -> tuple[int, int]: ...


class Membership:
    """This replica's registry entry, kept fresh by a heartbeat thread.

    The thread re-registers if the registry forgot the entry (a restarted registry actor), and
    stops heartbeating once `alive()` turns False, so routers drop a replica whose worker died.
    """

    def __init__(
        self,
        registry: RegistryClient,
        entry: ServiceEntry,
        alive: Callable[[], bool] = lambda: True,
        interval_s: float = HEARTBEAT_INTERVAL_S,
    ) -> None:
        self.registry = registry
        self.entry = entry
        self.alive = alive
        self.last_ok = time.monotonic()
        self._ticker = Ticker("heartbeat", interval_s, self._beat)

    def start(self) -> None:
        self._ticker.start()

    def update(self, **changes: Any) -> None:
        """Change this replica's entry (state, endpoints) and publish it now."""
        self.entry = replace(self.entry, **changes)
        self.registry.register(self.entry)
        self.last_ok = time.monotonic()

    def healthy(self) -> bool:
        """The heartbeat thread runs (or has not started yet). A heartbeat the registry has not
        taken lately is the registry's trouble, not this replica's: a registry that is slow,
        stopped or restarting must never fail a healthy replica's health check (Serve would
        replace every replica of the mesh at once). The thread re-registers when it is back."""
        thread = self._ticker.thread
        return thread.is_alive() or thread.ident is None  # None: not started yet

    def heartbeat_age_s(self) -> float:
        """Seconds since the registry last took this replica's heartbeat (for logs and stats)."""
        return time.monotonic() - self.last_ok

    def stop(self, unregister: bool = True) -> None:
        self._ticker.stop()
        if unregister:
            try:
                self.registry.unregister(self.entry.service_id)
            except Exception as exc:  # noqa: BLE001 - shutting down; the entry expires anyway
                log.warning("unregister failed", error=repr(exc))

    def _beat(self) -> None:
        if not self.alive():
            log.error("worker is dead; leaving the registry", service_id=self.entry.service_id)
            self.stop()
            return
        try:
            self._beat_once()
        except Exception as exc:  # noqa: BLE001 - keep trying; the registry may be restarting
            log.warning("heartbeat failed", error=repr(exc))

    def _beat_once(self) -> None:
        if not self.registry.heartbeat(self.entry.service_id):
            self.registry.register(self.entry)
        self.last_ok = time.monotonic()
