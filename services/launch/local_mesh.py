"""A mesh topology as local OS processes, without Ray: `LocalMesh.start(Topology(...))`.

Starts N prompt engines, M token engines and S attention shards (S/M shards per token engine,
split by KV heads; S = 0 is local attention), each a `services.launch.worker_process` child that
reports its endpoints when ready, forked from a server that imported the worker's code once
(`fork_server`). Decode groups are pinned to cores (`core_pinning`). Tests,
benches and `python -m services.launch` (the demo) use it; Ray Serve replicas are wired by
`services.mesh` instead.

As with any `multiprocessing` start method but "fork", a worker imports the launcher's main
module: a script that starts a `LocalMesh` runs it under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import structlog
import zmq

from common.protocol import EngineStats, Shutdown
from common.roles import Role
from common.transport.service_stats import request_stats
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import PushPool, bind_random
from common.worker_config import WorkerConfig, WorkerReady, role_config, shard_config
from services.launch.core_pinning import GroupPlacement, place_decode_groups
from services.launch.fork_server import STACKS_SIGNAL, start_worker
from services.launch.supervisor import Supervisor
from services.launch.topology import Topology
from services.mesh.registry import Registry, ServiceEntry
from services.router.mesh_client import MeshEngineClient

log = structlog.get_logger(__name__)

SHUTDOWN_LINGER_S = 5.0  # how long `close` lets each `Shutdown` wait for its connection


@dataclass
class LocalWorker:
    """One worker process: the config it was started with, the process, what it reported."""

    cfg: WorkerConfig
    proc: BaseProcess
    ready: WorkerReady

    @property
    def service_id(self) -> str:
        return self.cfg.service_id


class LocalMesh:
    """The running processes of a topology, registered in an in-process `Registry`.

    The registry holds what a router needs (`registry.live`, as on Ray), and the `Supervisor`
    (`supervisor.py`) restarts a worker that dies and keeps token engines' shard groups whole.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        # NOTE: entries are heartbeated by the supervisor and removed the moment a process exits;
        # the age bound only matters if the supervisor itself stalls.
        self.registry = Registry(max_age_s=60.0)
        self.workers: dict[str, LocalWorker] = {}  # shards, token engines, prompt engines
        # Token engines' model peers (Lamina 4.3): not registered (each token engine's config lists
        # its own); the supervisor restarts one that dies and re-links its engine (LinkPeers).
        self.model_peers: dict[str, LocalWorker] = {}
        self.supervisor: Supervisor | None = None
        # The mesh's secret: UCX hellos are signed with it, ZeroMQ sockets use CURVE keys derived
        # from it (`auth`); a process without it cannot talk to this mesh.
        self.mesh_key = topology.options.key or secrets.token_hex(32)
        self.auth = CurveKeys.from_mesh_key(self.mesh_key)
        self._ctx: zmq.Context = zmq.Context.instance()
        self._ready_sock, self._ready_endpoint = bind_random(self._ctx, zmq.PULL, auth=self.auth)

    @classmethod
    def start(cls, topology: Topology, timeout: float = 120.0, supervise: bool = True) -> LocalMesh:
        mesh = cls(topology)
        try:
            mesh._start_all(timeout)
        except BaseException:
            mesh.close()
            raise
        if supervise:
            mesh.supervisor = Supervisor(mesh)
        return mesh

    def _start_all(self, timeout: float) -> None:
        t = self.topology
        base = WorkerConfig(
            service_id="", model_path=t.model_path, ready_endpoint=self._ready_endpoint,
            host=t.options.host or "127.0.0.1", mesh_key=self.mesh_key, options=t.options,
        )  # fmt: skip
        cores = sorted(os.sched_getaffinity(0)) if t.pin_decode_groups else []
        placements = place_decode_groups(
            t.num_token, t.shards_per_group, cores, t.options.threads_of(Role.TOKEN)
        )
        for worker in self.spawn(self._shard_configs(base, placements), timeout):
            self.registry.register(entry_of(worker))
        peers = self._spawn_model_peers(base, timeout)
        token = [
            role_config(
                base,
                Role.TOKEN,
                f"token-{e}",
                cpus=list(placements[e].engine),
                model_peers=[w.ready.link_address for w in peers[e]],
            )  # fmt: skip
            for e in range(t.num_token)
        ]
        for worker in self.spawn([self.with_group(cfg) for cfg in token], timeout):
            self.registry.register(entry_of(worker))
        prompt = [role_config(base, Role.PROMPT, f"prompt-{i}") for i in range(t.num_prompt)]
        for worker in self.spawn(prompt, timeout):
            self.registry.register(entry_of(worker))

    def _spawn_model_peers(self, base: WorkerConfig, timeout: float) -> list[list[LocalWorker]]:
        """Each token engine's model peers (`peer-{engine}-{i}`), started and ready."""
        n, num_token = self.topology.options.model_peers, self.topology.num_token
        cfgs = [
            role_config(base, Role.MODEL_PEER, f"peer-{e}-{i}")
            for e in range(num_token) for i in range(n)
        ]  # fmt: skip
        started = self.spawn(cfgs, timeout, into=self.model_peers)
        return [started[e * n : (e + 1) * n] for e in range(num_token)]

    @property
    def shards_per_group(self) -> int:
        return self.topology.shards_per_group

    def _shard_configs(
        self, base: WorkerConfig, placements: list[GroupPlacement]
    ) -> list[WorkerConfig]:
        """One config per shard; shard i is slot i % shards_per_group of group i // it."""
        t, per_group = self.topology, self.shards_per_group
        if not per_group:
            return []
        num_kv_heads = _num_kv_heads(t.model_path)
        return [
            shard_config(
                base,
                f"shard-{i}",
                i % per_group,
                num_kv_heads,
                cpus=list(placements[i // per_group].shards[i % per_group]),
            )  # fmt: skip
            for i in range(t.num_shards)
        ]

    def with_group(self, cfg: WorkerConfig) -> WorkerConfig:
        """A token engine's config with a shard group claimed for it (none if none is free)."""
        group = self.registry.claim_group(cfg.service_id, self.shards_per_group) or []
        return msgspec.structs.replace(cfg, shards=[e.shard_address() for e in group])

    def spawn(
        self, cfgs: list[WorkerConfig], timeout: float, into: dict[str, LocalWorker] | None = None
    ) -> list[LocalWorker]:
        """Start workers and wait until each has reported its endpoints; they join `into`
        (default: `workers`, the supervised ones)."""
        procs = {cfg.service_id: start_worker(cfg, self._env(cfg)) for cfg in cfgs}
        try:
            readies = self._wait_ready(procs, timeout)
        except BaseException:
            for proc in procs.values():
                proc.kill()
            raise
        workers = [LocalWorker(c, procs[c.service_id], readies[c.service_id]) for c in cfgs]
        (self.workers if into is None else into).update((w.service_id, w) for w in workers)
        return workers

    def _wait_ready(self, procs: dict[str, BaseProcess], timeout: float) -> dict[str, WorkerReady]:
        """Each started worker's `WorkerReady`; raises at once if one exits before sending it."""
        poller = zmq.Poller()
        poller.register(self._ready_sock, zmq.POLLIN)
        starting = {proc.sentinel: service_id for service_id, proc in procs.items()}
        for sentinel in starting:  # readable once its process has exited
            poller.register(sentinel, zmq.POLLIN)
        readies: dict[str, WorkerReady] = {}
        deadline = time.monotonic() + timeout
        while len(readies) < len(procs):
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(poller.poll(left_ms))
            if not events:
                stuck = [p for service_id, p in procs.items() if service_id not in readies]
                _dump_stacks(stuck)
                raise TimeoutError(f"not ready in {timeout} s: {len(readies)}/{len(procs)} "
                                   "(the others' stacks are on stderr)")  # fmt: skip
            while self._ready_sock.poll(0):
                ready = msgspec.msgpack.decode(self._ready_sock.recv(), type=WorkerReady)
                if ready.service_id in procs:  # a late report of an earlier, dead start is not
                    readies[ready.service_id] = ready
                    sentinel = procs[ready.service_id].sentinel
                    if starting.pop(sentinel, None) is not None:
                        poller.unregister(sentinel)
            for sentinel, service_id in starting.items():
                if sentinel in events:
                    code = procs[service_id].exitcode
                    raise RuntimeError(f"{service_id} exited with code {code} before it was "
                                       "ready: its output says why")  # fmt: skip
        return readies

    def restart(self, dead: LocalWorker, timeout: float = 120.0) -> LocalWorker:
        """Replace a worker whose process exited, as Serve replaces a replica: a new service id
        (`token-0.1`, ...), so routers see one service leave and another join; a token engine
        claims a group again. The replacement keeps the dead one's place in `workers`."""
        self.registry.unregister(dead.service_id)
        base_id, _, generation = dead.service_id.partition(".")
        cfg = msgspec.structs.replace(dead.cfg, service_id=f"{base_id}.{int(generation or 0) + 1}")
        if cfg.role == Role.TOKEN:
            cfg = self.with_group(cfg)
        [worker] = self.spawn([cfg], timeout)
        self.workers = {
            (worker.service_id if key == dead.service_id else key): (
                worker if key == dead.service_id else w
            )
            for key, w in self.workers.items()
            if key != worker.service_id
        }
        self.registry.register(entry_of(worker))
        return worker

    def restart_peer(self, dead: LocalWorker, timeout: float = 120.0) -> LocalWorker:
        """Replace a model peer whose process exited (`peer-0-1` -> `peer-0-1.1`), in its place
        in `model_peers`; its token engine's config lists the new address instead (the caller
        tells the engine)."""
        base_id, _, generation = dead.service_id.partition(".")
        cfg = msgspec.structs.replace(dead.cfg, service_id=f"{base_id}.{int(generation or 0) + 1}")
        [peer] = self.spawn([cfg], timeout, into={})
        self.model_peers = {
            (peer.service_id if key == dead.service_id else key): (
                peer if key == dead.service_id else w
            )
            for key, w in self.model_peers.items()
        }
        old, new = dead.ready.link_address, peer.ready.link_address
        for worker in self._of(Role.TOKEN):
            if old in worker.cfg.model_peers:
                peers = [new if a == old else a for a in worker.cfg.model_peers]
                worker.cfg = msgspec.structs.replace(worker.cfg, model_peers=peers)
        return peer

    def _env(self, cfg: WorkerConfig) -> dict[str, str]:
        """A worker's own environment variables, over this process's."""
        exporter = self.topology.otel_exporter.replace("{service_id}", cfg.service_id)
        return {"PHASEMESH_OTEL_EXPORTER": exporter} if exporter else {}

    # -- views for tests, benches and the direct client ---------------------------------------

    def _of(self, *roles: Role) -> list[LocalWorker]:
        return [w for w in self.workers.values() if w.cfg.role in roles]

    @property
    def procs(self) -> list[BaseProcess]:
        """Every process, shards first, then token engines, then prompt engines."""
        return [w.proc for w in self.workers.values()]

    def _entries(self, role: Role) -> list[ServiceEntry]:
        """The registry's entries of `role`, in start order: what a router would see."""
        live = {e.service_id: e for e in self.registry.live()}
        return [live[w.service_id] for w in self._of(role) if w.service_id in live]

    @property
    def prompt(self) -> list[ServiceEntry]:
        return self._entries(Role.PROMPT)

    @property
    def token(self) -> list[ServiceEntry]:
        """Token engines, each with its current shard group (`shards`)."""
        return self._entries(Role.TOKEN)

    @property
    def shards(self) -> list[ServiceEntry]:
        return self._entries(Role.SHARD)

    def engine_client(
        self, list_services: Callable[[], list[ServiceEntry]] | None = None, **options: Any
    ) -> MeshEngineClient:
        """The router's own client over this mesh, built as a router replica builds it
        (`services/app.py`): JSQ placement over the services `list_services` lists (default
        `registry.live`; a bench may narrow it), the mesh's keys and block size, `RequestOutput`
        streams. `options`: `MeshEngineClient`'s keywords (`refresh_s`, `limits`, ...). Every
        engine is registered ready once `start` returns, so it places at once; the caller shuts
        it down."""
        t = self.topology
        return MeshEngineClient(
            t.model_path, list_services or self.registry.live, auth=self.auth,
            block_size=t.options.block_size, **options,
        )  # fmt: skip

    def control_endpoints(self) -> list[str]:
        return [w.ready.control_endpoint for w in self._of(Role.PROMPT, Role.TOKEN, Role.MIXED)] + [
            s.control_endpoint for s in self.shards
        ]

    def stats(self, timeout: float = 10.0) -> list[EngineStats]:
        """What every service holds (KV blocks in use, live requests), in `control_endpoints`
        order; raises TimeoutError if one does not answer within `timeout` seconds."""
        endpoints = self.control_endpoints()
        replies = request_stats(endpoints, timeout, auth=self.auth)
        if missing := [endpoint for endpoint in endpoints if endpoint not in replies]:
            raise TimeoutError(f"no stats in {timeout} s from {missing}")
        return [replies[endpoint] for endpoint in endpoints]

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        pool: PushPool[object] = PushPool(self._ctx, object, auth=self.auth)
        for w in self._of(Role.PROMPT, Role.TOKEN, Role.MIXED):
            pool.get(w.ready.command_endpoint).send(Shutdown())
        for w in self._of(Role.SHARD):
            pool.get(w.ready.kv_endpoint).send_tensors(Shutdown(), [])
        # The shutdown messages leave once each connection is up (a CURVE handshake: longer on a
        # loaded machine), after the sockets close: ZeroMQ's I/O thread sends what they hold for
        # up to the linger. A worker that never takes its message is killed below.
        pool.close(linger_s=SHUTDOWN_LINGER_S)
        for peer in self.model_peers.values():  # stateless: nothing to flush (model_peer.py)
            peer.proc.terminate()
        for proc in self.procs + [w.proc for w in self.model_peers.values()]:
            proc.join(timeout=5)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        self._ready_sock.close(linger=0)


def entry_of(worker: LocalWorker) -> ServiceEntry:
    """The registry entry of a started worker, as a Ray replica registers itself."""
    cfg, r = worker.cfg, worker.ready
    return ServiceEntry(
        role=cfg.role, service_id=cfg.service_id, state="ready",
        command_endpoint=r.command_endpoint, kv_endpoint=r.kv_endpoint,
        control_endpoint=r.control_endpoint, load_endpoint=r.load_endpoint,
        link_address=r.link_address, kv_address=r.kv_address, head_start=cfg.head_start,
        head_end=cfg.head_end,
        slot=cfg.shard_slot, shards=tuple(cfg.shards),
    )  # fmt: skip


def _num_kv_heads(model_path: str) -> int:
    from common.config import ModelConfig

    return ModelConfig.from_folder(model_path).num_key_value_heads


def _dump_stacks(procs: list[BaseProcess]) -> None:
    """Ask each of `procs` for its threads' stacks (`worker_process.run` registers the signal
    with faulthandler), to their stderr: where a worker that never became ready is stuck."""
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, STACKS_SIGNAL)
    time.sleep(1.0)  # NOTE: the dumps are written by the workers themselves, asynchronously
