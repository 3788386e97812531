"""For a `LocalMesh`, what Ray Serve and the registry do for replicas: restarts and shard groups.

Every `interval_s` the supervisor thread
- drops a worker whose process exited from the registry and starts a replacement
  (`LocalMesh.restart`), so routers reading the registry see it leave and its successor join;
- heartbeats the live workers' registry entries (the processes are its children: it knows);
- keeps every token engine's shard group whole (`ShardGroupKeeper`): a lost shard is reported to
  the engine at once as a `LinkShards` without it, the replacement as a `LinkShards` with it.
- restarts a token engine's model peer that dies (`LocalMesh.restart_peer`) and tells the engine
  its peers' addresses (`LinkPeers`), then and every `PEER_REMIND_S` (a peer the engine dropped
  for a fault but still running rejoins the rotation: services/engine/rotation.py).

A dead launcher takes its workers with it (each exits at the end of its launcher's pipe:
`fork_server.py`), so nothing here outlives the mesh. A restart blocks the loop while the new
worker, forked from the launcher's fork server, loads its weights (a fraction of a second for
the tiny model).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import msgspec
import structlog
import zmq

from common.protocol import LinkPeers, LinkShards
from common.roles import Role
from common.transport.zmq_sockets import PushPool
from services.mesh.shard_group import GroupChange, ShardGroupKeeper, rebuilders
from services.mesh.ticker import Ticker

if TYPE_CHECKING:
    from services.launch.local_mesh import LocalMesh, LocalWorker

log = structlog.get_logger(__name__)

PEER_REMIND_S = 5.0  # how often token engines are reminded of their model peers


class Supervisor:
    """The thread that keeps a `LocalMesh` whole; see the module docstring."""

    def __init__(self, mesh: LocalMesh, interval_s: float = 0.1) -> None:
        self.mesh = mesh
        self.num_restarts = 0
        self.keepers: dict[str, ShardGroupKeeper] = {}
        self._push: PushPool[LinkShards | LinkPeers] = PushPool(
            zmq.Context.instance(), LinkShards | LinkPeers, auth=mesh.auth
        )
        self._peers_told = time.monotonic()
        # Child processes have no event to block on here. The sockets are the ticker thread's.
        self._ticker = Ticker("local-mesh-supervisor", interval_s, self._tick, self._push.close)
        self._ticker.start()

    def stop(self) -> None:
        self._ticker.stop(timeout_s=150)

    def _tick(self) -> None:
        dead = []
        for worker in list(self.mesh.workers.values()):
            if worker.proc.is_alive():
                self.mesh.registry.heartbeat(worker.service_id)
            else:
                dead.append(worker)
        for worker in dead:
            log.warning("worker exited; restarting it", service_id=worker.service_id,
                        returncode=worker.proc.exitcode)  # fmt: skip
            self.mesh.registry.unregister(worker.service_id)
            self.keepers.pop(worker.service_id, None)
        if dead:
            self._keep_groups()  # token engines learn of a lost shard before its restart
        for worker in dead:
            if self._ticker.stopped.is_set():
                return
            self.mesh.restart(worker)
            self.num_restarts += 1
        self._keep_groups()
        self._keep_peers()

    def _keep_peers(self) -> None:
        """Restart dead model peers; tell their engines (all engines, every PEER_REMIND_S)."""
        dead = [p for p in list(self.mesh.model_peers.values()) if not p.proc.is_alive()]
        for peer in dead:
            if self._ticker.stopped.is_set():
                return
            log.warning("model peer exited; restarting it", service_id=peer.service_id,
                        returncode=peer.proc.exitcode)  # fmt: skip
            self.mesh.restart_peer(peer)
            self.num_restarts += 1
        now = time.monotonic()
        if dead or now - self._peers_told >= PEER_REMIND_S:
            self._peers_told = now
            for worker in list(self.mesh.workers.values()):
                if worker.cfg.model_peers and worker.proc.is_alive():
                    command = LinkPeers(list(worker.cfg.model_peers))
                    self._push.get(worker.ready.command_endpoint).send(command)

    def _keep_groups(self) -> None:
        for worker in list(self.mesh.workers.values()):
            if worker.cfg.role == Role.TOKEN and worker.proc.is_alive():
                change = self._keeper(worker).check()
                if change is not None:
                    self._relink(worker, change)

    def _keeper(self, worker: LocalWorker) -> ShardGroupKeeper:
        keeper = self.keepers.get(worker.service_id)
        if keeper is None:
            held = {s.service_id for s in worker.cfg.shards}
            group = [e for e in self.mesh.registry.live() if e.service_id in held]
            # No wait before a shard counts as lost: this registry lives in this process (it
            # never restarts) and a shard leaves it only when its process exited.
            keeper = ShardGroupKeeper(
                self.mesh.registry, worker.service_id, self.mesh.shards_per_group, group,
                confirm_s=0.0,
            )  # fmt: skip
            self.keepers[worker.service_id] = keeper
        return keeper

    def _relink(self, worker: LocalWorker, change: GroupChange) -> None:
        shards = [e.shard_address() for e in change.group]
        log.info("shard group changed", token_engine=worker.service_id, lost=change.lost,
                 group=[s.service_id for s in shards])  # fmt: skip
        command = LinkShards(shards, rebuilders(self.mesh.registry))
        self._push.get(worker.ready.command_endpoint).send(command)
        worker.cfg = msgspec.structs.replace(worker.cfg, shards=shards)
        entry = next(e for e in self.mesh.registry.live() if e.service_id == worker.service_id)
        self.mesh.registry.register(replace(entry, shards=tuple(shards)))
