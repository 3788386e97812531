"""CPU accounting of the local mesh's processes on this host, for `bench/sim_validation.py`.

The mesh's processes are found by their Ray titles (below the `serve run` the bench started);
`CpuSampler` reads their CPU time, their runnable threads, and the whole machine's, from /proc on
a thread, so that a window's cores per role and its background can be read afterwards.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from pathlib import Path

ROLES = {  # Ray process titles of the mesh's processes
    "router": "ServeReplica:phasemesh:Router",
    "proxy": "ProxyActor",
    "prompt": "ServeReplica:phasemesh:PromptEngine",
    "token": "ServeReplica:phasemesh:TokenEngine",
    "shard": "ServeReplica:phasemesh:AttentionShard",
}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> set[int]:
    """`root` and every process below it (from /proc/PID/stat's parent field)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue  # exited meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def stop_survivors(pids: set[int]) -> None:
    """SIGKILL what is left of the server this bench started (a Ray that outlived Ctrl-C)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it exited, as it should have


def role_pids(root: int | None) -> dict[int, str]:
    """The mesh's processes by role (the shards are two): those below `root` (the `serve run`
    this bench started), else any on this host, which must then be one mesh only."""
    found = {}
    candidates = process_tree(root) if root else {int(p.name) for p in Path("/proc").glob("[0-9]*")}
    for pid in candidates:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        for role, marker in ROLES.items():
            if title.startswith("ray::") and marker in title:
                found[pid] = role
    counts = {role: list(found.values()).count(role) for role in ROLES}
    if any(counts[r] != 1 for r in ("router", "proxy", "prompt", "token")):
        raise RuntimeError(f"need exactly one local mesh; its processes by role: {counts}")
    return found


def process_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0  # it exited
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_nice(pid: int) -> int:
    """The nice value of `pid` (Ray starts its workers at 15)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def runnable_threads(pid: int) -> int:
    """Threads of `pid` running or waiting for a core (state R)."""
    count = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            count += stat.read_text().rsplit(")", 1)[1].split()[0] == "R"
        except OSError:
            continue  # exited meanwhile
    return count


def box_runnable() -> int:
    """Threads running or waiting for a core on the whole machine (`procs_running`)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("procs_running"):
            return int(line.split()[1])
    return 0


def box_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


class CpuSampler:
    """Every `interval_s` on a thread: cumulative CPU seconds per role, this process ('client'),
    a client subprocess and the whole box (`cores` averages them over a window), and how many
    threads wait for or hold a core on the box and in those processes (`background_threads`)."""

    def __init__(self, pids: dict[int, str], interval_s: float = 0.05) -> None:
        self.pids, self.interval_s = pids, interval_s
        self.extra_client_pid: int | None = None
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[float, dict[str, float]]:
        values = dict.fromkeys(ROLES, 0.0) | {"client": time.process_time(), "box": box_busy_s()}
        for pid, role in self.pids.items():
            values[role] += process_cpu_s(pid)
        ours = [*self.pids, os.getpid()]
        if self.extra_client_pid is not None:
            values["client"] += process_cpu_s(self.extra_client_pid)
            ours.append(self.extra_client_pid)
        # NOTE: minus this sampling thread, which is running while it counts.
        values["foreign_threads"] = box_runnable() - sum(map(runnable_threads, ours))
        return time.monotonic(), values

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.interval_s)  # NOTE: a sampling clock, not a poll for work

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def cores(self, t0: float, t1: float) -> dict[str, float]:
        """Average cores per role over [t0, t1] (nearest samples inside), plus 'background':
        the box's busy cores that no role and no client accounts for."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1] or self.samples[-2:]
        (a_t, a), (b_t, b) = inside[0], inside[-1]
        span = max(b_t - a_t, 1e-9)
        out = {k: (b[k] - a[k]) / span for k in a if k != "foreign_threads"}
        out["background"] = out.pop("box") - sum(out[k] for k in (*ROLES, "client"))
        return out

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """`cores`, plus `background_threads` as 'background_threads'."""
        return self.cores(t0, t1) | {"background_threads": self.background_threads(t0, t1)}

    def background_threads(self, t0: float, t1: float) -> float:
        """Mean number of threads outside the mesh and the client that held or waited for a
        core over [t0, t1]: the competition they are, which CPU time alone understates on a
        saturated box."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1] or self.samples[-2:]
        return max(statistics.fmean(v["foreign_threads"] for _, v in inside), 0.0)


def minus(busy: dict[str, float], idle: dict[str, float], roles: tuple[str, ...]) -> float:
    """Cores `roles` took beyond their idle use (health checks, idle polls: the background)."""
    return sum(max(busy[r] - idle[r], 0.0) for r in roles)
