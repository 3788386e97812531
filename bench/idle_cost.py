"""What the served runtime costs while idle, process by process and thread by thread.

    python bench/idle_cost.py [--paths mesh local] [--window 30] [--settle 15]
                              [--preset tiny|small|smollm2] [--server-pid PID]

For each path, `serve run` as `make run` starts it (`mesh`: deploy/local.yaml, `local`:
deploy/single.yaml; direct ingress; or, with `--server-pid`, one running already), one request,
`--settle` seconds for start-up work to end, then a `--window` of seconds with no request: every
process of the server's session (Ray's GCS, raylet, dashboard and agents, Serve's controller and
proxy, the replicas, the registry actor) is read from /proc before and after. Figures per process
(by Ray title or command): `cores` (CPU seconds over the window's seconds) and `wakeups_per_s`
(voluntary context switches: a thread that blocks and is woken; what an idle loop's timer costs
even when its work is small), `main_thread_cores` (its main thread's: a Ray worker's task loop,
which checks for signals every 10 ms); the busiest threads by name across the tree; and
`ray_workers_main_thread_cores`, those main threads' sum over the Ray workers (the floor no
setting moves).

CPU seconds of the server's own processes do not depend on what else the machine runs (a shared
machine's load slows them, it does not add to them), so the figures compare across runs where
wall-clock throughput would not. The last line is one JSON object with `targets` and
`targets_met` (issue 54: the mesh at most 0.10 cores idle, `local` at most 0.05).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # NOTE: not bench/, whose profile.py would shadow the stdlib's

from bench.host_cpu import CLK_TCK, box_busy_s  # noqa: E402
from bench.machine import cpu_variant  # noqa: E402
from bench.serve_server import model_vocab, prompts_for, served_batch, server_pids  # noqa: E402
from common.model.default import PRESETS  # noqa: E402
from tests.e2e.serve_process import ServeRun  # noqa: E402

CONFIGS = {"mesh": "local.yaml", "local": "single.yaml"}
TARGETS = {"mesh_idle_cores_max": 0.10, "local_idle_cores_max": 0.05}
TOP_THREADS = 12
# Processes titled `ray::` that are Ray's agents, not core workers (no task loop on the main thread)
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")

ThreadKey = tuple[int, int]  # (pid, tid)


def process_name(pid: int) -> str:
    """A Ray worker's title (`ray::ServeReplica:phasemesh:Router`), a dashboard module's
    (`ray-dashboard-NodeHead`), else the command's name (`serve` for `serve run` itself)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    first = args[0].decode(errors="replace")
    if first.startswith("ray::"):
        return first.split()[0]
    if first.startswith("ray-dashboard-"):  # a dashboard module's process: `ray-dashboard-X-0 (...`
        return first.split()[0].rsplit("-", 1)[0]
    for arg in args:  # `python -m ray.x.y` and Ray's binaries: the module or the binary
        text = arg.decode(errors="replace")
        if text.startswith("from multiprocessing."):  # the dashboard's forkserver, its tracker
            return text.split()[1]
        if text.endswith(".py") or "/ray/" in text or Path(text).name == "serve":
            return Path(text).name
    return Path(first).name


def read_threads(pids: set[int]) -> dict[ThreadKey, tuple[str, float, int]]:
    """Every live thread of `pids`: (name, CPU seconds, voluntary context switches)."""
    found = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                status = (task / "status").read_text()
                name = (task / "comm").read_text().strip()
            except OSError:
                continue  # it exited
            switches = int(status.split("voluntary_ctxt_switches:", 1)[1].split()[0])
            cpu_s = (int(fields[11]) + int(fields[12])) / CLK_TCK
            found[(pid, int(task.name))] = (name, cpu_s, switches)
    return found


def idle_window(root: int, window_s: float) -> dict[str, Any]:
    """The server's processes and threads over `window_s` of idleness."""
    pids = server_pids(root)
    names = {pid: process_name(pid) for pid in pids}
    box_before, start = box_busy_s(), time.monotonic()
    before = read_threads(pids)
    time.sleep(window_s)
    after = read_threads(pids)
    span = time.monotonic() - start
    box_cores = (box_busy_s() - box_before) / span
    by_process: dict[str, dict[str, float]] = defaultdict(
        lambda: {"cores": 0.0, "main_thread_cores": 0.0, "wakeups_per_s": 0.0, "num_processes": 0}
    )
    threads: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for pid in pids:
        by_process[names[pid]]["num_processes"] += 1
    for key, (name, cpu_s, switches) in after.items():
        _, cpu0, switches0 = before.get(key, (name, 0.0, 0))
        cores, wakeups = (cpu_s - cpu0) / span, (switches - switches0) / span
        process = by_process[names.get(key[0], "?")]
        process["cores"] += cores
        process["wakeups_per_s"] += wakeups
        if key[0] == key[1]:  # its main thread: a Ray worker's task loop, its 10 ms signal check
            process["main_thread_cores"] += cores
        thread = threads[(names.get(key[0], "?"), name)]
        thread[0] += cores
        thread[1] += wakeups
    top = sorted(threads.items(), key=lambda kv: -(kv[1][0] + kv[1][1] * 2e-5))[:TOP_THREADS]
    return {
        "idle_cores": sum(p["cores"] for p in by_process.values()),
        "wakeups_per_s": sum(p["wakeups_per_s"] for p in by_process.values()),
        "box_cores": box_cores,
        # What no setting moves: every Ray worker's main thread wakes every 10 ms (its core
        # worker's signal check, a fixed period), with or without work.
        "ray_workers_main_thread_cores": sum(
            p["main_thread_cores"]
            for name, p in by_process.items()
            if name.startswith("ray::") and name not in RAY_AGENTS
        ),
        "by_process": {
            name: {k: round(v, 4) for k, v in p.items()}
            for name, p in sorted(by_process.items(), key=lambda kv: -kv[1]["cores"])
        },
        "top_threads": [
            {"process": p, "thread": t, "cores": round(c, 4), "wakeups_per_s": round(w, 1)}
            for (p, t), (c, w) in top
        ],
    }


def measure(
    path: str, preset: str, window_s: float, settle_s: float, server_pid: int | None = None
) -> dict[str, Any]:
    """The idle window of a `serve run` of `path` started here, or of the running one whose
    process is `server_pid` (its start-up and requests are its caller's)."""
    import asyncio

    if server_pid is not None:
        time.sleep(settle_s)
        return idle_window(server_pid, window_s)
    with tempfile.TemporaryDirectory() as workdir:
        server = ServeRun(REPO / "deploy" / CONFIGS[path], Path(workdir), {}, preset=preset)
        try:
            url = server.start()
            assert server.pid is not None
            asyncio.run(served_batch(url, preset, prompts_for(1, model_vocab(preset)), 16))
            time.sleep(settle_s)
            return idle_window(server.pid, window_s)
        finally:
            tree = server_pids(server.pid) if server.pid else set()
            server.stop()
            from bench.host_cpu import stop_survivors

            stop_survivors({p for p in tree if Path(f"/proc/{p}").exists()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paths", nargs="+", default=["mesh", "local"], choices=list(CONFIGS))
    parser.add_argument("--preset", default="tiny", choices=PRESETS,
                        help="the model: a random preset, or smollm2 (`make run`'s)")  # fmt: skip
    parser.add_argument("--window", type=float, default=30.0, help="idle seconds measured")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds before the window")
    parser.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="extra environment of `serve run`")  # fmt: skip
    parser.add_argument("--server-pid", type=int, default=None,
                        help="a running `serve run` (of the one path in --paths)")  # fmt: skip
    args = parser.parse_args()
    if args.server_pid is not None and len(args.paths) != 1:
        parser.error("--server-pid measures one server: name its path alone in --paths")
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}").is_dir():
        parser.error(f"--server-pid {args.server_pid}: no such process (its window would be empty)")
    extra_env = dict(item.split("=", 1) for item in args.env)
    os.environ.update(extra_env)
    results: dict[str, Any] = {"preset": args.preset, "cpu": cpu_variant(), "window_s": args.window,
                               "env": extra_env}  # fmt: skip
    for path in args.paths:
        figures = measure(path, args.preset, args.window, args.settle, args.server_pid)
        print(f"{path}: {figures['idle_cores']:.3f} cores, {figures['wakeups_per_s']:.0f} "
              f"wake-ups/s (box {figures['box_cores']:.2f}); Ray workers' main threads "
              f"{figures['ray_workers_main_thread_cores']:.3f} cores")  # fmt: skip
        for name, p in figures["by_process"].items():
            print(f"  {p['cores']:.4f} cores {p['wakeups_per_s']:8.1f}/s  {name}")
        for t in figures["top_threads"]:
            print(f"    thread {t['cores']:.4f} cores {t['wakeups_per_s']:8.1f}/s  "
                  f"{t['process']} / {t['thread']}")  # fmt: skip
        results[path] = figures
    results["targets"] = TARGETS
    results["targets_met"] = {
        f"{path}_idle_cores_max": results[path]["idle_cores"] <= TARGETS[f"{path}_idle_cores_max"]
        for path in args.paths
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
