"""Seesaw behind the Batch API: the offline group as a service the router calls with token ids.

A batch whose every line is a plain greedy completion or chat (`offline_eligible` in
`services/router/batch_api.py`) goes to the offline group in one job: the router tokenizes (a
chat through its template), the group generates, the router writes each response as
`/v1/completions` or `/v1/chat/completions` would. Any other batch,
and any line the router cannot hand over (one it would refuse, one longer than the group's
`max_len`), runs line by line through the online API.

`OfflineService` is what the Serve deployment wraps (`services/app.py`): one replica owning the
group's k worker processes (`services/offline/group.py`). A job that fails (a worker died) raises;
the batch runner then runs the batch through the online API instead, so no batch fails for it.

The deployment's group runs only while there is work: its workers start with the first job (each
loads the model: that job waits for it) and stop once `IDLE_STOP_S` pass without one, so an idle
server keeps no worker processes (each would wake its gloo loop a hundred times a second). A
group that fails to start, or fails a job, is stopped: that job raises as above, and the next
one starts a fresh group.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import structlog

from services.offline.group import OfflineGroup, OfflineGroupError
from services.offline.options import OfflineOptions

log = structlog.get_logger(__name__)


MAX_CANCELLED = 256  # job ids remembered as cancelled (a cancel may come before its job runs)
IDLE_STOP_S = 60.0  # a started group's workers stop after this long without a job


class OfflineService:
    """The group behind one lock: one job at a time (Seesaw runs one batch at a time).

    `group`: a running group, kept for the service's life; or None with `start_group`: a group
    started at each first job and stopped `idle_stop_s` after the last (the module docstring).
    """

    def __init__(
        self, group: OfflineGroup | None, mode: str = "seesaw", *,
        start_group: Callable[[], OfflineGroup] | None = None, max_len: int = 0,
        idle_stop_s: float = IDLE_STOP_S,
    ) -> None:  # fmt: skip
        if group is None and start_group is None:
            raise ValueError("an offline service needs a group or a way to start one")
        self.group, self.mode = group, mode
        self.start_group = start_group
        self.max_len = group.kv.max_len if group is not None else max_len
        self.idle_stop_s = idle_stop_s
        self._lock = threading.Lock()
        self._cancelled: dict[str, None] = {}  # insertion-ordered: the oldest go first
        self._idle_timer: threading.Timer | None = None
        self.num_jobs = 0
        self.num_starts = 0

    @classmethod
    def start(
        cls, model_path: str | Path, options: OfflineOptions, weight_cache: Path | None = None
    ) -> OfflineService:
        """A service whose group's worker processes (each loads the model once, from the node's
        `weight_cache` where given) start with its first job and stop when idle."""

        def start_group() -> OfflineGroup:
            return OfflineGroup(
                model_path, options.workers, num_buffer_slots=options.buffer_slots,
                num_decode_slots=options.decode_slots, max_len=options.max_len,
                threads_per_worker=options.threads_per_worker, weight_cache=weight_cache,
            )  # fmt: skip

        return cls(None, options.mode, start_group=start_group, max_len=options.max_len)

    def healthy(self) -> bool:
        """Every worker of the running group lives (a stopped group has none to lose)."""
        group = self.group
        return group is None or all(p.is_alive() for p in group.procs)

    def generate(self, prompts: list[list[int]], max_tokens: list[int],
                 job_id: str | None = None) -> list[list[int] | None]:  # fmt: skip
        """Each prompt's greedy output ids, None for one a cancel of `job_id` cut short
        (blocking: the caller runs it off its event loop)."""

        def cancelled() -> bool:
            return job_id is not None and job_id in self._cancelled

        with self._lock:
            self._cancel_idle_stop()
            try:
                outputs, stats = self._running_group().generate(prompts, max_tokens, self.mode,
                                                                stop=cancelled)  # fmt: skip
            except OfflineGroupError:
                self._stop_started_group()  # the next job starts a fresh one
                raise
            finally:
                self._cancelled.pop(job_id or "", None)
                self._arm_idle_stop()
            self.num_jobs += 1
        log.info("offline job done", requests=len(prompts), tokens=stats.num_tokens,
                 unfinished=len(prompts) - len(stats.finished),
                 transitions=stats.num_transitions, wall_s=round(stats.wall_s, 3))  # fmt: skip
        return [out if i in stats.finished else None for i, out in enumerate(outputs)]

    def cancel(self, job_id: str) -> None:
        """End `job_id` at its next step (or before its first, if it has not started)."""
        self._cancelled[job_id] = None
        while len(self._cancelled) > MAX_CANCELLED:
            self._cancelled.pop(next(iter(self._cancelled)))

    def close(self) -> None:
        with self._lock:
            self._cancel_idle_stop()
            if self.group is not None:
                self.group.close()
                self.group = None

    def _running_group(self) -> OfflineGroup:
        """The group, started now if it is not running (under the lock)."""
        if self.group is None:
            assert self.start_group is not None
            self.group = self.start_group()
            self.num_starts += 1
        return self.group

    def _stop_started_group(self) -> None:
        """Stop a group this service started (under the lock); a given group is kept."""
        if self.start_group is not None and self.group is not None:
            self.group.close()
            self.group = None

    def _arm_idle_stop(self) -> None:
        if self.start_group is not None and self.group is not None:
            self._idle_timer = threading.Timer(self.idle_stop_s, self._stop_if_idle)
            self._idle_timer.daemon = True
            self._idle_timer.start()

    def _cancel_idle_stop(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _stop_if_idle(self) -> None:
        """The idle timer: stop the group unless a job came meanwhile (it cancels the timer
        under the lock, so a timer that fired late finds itself replaced)."""
        timer = threading.current_thread()
        with self._lock:
            if self._idle_timer is timer:
                self._idle_timer = None
                self._stop_started_group()
                log.info("offline group stopped while idle", idle_s=self.idle_stop_s)


class LocalOffline:
    """An `OfflineService` in the router's process (`OfflineBackend`: tests, one machine)."""

    def __init__(self, service: OfflineService) -> None:
        self.service, self.max_len = service, service.max_len

    async def generate(self, prompts: list[list[int]], max_tokens: list[int],
                       job_id: str) -> list[list[int] | None]:  # fmt: skip
        return await asyncio.to_thread(self.service.generate, prompts, max_tokens, job_id)

    async def cancel(self, job_id: str) -> None:
        self.service.cancel(job_id)
