"""Model peers in the registry (`Registry.claim_peers`) and `ModelPeerKeeper`, on the plain
`Registry` with a fake clock: a token engine claims its peers like a shard group, a lost peer is
reported once it has been gone for `ABSENT_CONFIRM_S` and its replacement (Serve's new replica)
claimed when ready, and the current list is repeated to the engine now and then (a peer it
dropped for a fault rejoins); a token engine that fails to start frees what it claimed."""

from __future__ import annotations

import functools

import pytest
import torch

from common.mesh_options import MeshOptions
from common.roles import Role
from common.worker_config import WorkerConfig
from services.mesh import replica
from services.mesh.absence import ABSENT_CONFIRM_S
from services.mesh.peer_group import ModelPeerKeeper
from services.mesh.registry import Membership, Registry, ServiceEntry
from tests.unit.test_shard_group import Clock, ids


def start_peer(registry: Registry, service_id: str, state: str = "ready") -> None:
    registry.register(ServiceEntry(role=Role.MODEL_PEER, service_id=service_id, state=state,
                                   link_address=f"ucx-{service_id}"))  # fmt: skip


def test_claims_are_exclusive_partial_and_sticky() -> None:
    registry = Registry(clock=Clock())
    for name in ("p0", "p1", "p2"):
        start_peer(registry, name)
    start_peer(registry, "p3", state="starting")
    assert ids(tuple(registry.claim_peers("t0", 2))) == ["p0", "p1"]
    assert ids(tuple(registry.claim_peers("t1", 2))) == ["p2"]  # what is left; p3 not ready
    assert ids(tuple(registry.claim_peers("t0", 2))) == ["p0", "p1"]  # its own, kept
    start_peer(registry, "p3")
    assert ids(tuple(registry.claim_peers("t1", 2))) == ["p2", "p3"]
    registry.unregister("t0")  # a token engine left: its peers serve the next one
    assert ids(tuple(registry.claim_peers("t2", 1))) == ["p0"]
    # Shards are not peers, nor peers shards.
    registry.register(ServiceEntry(role=Role.SHARD, service_id="s0", state="ready", slot=0))
    assert "s0" not in ids(tuple(registry.claim_peers("t3", 5)))
    assert registry.claim_group("t3", 1) is not None and registry.shard_census() == (1, 0)


def test_a_lost_peer_is_reported_and_its_replacement_claimed() -> None:
    clock = Clock()
    registry = Registry(max_age_s=5, clock=clock)
    start_peer(registry, "p0")
    start_peer(registry, "p1")
    keeper = ModelPeerKeeper(registry, "t0", 2, registry.claim_peers("t0", 2), clock=clock)
    assert keeper.check() is None
    clock.now = 4
    registry.heartbeat("p0")
    clock.now = 8  # p1 was killed
    assert keeper.check() is None  # missing: not yet lost
    registry.heartbeat("p0")
    clock.now = 8 + ABSENT_CONFIRM_S
    change = keeper.check()
    assert change is not None and change.lost == ("p1",) and ids(change.peers) == ["p0"]
    assert change.addresses() == ["ucx-p0"]
    assert keeper.check() is None  # no replacement yet: nothing new
    start_peer(registry, "p1b", state="starting")
    registry.heartbeat("p0")
    assert keeper.check() is None  # not ready yet
    start_peer(registry, "p1b")
    change = keeper.check()
    assert change is not None and change.lost == () and ids(change.peers) == ["p0", "p1b"]
    assert keeper.check() is None


def test_peers_that_start_after_their_engine_are_claimed_as_they_come() -> None:
    registry = Registry(clock=Clock())
    keeper = ModelPeerKeeper(registry, "t0", 2)
    assert keeper.check() is None  # none yet
    start_peer(registry, "p0")
    change = keeper.check()
    assert change is not None and ids(change.peers) == ["p0"]
    start_peer(registry, "p1")
    change = keeper.check()
    assert change is not None and ids(change.peers) == ["p0", "p1"]
    assert ModelPeerKeeper(registry, "t1", 2).check() is None  # both are t0's


def test_the_current_list_is_repeated_every_interval() -> None:
    clock = Clock()
    registry = Registry(max_age_s=1e9, clock=clock)
    assert ModelPeerKeeper(registry, "t0", 0).check() is None  # no peers wanted
    start_peer(registry, "p0")
    keeper = ModelPeerKeeper(registry, "t0", 1, remind_interval_s=5, clock=clock)
    assert keeper.due_reminder() is None  # no peers yet
    assert keeper.check() is not None
    clock.now = 4
    assert keeper.due_reminder() is None
    clock.now = 5
    assert keeper.due_reminder() == ["ucx-p0"]
    assert keeper.due_reminder() is None


def test_a_token_engine_that_fails_to_start_frees_its_shards_and_peers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Claims end with the engine's registry entry, but one whose worker fails (a shard refusing
    its link) never made one: its group and peers must not stay claimed by no one (found on
    Ray: Serve's retry of the replica waited out `shard_wait_s` and decoded locally)."""
    registry = Registry(clock=Clock())
    for slot in (0, 1):
        registry.register(ServiceEntry(role=Role.SHARD, service_id=f"s{slot}", state="ready",
                                       slot=slot))  # fmt: skip
    start_peer(registry, "p0")

    def refused(cfg: object) -> None:
        raise RuntimeError("the listener did not accept the link")

    monkeypatch.setattr(replica, "EngineWorker", refused)
    threads = torch.get_num_threads()  # start_engine sets it: keep this process's
    options = MeshOptions(shards_per_group=2, shard_wait_s=5.0, model_peers=1,
                          token_engine_threads=threads)  # fmt: skip
    base = WorkerConfig(service_id="", model_path="unused", ready_endpoint="", mesh_key="00" * 16,
                        options=options)  # fmt: skip
    with pytest.raises(RuntimeError, match="failed to start"):
        replica.start_engine(Role.TOKEN, "t0", registry, base)
    assert ids(tuple(registry.claim_group("t1", 2) or ())) == ["s0", "s1"]
    assert ids(tuple(registry.claim_peers("t1", 1))) == ["p0"]


def test_a_token_engine_killed_while_it_starts_frees_its_claims_when_its_entry_expires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica killed outright (SIGKILL, a lost node) runs no `except`: its claims are freed
    because it registered (starting, not routable) and heartbeated before claiming, so its entry
    expires like any silent replica's and its claims go with it."""
    clock = Clock()
    registry = Registry(clock=clock)
    for slot in (0, 1):
        registry.register(ServiceEntry(role=Role.SHARD, service_id=f"s{slot}", state="ready",
                                       slot=slot))  # fmt: skip
    start_peer(registry, "p0")
    seen: dict[str, object] = {}

    def dies_silently(cfg: object) -> None:
        # While its model loads: registered as starting, holding the group and the peer.
        seen["state"] = registry.entries["t0"].state
        seen["claims"] = dict(registry.claimed_by)
        for _ in range(2):  # ... then it stops heartbeating (killed); the others go on
            clock.now += registry.max_age_s * 0.6
            for other in ("s0", "s1", "p0"):
                registry.heartbeat(other)
        seen["group"] = ids(tuple(registry.claim_group("t1", 2) or ()))
        seen["peers"] = ids(tuple(registry.claim_peers("t1", 1)))
        raise RuntimeError("stand-in for the process's end")

    monkeypatch.setattr(replica, "EngineWorker", dies_silently)
    # Its own heartbeat thread beats only when the test says (never): the fake clock decides.
    monkeypatch.setattr(replica, "Membership", functools.partial(Membership, interval_s=3600))
    threads = torch.get_num_threads()  # start_engine sets it: keep this process's
    options = MeshOptions(shards_per_group=2, shard_wait_s=5.0, model_peers=1,
                          token_engine_threads=threads)  # fmt: skip
    base = WorkerConfig(service_id="", model_path="unused", ready_endpoint="", mesh_key="00" * 16,
                        options=options)  # fmt: skip
    with pytest.raises(RuntimeError, match="failed to start"):
        replica.start_engine(Role.TOKEN, "t0", registry, base)
    assert seen["state"] == "starting"
    assert seen["claims"] == {"s0": "t0", "s1": "t0", "p0": "t0"}
    assert (seen["group"], seen["peers"]) == (["s0", "s1"], ["p0"])
    assert all(e.role != Role.TOKEN for e in registry.live())  # and it left no entry behind
