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
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import msgspec
import structlog

from services.offline.group import MODES, OfflineGroup

log = structlog.get_logger(__name__)


class OfflineOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The app args' `offline:`: the group's size and room (None there: no offline group)."""

    workers: int = 2
    buffer_slots: int = 64  # requests whose prefilled KV the shared buffer holds
    decode_slots: int = 16  # requests decoding at once
    max_len: int = 1024  # prompt + output of one request
    mode: str = "seesaw"
    threads_per_worker: int = 1

    def __post_init__(self) -> None:
        if self.workers < 1 or self.buffer_slots < 1 or self.decode_slots < 1:
            raise ValueError("offline: workers, buffer_slots and decode_slots must be >= 1")
        if self.max_len < 2 or self.threads_per_worker < 1:
            raise ValueError("offline: max_len must be >= 2 and threads_per_worker >= 1")
        if self.mode not in MODES:
            raise ValueError(f"offline: mode must be one of {sorted(MODES)}")


MAX_CANCELLED = 256  # job ids remembered as cancelled (a cancel may come before its job runs)


class OfflineService:
    """The group behind one lock: one job at a time (Seesaw runs one batch at a time)."""

    def __init__(self, group: OfflineGroup, mode: str = "seesaw") -> None:
        self.group, self.mode = group, mode
        self._lock = threading.Lock()
        self._cancelled: dict[str, None] = {}  # insertion-ordered: the oldest go first
        self.num_jobs = 0

    @classmethod
    def start(cls, model_path: str | Path, options: OfflineOptions) -> OfflineService:
        """Start the group's worker processes (each loads the model once)."""
        group = OfflineGroup(
            model_path, options.workers, num_buffer_slots=options.buffer_slots,
            num_decode_slots=options.decode_slots, max_len=options.max_len,
            threads_per_worker=options.threads_per_worker,
        )  # fmt: skip
        return cls(group, options.mode)

    @property
    def max_len(self) -> int:
        return self.group.kv.max_len

    def generate(self, prompts: list[list[int]], max_tokens: list[int],
                 job_id: str | None = None) -> list[list[int] | None]:  # fmt: skip
        """Each prompt's greedy output ids, None for one a cancel of `job_id` cut short
        (blocking: the caller runs it off its event loop)."""

        def cancelled() -> bool:
            return job_id is not None and job_id in self._cancelled

        with self._lock:
            try:
                outputs, stats = self.group.generate(prompts, max_tokens, self.mode,
                                                     stop=cancelled)  # fmt: skip
            finally:
                self._cancelled.pop(job_id or "", None)
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
        self.group.close()


class LocalOffline:
    """An `OfflineService` in the router's process (`OfflineBackend`: tests, one machine)."""

    def __init__(self, service: OfflineService) -> None:
        self.service, self.max_len = service, service.max_len

    async def generate(self, prompts: list[list[int]], max_tokens: list[int],
                       job_id: str) -> list[list[int] | None]:  # fmt: skip
        return await asyncio.to_thread(self.service.generate, prompts, max_tokens, job_id)

    async def cancel(self, job_id: str) -> None:
        self.service.cancel(job_id)
