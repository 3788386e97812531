"""How `LocalMesh` starts a worker process: a fork of a server that imported the worker's code once.

A fresh interpreter running `worker_process` spends seconds of CPU importing torch, ucxx,
numpy and the services before it builds anything: a mesh of four workers paid that four times to
start, and the replacement of a dead worker once more before it could load its weights. The
standard library's fork server (`multiprocessing`'s "forkserver" start method) imports
`worker_process` once per launcher; each worker is then a `fork()` of that server, which is
single-threaded and has run nothing but imports: a process of its own (its own pid, signals,
memory and exit status), started in a fraction of a second.

What a worker gets from its launcher, as a `subprocess.Popen` child did:
- the launcher's environment as it is when the worker starts, plus the worker's own variables
  (the server's is the one the launcher had when the server started, plus what its imports set,
  such as `common/transport/ucx_channel.py`'s UCX defaults);
- the launcher's stdout and stderr as they are when the worker starts, passed over the server's
  socket (SCM_RIGHTS): pytest captures each test's output, so a worker's logs land in the test
  that started it, not in whichever test happened to start the server;
- its end with the launcher: a worker reads a pipe that only the launcher holds open for writing
  and exits at its end of file (`worker_process.run`); the server exits once the launcher and its
  workers have. A worker also exits with the server: the launcher learns its workers' exits from
  it, and without it would count them dead while they ran on.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
from multiprocessing import reduction
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from common.worker_config import WorkerConfig

# A worker dumps every thread's stack to stderr on this signal (faulthandler): the launcher asks
# one that never became ready.
STACKS_SIGNAL = signal.SIGUSR1

WORKER_MODULE = "services.launch.worker_process"
_CONTEXT = multiprocessing.get_context("forkserver")
# NOTE: the server imports these when it starts (the launcher's first worker), not the launcher.
_CONTEXT.set_forkserver_preload([WORKER_MODULE])


def start_worker(cfg: WorkerConfig, environ: dict[str, str]) -> BaseProcess:
    """Fork a worker running `cfg` with `environ` over this process's environment; it reports
    its endpoints on `cfg.ready_endpoint` when ready (`worker_process.run`)."""
    process = _CONTEXT.Process(
        target=_run_forked,
        args=(msgspec.json.encode(cfg), dict(os.environ) | environ, _FromLauncher()),
        name=cfg.service_id,
        # Terminated, not waited for, if the launcher exits without closing its mesh.
        daemon=True,
    )
    process.start()
    return process


@functools.cache
def _launcher_pipe() -> tuple[int, int]:
    """A pipe whose write end only this process holds (not inherited: `os.pipe` descriptors are
    close-on-exec), so a reader sees end of file once this process has exited.

    NOTE: not the fork server's own "alive" pipe: the server hands its write end to every worker
    too (so that a worker could fork through it), and it sees end of file only once the workers
    have exited as well."""
    return os.pipe()


class _FromLauncher:
    """What a worker takes from its launcher's descriptors: its stdout and stderr as they are
    now, and the read end of `_launcher_pipe`. `__reduce__` runs while multiprocessing pickles
    the process for the server, where `reduction.DupFd` adds each descriptor to those that travel
    with the request."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        stdio = [(fd, reduction.DupFd(fd)) for fd in (1, 2) if _is_open(fd)]
        return (_InWorker, (stdio, reduction.DupFd(_launcher_pipe()[0])))


class _InWorker:
    """In the worker: the launcher's descriptors, as the server handed them over."""

    def __init__(self, stdio: list[tuple[int, Any]], launcher: Any) -> None:
        self.stdio = stdio
        self.launcher = launcher

    def install_stdio(self) -> None:
        for fd, duplicate in self.stdio:
            os.dup2(duplicate.detach(), fd)

    def launcher_fd(self) -> int:
        return int(self.launcher.detach())


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False  # a launcher without stdout (a daemon): the worker keeps the server's
    return True


def _run_forked(cfg_json: bytes, environ: dict[str, str], launcher: _InWorker) -> None:
    """The worker's start, in the forked process."""
    launcher.install_stdio()
    os.environ.update(environ)
    from services.launch.worker_process import run  # imported already: the server preloaded it

    run(msgspec.json.decode(cfg_json, type=WorkerConfig), launcher.launcher_fd())
