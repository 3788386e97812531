"""Telling a replica that left from a registry that briefly forgot it.

The registry actor restarts (`max_restarts=-1`) with no entries; each replica re-registers at its
next heartbeat (`HEARTBEAT_INTERVAL_S`). For that while every healthy replica is missing from
`live()`, so a reader that acted on one missing read would migrate every request in flight (the
router) or drop a healthy shard group and its model peers (a token engine's keepers). A replica
counts as gone only once it has been missing from every read for `ABSENT_CONFIRM_S`, longer than
two heartbeat intervals. A replica that really stopped was already missing its heartbeats for
`MAX_HEARTBEAT_AGE_S` before the registry dropped it, and its direct links (UCX, ZeroMQ) fail
sooner than that, so the wait delays no failover that matters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence, Set

from services.mesh.registry import HEARTBEAT_INTERVAL_S, RegistryClient, ServiceEntry

# Two heartbeat intervals and a second: the beat due while the registry restarts may be lost
# to the restart itself (its call fails or waits for the new actor), and the next one
# re-registers in two calls (heartbeat, then register) to an actor that has just started. With
# one interval's margin, a loaded machine's replicas were counted gone and their groups
# dropped and claimed back.
ABSENT_CONFIRM_S = 2 * HEARTBEAT_INTERVAL_S + 1.0


class Absences:
    """When each watched id was first missing from the registry's reads, without a break."""

    def __init__(self, confirm_s: float = ABSENT_CONFIRM_S) -> None:
        self.confirm_s = confirm_s
        self.missing_since: dict[str, float] = {}

    def gone(self, watched: Iterable[str], present: Set[str], now: float) -> set[str]:
        """The ids of `watched` missing from `present` in every read for `confirm_s` up to `now`;
        an id seen again, or no longer watched, starts over."""
        watched = set(watched)
        for service_id in list(self.missing_since):
            if service_id in present or service_id not in watched:
                del self.missing_since[service_id]
        for service_id in watched - present:
            self.missing_since.setdefault(service_id, now)
        return {s for s, since in self.missing_since.items() if now - since >= self.confirm_s}

    def lost(self, held: Sequence[str], present: Set[str], now: float) -> tuple[str, ...] | None:
        """What a keeper of `held` acts on: those gone (`gone`), in `held`'s order; None while
        one is missing but not yet for `confirm_s` (decide nothing: ask again later)."""
        gone = self.gone(held, present, now)
        if any(now - since < self.confirm_s for since in self.missing_since.values()):
            return None
        return tuple(s for s in held if s in gone)


def recheck(
    absences: Absences,
    registry: RegistryClient,
    held: Sequence[ServiceEntry],
    num_wanted: int,
    claim: Callable[[], Sequence[ServiceEntry]],
    clock: Callable[[], float],
) -> tuple[tuple[str, ...], tuple[ServiceEntry, ...]] | None:
    """One check of a keeper that holds `held` and wants `num_wanted` entries: None while
    nothing changed (all held and present, one missing not yet for `confirm_s`, or still short
    with nothing new to claim); else the ids lost, in `held`'s order, and what `claim()` returns
    now, the entries to hold from then on."""
    if num_wanted == 0:
        return None
    # A draining entry still serves what it holds (a shard waits for its draining engine): not
    # lost until it leaves the registry; claims take only ready ones (`Registry.claim_group`).
    serving = {e.service_id for e in registry.live() if e.state in ("ready", "draining")}
    lost = absences.lost(_ids(held), serving, clock())
    if lost is None:
        return None  # one is missing, maybe only from a restarted registry: ask again later
    if not lost and len(held) == num_wanted:
        return None
    claimed = tuple(claim())
    if not lost and _ids(claimed) == _ids(held):
        return None  # still short, nothing new
    return lost, claimed


def _ids(entries: Sequence[ServiceEntry]) -> list[str]:
    return [e.service_id for e in entries]


__all__ = ["ABSENT_CONFIRM_S", "Absences", "recheck"]
