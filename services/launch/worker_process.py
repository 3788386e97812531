"""One mesh service (engine, attention shard, model peer) as an OS process, started by `LocalMesh`.

`run(cfg, launcher_fd)` pins the process to the cores it was given, builds the worker the
`WorkerConfig` describes, reports its endpoints with a `WorkerReady` on `ready_endpoint`, and runs
the worker's loop until told to shut down or its launcher dies. `LocalMesh` forks it from a server
that imported this module once (`fork_server.py`).
"""

from __future__ import annotations

import faulthandler
import os
import select
import threading

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
from services.launch.fork_server import STACKS_SIGNAL
from services.shard.worker import ShardWorker


def run(cfg: WorkerConfig, launcher_fd: int) -> None:
    """Run the worker `cfg` describes until it is told to shut down, or until `launcher_fd` (the
    read end of a pipe that only the launcher holds open for writing) says the launcher is gone,
    or its parent (the fork server) is gone."""
    parent_pid = os.getppid()
    faulthandler.enable()  # a crash in native code (UCX, the kernel) still leaves a stack
    # Every thread's stack on demand: the launcher asks a worker that never became ready.
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    if cfg.cpus:  # before the worker starts threads: they inherit the mask
        pin_this_process(cfg.cpus)
    telemetry = configure_telemetry(cfg.telemetry_name, instance_id=cfg.service_id)
    configure_logging()
    torch.set_num_threads(cfg.num_threads)
    worker: EngineWorker | ShardWorker | ModelPeerWorker
    if cfg.role == Role.MODEL_PEER:
        worker = ModelPeerWorker(cfg)
    else:
        worker = ShardWorker(cfg) if cfg.role == Role.SHARD else EngineWorker(cfg)
    _exit_with_launcher(launcher_fd, parent_pid)
    ctx: zmq.Context = zmq.Context.instance()
    ready = connect(ctx, zmq.PUSH, cfg.ready_endpoint, auth=cfg.curve_keys)
    ready.send(msgspec.msgpack.encode(worker.ready()))
    # NOTE: no limit on the linger: the message leaves once the connection (a CURVE handshake)
    # is up, which on a loaded machine can take seconds, and a close with a short linger drops
    # it: the launcher then waits out its whole start timeout for a worker that runs. A launcher
    # that is gone ends this process through the watch above, so this cannot hang.
    ready.close(linger=-1)
    freeze_startup_heap()  # no full collection over the start-up heap mid-step (common/gc_heap.py)
    try:
        worker.run()
    finally:
        # NOTE: a forked process ends in `os._exit` (multiprocessing's), which runs no atexit
        # hook: what the exporters (PHASEMESH_OTEL_EXPORTER) still buffer is flushed here.
        telemetry.shutdown()


def _exit_with_launcher(launcher_fd: int, parent_pid: int) -> None:
    """A worker whose launcher died must not linger (tests kill launchers). Nor one whose fork
    server died: the launcher learns a worker's exit from that server, so it counts every worker
    as dead (exit code 255) and its supervisor starts replacements through a new server."""

    def watch() -> None:
        # NOTE: end of file on the pipe (the launcher has exited), or a second's timeout to look
        # at the parent: nothing to block on for a parent's death.
        while not select.select([launcher_fd], [], [], 1.0)[0] and os.getppid() == parent_pid:
            pass
        os._exit(0)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
