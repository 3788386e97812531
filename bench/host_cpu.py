"""CPU accounting of the local mesh's processes on this host, for `bench/sim_validation.py`.

The mesh's processes are found by their Ray titles (below the `serve run` the bench started);
`CpuSampler` reads their CPU time and the whole machine's from /proc on a thread, so that a
window's cores per role can be read afterwards; `snapshot` and `foreign_cores` split the other
processes' CPU by priority against the mesh's (Ray starts its workers at nice 15).
"""

from __future__ import annotations

import os
import signal
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


def box_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


class CpuSampler:
    """Every `interval_s` on a thread: cumulative CPU seconds per role, this process ('client'),
    a client subprocess and the whole box; `cores` averages them over a window."""

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
        if self.extra_client_pid is not None:
            values["client"] += process_cpu_s(self.extra_client_pid)
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
        out = {k: (b[k] - a[k]) / span for k in a}
        out["background"] = out.pop("box") - sum(out[k] for k in (*ROLES, "client"))
        return out


def minus(busy: dict[str, float], idle: dict[str, float], roles: tuple[str, ...]) -> float:
    """Cores `roles` took beyond their idle use (health checks, idle polls: the background)."""
    return sum(max(busy[r] - idle[r], 0.0) for r in roles)


def snapshot() -> dict[int, tuple[int, float]]:
    """Every process on the box: pid -> (nice, CPU seconds so far)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        found[int(stat.parent.name)] = (
            int(fields[16]),
            (int(fields[11]) + int(fields[12])) / CLK_TCK,
        )
    return found


class BackgroundMeter:
    """The other processes' cores over a window, by priority against the mesh's: those at its
    nice or below share the cores with it; everything else the box did (processes above its
    priority, short-lived ones no snapshot saw, the kernel) is served before it."""

    def __init__(self) -> None:
        self.start_s = time.monotonic()
        self.busy_s = box_busy_s()
        self.before = snapshot()

    def stop(self, ours: set[int], mesh_nice: int) -> tuple[float, float]:
        """(cores above the mesh's priority, cores at it or below) since the start."""
        after, busy_s = snapshot(), box_busy_s()
        span = max(time.monotonic() - self.start_s, 1e-9)
        ours_s = shared_s = 0.0
        for pid, (nice, cpu_s) in after.items():
            used = cpu_s - self.before.get(pid, (nice, 0.0))[1]
            if pid in ours:
                ours_s += used
            elif nice >= mesh_nice:
                shared_s += used
        above_s = busy_s - self.busy_s - ours_s - shared_s
        return max(above_s, 0.0) / span, shared_s / span
