"""`ShardGroupKeeper` on the plain `Registry` with a fake clock: a token engine's group is reported
broken the moment a shard stops heartbeating, and whole again once its replacement is ready."""

from __future__ import annotations

from common.roles import Role
from services.mesh.registry import Registry, ServiceEntry
from services.mesh.shard_group import ShardGroupKeeper


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
    keeper = ShardGroupKeeper(registry, "t0", 2, registry.claim_group("t0", 2) or ())
    clock.now = 4
    registry.heartbeat("s0")
    clock.now = 8  # s1 was killed
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
