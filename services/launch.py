"""Start a mesh topology as local OS processes, and talk to it.

    python -m services.launch --prompt 1 --token 1 --shards 2 [--model PATH]

starts N prompt engines, M token engines and S attention shards (S/M shards per token engine,
split by KV heads; S = 0 is local attention), prints their endpoints and runs a short demo.
Tests and benchmarks use `Mesh.start(...)` and `MeshClient` directly.
"""

from __future__ import annotations

import argparse
import itertools
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
    AbortRequest,
    EngineStats,
    GenerateRequest,
    SamplingSpec,
    ServiceReply,
    ShardAddress,
    Shutdown,
    StatsRequest,
    TokenOutput,
)
from common.transport.zmq_sockets import PushPool, TypedSocket, bind_random
from services.cpu_placement import GroupPlacement, place_decode_groups
from services.token_stream import TokenStreamOrderer
from services.worker_config import ShardLinkSpec, WorkerConfig, WorkerReady

log = structlog.get_logger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[1]


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
    # Pin each token engine and its shards to cores (services/cpu_placement.py); prompt engines
    # float.
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
class Mesh:
    """The running processes of a topology and their endpoints."""

    topology: Topology
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    prompt: list[WorkerReady] = field(default_factory=list)
    token: list[TokenEngineInfo] = field(default_factory=list)
    shards: list[WorkerReady] = field(default_factory=list)

    @classmethod
    def start(cls, topology: Topology, timeout: float = 120.0) -> Mesh:
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
            cmd = [sys.executable, "-m", "services.worker", msgspec.json.encode(cfg).decode()]
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


class MeshClient:
    """Submits requests to a mesh and collects their token streams (round-robin placement)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        ctx: zmq.Context = zmq.Context.instance()
        sock, self.reply_endpoint = bind_random(ctx, zmq.PULL)
        self.replies: TypedSocket[ServiceReply] = TypedSocket(sock, ServiceReply)
        self.push: PushPool[object] = PushPool(ctx, object)
        self._prompt_rr = itertools.cycle(mesh.prompt)
        self._token_rr = itertools.cycle(mesh.token)
        self.placement: dict[str, tuple[WorkerReady, TokenEngineInfo]] = {}
        self.orderer = TokenStreamOrderer()

    def submit(
        self, req_id: str, prompt: list[int], sampling: SamplingSpec, traceparent: str = ""
    ) -> None:
        """`traceparent`: the request's trace context (`inject_context()`), as a router sends it."""
        pe, te = next(self._prompt_rr), next(self._token_rr)
        self.placement[req_id] = (pe, te)
        msg = GenerateRequest(
            req_id=req_id, prompt_token_ids=prompt, sampling=sampling,
            reply_to=self.reply_endpoint, token_engine=te.ready.command_endpoint,
            token_kv_endpoint=te.ready.kv_endpoint, shards=te.shards, traceparent=traceparent,
        )  # fmt: skip
        self.push.get(pe.command_endpoint).send(msg)

    def abort(self, req_id: str) -> None:
        """Abort at the prompt engine and the token engine; the token engine frees the shards."""
        pe, te = self.placement[req_id]
        self.push.get(pe.command_endpoint).send(AbortRequest(req_id))
        self.push.get(te.ready.command_endpoint).send(AbortRequest(req_id))

    def recv(self, timeout: float = 30.0) -> TokenOutput:
        """The next token message from any request, in each request's token order."""
        deadline = time.monotonic() + timeout
        while not self.orderer.ready:
            item = self.replies.recv_nowait()
            if item is not None and isinstance(item[1], TokenOutput):
                self.orderer.push(item[1])
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not self.replies.sock.poll(int(left * 1000)):
                raise TimeoutError(f"no tokens from the mesh in {timeout} s")
        return self.orderer.ready.popleft()

    def close(self) -> None:
        self.replies.close()
        self.push.close()


def main() -> None:
    from common.model.default import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt", type=int, default=1)
    parser.add_argument("--token", type=int, default=1)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--no-pin", action="store_true", help="let the OS place every process")
    args = parser.parse_args()
    topology = Topology(
        str(args.model or default_model_path()), args.prompt, args.token, args.shards,
        pin_decode_groups=not args.no_pin,
    )  # fmt: skip
    mesh = Mesh.start(topology)
    try:
        client = MeshClient(mesh)
        client.submit("demo", list(range(10, 60)), SamplingSpec(max_tokens=16, temperature=0))
        tokens: list[int] = []
        while True:
            out = client.recv()
            tokens += out.token_ids
            if out.finish_reason:
                break
        print(f"demo request: {len(tokens)} tokens {tokens}, finish: {out.finish_reason}")
        for stats in mesh.stats():
            print(stats)
    finally:
        mesh.close()


if __name__ == "__main__":
    main()
