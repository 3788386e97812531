"""A mesh service inside a Ray Serve replica: its worker on a thread, its registry entry alive.

`services/app.py` wraps these in deployments; nothing here imports `ray.serve`. A worker
(`EngineWorker` or `ShardWorker`) is built *and* run on one background thread, because a UCX worker
and ZeroMQ sockets must stay on the thread that made them. The replica then registers the
worker's endpoints (`services.mesh.registry`) and heartbeats; `check_health` fails when the worker
thread died or the heartbeat went stale, so Serve replaces the replica.

Token engines claim a shard group from the registry before their worker starts (its UCX links are
made in the constructor), waiting a bounded time for shards still starting. When every live shard
is already claimed (say, the second token engine after scaling 1 -> 2 with 2 shards), the engine
runs with local attention and says so in its log.

Model peers (`model_peers: N`, Lamina 4.3's rotation) register ready with their UCX address; a
token engine claims up to N of them before its worker starts (a short, bounded wait: peers
that come later are claimed by its watch) and its `GroupWatch` keeps them claimed and linked
(`services.mesh.peer_group`), as it keeps the shard group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import structlog
import torch
import zmq

from common.config import ModelConfig
from common.protocol import LinkPeers, LinkShards
from common.roles import Role
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import PushPool
from common.worker_config import WorkerConfig, role_config, shard_config, shard_heads
from services.engine.model_peer_worker import ModelPeerWorker
from services.engine.worker import EngineWorker
from services.mesh.absence import ABSENT_CONFIRM_S
from services.mesh.peer_group import ModelPeerKeeper
from services.mesh.registry import Membership, RegistryClient, ServiceEntry
from services.mesh.registry_watch import RegistryWatch
from services.mesh.shard_group import ShardGroupKeeper, SlotBalance, claimant_of, rebuilders
from services.shard.worker import ShardWorker

log = structlog.get_logger(__name__)

# A worker loop that has not made a pass for this long is unhealthy: longer than any one step
# (a 2048-token prefill, a shard round trip's 30 s timeout), far shorter than forever.
STALL_S = 120.0

ALL_CLAIMED_SETTLE_S = 3.0  # every live shard claimed for this long: stop waiting for a group
CLAIM_RETRY_S = 0.5
DRAIN_POLL_S = 0.1
# A leaving engine serves on this long before an empty request table may end its drain: every
# router hears of the change at once (the registry's long poll, `services/router/
# mesh_membership.py`; a router without it reads every half second), so by then none places
# here any more, and what they placed just before (a prompt still prefilling for this token
# engine) has arrived.
DRAIN_NOTICE_S = 2.0
GROUP_CHECK_INTERVAL_S = 0.5  # how often a token engine replica looks for lost or new shards
PEER_WAIT_S = 10.0  # at most this long a starting token engine waits for all its model peers

Worker = EngineWorker | ShardWorker | ModelPeerWorker


class WorkerThread:
    """Builds a worker on its own thread and runs it there, on `num_threads` torch threads; the
    constructor waits for the build."""

    def __init__(
        self, build: Callable[[], Worker], name: str, num_threads: int, timeout_s: float = 600.0
    ) -> None:
        self._build = build
        self._num_threads = num_threads
        self._built = threading.Event()
        self._error: BaseException | None = None
        self.worker: Worker | None = None
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        if not self._built.wait(timeout_s):
            raise TimeoutError(f"{name}: worker not built in {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"{name}: worker failed to start") from self._error

    def _main(self) -> None:
        # On this thread, before its first torch op: OpenMP's thread count is per calling
        # thread, and Ray starts a replica with OMP_NUM_THREADS = its num_cpus.
        torch.set_num_threads(self._num_threads)
        try:
            self.worker = self._build()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the constructor's thread
            self._error = exc
            return
        finally:
            self._built.set()
        try:
            self.worker.run()
        except BaseException:
            log.exception("worker loop died", thread=self.thread.name)
            raise

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stalled_s(self) -> float:
        """How long the worker's loop has gone without a pass (0 while it is starting)."""
        if self.worker is None:
            return 0.0
        return time.monotonic() - self.worker.last_pass

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.worker is not None:
            # NOTE: a worker's loops check `running` at least every idle wait (an engine's
            # 0.2 s, a shard's 1 s), then close.
            self.worker.running = False
        self.thread.join(timeout_s)


class GroupWatch:
    """A token engine replica's shard group kept whole, and its model peers linked: a thread
    checks the registry at each change (`RegistryWatch`; `ShardGroupKeeper`, `ModelPeerKeeper`)
    and every `interval_s` while an absence waits to be confirmed, and tells the
    engine of a change with a `LinkShards` or `LinkPeers` on its own command socket (the engine
    loop owns the UCX links), then republishes its entry (`shards`, `peers`: what it holds)."""

    def __init__(
        self, keeper: ShardGroupKeeper, membership: Membership, command_endpoint: str,
        auth: CurveKeys, interval_s: float = GROUP_CHECK_INTERVAL_S,
        peer_keeper: ModelPeerKeeper | None = None,
    ) -> None:  # fmt: skip
        self.keeper = keeper
        self.peer_keeper = peer_keeper
        self.membership = membership
        self.command_endpoint = command_endpoint
        # Its sockets are the watch thread's, closed on it.
        self._push: PushPool[LinkShards | LinkPeers] = PushPool(
            zmq.Context.instance(), LinkShards | LinkPeers, auth=auth
        )
        # The registry's long poll: a change at once; `interval_s` while a lost shard's absence
        # is being confirmed or model peers get their reminders, else the watch's idle pace.
        self._watch = RegistryWatch(
            "shard-group-watch", keeper.registry.wait_change, lambda _v, _e: self._check(),
            busy_s=interval_s, settle_s=ABSENT_CONFIRM_S + 2 * interval_s,
            busy=lambda: peer_keeper is not None or keeper.confirming(), on_exit=self._push.close,
        )  # fmt: skip
        self._watch.start()

    def stop(self) -> None:
        self._watch.stop(timeout_s=5)

    def _check(self) -> None:
        try:
            if self.peer_keeper is not None:
                self._check_peers(self.peer_keeper)
            self._check_shards()
        except Exception as exc:  # noqa: BLE001 - the registry may be restarting
            log.warning("shard group check failed", error=repr(exc))

    def _check_shards(self) -> None:
        change = self.keeper.check()
        if change is None:
            return
        shards = [e.shard_address() for e in change.group]
        log.warning("shard group changed", lost=change.lost, group=[s.service_id for s in shards])
        command = LinkShards(shards, rebuilders(self.keeper.registry))
        self._push.get(self.command_endpoint).send(command)
        self.membership.update(shards=tuple(shards))

    def _check_peers(self, keeper: ModelPeerKeeper) -> None:
        change = keeper.check()
        if change is not None:
            log.warning("model peers changed", lost=change.lost,
                        peers=[e.service_id for e in change.peers])  # fmt: skip
            self._push.get(self.command_endpoint).send(LinkPeers(change.addresses()))
            self.membership.update(peers=tuple(e.service_id for e in change.peers))
        elif (addresses := keeper.due_reminder()) is not None:
            self._push.get(self.command_endpoint).send(LinkPeers(addresses))


class MeshReplica:
    """One running mesh service (worker thread + registry membership)."""

    def __init__(
        self, worker: WorkerThread, membership: Membership, group_watch: GroupWatch | None = None,
        slot_balance: SlotBalance | None = None,
    ) -> None:  # fmt: skip
        self.worker = worker
        self.membership = membership
        self.group_watch = group_watch
        self.slot_balance = slot_balance  # a shard's: replaced when a spare in a full slot

    def check_health(self) -> None:
        """Raise if the worker thread or the heartbeat thread died, or the loop stopped moving;
        never for the registry's own trouble (slow, stopped, restarting)."""
        if not self.worker.alive():
            raise RuntimeError(f"{self.membership.entry.service_id}: the worker thread died")
        # Health means progress: a loop frozen (a deadlock, a wait without a deadline) fails
        # here although the heartbeat thread beside it goes on.
        if (stalled := self.worker.stalled_s()) > STALL_S:
            raise RuntimeError(
                f"{self.membership.entry.service_id}: its loop has not moved for {stalled:.0f} s"
            )
        if not self.membership.healthy():
            raise RuntimeError(f"{self.membership.entry.service_id}: its heartbeat thread died")
        if self.slot_balance is not None and self.slot_balance.misplaced():
            raise RuntimeError(
                f"{self.membership.entry.service_id}: a spare shard in a slot with two more than "
                "another: to be replaced in the emptiest slot (services/mesh/shard_group.py)"
            )

    def shutdown(self, drain_s: float = 20.0) -> None:
        """Leave routing, let an engine finish what it holds (bounded by `drain_s`), then stop.

        The entry turns `draining` first: routers place nothing new here once they read it
        (within `DRAIN_NOTICE_S`), while the engine goes on serving its requests, those that
        arrive meanwhile included. Requests still running at `drain_s` (and any a router
        placed here although it could not read the registry) lose their engine when it stops:
        routers re-run them elsewhere from their tokens (migration, docs/failures.md). A shard
        first serves the draining token engine that holds it (`_outlive_draining_claimant`)."""
        worker = self.worker.worker
        if isinstance(worker, ShardWorker):
            self._outlive_draining_claimant(drain_s + DRAIN_NOTICE_S)
        if isinstance(worker, EngineWorker):
            try:
                self.membership.update(state="draining")
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                log.warning("could not mark draining", error=repr(exc))
            started = time.monotonic()
            deadline, noticed = started + drain_s, started + min(DRAIN_NOTICE_S, drain_s)
            # NOTE: bounded wait at shutdown; the engine loop owns the state, we only read a size.
            while time.monotonic() < deadline and (
                time.monotonic() < noticed or worker.engine.table.requests
            ):
                time.sleep(DRAIN_POLL_S)
            if left := len(worker.engine.table.requests):
                log.warning("drain time over: the requests left migrate", num_requests=left)
        if self.group_watch is not None:
            self.group_watch.stop()
        if self.slot_balance is not None:
            self.slot_balance.stop()
        self.membership.stop()
        self.worker.stop()
        log.info("mesh replica stopped", service_id=self.membership.entry.service_id)

    def _outlive_draining_claimant(self, wait_s: float) -> None:
        """A shard leaving: claimable no more, it serves the token engine that holds it while that
        engine drains, at most `wait_s`, so that a group told to stop with its engine (one
        scale-down) leaves after it. Its engine may mark itself draining a moment after this
        shard was told to stop: a claimant still `ready` is waited for `DRAIN_NOTICE_S`. An
        engine that stays keeps no shard here: its group breaks and its keeper rebuilds the lost
        heads on a free shard of the same slot (services/mesh/autoscaling.py)."""
        shard_id = self.membership.entry.service_id
        started = time.monotonic()
        claimant: ServiceEntry | None = None
        try:
            self.membership.update(state="draining")
            # NOTE: bounded wait at shutdown on another replica's drain; nothing to block on.
            while (claimant := claimant_of(self.membership.registry.live(), shard_id)) and (
                time.monotonic() - started < (wait_s if claimant.state == "draining" else
                                              min(DRAIN_NOTICE_S, wait_s))
            ):  # fmt: skip
                time.sleep(DRAIN_POLL_S)
        except Exception as exc:  # noqa: BLE001 - the registry may be gone: stopping anyway
            log.warning("could not wait for the shard's token engine", error=repr(exc))
        if claimant is not None:
            log.warning("its token engine still holds it: stopping anyway",
                        engine=claimant.service_id, state=claimant.state)  # fmt: skip


def start_engine(
    role: Role,
    service_id: str,
    registry: RegistryClient,
    base: WorkerConfig,
    generation: str = "",
) -> MeshReplica:
    """A prompt or token engine: claim shards and model peers (token, as many as `base.options`
    says), start the worker, register as ready. `generation`: its application's version (it
    claims only its own)."""
    opts = base.options
    shards_per_group, num_model_peers = opts.shards_per_group, opts.model_peers
    group: list[ServiceEntry] = []
    peers: list[ServiceEntry] = []
    # Registered (starting: not routable) and heartbeating before it claims anything: claims end
    # with their token engine's entry, so a replica killed outright while it starts (no
    # `except` runs) still frees its shards and peers when its entry expires.
    entry = ServiceEntry(role=role, service_id=service_id, generation=generation)
    membership = Membership(registry, entry)
    try:
        if role == Role.TOKEN:
            membership.update()
            membership.start()
            group = claim_shard_group(registry, service_id, shards_per_group, opts.shard_wait_s)
            peers = claim_model_peers(registry, service_id, num_model_peers, PEER_WAIT_S)
        if role == Role.TOKEN and not group:
            log.warning("no free shard group: this token engine decodes with local attention",
                        service_id=service_id)  # fmt: skip
        links = [s.shard_address() for s in group]
        cfg = role_config(base, role, service_id, shards=links,
                          model_peers=[e.link_address for e in peers])  # fmt: skip
        thread = WorkerThread(lambda: EngineWorker(cfg), f"{service_id}-loop", cfg.num_threads)
    except BaseException:
        # Unregistered, its shards and peers are free now, not when its entry expires (Serve's
        # retry would find no free group meanwhile).
        membership.stop()
        raise
    assert isinstance(thread.worker, EngineWorker)
    ready = thread.worker.ready()
    membership.alive = thread.alive
    membership.update(
        state="ready", command_endpoint=ready.command_endpoint, kv_endpoint=ready.kv_endpoint,
        kv_address=ready.kv_address, control_endpoint=ready.control_endpoint,
        load_endpoint=ready.load_endpoint, shards=tuple(links),
        peers=tuple(e.service_id for e in peers),
    )  # fmt: skip
    if role != Role.TOKEN:
        membership.start()
    log.info("engine replica ready", service_id=service_id, role=role, num_shards=len(group),
             num_model_peers=len(peers))  # fmt: skip
    watch = None
    if role == Role.TOKEN and shards_per_group:
        keeper = ShardGroupKeeper(registry, service_id, shards_per_group, group)
        peer_keeper = None
        if num_model_peers:
            peer_keeper = ModelPeerKeeper(registry, service_id, num_model_peers, peers)
        watch = GroupWatch(keeper, membership, ready.command_endpoint, cfg.curve_keys,
                           peer_keeper=peer_keeper)  # fmt: skip
    return MeshReplica(thread, membership, watch)


def start_shard(
    service_id: str,
    registry: RegistryClient,
    base: WorkerConfig,
    generation: str = "",
) -> MeshReplica:
    """An attention shard: take a slot of a group (`shard_config`: its heads), start the worker,
    register as ready."""
    num_kv_heads = ModelConfig.from_folder(base.model_path).num_key_value_heads
    shard_heads(num_kv_heads, base.options, 0)  # raises before a slot is taken if heads don't split
    entry = ServiceEntry(role=Role.SHARD, service_id=service_id, generation=generation)
    slot = registry.take_shard_slot(entry, max(base.options.shards_per_group, 1))
    membership = Membership(registry, replace(entry, slot=slot))
    membership.start()  # holds the slot while the shard allocates its KV
    cfg = shard_config(base, service_id, slot, num_kv_heads)
    head_start, head_end = cfg.head_start, cfg.head_end
    thread = WorkerThread(lambda: ShardWorker(cfg), f"{service_id}-loop", cfg.num_threads)
    assert isinstance(thread.worker, ShardWorker)
    ready = thread.worker.ready()
    membership.alive = thread.alive
    membership.update(
        state="ready", kv_endpoint=ready.kv_endpoint, control_endpoint=ready.control_endpoint,
        link_address=ready.link_address, kv_address=ready.kv_address, head_start=head_start,
        head_end=head_end,
    )  # fmt: skip
    log.info("shard replica ready", service_id=service_id, heads=(head_start, head_end))
    num_slots = base.options.shards_per_group
    balance = SlotBalance(registry, service_id, num_slots) if num_slots > 1 else None
    if balance is not None:
        balance.start()
    return MeshReplica(thread, membership, slot_balance=balance)


def start_model_peer(
    service_id: str, registry: RegistryClient, base: WorkerConfig, generation: str = ""
) -> MeshReplica:
    """A model peer: start the worker (it loads the model), register as ready (claimable)."""
    cfg = role_config(base, Role.MODEL_PEER, service_id)
    thread = WorkerThread(lambda: ModelPeerWorker(cfg), f"{service_id}-loop", cfg.num_threads)
    assert isinstance(thread.worker, ModelPeerWorker)
    entry = ServiceEntry(role=Role.MODEL_PEER, service_id=service_id, state="ready",
                         link_address=thread.worker.ready().link_address,
                         generation=generation)  # fmt: skip
    membership = Membership(registry, entry, alive=thread.alive)
    membership.update()
    membership.start()
    log.info("model peer replica ready", service_id=service_id)
    return MeshReplica(thread, membership)


def claim_model_peers(
    registry: RegistryClient, token_id: str, num_peers: int, wait_s: float
) -> list[ServiceEntry]:
    """Up to `num_peers` model peers for `token_id`, waiting at most `wait_s` for all of them;
    fewer (even none) is fine: the engine's watch claims the rest as they come."""
    deadline = time.monotonic() + wait_s
    peers = registry.claim_peers(token_id, num_peers) if num_peers else []
    while len(peers) < num_peers and time.monotonic() < deadline:
        # NOTE: waiting on other replicas' start-up (bounded by wait_s); nothing to block on.
        time.sleep(CLAIM_RETRY_S)
        peers = registry.claim_peers(token_id, num_peers)
    return peers


def claim_shard_group(
    registry: RegistryClient, token_id: str, num_slots: int, wait_s: float
) -> list[ServiceEntry]:
    """A full shard group for `token_id`, or [] (local attention) if none frees up in time."""
    if num_slots == 0:
        return []
    deadline = time.monotonic() + wait_s
    all_claimed_since: float | None = None
    while time.monotonic() < deadline:
        group = registry.claim_group(token_id, num_slots)
        if group:
            return list(group)
        num_live, num_unclaimed = registry.shard_census()
        now = time.monotonic()
        if num_live and not num_unclaimed:
            all_claimed_since = all_claimed_since or now
            if now - all_claimed_since >= ALL_CLAIMED_SETTLE_S:
                break
        else:
            all_claimed_since = None
        # NOTE: waiting on other replicas' start-up (bounded by wait_s); nothing to block on.
        time.sleep(CLAIM_RETRY_S)
    return []
