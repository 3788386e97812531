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

`ShardGroupKeeper.check()` is called periodically by whoever runs the engine (the Ray replica's
watch thread, or the local launcher's supervisor) and says what changed; it never touches links.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.roles import Role
from services.mesh.absence import ABSENT_CONFIRM_S, Absences, recheck
from services.mesh.registry import RegistryClient, ServiceEntry


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


def rebuilders(registry: RegistryClient) -> list[str]:
    """The command endpoints of the ready prompt (and mixed) engines: those that may rebuild a
    lost shard's heads (`LinkShards.rebuilders`)."""
    return [
        e.command_endpoint for e in registry.live()
        if e.role in (Role.PROMPT, Role.MIXED) and e.state == "ready"
    ]  # fmt: skip
