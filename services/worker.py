"""Run one mesh service (engine or attention shard) as an OS process on ZeroMQ and UCX.

`python -m services.worker CONFIG_JSON` starts the service described by a `WorkerConfig`, binds
its sockets on free ports, and reports them with a `WorkerReady` on `ready_endpoint`. The loops
block in `zmq.Poller.poll` / UCX's event fd while idle and never sleep-poll.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

import msgspec
import structlog
import torch
import zmq

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.protocol import (
    AbortRequest,
    DecodeHandoff,
    EngineCommand,
    FreeRequest,
    GenerateRequest,
    KvPages,
    LoadReport,
    ServiceReply,
    ShardIngress,
    ShardLinkMessage,
    Shutdown,
    StatsRequest,
)
from common.telemetry import configure_logging, configure_telemetry
from common.transport.ucx_channel import UcxTensorChannel
from common.transport.zmq_sockets import PushPool, TypedSocket, bind_random
from services.cpu_placement import pin_this_process
from services.engine import Engine, EngineRole
from services.engine_telemetry import EngineTelemetry
from services.worker_config import WorkerConfig, WorkerReady

log = structlog.get_logger(__name__)

IDLE_POLL_MS = 200  # an idle loop wakes this often to notice a dead parent; never busy-polls
LOAD_REPORT_INTERVAL_S = 0.05


class EngineWorker:
    """Sockets and loop around an `Engine`."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        cmd, self.command_endpoint = bind_random(self.ctx, zmq.PULL, cfg.host)
        kv, self.kv_endpoint = bind_random(self.ctx, zmq.PULL, cfg.host)
        ctl, self.control_endpoint = bind_random(self.ctx, zmq.ROUTER, cfg.host)
        pub, self.load_endpoint = bind_random(self.ctx, zmq.PUB, cfg.host)
        self.commands: TypedSocket[EngineCommand] = TypedSocket(cmd, EngineCommand)
        self.kv_in: TypedSocket[ShardIngress] = TypedSocket(kv, ShardIngress)
        self.control: TypedSocket[StatsRequest] = TypedSocket(ctl, StatsRequest)
        self.replies: TypedSocket[ServiceReply] = TypedSocket(ctl, ServiceReply)
        self.load_pub: TypedSocket[LoadReport] = TypedSocket(pub, LoadReport)
        self.push: PushPool[object] = PushPool(self.ctx, object)
        self.kv_push: PushPool[ShardIngress] = PushPool(self.ctx, ShardIngress)
        links = [UcxTensorChannel.connect(s.link_address, ShardLinkMessage) for s in cfg.shards]
        role = EngineRole(
            cfg.role, self.command_endpoint, cfg.layer_wise_min_tokens, cfg.shard_num_blocks
        )
        telemetry = EngineTelemetry(
            cfg.service_id, cfg.model_name, shards=[s.service_id for s in cfg.shards]
        )
        self.engine = Engine(
            cfg.service_id, role, _engine_config(cfg), self._send_kv, links,
            [(s.head_start, s.head_end) for s in cfg.shards], telemetry,
        )  # fmt: skip
        self.running = True
        self._last_report = 0.0

    def ready(self) -> WorkerReady:
        return WorkerReady(
            self.cfg.service_id, self.cfg.role, self.command_endpoint, self.kv_endpoint,
            self.control_endpoint, self.load_endpoint,
        )  # fmt: skip

    def _send_kv(self, endpoint: str, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv_push.get(endpoint).send_tensors(pages, [k, v])

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.commands.sock, self.kv_in.sock, self.control.sock):
            poller.register(sock, zmq.POLLIN)
        while self.running:
            poller.poll(0 if self.engine.has_work() else IDLE_POLL_MS)
            self._drain()
            if self.engine.has_work():
                self._step()
            self._report_load()
        self.ctx.destroy(linger=0)

    def _step(self) -> None:
        try:
            self._send(self.engine.step())
        except Exception as exc:  # noqa: BLE001 - fail the requests, keep the service alive
            log.exception("engine step failed; failing its requests")
            self._send(self.engine.fail_all(f"engine {self.cfg.service_id}: {exc!r}"))

    def _drain(self) -> None:
        while (item := self.commands.recv_nowait()) is not None:
            self._on_command(item[1])
        while (kv := self.kv_in.recv_tensors_nowait()) is not None:
            header, tensors = kv
            if isinstance(header, KvPages) and len(tensors) == 2:
                self.engine.on_kv(header, *tensors)
            elif isinstance(header, FreeRequest):
                self._send(self.engine.on_abort(header.req_id))
        while (req := self.control.recv_nowait()) is not None:
            self.replies.send(self.engine.stats(), prefix=req[0])

    def _on_command(self, msg: EngineCommand) -> None:
        if isinstance(msg, GenerateRequest):
            self._send(self.engine.on_generate(msg))
        elif isinstance(msg, DecodeHandoff):
            self._send(self.engine.on_handoff(msg))
        elif isinstance(msg, AbortRequest):
            self._send(self.engine.on_abort(msg.req_id))
        elif isinstance(msg, Shutdown):
            self.running = False

    def _send(self, outgoing: list[tuple[str, object]]) -> None:
        for endpoint, msg in outgoing:
            if isinstance(msg, FreeRequest):  # KV ingress carries tensor messages only
                self.kv_push.get(endpoint).send_tensors(msg, [])
            else:
                self.push.get(endpoint).send(msg)

    def _report_load(self) -> None:
        now = time.monotonic()
        if now - self._last_report >= LOAD_REPORT_INTERVAL_S:
            self._last_report = now
            report = self.engine.load_report(time.time())
            self.load_pub.send(report)
            self.engine.telemetry.report(report, self.engine.blocks.num_used_blocks)


def _engine_config(cfg: WorkerConfig) -> EngineConfig:
    return EngineConfig(
        model_path=cfg.model_path,
        cache=CacheConfig(cfg.block_size, cfg.num_blocks),
        scheduler=SchedulerConfig(cfg.max_num_batched_tokens, cfg.max_num_seqs),
        attention_backend=cfg.attention_backend,
    )


def main() -> None:
    faulthandler.enable()  # a crash in native code (UCX, the kernel) still leaves a stack
    cfg = msgspec.json.decode(sys.argv[1], type=WorkerConfig)
    if cfg.cpus:  # before the worker starts threads: they inherit the mask
        pin_this_process(cfg.cpus)
    configure_telemetry(cfg.telemetry_name, instance_id=cfg.service_id)  # PHASEMESH_OTEL_EXPORTER
    configure_logging()
    torch.set_num_threads(cfg.num_threads)
    if cfg.service == "shard":
        from services.shard_worker import ShardWorker

        worker: EngineWorker | ShardWorker = ShardWorker(cfg)
    else:
        worker = EngineWorker(cfg)
    ctx: zmq.Context = zmq.Context.instance()
    ready = ctx.socket(zmq.PUSH)
    ready.connect(cfg.ready_endpoint)
    ready.send(msgspec.msgpack.encode(worker.ready()))
    ready.close(linger=1000)
    _exit_with_parent(cfg.parent_pid)
    worker.run()


def _exit_with_parent(parent_pid: int) -> None:
    """A worker whose launcher died must not linger (tests kill launchers)."""

    def watch() -> None:
        while True:
            time.sleep(1.0)  # NOTE: a watchdog thread, off the hot path
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    main()
