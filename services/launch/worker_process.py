"""One mesh service (engine, attention shard, model peer) as an OS process, started by `LocalMesh`.

`python -m services.launch.worker_process CONFIG_JSON` pins itself to the cores it was given,
builds the worker the `WorkerConfig` describes, reports its endpoints with a `WorkerReady` on
`ready_endpoint`, and runs the worker's loop until told to shut down or its launcher dies.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

import msgspec
import torch
import zmq

from common.gc_heap import freeze_startup_heap
from common.roles import Role
from common.telemetry import configure_logging, configure_telemetry
from common.transport.zmq_sockets import connect
from common.worker_config import WorkerConfig
from services.engine.model_peer_worker import ModelPeerWorker
from services.engine.worker import EngineWorker
from services.launch.core_pinning import pin_this_process
from services.shard.worker import ShardWorker


def main() -> None:
    faulthandler.enable()  # a crash in native code (UCX, the kernel) still leaves a stack
    cfg = msgspec.json.decode(sys.argv[1], type=WorkerConfig)
    if cfg.cpus:  # before the worker starts threads: they inherit the mask
        pin_this_process(cfg.cpus)
    configure_telemetry(cfg.telemetry_name, instance_id=cfg.service_id)  # PHASEMESH_OTEL_EXPORTER
    configure_logging()
    torch.set_num_threads(cfg.num_threads)
    worker: EngineWorker | ShardWorker | ModelPeerWorker
    if cfg.role == Role.MODEL_PEER:
        worker = ModelPeerWorker(cfg)
    else:
        worker = ShardWorker(cfg) if cfg.role == Role.SHARD else EngineWorker(cfg)
    ctx: zmq.Context = zmq.Context.instance()
    ready = connect(ctx, zmq.PUSH, cfg.ready_endpoint, auth=cfg.curve_keys)
    ready.send(msgspec.msgpack.encode(worker.ready()))
    ready.close(linger=1000)
    _exit_with_parent(cfg.parent_pid)
    freeze_startup_heap()  # no full collection over the start-up heap mid-step (common/gc_heap.py)
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
