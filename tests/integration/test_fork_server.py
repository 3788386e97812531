"""`LocalMesh` workers forked from the launcher's fork server (services/launch/fork_server.py):
they take the launcher's environment and output as they are when each starts, a worker that
dies while starting fails the start at once, killing the launcher takes every worker with it, and
a mesh with a dead worker still closes, the others stopping by themselves.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from services.launch.local_mesh import LocalMesh, Topology

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]


def test_a_worker_takes_the_launchers_environment_and_output_as_they_are_when_it_starts(
    tiny_model_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    topology = Topology(str(tiny_model_path), pin_decode_groups=False)
    with capfd.disabled():  # the fork server runs from here on, its stderr not this test's
        LocalMesh.start(topology, supervise=False).close()
    monkeypatch.setenv("PHASEMESH_LOG_FORMAT", "console")  # the server started with json
    LocalMesh.start(topology, supervise=False).close()
    err = capfd.readouterr().err
    # Both engines load the model and say so, in the format set after the server started.
    assert len(re.findall(r"\[info\s*\] model loaded", err)) == 2, err[-3000:]


def test_a_worker_that_dies_starting_fails_the_start_at_once(tmp_path: Path) -> None:
    # No checkpoint there: the engines raise while loading it. The start says so as soon as a
    # worker exits (a RuntimeError), not when its time is up (a TimeoutError).
    topology = Topology(str(tmp_path / "missing"), pin_decode_groups=False)
    with pytest.raises(RuntimeError, match=r"-0 exited with code 1 before it was ready"):
        LocalMesh.start(topology, timeout=120)


LAUNCHER = """
import sys
from services.launch.local_mesh import LocalMesh, Topology

if __name__ == "__main__":
    mesh = LocalMesh.start(Topology(sys.argv[1], num_shards=2, pin_decode_groups=False))
    print(" ".join(str(proc.pid) for proc in mesh.procs), flush=True)
    sys.stdin.read()  # until the test kills this process
"""


def test_killing_the_launcher_takes_every_worker_and_the_fork_server_with_it(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    launcher = subprocess.Popen(
        [sys.executable, str(script), str(tiny_model_path)], cwd=REPO, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, env=os.environ | {"PYTHONPATH": str(REPO)}, text=True,
    )  # fmt: skip
    try:
        assert launcher.stdout is not None
        workers = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(workers) == 4, workers  # two shards, a token and a prompt engine
        server = {psutil.Process(pid).ppid() for pid in workers}
        assert len(server) == 1 and server != {launcher.pid}  # forked by one fork server
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(30)
        deadline = time.monotonic() + 30
        while alive := [pid for pid in workers + list(server) if running(pid)]:
            assert time.monotonic() < deadline, f"still running: {alive}"
            time.sleep(0.2)  # waiting on other processes' exits: nothing to block on
    finally:
        launcher.kill()
        launcher.wait(30)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_fork_server_takes_its_workers_and_the_supervisor_replaces_them(
    tiny_model_path: Path,
) -> None:
    """The launcher hears of its workers' exits through their fork server: with the server gone,
    every worker counts as dead. So they exit with it (none left running unsupervised), the
    supervisor starts each again through a new server, and the mesh serves the single-process
    engine's greedy tokens."""
    from common.engine.core import LLMEngine
    from common.protocol import SamplingSpec
    from common.sampling_params import SamplingParams
    from tests.conftest import random_prompts
    from tests.integration.mesh_test_client import MeshTestClient

    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_shards=2, pin_decode_groups=False))
    try:
        old = {w.service_id: w.proc.pid for w in mesh.workers.values()}
        [server] = {psutil.Process(pid).ppid() for pid in old.values()}
        os.kill(server, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while (alive := [p for p in old.values() if running(p)]) or len(
            {e.service_id for e in mesh.registry.live()} - set(old)
        ) < len(old):
            assert time.monotonic() < deadline, (alive, mesh.registry.live())
            time.sleep(0.2)  # waiting on other processes' exits and starts
        prompt = random_prompts([40], 2048, seed=5)[0]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        [expected] = LLMEngine.from_path(tiny_model_path, num_blocks=64).generate([prompt], params)
        client = MeshTestClient(mesh)
        client.submit("after", prompt, SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True))
        tokens: list[int] = []
        while True:
            out = client.recv(timeout=120)
            assert not out.error, out.error
            tokens += out.token_ids
            if out.finish_reason:
                break
        assert tokens == expected
        client.close()
    finally:
        mesh.close()


def test_a_mesh_with_a_worker_already_dead_closes_and_the_others_stop_by_themselves(
    tiny_model_path: Path,
) -> None:
    """`close` sends each worker its `Shutdown` on sockets that linger rather than after a fixed
    pause: the one to a worker SIGKILLed before (unsupervised: nothing replaces it) is left to
    ZeroMQ's I/O thread, and every other worker takes its own and exits by itself (status 0), not
    killed at the end of the join's wait."""
    topology = Topology(str(tiny_model_path), num_shards=2, pin_decode_groups=False)
    mesh = LocalMesh.start(topology, supervise=False)
    procs = list(mesh.procs)
    [dead] = [w.proc for w in mesh.workers.values() if w.service_id.startswith("token")]
    os.kill(dead.pid, signal.SIGKILL)
    dead.join(30)
    mesh.close()
    assert dead.exitcode == -signal.SIGKILL
    assert [p.exitcode for p in procs if p is not dead] == [0] * (len(procs) - 1)
