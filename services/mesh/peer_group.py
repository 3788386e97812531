"""Keeping a token engine's model peers (Lamina 4.3's rotation) linked while peers die and restart.

A token engine with `model_peers: N` rotates its decode lanes' layer slices over N peers
(services/engine/rotation.py). A peer that leaves the registry (killed, or its worker died) and
stays gone for `ABSENT_CONFIRM_S` (`services.mesh.absence`: a restarted registry actor forgets every
peer for a second) is lost; Ray Serve starts a replacement, which registers ready, and the keeper
claims it, so the engine links to it and the rotation grows back, with nothing else restarted. Peers
that start after their engine (a deploy brings every deployment up at once) are claimed the same
way.

`ModelPeerKeeper.check()` is called periodically by whoever runs the engine (the Ray replica's
watch thread, `services.mesh.replica.GroupWatch`) and says what changed; it never touches links.
`due_reminder()` says when to repeat the current list anyway: a `LinkPeers` is idempotent, and a
repeat re-links a peer the engine dropped for a fault (a silent or wrong reply) that is still
registered, so a transient fault does not shrink the rotation for good.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.mesh.absence import Absences, recheck
from services.mesh.registry import RegistryClient, ServiceEntry

REMIND_INTERVAL_S = 5.0  # how often the current list is repeated to the engine


@dataclass(frozen=True)
class PeerChange:
    """What a check found: peers that left, and the peers to link to now (in rotation order)."""

    lost: tuple[str, ...]
    peers: tuple[ServiceEntry, ...]

    def addresses(self) -> list[str]:
        return [e.link_address for e in self.peers]


@dataclass(eq=False)
class ModelPeerKeeper:
    """One token engine's view of its model peers in the registry."""

    registry: RegistryClient
    token_id: str
    num_peers: int
    peers: Sequence[ServiceEntry] = ()
    remind_interval_s: float = REMIND_INTERVAL_S
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.peers = tuple(self.peers)
        self._last_told = self.clock()
        self._absences = Absences()

    def check(self) -> PeerChange | None:
        """None while nothing changed; else the lost peers and the peers claimed now (those
        still held first, in their order, then new ones). A peer missing for
        `ABSENT_CONFIRM_S` is lost and reported then, without a replacement if none is ready; a
        later check adds the replacement."""
        found = recheck(
            self._absences, self.registry, self.peers, self.num_peers,
            lambda: self.registry.claim_peers(self.token_id, self.num_peers), self.clock,
        )  # fmt: skip
        if found is None:
            return None
        lost, claimed = found
        self.peers = claimed
        self._last_told = self.clock()
        return PeerChange(lost, claimed)

    def due_reminder(self) -> list[str] | None:
        """The current addresses when a reminder is due (every `remind_interval_s`), else None."""
        if not self.peers or self.clock() - self._last_told < self.remind_interval_s:
            return None
        self._last_told = self.clock()
        return [e.link_address for e in self.peers]


__all__ = ["ModelPeerKeeper", "PeerChange"]
