"""A mesh topology as local OS processes, without Ray: `LocalMesh.start(Topology(...))`.

Starts N prompt engines, M token engines and S attention shards (S/M shards per token engine,
split by KV heads; S = 0 is local attention), each a `services.launch.worker_process` child that
reports its endpoints when ready. Decode groups are pinned to cores (`core_pinning`). Tests,
benches and `python -m services.launch` (the demo) use it; Ray Serve replicas are wired by
`services.mesh` instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog
import zmq

from common.protocol import (
    EngineStats,
    ServiceReply,
    ShardAddress,
    Shutdown,
    StatsRequest,
)
from common.transport.zmq_sockets import PushPool, TypedSocket, bind_random
from common.worker_config import ShardLinkSpec, WorkerConfig, WorkerReady
from services.launch.core_pinning import GroupPlacement, place_decode_groups

log = structlog.get_logger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Topology:
    """How many of each service, and their KV capacity."""

    model_path: str
    num_prompt: int = 1
    num_token: int = 1
    num_shards: int = 0  # in all; each token engine gets num_shards / num_token of them
    num_blocks: int = 512
    block_size: int = 16
    layer_wise_min_tokens: int = 256
    attention_backend: str = "auto"
    num_threads: int = 1
    # Pin each token engine and its shards to cores (core_pinning.py); prompt engines float.
    pin_decode_groups: bool = True
    # PHASEMESH_OTEL_EXPORTER for every service ("" keeps this process's environment);
    # `{service_id}` is replaced, so `jsonl:/tmp/t/{service_id}.jsonl` gives each its own file.
    otel_exporter: str = ""

    def __post_init__(self) -> None:
        if self.num_prompt < 1 or self.num_token < 1:
            raise ValueError("a topology needs at least one prompt and one token engine")
        if self.num_shards % self.num_token:
            raise ValueError("num_shards must be a multiple of num_token (equal shard groups)")


@dataclass
class TokenEngineInfo:
    ready: WorkerReady
    shards: list[ShardAddress]


@dataclass
class LocalMesh:
    """The running processes of a topology and their endpoints."""

    topology: Topology
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    prompt: list[WorkerReady] = field(default_factory=list)
    token: list[TokenEngineInfo] = field(default_factory=list)
    shards: list[WorkerReady] = field(default_factory=list)

    @classmethod
    def start(cls, topology: Topology, timeout: float = 120.0) -> LocalMesh:
        mesh = cls(topology)
        try:
            mesh._start_all(timeout)
        except BaseException:
            mesh.close()
            raise
        return mesh

    def _start_all(self, timeout: float) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        ready_sock, ready_endpoint = bind_random(ctx, zmq.PULL)
        try:
            t = self.topology
            base = WorkerConfig(
                service="engine", service_id="", model_path=t.model_path,
                ready_endpoint=ready_endpoint, parent_pid=os.getpid(), num_blocks=t.num_blocks,
                block_size=t.block_size, attention_backend=t.attention_backend,
                num_threads=t.num_threads, layer_wise_min_tokens=t.layer_wise_min_tokens,
            )  # fmt: skip
            cores = sorted(os.sched_getaffinity(0)) if t.pin_decode_groups else []
            placements = place_decode_groups(t.num_token, t.num_shards // t.num_token, cores)
            groups = self._start_shards(base, placements, ready_sock, timeout)
            self._start_token_engines(base, groups, placements, ready_sock, timeout)
            prompt = [
                msgspec.structs.replace(base, service_id=f"prompt-{i}", role="prompt")
                for i in range(t.num_prompt)
            ]
            self.prompt = self._spawn(prompt, ready_sock, timeout)
        finally:
            ready_sock.close(linger=0)

    def _start_shards(
        self,
        base: WorkerConfig,
        placements: list[GroupPlacement],
        ready_sock: zmq.Socket,
        timeout: float,
    ) -> list[list[ShardLinkSpec]]:
        """Start every shard; return each token engine's group (heads split evenly)."""
        t = self.topology
        per_group = t.num_shards // t.num_token
        if not per_group:
            return [[] for _ in range(t.num_token)]
        num_kv_heads = _num_kv_heads(t.model_path)
        if num_kv_heads % per_group:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {per_group} shards")
        width = num_kv_heads // per_group
        cfgs = [
            msgspec.structs.replace(
                base,
                service="shard",
                service_id=f"shard-{i}",
                head_start=(i % per_group) * width,
                head_end=(i % per_group + 1) * width,
                cpus=list(placements[i // per_group].shards[i % per_group]),
            )  # fmt: skip
            for i in range(t.num_shards)
        ]
        self.shards = self._spawn(cfgs, ready_sock, timeout)
        links = [
            ShardLinkSpec(r.link_address, r.kv_endpoint, c.head_start, c.head_end, r.service_id)
            for c, r in zip(cfgs, self.shards, strict=True)
        ]
        return [links[e * per_group : (e + 1) * per_group] for e in range(t.num_token)]

    def _start_token_engines(
        self,
        base: WorkerConfig,
        groups: list[list[ShardLinkSpec]],
        placements: list[GroupPlacement],
        ready_sock: zmq.Socket,
        timeout: float,
    ) -> None:
        cfgs = [
            msgspec.structs.replace(
                base,
                service_id=f"token-{e}",
                role="token",
                shards=group,
                shard_num_blocks=self.topology.num_blocks,
                cpus=list(placements[e].engine),
            )  # fmt: skip
            for e, group in enumerate(groups)
        ]
        for group, ready in zip(groups, self._spawn(cfgs, ready_sock, timeout), strict=True):
            addrs = [ShardAddress(s.kv_endpoint, s.head_start, s.head_end) for s in group]
            self.token.append(TokenEngineInfo(ready, addrs))

    def _spawn(
        self, cfgs: list[WorkerConfig], ready_sock: zmq.Socket, timeout: float
    ) -> list[WorkerReady]:
        for cfg in cfgs:
            cmd = [
                sys.executable,
                "-m",
                "services.launch.worker_process",
                msgspec.json.encode(cfg).decode(),
            ]
            self.procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=self._env(cfg)))
        readies: dict[str, WorkerReady] = {}
        deadline = time.monotonic() + timeout
        while len(readies) < len(cfgs):
            if ready_sock.poll(max(0, int((deadline - time.monotonic()) * 1000))) == 0:
                raise TimeoutError(f"services not ready in {timeout} s: {len(readies)}/{len(cfgs)}")
            ready = msgspec.msgpack.decode(ready_sock.recv(), type=WorkerReady)
            readies[ready.service_id] = ready
        return [readies[c.service_id] for c in cfgs]

    def _env(self, cfg: WorkerConfig) -> dict[str, str]:
        env = os.environ | {"PYTHONPATH": str(REPO_ROOT)}
        if self.topology.otel_exporter:
            exporter = self.topology.otel_exporter.replace("{service_id}", cfg.service_id)
            env["PHASEMESH_OTEL_EXPORTER"] = exporter
        return env

    def control_endpoints(self) -> list[str]:
        engines = [r.control_endpoint for r in self.prompt] + [
            t.ready.control_endpoint for t in self.token
        ]
        return engines + [s.control_endpoint for s in self.shards]

    def stats(self, timeout: float = 10.0) -> list[EngineStats]:
        """Ask every service what it holds (KV blocks in use, live requests)."""
        return [service_stats(endpoint, timeout) for endpoint in self.control_endpoints()]

    def close(self) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        pool: PushPool[object] = PushPool(ctx, object)
        for r in self.prompt + [t.ready for t in self.token]:
            pool.get(r.command_endpoint).send(Shutdown())
        for s in self.shards:
            pool.get(s.kv_endpoint).send_tensors(Shutdown(), [])
        time.sleep(0.2)  # NOTE: let the shutdown messages leave before the sockets close
        pool.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def service_stats(control_endpoint: str, timeout: float = 10.0) -> EngineStats:
    """One service's `EngineStats`, asked on its control endpoint."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control_endpoint)
    try:
        typed: TypedSocket[ServiceReply] = TypedSocket(sock, ServiceReply)
        sock.send(msgspec.msgpack.encode(StatsRequest()))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no stats from {control_endpoint}")
        item = typed.recv_nowait()
        if item is None or not isinstance(item[1], EngineStats):
            raise RuntimeError(f"unexpected stats reply from {control_endpoint}: {item!r}")
        return item[1]
    finally:
        sock.close()


def _num_kv_heads(model_path: str) -> int:
    from common.config import ModelConfig

    return ModelConfig.from_folder(model_path).num_key_value_heads
