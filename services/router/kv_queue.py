"""KV admission at the router: a request whose whole length (prompt + max_tokens) no token
engine has free KV for now waits here, in order of vLLM's `priority` (lower first), first come
first served within a priority, instead of being placed where
its shards would refuse it mid-stream. The queue is bounded in length (a request past it gets
`Overloaded`, 429) and in time (one that waits past `wait_s` gets `Unavailable`, 503); both leave
before the request's first byte, with Retry-After. A request that could never fit (more than any
token engine holds in all) is refused at once (400, naming `max_tokens`).

A low-priority waiter is bounded all the same: it leaves with a 503 after `wait_s`, however many
higher-priority requests keep arriving. Waiters live on the router's event loop; only the head of
the queue tries to place, every `retry_s`, as the engines' load reports (every 50 ms) and this
router's own releases free room.

A re-run of a started stream (mesh_client.py `_migrate`: its engines were lost) goes ahead of
every new request, whatever its priority: while one waits (`rerun_first`, from its loss to its
placement), no new request is placed, and those that come join the queue. The re-run places
itself (it waits for engines too, bounded by `MIGRATION_WAIT_S`); a client whose stream has
started would otherwise lose it to requests that have sent nothing yet, which keep waiting,
each bounded by `wait_s` as above.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from services.router.cluster_scheduler import NoKvRoom
from services.router.streams import AdmissionLimits, Overloaded, Unavailable

T = TypeVar("T")

RETRY_S = 0.05  # a load report's period: room shows up no faster


class KvWaitQueue:
    """Requests waiting for KV room, by (priority, arrival)."""

    def __init__(self, limits: Callable[[], AdmissionLimits], retry_s: float = RETRY_S) -> None:
        self.limits, self.retry_s = limits, retry_s  # read at each admission: reconfigurable
        self._waiting: list[tuple[int, int]] = []  # (priority, arrival number), sorted
        self._arrivals = itertools.count()
        self.num_waited = 0  # requests that had to wait, since start (stats, tests)
        self.num_reruns = 0  # re-runs waiting for room or engines: no new request goes first

    @contextmanager
    def rerun_first(self) -> Iterator[None]:
        """A re-run waits for room inside this: no new request takes room meanwhile."""
        self.num_reruns += 1
        try:
            yield
        finally:
            self.num_reruns -= 1

    def __len__(self) -> int:
        return len(self._waiting)

    async def admit(
        self, place: Callable[[], T], ever_fits: Callable[[], None], priority: int = 0
    ) -> T:
        """`place()` once no one waits ahead (no re-run either) and it finds room (it raises
        `NoKvRoom` until it does); the refusals above otherwise. `ever_fits` raises `NoKvRoom`
        for a request that could never fit, before it joins the queue. A waiter with a lower
        `priority` goes ahead of those with a higher one, even if they came first (a full queue
        refuses it all the same)."""
        try:
            ever_fits()
        except NoKvRoom as exc:
            _check_ever(exc)
        if not self._waiting and not self.num_reruns:
            try:
                return place()
            except NoKvRoom as exc:
                _check_ever(exc)
        limits = self.limits()
        if len(self._waiting) >= limits.max_waiting_requests:
            raise Overloaded("max_waiting_requests", f"The server is busy: {len(self._waiting)} "
                             "requests are waiting for KV room. Please retry later.")  # fmt: skip
        ticket = (priority, next(self._arrivals))
        bisect.insort(self._waiting, ticket)
        self.num_waited += 1
        deadline = time.monotonic() + limits.kv_wait_s
        try:
            while True:
                await asyncio.sleep(self.retry_s)
                if self._waiting[0] == ticket and not self.num_reruns:
                    try:
                        return place()
                    except NoKvRoom as exc:
                        _check_ever(exc)
                if time.monotonic() > deadline:
                    raise Unavailable("kv_wait", f"The server is busy: no KV room for the "
                                      f"request within {limits.kv_wait_s} s. Please retry "
                                      "later.")  # fmt: skip
        finally:
            self._waiting.remove(ticket)


def _check_ever(exc: NoKvRoom) -> None:
    """A request no token engine could ever hold is the request's fault: a 400."""
    if not exc.ever:
        raise ValueError(f"invalid sampling parameter max_tokens: {exc}") from exc


__all__ = ["KvWaitQueue", "RETRY_S"]
