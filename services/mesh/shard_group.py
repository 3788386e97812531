"""Keeping a token engine's shard group whole while shards die and restart (Lamina §5).

A token engine decodes against one shard per head-range slot. When a shard leaves the registry (it
stopped heartbeating: killed, or its worker died) and stays gone for `ABSENT_CONFIRM_S` (a restarted
registry actor forgets every shard for a second: `services.mesh.absence`), the group is broken: the
engine must stop using that link and the requests decoding against it move elsewhere (the router
re-runs them from their tokens). Ray Serve restarts the shard; the replacement registers in the same
slot, and the keeper claims it, so the engine links to it and is whole again, with nothing else
restarted.

The replacement holds none of the dead shard's KV: the engine has a prompt engine recompute the lost
heads from each request's tokens (services/engine/shard_rebuild.py), so with the group it is told
the live prompt engines (`rebuilders`).

A group leaves after its token engine: a shard told to stop (scale-down) turns `draining` (no
engine claims it any more) and serves on while the token engine that holds it drains
(`claimant_of`); its engine's keeper counts a draining shard as present, not lost.

Serve picks which shard replicas a scale-down stops; on several nodes it may stop shards of one
slot, so that what is left cannot form a whole group (slot counts 0 and 2). A spare shard in a
slot with two more shards than another (`surplus`) asks to be replaced (`SlotBalance`: its
replica fails its health check after `REBALANCE_AFTER_S`), and the replacement takes the
emptiest slot (`Registry.take_shard_slot`).

`ShardGroupKeeper.check()` is called periodically by whoever runs the engine (the Ray replica's
watch thread, or the local launcher's supervisor) and says what changed; it never touches links.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import structlog

from common.roles import Role
from services.mesh.absence import ABSENT_CONFIRM_S, Absences, recheck
from services.mesh.registry import RegistryClient, ServiceEntry
from services.mesh.ticker import Ticker

log = structlog.get_logger(__name__)

REBALANCE_AFTER_S = 10.0  # a spare in an over-full slot this long is replaced (module docstring)


@dataclass(frozen=True)
class GroupChange:
    """What a check found: shards that left, and the group to link to now (empty: none yet)."""

    lost: tuple[str, ...]
    group: tuple[ServiceEntry, ...]


@dataclass(eq=False)
class ShardGroupKeeper:
    """One token engine's view of its shard group in the registry."""

    registry: RegistryClient
    token_id: str
    num_slots: int
    group: Sequence[ServiceEntry] = ()
    clock: Callable[[], float] = time.monotonic
    confirm_s: float = ABSENT_CONFIRM_S

    def __post_init__(self) -> None:
        self.group = tuple(self.group)
        self._absences = Absences(self.confirm_s)

    def check(self) -> GroupChange | None:
        """None while nothing changed; else the lost shards and the group claimed in their place.

        A shard missing for `ABSENT_CONFIRM_S` is lost: the broken group is reported then, with
        `group=()` when no replacement is ready yet; a later check reports the whole group when
        the replacement has registered.
        """
        found = recheck(
            self._absences, self.registry, self.group, self.num_slots,
            lambda: self.registry.claim_group(self.token_id, self.num_slots) or (), self.clock,
        )  # fmt: skip
        if found is None:
            return None
        lost, claimed = found
        self.group = claimed
        return GroupChange(lost, claimed)

    def confirming(self) -> bool:
        """A held shard is missing from the registry, not yet for `confirm_s`: the next check
        is due on the clock, not at a change."""
        return bool(self._absences.missing_since)


def claimant_of(entries: Iterable[ServiceEntry], shard_id: str) -> ServiceEntry | None:
    """The token engine that holds `shard_id` in its group, if any: a shard told to stop serves
    it while it drains (`MeshReplica.shutdown`)."""
    for e in entries:
        if e.role == Role.TOKEN and any(s.service_id == shard_id for s in e.shards):
            return e
    return None


def surplus(entries: Sequence[ServiceEntry], shard_id: str, num_slots: int) -> bool:
    """Whether `shard_id` is a spare in an over-full slot: ready, held by no token engine, in a
    slot with at least two more shards (starting or ready: draining ones are leaving) than
    another. One more is the normal state of an odd count; two more means a group cannot form."""
    shards = [e for e in entries if e.role == Role.SHARD and e.state != "draining"]
    me = next((e for e in shards if e.service_id == shard_id), None)
    if num_slots < 2 or me is None or me.state != "ready" or not 0 <= me.slot < num_slots:
        return False
    if claimant_of(entries, shard_id) is not None:
        return False
    counts = [0] * num_slots
    for e in shards:
        if 0 <= e.slot < num_slots:
            counts[e.slot] += 1
    return counts[me.slot] >= min(counts) + 2


@dataclass(eq=False)
class SlotBalance:
    """A shard replica's check that it is not a spare in an over-full slot for long (`surplus`).

    `observe()` reads the registry (a shard replica runs it on a thread of its own, `start`);
    `misplaced()` only reads what it found, so a health check never waits on the registry."""

    registry: RegistryClient
    shard_id: str
    num_slots: int
    after_s: float = REBALANCE_AFTER_S
    clock: Callable[[], float] = time.monotonic
    interval_s: float = 2.0

    def __post_init__(self) -> None:
        self._since: float | None = None
        self._ticker = Ticker("slot-balance", self.interval_s, self.observe)

    def start(self) -> None:
        self._ticker.start()

    def stop(self) -> None:
        self._ticker.stop(timeout_s=5)

    def observe(self) -> None:
        """One registry read; a failed one counts as balanced (the registry's own trouble)."""
        try:
            spare = surplus(self.registry.live(), self.shard_id, self.num_slots)
        except Exception as exc:  # noqa: BLE001 - the registry may be restarting
            log.warning("slot balance check failed", error=repr(exc))
            spare = False
        now = self.clock()
        self._since = (self._since if self._since is not None else now) if spare else None

    def misplaced(self) -> bool:
        """This shard has been a spare in an over-full slot for `after_s` (at the last read)."""
        return self._since is not None and self.clock() - self._since >= self.after_s


def rebuilders(registry: RegistryClient) -> list[str]:
    """The command endpoints of the ready prompt (and mixed) engines: those that may rebuild a
    lost shard's heads (`LinkShards.rebuilders`)."""
    return [
        e.command_endpoint for e in registry.live()
        if e.role in (Role.PROMPT, Role.MIXED) and e.state == "ready"
    ]  # fmt: skip
