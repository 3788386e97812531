"""`services.mesh.registry.Registry` (the plain class the registry actor runs): liveness by
heartbeat, head-range slots for shards, atomic shard-group claims, the long poll of changes. A
fake clock stands in for time where ages are judged."""

from __future__ import annotations

import threading
import time

from common.roles import Role
from services.mesh.registry import Registry, ServiceEntry


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def shard(service_id: str) -> ServiceEntry:
    return ServiceEntry(role=Role.SHARD, service_id=service_id)


def test_entries_live_while_they_heartbeat() -> None:
    clock = Clock()
    registry = Registry(max_age_s=5, clock=clock)
    registry.register(ServiceEntry(role=Role.TOKEN, service_id="t0", state="ready"))
    registry.register(ServiceEntry(role=Role.TOKEN, service_id="t1", state="ready"))
    clock.now = 4
    assert registry.heartbeat("t0")
    clock.now = 6
    assert [e.service_id for e in registry.live()] == ["t0"]
    assert not registry.heartbeat("t1")  # expired: the replica must register again


def test_shards_take_balanced_slots_and_groups_need_every_slot() -> None:
    registry = Registry(clock=Clock())
    assert [registry.take_shard_slot(shard(f"s{i}"), 2) for i in range(4)] == [0, 1, 0, 1]
    assert registry.claim_group("t0", 2) is None  # all still starting
    for i in range(4):
        entry = next(e for e in registry.live() if e.service_id == f"s{i}")
        registry.register(type(entry)(**{**entry.__dict__, "state": "ready"}))
    first = registry.claim_group("t0", 2)
    second = registry.claim_group("t1", 2)
    assert first is not None and second is not None
    assert [e.slot for e in first] == [0, 1] and [e.slot for e in second] == [0, 1]
    assert {e.service_id for e in first}.isdisjoint(e.service_id for e in second)
    assert registry.claim_group("t2", 2) is None
    assert registry.shard_census() == (4, 0)


def test_a_claim_ends_with_its_shard() -> None:
    clock = Clock()
    registry = Registry(max_age_s=5, clock=clock)
    registry.take_shard_slot(shard("s0"), 1)
    registry.register(ServiceEntry(role=Role.SHARD, service_id="s0", state="ready", slot=0))
    assert registry.claim_group("t0", 1) is not None
    clock.now = 10  # s0 died; its replacement registers fresh and is claimable
    registry.take_shard_slot(shard("s1"), 1)
    registry.register(ServiceEntry(role=Role.SHARD, service_id="s1", state="ready", slot=0))
    assert registry.shard_census() == (1, 1)
    group = registry.claim_group("t1", 1)
    assert group is not None and group[0].service_id == "s1"


def test_a_claim_ends_with_its_token_engine() -> None:
    clock = Clock()
    registry = Registry(max_age_s=5, clock=clock)
    registry.take_shard_slot(shard("s0"), 1)
    registry.register(ServiceEntry(role=Role.SHARD, service_id="s0", state="ready", slot=0))
    registry.register(ServiceEntry(role=Role.TOKEN, service_id="t0", state="ready"))
    assert registry.claim_group("t0", 1) is not None
    assert registry.claim_group("t1", 1) is None
    clock.now = 4
    registry.heartbeat("s0")
    clock.now = 8  # t0 stopped heartbeating; the shard lives on and serves the next engine
    assert [e.service_id for e in registry.live()] == ["s0"]
    group = registry.claim_group("t1", 1)
    assert group is not None and group[0].service_id == "s0"


def ready_shard(service_id: str, slot: int) -> ServiceEntry:
    return ServiceEntry(role=Role.SHARD, service_id=service_id, state="ready", slot=slot)


def test_a_group_that_lost_a_shard_is_made_whole_with_its_replacement() -> None:
    clock = Clock()
    registry = Registry(max_age_s=5, clock=clock)
    for i in range(2):
        registry.take_shard_slot(shard(f"s{i}"), 2)
        registry.register(ready_shard(f"s{i}", i))
    first = registry.claim_group("t0", 2)
    assert first is not None and [e.service_id for e in first] == ["s0", "s1"]
    clock.now = 4
    registry.heartbeat("s0")
    clock.now = 8  # s1 died (SIGKILL: no unregister); s0 lives on, still t0's
    assert registry.take_shard_slot(shard("s1b"), 2) == 1  # the replacement takes the free slot
    assert registry.claim_group("t0", 2) is None  # still starting
    registry.register(ready_shard("s1b", 1))
    assert registry.claim_group("t1", 2) is None  # s0 is t0's: no other engine gets half of it
    regrouped = registry.claim_group("t0", 2)
    assert regrouped is not None and [e.service_id for e in regrouped] == ["s0", "s1b"]
    assert registry.shard_census() == (2, 0)


def test_a_reclaim_prefers_the_shards_the_engine_already_holds() -> None:
    registry = Registry(clock=Clock())
    for i, slot in enumerate([0, 1, 0]):
        registry.take_shard_slot(shard(f"s{i}"), 2)
        registry.register(ready_shard(f"s{i}", slot))
    registry.claim_group("t0", 2)  # s0, s1
    again = registry.claim_group("t0", 2)
    assert again is not None and [e.service_id for e in again] == ["s0", "s1"]
    assert registry.shard_census() == (3, 1)  # s2 stays free for another engine


def test_the_first_proposed_mesh_key_is_every_replicas() -> None:
    """An application without a set key: its first replica's proposal is the key every later
    replica gets, of this deploy or the next (a rolling update stays one mesh)."""
    registry = Registry()
    assert registry.agree_key("aa" * 32) == "aa" * 32
    assert registry.agree_key("bb" * 32) == "aa" * 32


def test_a_token_engine_claims_only_shards_and_peers_of_its_own_generation() -> None:
    # A rolling update (`serve deploy` with changed args): the old generation's shard and peer
    # are free and ready, the new ones still loading. The new token engine takes neither old
    # one, then its own as soon as they are ready.
    registry = Registry(clock=Clock())
    for service_id, generation, state in (("s-old", "g1", "ready"), ("s-new", "g2", "starting")):
        registry.register(ServiceEntry(role=Role.SHARD, service_id=service_id, state=state,
                                       slot=0, generation=generation))  # fmt: skip
    registry.register(ServiceEntry(role=Role.MODEL_PEER, service_id="p-old", state="ready",
                                   generation="g1"))  # fmt: skip
    registry.register(ServiceEntry(role=Role.TOKEN, service_id="t-new", generation="g2"))
    assert registry.claim_group("t-new", 1) is None
    assert registry.claim_peers("t-new", 1) == []
    registry.register(ServiceEntry(role=Role.SHARD, service_id="s-new", state="ready", slot=0,
                                   generation="g2"))  # fmt: skip
    registry.register(ServiceEntry(role=Role.MODEL_PEER, service_id="p-new", state="ready",
                                   generation="g2"))  # fmt: skip
    group = registry.claim_group("t-new", 1)
    assert group is not None and [e.service_id for e in group] == ["s-new"]
    assert [e.service_id for e in registry.claim_peers("t-new", 2)] == ["p-new"]
    # The old generation's token engine (still running until Serve stops it) keeps its own.
    registry.register(ServiceEntry(role=Role.TOKEN, service_id="t-old", generation="g1"))
    group = registry.claim_group("t-old", 1)
    assert group is not None and [e.service_id for e in group] == ["s-old"]
    assert [e.service_id for e in registry.claim_peers("t-old", 2)] == ["p-old"]


def test_an_entry_listing_another_engines_shard_and_peer_does_not_take_them() -> None:
    # A claim restored from an entry (`register`) never displaces the engine holding it: a stale
    # or wrong entry cannot steal a running engine's group or peer.
    registry = Registry(clock=Clock())
    registry.register(ServiceEntry(role=Role.SHARD, service_id="s0", state="ready", slot=0))
    registry.register(ServiceEntry(role=Role.MODEL_PEER, service_id="p0", state="ready"))
    group = registry.claim_group("t0", 1)
    assert group is not None and [e.service_id for e in registry.claim_peers("t0", 1)] == ["p0"]
    registry.register(ServiceEntry(role=Role.TOKEN, service_id="t1", state="ready",
                                   shards=(group[0].shard_address(),), peers=("p0",)))  # fmt: skip
    assert registry.claim_group("t1", 1) is None and registry.claim_peers("t1", 1) == []
    assert registry.claim_group("t0", 1) is not None  # still t0's
    # An entry naming replicas that do not exist claims nothing anyone could use.
    registry.register(ServiceEntry(role=Role.TOKEN, service_id="t2", state="ready",
                                   peers=("no-such-peer",)))  # fmt: skip
    assert registry.shard_census() == (1, 0)


class StalledRegistry(Registry):
    """A registry whose calls block while it is stopped (a SIGSTOPped actor: the caller waits),
    then answers as a restarted one would: it forgot every entry."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.running = threading.Event()
        self.running.set()

    def heartbeat(self, service_id: str) -> bool:
        self.running.wait()
        return super().heartbeat(service_id)


def test_a_stopped_registry_never_fails_a_replicas_health_and_it_re_registers_when_back() -> None:
    import time

    from services.mesh import registry as registry_module
    from services.mesh.registry import Membership

    registry = StalledRegistry()
    entry = ServiceEntry(role=Role.TOKEN, service_id="t0", state="ready")
    registry.register(entry)
    membership = Membership(registry, entry, interval_s=0.01)
    assert membership.healthy()  # not started yet
    membership.start()
    registry.running.clear()  # stopped: heartbeats block
    registry.entries.clear()  # and it forgets us (a restart)
    registry.last_seen.clear()
    time.sleep(0.1)
    membership.last_ok -= registry_module.MAX_HEARTBEAT_AGE_S + 1  # as if stopped that long
    assert membership.healthy()  # its trouble, not ours: Serve must not replace us
    assert membership.heartbeat_age_s() > registry_module.MAX_HEARTBEAT_AGE_S
    registry.running.set()  # back
    deadline = time.monotonic() + 5
    while not [e for e in registry.live() if e.service_id == "t0"]:
        assert time.monotonic() < deadline, "never re-registered"
        time.sleep(0.01)
    assert membership.healthy() and membership.heartbeat_age_s() < 1
    membership.stop(unregister=False)


def test_a_long_poll_returns_at_a_change_and_not_at_a_heartbeat() -> None:
    """`wait_change`: at once for an old version; otherwise woken by another thread's register
    (a real thread and the real lock, the actor's own concurrency), never by a heartbeat."""
    registry = Registry()
    registry.register(ServiceEntry(role=Role.TOKEN, service_id="t0", state="ready"))
    version, entries = registry.wait_change("", timeout_s=60)  # no version yet: at once
    assert [e.service_id for e in entries] == ["t0"]
    registry.heartbeat("t0")
    same, _ = registry.wait_change(version, timeout_s=0.2)  # a beat changes no entry
    assert same == version
    registry.register(ServiceEntry(role=Role.TOKEN, service_id="t0", state="ready"))
    assert registry.wait_change(version, timeout_s=0.2)[0] == version  # the same entry again

    def later() -> None:
        time.sleep(0.2)
        registry.register(ServiceEntry(role=Role.TOKEN, service_id="t0", state="draining"))

    thread = threading.Thread(target=later)
    thread.start()
    changed, entries = registry.wait_change(version, timeout_s=60)  # 60 s: a hang guard only
    thread.join()
    assert changed != version and [e.state for e in entries] == ["draining"]


def test_a_long_poll_wakes_to_expire_an_entry_that_stopped_heartbeating() -> None:
    """Nobody calls the registry while it waits: the waiter itself drops the silent entry at
    its expiry deadline, which is a change."""
    registry = Registry(max_age_s=0.3)
    registry.register(ServiceEntry(role=Role.SHARD, service_id="s0", state="ready"))
    version, _ = registry.wait_change("", timeout_s=0)
    changed, entries = registry.wait_change(version, timeout_s=60)  # 60 s: a hang guard only
    assert changed != version and entries == []


def test_a_new_registry_never_answers_with_an_old_ones_version() -> None:
    """A restarted actor counts its changes from zero: its version names it, so a reader's
    version from the old one is never taken for 'no change'."""
    old, new = Registry(), Registry()
    assert old.version != new.version
    assert new.wait_change(old.version, timeout_s=60)[0] == new.version
