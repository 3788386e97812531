"""A synthetic neighbour for `bench/serve.py`'s `neighbor` path: CPU taken in short bursts.

A served engine never has the machine to itself: the benchmark's client, Ray's runtime (raylet,
GCS, the Serve controller, the proxy) and the Router's own threads run on the same cores and wake
hundreds of times a second. `BurstLoad(cores)` stands in for them with nothing of theirs: a few
processes that each spin for `burst_us`, then sleep, so that together they keep `cores` cores
busy on average. The in-process engine measured beside it answers what the served path's ratio
can reach at best on the machine it runs on once that much CPU is taken by others, whatever the
front end does: an engine whose threads meet at OpenMP barriers loses more than the CPU it is
denied, because while one of its threads is preempted the others wait at the next barrier.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

BURST_US = 300.0  # a Ray thread's wake-up or a client's request: a few hundred microseconds
PROCESSES = 2  # so that bursts can land on two cores at once


def _burn(burst_s: float, sleep_s: float, parent_pid: int) -> None:
    print("burning", flush=True)  # the parent waits for this line
    while os.getppid() == parent_pid:  # a parent killed outright cannot kill us: we stop then
        end = time.perf_counter() + burst_s
        while time.perf_counter() < end:
            pass  # NOTE: busy on purpose: this is the load
        time.sleep(sleep_s)


class BurstLoad:
    """`cores` cores of CPU on average, taken by `processes` processes in `burst_us` bursts,
    while the `with` block runs (the processes are killed on exit, and stop by themselves within
    a burst and a sleep if this process dies first).

    NOTE: each is `python bench/cpu_load.py`, which imports nothing but the standard library: a
    `multiprocessing` child would import its parent's main module (torch), a few seconds of
    full load that would land in the first figures measured."""

    def __init__(
        self, cores: float, burst_us: float = BURST_US, processes: int = PROCESSES
    ) -> None:
        duty = cores / processes
        if not 0.0 < duty < 1.0:
            raise ValueError(f"{cores} cores over {processes} processes: each needs (0, 1)")
        self.cores = cores
        self._burst_s = burst_us / 1e6
        self._sleep_s = self._burst_s * (1.0 - duty) / duty
        self._processes = processes
        self._running: list[subprocess.Popen[str]] = []

    def __enter__(self) -> BurstLoad:
        command = [sys.executable, str(Path(__file__).resolve()), str(self._burst_s),
                   str(self._sleep_s), str(os.getpid())]  # fmt: skip
        for _ in range(self._processes):
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
            self._running.append(proc)
        for proc in self._running:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "burning":
                self.__exit__(None, None, None)
                raise RuntimeError("a load process did not start")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for proc in self._running:
            proc.kill()
        for proc in self._running:
            proc.wait()
        self._running.clear()


if __name__ == "__main__":
    _burn(float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
