"""`serve run <config>` as a child process, exactly as `make run` starts PhaseMesh.

The config is a copy of a `deploy/` YAML with the HTTP port changed (a free one, so tests never
collide with a server someone else is running) and, where a test says so, some application args
and a random preset model (`on_preset`: the suite serves `tiny`, not `make run`'s SmolLM2).
`--address local` makes `serve run` start its own Ray even if a `ray start` cluster exists on the
machine; SIGINT (Ctrl-C) makes it shut Serve and that Ray down, so no Ray process outlives the
test.

`ingress="direct"` (the default, what `make run` starts) is Serve's direct ingress: the Router
replica serves HTTP itself on a port of Serve's direct-ingress range (moved here to a free region),
and `base_url` points at it; Serve's HTTP proxy still listens on the config's port
(`proxy_url`), the fallback. `ingress="proxy"` is Serve's classic path: every request and every
streamed chunk through the proxy actor; `base_url` is then the proxy's. `direct_thread`: direct
ingress with the app's code on Serve's user-code thread (Serve's default) instead of the
replica's own event loop (`LOCAL_DIRECT_INGRESS`). docs/serving.md.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml

from common.model.default import RANDOM_PRESETS
from services.serve_cli import QUIET_RUNTIME_ENV

REPO = Path(__file__).resolve().parents[2]
SERVE_CLI = Path(sys.executable).with_name("serve")
Ingress = Literal["direct", "direct_thread", "proxy"]
OFFLINE_TITLE = "ray::ServeReplica:phasemesh:OfflineGroup"  # the offline group's replica
DIRECT_INGRESS_PORTS = 100  # the range Serve allocates Router replicas' HTTP ports from
# Direct ingress on one machine, as `make run` sets it: the app's code on the replica's own event
# loop, uvicorn's (not Serve's user-code thread: no thread hop per chunk, as Ray's
# RAY_SERVE_THROUGHPUT_OPTIMIZED has it); no load balancer in front, so neither Serve's 30 s hold
# of a stopping Router replica (for balancers to deregister it: every Ctrl-C would wait it out)
# nor its quarantine of a freed port (a restarted Router takes its port back).
LOCAL_DIRECT_INGRESS = {
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    "RAY_SERVE_PORT_QUARANTINE_S": "0",
}


# Tries of a start whose HTTP port another process bound between its choice here and Serve's
# bind (a port is only reserved once bound): each retry on fresh ports.
PORT_TRIES = 3
PORT_TAKEN = "Failed to bind to address"  # Serve's proxy, when its port is busy


def free_port() -> int:
    """A free port below the kernel's ephemeral ones: the kernel hands those to every `bind` to
    port 0 (Ray's and ZeroMQ's) and outgoing connection, so one picked there can be taken before
    the server it is for binds it."""
    return free_port_range(1)


# The random presets' mesh: deploy/local.yaml gives SmolLM2's 3 KV heads a shard each; tiny's 2
# KV heads (and small's 4) split over 2 shards, as the suite and the benches have always run them.
PRESET_SHARDS = 2


def on_preset(config: dict[str, Any], preset: str) -> dict[str, Any]:
    """A serve config's application on a preset model, served under that name. On a random one
    (`tiny`, `small`) a mesh with shards gets the random presets' shard count, in its args and its
    replicas (one group, fixed: an AttentionShard `autoscaling_config`, deploy/cluster.yaml's, is
    dropped, as Serve refuses it beside `num_replicas`); a real one (`smollm2`) keeps the
    config's, which deploy/local.yaml sizes for it."""
    [app] = config["applications"]
    app["args"] |= {"model": preset, "served_model_name": preset}
    if preset not in RANDOM_PRESETS:
        return config
    mesh = app["args"].get("mesh") or {}
    if app["args"].get("offline"):  # the group splits the preset's layers and KV heads
        app["args"]["offline"] = app["args"]["offline"] | {"workers": PRESET_SHARDS}
    if app["args"].get("topology") == "mesh" and mesh.get("shards_per_group", 2):
        mesh["shards_per_group"] = PRESET_SHARDS
        for deployment in app["deployments"]:
            if deployment["name"] == "AttentionShard":
                deployment["num_replicas"] = PRESET_SHARDS
                deployment.pop("autoscaling_config", None)
    return config


def config_on_port(
    source: Path,
    target: Path,
    port: int,
    args: dict[str, Any] | None = None,
    preset: str | None = None,
    deployments: dict[str, dict[str, Any]] | None = None,
    app_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Copy a serve config, moving its HTTP port and updating its app's `args` (then, with
    `preset`, switching it to that preset model: `on_preset`), its deployments' options
    (`deployments`: by name, options to set; a None value removes the option) and the
    application's own (`app_options`: `autoscaling_policy`, ...); return the copy."""
    config = yaml.safe_load(source.read_text())
    config["applications"][0].update(app_options or {})
    config["http_options"]["port"] = port
    # The Batch API's store beside the config, not in the user's cache (runs never share one).
    config["applications"][0]["args"]["batch_store"] = str(target.parent / "batches.sqlite")
    config["applications"][0]["args"].update(args or {})
    if preset is not None:
        on_preset(config, preset)
    for deployment in config["applications"][0]["deployments"]:
        for option, value in (deployments or {}).get(deployment["name"], {}).items():
            if value is None:
                deployment.pop(option, None)
            else:
                deployment[option] = value
    target.write_text(yaml.safe_dump(config, sort_keys=False))
    return config


class ServeExited(RuntimeError):
    """`serve run` exited before its server was healthy; `log` is its log's tail."""

    def __init__(self, log: str) -> None:
        super().__init__(f"serve run exited early:\n{log}")
        self.log = log


class ServeRun:
    """One `serve run` child process and its log file."""

    def __init__(
        self,
        source_config: Path,
        workdir: Path,
        args: dict[str, Any] | None = None,
        ingress: Ingress = "direct",
        preset: str | None = None,
        deployments: dict[str, dict[str, Any]] | None = None,
        app_options: dict[str, Any] | None = None,
    ) -> None:
        self.config_path = workdir / source_config.name
        self.config = config_on_port(
            source_config, self.config_path, free_port(), args, preset, deployments, app_options
        )
        self.log_path = workdir / "serve-run.log"
        self.ingress = ingress
        self.base_url = self.proxy_url  # the Router replica's own once started, if direct
        self._proc: subprocess.Popen[bytes] | None = None
        self._direct_low = 0

    def start(self, timeout_s: float = 240.0) -> str:
        """Start `serve run` and wait for a healthy server: the URL requests go to. A start that
        finds its HTTP port taken is tried again on another (`PORT_TRIES` in all, one deadline)."""
        deadline = time.monotonic() + timeout_s
        for _ in range(PORT_TRIES - 1):
            try:
                return self._start(deadline)
            except ServeExited as exc:
                if PORT_TAKEN not in exc.log:
                    raise
                self.kill()  # whatever of that Ray is left
                self._move_to_port(free_port())
        return self._start(deadline)

    @property
    def port(self) -> int:
        """The HTTP port of Serve's proxy: the config's."""
        return int(self.config["http_options"]["port"])

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _move_to_port(self, port: int) -> None:
        self.config["http_options"]["port"] = port
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.base_url = self.proxy_url

    def _start(self, deadline: float) -> str:
        # Ray's idle timers as `make run` slows them (the caller's environment may override).
        env = QUIET_RUNTIME_ENV | {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        # NOTE: Ray 2.60 turns token auth on for the clusters it starts; say so explicitly.
        env.setdefault("RAY_AUTH_MODE", "token")
        ingress = ingress_env(self.ingress)
        env.update(ingress)
        self._direct_low = int(ingress.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "0"))
        command = [str(SERVE_CLI), "run", "--address", "local", str(self.config_path)]
        with self.log_path.open("wb") as log:
            # A session of its own: `kill` can then SIGKILL everything it started, and only that.
            self._proc = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self._wait_healthy(self.proxy_url, deadline)
        if self.ingress != "proxy":
            self.base_url = f"http://127.0.0.1:{self._router_port()}"
            self._wait_healthy(self.base_url, deadline)
        return self.base_url

    def follow_router(self) -> None:
        """Point `base_url` at the Router replica serving now (Serve may have replaced the one
        it named); direct ingress only, raising while no Router replica listens."""
        if self.ingress != "proxy":
            self.base_url = f"http://127.0.0.1:{self._router_port()}"

    def _router_port(self) -> int:
        assert self.pid is not None
        return router_port(self.pid, self._direct_low)

    @property
    def pid(self) -> int | None:
        """The `serve run` process: the Ray it starts (and every replica) runs below it."""
        return None if self._proc is None else self._proc.pid

    def _wait_healthy(self, url: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise ServeExited(self.log_tail())
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            # Waiting on another process's start-up: nothing to block on. Often: every test that
            # serves waits out the rest of a poll after the server is up.
            time.sleep(0.25)
        raise TimeoutError(f"no healthy server at {url} in time:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ctrl-C, as a user would; kill only if it does not exit."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGINT)
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL `serve run` and everything it started (its whole session), as a crash would."""
        if self._proc is None:
            return
        kill_session(self._proc.pid)
        self._proc.wait(30)

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def ray_metrics_url(self) -> str:
        """Ray's metrics agent (Prometheus text) of the Ray this `serve run` started.

        `--address local` lets Ray pick the export port; its agent keeps it in the session folder
        as `metrics_export_port_<node id>`, and Ray's own processes name that folder."""
        assert self.pid is not None
        for pid in descendants(self.pid):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue  # exited meanwhile
            for arg in args.split("\0"):
                name, _, value = arg.partition("=")
                if name in ("--session-dir", "--session_dir"):
                    for port_file in Path(value).glob("metrics_export_port_*"):
                        return f"http://127.0.0.1:{int(port_file.read_text())}/metrics"
        raise LookupError(f"no Ray metrics export port under serve run {self.pid}")


def ingress_env(ingress: Ingress) -> dict[str, str]:
    """The environment `serve run` needs for an ingress (Serve reads it where Ray starts)."""
    if ingress == "proxy":
        return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
    low = free_port_range(DIRECT_INGRESS_PORTS)
    env = LOCAL_DIRECT_INGRESS | {
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(low),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(low + DIRECT_INGRESS_PORTS),
    }
    if ingress == "direct_thread":  # Serve's default: the app on a user-code thread of its own
        env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] = "1"
    return env


def free_port_range(size: int) -> int:
    """The low end of `size` ports whose first is free, below the kernel's ephemeral ports (ZeroMQ
    and Ray bind there) and above Ray's worker ports; Serve skips any other busy one."""
    rng = random.Random()
    while True:
        low = rng.randrange(20000, 32000 - size)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", low))
            except OSError:
                continue  # taken: another server, another test's range
            return low


@contextlib.contextmanager
def served(
    config_name: str,
    workdir: Path,
    args: dict[str, Any] | None = None,
    ingress: Ingress = "direct",
    preset: str | None = "tiny",
    deployments: dict[str, dict[str, Any]] | None = None,
    app_options: dict[str, Any] | None = None,
) -> Iterator[ServeRun]:
    """`serve run deploy/<config_name>` (with `args` over its app's args, `deployments`' options
    over theirs and `app_options` over the application's: `config_on_port`) on the `preset`
    random model (None: the config's own, `make run`'s) for the `with` block. It ends killed
    (`kill`): no test here checks an orderly stop, and Serve's takes seconds of replica drains."""
    run = ServeRun(REPO / "deploy" / config_name, workdir, args, ingress, preset, deployments,
                   app_options)  # fmt: skip
    try:
        run.start()
        yield run
    finally:
        run.kill()


def end_ray() -> None:
    """Leave Ray: the cluster `ray.init` started here ends with every worker on it (the nodes
    of a `ray.cluster_utils.Cluster` end with its own `shutdown`). No `serve.shutdown()` first:
    nothing here checks an orderly stop, and Serve's drains every replica one by one (seconds of
    the suite's time)."""
    import ray
    from ray.serve import context as serve_context

    ray.shutdown()
    # NOTE: Serve caches its controller's handle in this process, keyed by the job id, and the
    # next cluster's first job has the same id: without this, the next module's Serve calls
    # would go to this cluster's dead controller (a private call of the pinned Ray).
    serve_context._disconnect()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), so a test touches only the Ray it started."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def replica_pid(server: ServeRun, deployment: str) -> int:
    assert server.pid is not None
    return replica_pid_below(server.pid, deployment)


def registry_pid(server: ServeRun) -> int:
    """The registry actor's process below this server (Ray names it after its class)."""
    assert server.pid is not None
    for pid in descendants(server.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if cmdline.startswith("ray::Registry"):
            return pid
    raise LookupError("no registry actor below the server")


def replica_pid_below(root: int, deployment: str) -> int:
    """The process of the one `deployment` replica below `root`."""
    for pid in replica_pids_below(root, deployment):
        return pid
    raise LookupError(f"no {deployment} replica under {root}")


def replica_pids_below(root: int, deployment: str) -> list[int]:
    """The processes of every `deployment` replica below `root` (a stopping one included)."""
    found = []
    for pid in descendants(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
        if f"ServeReplica:phasemesh:{deployment}" in cmdline:
            found.append(pid)
    return found


def router_port(root: int, low: int) -> int:
    """The port the Router replica below `root` serves HTTP on (direct ingress): the one TCP
    socket it listens on in the direct-ingress range from `low` (Serve skips busy ports, so look,
    not guess)."""
    ports = [p for p in listening_ports(replica_pid_below(root, "Router"))
             if low <= p < low + DIRECT_INGRESS_PORTS]  # fmt: skip
    if len(ports) != 1:
        raise RuntimeError(f"the Router replica listens on {ports} in the direct-ingress range")
    return ports[0]


def listening_ports(pid: int) -> list[int]:
    """TCP ports (IPv4 and IPv6) a process listens on: its socket inodes in /proc/net/tcp*."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def kill_session(session_id: int) -> None:
    """SIGKILL the process group `session_id` leads, then every other process of its session:
    Ray moves each worker (the HTTP proxy and the replicas among them) to a group of its own."""
    try:
        os.killpg(session_id, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone; members of other groups may remain
    for _ in range(50):  # again until none is left: one may have forked while we killed
        survivors = session_pids(session_id)
        if not survivors:
            break
        for pid in survivors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # exited on its own meanwhile
        time.sleep(0.1)  # SIGKILLed processes take a moment to leave /proc


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def session_pids(session_id: int) -> list[int]:
    """Live processes of a session, from /proc/PID/stat (state, ppid, pgrp, session follow the
    command name, which may hold spaces and parentheses)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue  # /proc/self, /proc/meminfo, ...
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited while we looked
        if int(fields[3]) == session_id and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def maps_torch_and_ucxx(pid: int) -> tuple[bool, bool]:
    """Whether the process `pid` has libtorch, and libucxx, mapped (/proc/<pid>/maps)."""
    mapped = Path(f"/proc/{pid}/maps").read_text()
    return "libtorch" in mapped, "libucxx" in mapped
