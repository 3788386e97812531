"""`ShardGroupKeeper` on the plain `Registry` with a fake clock: a token engine's group is reported
broken once a shard has been gone from the registry for `ABSENT_CONFIRM_S`, and whole again once
its replacement is ready; a restarted registry (empty for a heartbeat) breaks nothing and gives
no other engine the group."""

from __future__ import annotations

from typing import Any

from common.roles import Role
from services.mesh.absence import ABSENT_CONFIRM_S
from services.mesh.peer_group import ModelPeerKeeper
from services.mesh.registry import Registry, ServiceEntry
from services.mesh.shard_group import (
    ShardGroupKeeper,
    SlotBalance,
    claimant_of,
    rebuilders,
    surplus,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def start_shard(registry: Registry, service_id: str, num_slots: int) -> int:
    slot = registry.take_shard_slot(ServiceEntry(role=Role.SHARD, service_id=service_id), num_slots)
    registry.register(
        ServiceEntry(role=Role.SHARD, service_id=service_id, state="ready", slot=slot)
    )
    return slot


def ids(entries: tuple[ServiceEntry, ...]) -> list[str]:
    return [e.service_id for e in entries]


def test_a_whole_group_reports_nothing() -> None:
    registry = Registry(clock=Clock())
    start_shard(registry, "s0", 2)
    start_shard(registry, "s1", 2)
    keeper = ShardGroupKeeper(registry, "t0", 2, registry.claim_group("t0", 2) or ())
    assert keeper.check() is None
    assert keeper.check() is None


def test_a_lost_shard_breaks_the_group_until_its_replacement_is_ready() -> None:
    clock = Clock()
    registry = Registry(max_age_s=5, clock=clock)
    start_shard(registry, "s0", 2)
    start_shard(registry, "s1", 2)
    keeper = ShardGroupKeeper(registry, "t0", 2, registry.claim_group("t0", 2) or (), clock=clock)
    clock.now = 4
    registry.heartbeat("s0")
    clock.now = 8  # s1 was killed
    assert keeper.check() is None  # missing: maybe a restarted registry, not yet lost
    registry.heartbeat("s0")
    clock.now = 8 + ABSENT_CONFIRM_S
    change = keeper.check()
    assert change is not None and change.lost == ("s1",) and change.group == ()
    assert keeper.check() is None  # still broken, nothing new
    registry.heartbeat("s0")
    assert start_shard(registry, "s1b", 2) == 1
    change = keeper.check()
    assert change is not None and change.lost == () and ids(change.group) == ["s0", "s1b"]
    assert keeper.check() is None


def test_an_engine_without_a_group_gets_one_when_shards_appear() -> None:
    registry = Registry(clock=Clock())
    keeper = ShardGroupKeeper(registry, "t0", 1)
    assert keeper.check() is None
    start_shard(registry, "s0", 1)
    change = keeper.check()
    assert change is not None and ids(change.group) == ["s0"]


def test_local_attention_engines_never_claim() -> None:
    registry = Registry(clock=Clock())
    start_shard(registry, "s0", 1)
    assert ShardGroupKeeper(registry, "t0", 0).check() is None
    assert registry.shard_census() == (1, 1)


def test_a_keeper_started_on_a_partial_group_makes_it_whole() -> None:
    # The engine's shard died before anyone watched: the keeper starts with half a group.
    registry = Registry(clock=Clock())
    start_shard(registry, "s0", 2)
    start_shard(registry, "s1", 2)
    [s0, _] = registry.claim_group("t0", 2) or []
    registry.unregister("s1")
    keeper = ShardGroupKeeper(registry, "t0", 2, [s0])
    change = keeper.check()
    assert change is not None and change.group == ()  # no whole group yet: local attention
    assert keeper.check() is None
    start_shard(registry, "s1b", 2)
    change = keeper.check()
    assert change is not None and ids(change.group) == ["s0", "s1b"]


class RestartingRegistry:
    """A `Registry` whose state can be lost, as the Ray registry actor's is when it restarts."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.inner = Registry(max_age_s=5, clock=clock)

    def restart(self) -> None:
        self.inner = Registry(max_age_s=5, clock=self.clock)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_restarted_registry_breaks_no_group_and_hands_its_claims_to_no_other_engine() -> None:
    clock = Clock()
    registry = RestartingRegistry(clock)
    for shard_id in ("s0", "s1"):
        start_shard(registry.inner, shard_id, 2)
    registry.register(ServiceEntry(role=Role.MODEL_PEER, service_id="p0", state="ready"))
    group = registry.claim_group("t0", 2) or ()
    peers = registry.claim_peers("t0", 1)
    token = ServiceEntry(role=Role.TOKEN, service_id="t0", state="ready",
                         shards=tuple(e.shard_address() for e in group), peers=("p0",))  # fmt: skip
    registry.register(token)
    keeper = ShardGroupKeeper(registry, "t0", 2, group, clock=clock)
    peer_keeper = ModelPeerKeeper(registry, "t0", 1, peers, clock=clock)

    registry.restart()  # empty until each replica's next heartbeat
    clock.now = 0.5
    assert keeper.check() is None and peer_keeper.check() is None
    # Each replica's heartbeat finds itself forgotten and registers again (`Membership`); the
    # token engine first, so its claims are back before the shards are even listed.
    clock.now = 1.0
    registry.register(token)
    for shard_id, slot in (("s0", 0), ("s1", 1)):
        registry.register(
            ServiceEntry(role=Role.SHARD, service_id=shard_id, state="ready", slot=slot)
        )
    registry.register(ServiceEntry(role=Role.MODEL_PEER, service_id="p0", state="ready"))
    clock.now = 1.0 + ABSENT_CONFIRM_S
    assert keeper.check() is None and peer_keeper.check() is None  # nothing was lost
    assert registry.claim_group("t1", 2) is None and registry.claim_peers("t1", 1) == []
    assert ids(tuple(registry.claim_group("t0", 2) or ())) == ["s0", "s1"]
    # Claims end with their engine as before.
    registry.unregister("t0")
    assert ids(tuple(registry.claim_group("t1", 2) or ())) == ["s0", "s1"]


def test_the_prompt_engines_ready_now_may_rebuild_a_lost_shards_heads() -> None:
    """`LinkShards.rebuilders`: ready prompt and mixed engines only (a starting one, a token
    engine or a shard cannot rebuild KV for a group)."""
    registry = Registry(clock=Clock())
    start_shard(registry, "s0", 1)
    entries = [
        (Role.PROMPT, "p0", "ready"), (Role.PROMPT, "p1", "starting"),
        (Role.MIXED, "m0", "ready"), (Role.TOKEN, "t0", "ready"),
    ]  # fmt: skip
    for role, service_id, state in entries:
        registry.register(ServiceEntry(role=role, service_id=service_id, state=state,
                                       command_endpoint=f"{service_id}-cmd"))  # fmt: skip
    assert sorted(rebuilders(registry)) == ["m0-cmd", "p0-cmd"]


def test_a_draining_shard_serves_its_engine_on_and_is_claimed_by_no_other() -> None:
    """Scale-down: a shard told to stop turns `draining` while its engine drains: its keeper
    does not count it lost, and a new engine's claim does not take it."""
    clock = Clock()
    registry = Registry(clock=clock)
    for i in range(4):
        start_shard(registry, f"s{i}", 2)
    group = registry.claim_group("t0", 2) or ()
    keeper = ShardGroupKeeper(registry, "t0", 2, group, clock=clock)
    registry.register(ServiceEntry(role=Role.TOKEN, service_id="t0", state="draining",
                                   shards=tuple(e.shard_address() for e in group)))  # fmt: skip
    for shard in group:
        registry.register(ServiceEntry(role=Role.SHARD, service_id=shard.service_id,
                                       state="draining", slot=shard.slot))  # fmt: skip
        claimant = claimant_of(registry.live(), shard.service_id)
        assert claimant is not None and claimant.service_id == "t0"
    assert keeper.check() is None
    clock.now = ABSENT_CONFIRM_S + 1  # within the registry's heartbeat age
    assert keeper.check() is None  # its group is whole while it drains
    other = registry.claim_group("t1", 2)
    assert other is not None and not set(ids(tuple(other))) & set(ids(tuple(group)))
    assert claimant_of(registry.live(), "s9") is None


def test_a_spare_shard_in_a_slot_two_over_another_is_replaced_into_the_emptiest_slot() -> None:
    """A scale-down that stopped both slot-0 shards (Serve picks which, by node): what is left
    (two slot-1 shards) cannot form a group; the spare asks to be replaced, after a while, and
    its replacement takes slot 0."""
    clock = Clock()
    registry = Registry(max_age_s=60, clock=clock)  # no heartbeats needed in this test
    for i in range(4):
        start_shard(registry, f"s{i}", 2)  # slots 0, 1, 0, 1
    group = registry.claim_group("t0", 2) or ()
    registry.register(ServiceEntry(role=Role.TOKEN, service_id="t0", state="ready",
                                   shards=tuple(e.shard_address() for e in group)))  # fmt: skip
    assert ids(tuple(group)) == ["s0", "s1"]
    # Balanced, or one over (an odd count): nothing to do.
    assert not any(surplus(registry.live(), f"s{i}", 2) for i in range(4))
    registry.register(ServiceEntry(role=Role.SHARD, service_id="s2", state="draining", slot=0))
    assert not surplus(registry.live(), "s3", 2)
    # Both slot-0 shards stopped (still draining): t0's s1 stays held; s3, the spare, is replaced.
    registry.register(ServiceEntry(role=Role.SHARD, service_id="s0", state="draining", slot=0))
    assert surplus(registry.live(), "s3", 2) and not surplus(registry.live(), "s1", 2)
    balance = SlotBalance(registry, "s3", 2, after_s=10.0, clock=clock)  # observed by hand
    balance.observe()
    assert not balance.misplaced()
    clock.now = 9.0
    balance.observe()
    assert not balance.misplaced()  # not for long yet (a transient while replicas stop)
    clock.now = 10.0
    assert balance.misplaced()
    registry.unregister("s3")  # Serve replaced it: the replacement takes the emptiest slot,
    # the leaving (draining) ones not counted
    assert registry.take_shard_slot(ServiceEntry(role=Role.SHARD, service_id="s4"), 2) == 0


def test_a_failed_registry_read_is_never_a_misplaced_shard() -> None:
    class Gone:
        def live(self) -> list[ServiceEntry]:
            raise ConnectionError("registry restarting")

    balance = SlotBalance(Gone(), "s0", 2, after_s=0.0)  # type: ignore[arg-type]
    balance.observe()
    assert not balance.misplaced()
