"""The router's KV admission queue (`kv_queue.py`) and the pure choice of a token engine with KV
room (`common.scheduling.cluster.with_kv_room`): requests wait in arrival order, only the head
tries to place, the queue's length and wait are bounded (429 / 503 before any byte), one that
could never fit is the request's fault (400), and a re-run of a started stream takes room before
any new request."""

from __future__ import annotations

import asyncio

import pytest

from common.scheduling.cluster import MachineLoad, with_kv_room
from services.router.cluster_scheduler import NoKvRoom
from services.router.kv_queue import KvWaitQueue
from services.router.streams import AdmissionLimits, Overloaded, Unavailable


def never() -> None:
    return None


class Room:
    """A stand-in placement: `free` requests may be placed; each try is recorded."""

    def __init__(self, free: int) -> None:
        self.free, self.tries = free, []

    def place(self, name: str):  # type: ignore[no-untyped-def]
        def place() -> str:
            self.tries.append(name)
            if self.free <= 0:
                raise NoKvRoom(80, 0, ever=True)
            self.free -= 1
            return name

        return place


async def arrive(queue: KvWaitQueue, room: Room, name: str, placed: list[str]) -> None:
    """A new request through the queue: in `placed` once placed."""
    placed.append(await queue.admit(room.place(name), never))


def test_waiters_are_placed_in_arrival_order_and_only_the_head_tries():
    room = Room(free=1)
    queue = KvWaitQueue(lambda: AdmissionLimits(kv_wait_s=10), retry_s=0.001)

    async def scenario() -> list[str]:
        placed: list[str] = []
        tasks = [asyncio.ensure_future(arrive(queue, room, n, placed)) for n in "abc"]
        await asyncio.sleep(0.05)
        assert placed == ["a"] and len(queue) == 2
        assert set(room.tries) == {"a", "b"}  # c never tried: b is ahead of it
        room.free = 2  # room frees
        await asyncio.gather(*tasks)
        return placed

    assert asyncio.run(scenario()) == ["a", "b", "c"]
    assert queue.num_waited == 2


def test_a_full_queue_is_a_429_and_a_long_wait_a_503():
    room = Room(free=0)
    queue = KvWaitQueue(lambda: AdmissionLimits(max_waiting_requests=1, kv_wait_s=0.05), 0.001)

    async def scenario() -> None:
        first = asyncio.ensure_future(queue.admit(room.place("a"), never))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as full:
            await queue.admit(room.place("b"), never)
        assert full.value.status == 429
        with pytest.raises(Unavailable) as waited:
            await first
        assert waited.value.status == 503 and len(queue) == 0

    asyncio.run(scenario())


def test_a_request_that_could_never_fit_is_a_400_without_waiting():
    queue = KvWaitQueue(lambda: AdmissionLimits(), retry_s=0.001)

    def too_big() -> None:
        raise NoKvRoom(5000, 192, ever=False)

    with pytest.raises(ValueError, match="max_tokens"):
        asyncio.run(queue.admit(Room(free=1).place("a"), too_big))
    assert len(queue) == 0 and queue.num_waited == 0


async def rerun(queue: KvWaitQueue, room: Room, name: str = "rerun") -> str:
    """A re-run waiting for room as `MeshEngineClient._place_when_ready` does: it polls the
    placement itself, more slowly than the queue's head."""
    with queue.rerun_first():
        while True:
            try:
                return room.place(name)()
            except NoKvRoom:
                await asyncio.sleep(0.005)


def test_a_rerun_waiting_for_room_goes_before_new_requests_that_came_after_it():
    room = Room(free=0)
    queue = KvWaitQueue(lambda: AdmissionLimits(kv_wait_s=10), retry_s=0.001)

    async def scenario() -> list[str]:
        placed: list[str] = []
        rerunning = asyncio.ensure_future(rerun(queue, room))
        await asyncio.sleep(0.01)  # no room: it waits
        new = [asyncio.ensure_future(arrive(queue, room, n, placed)) for n in ("new", "newer")]
        await asyncio.sleep(0.02)
        assert len(queue) == 2 and room.tries == ["rerun"] * len(room.tries)  # none tried
        room.free = 1  # room for one frees: the re-run's
        placed.append(await rerunning)
        await asyncio.sleep(0.02)
        assert placed == ["rerun"] and len(queue) == 2
        room.free = 2
        await asyncio.gather(*new)
        return placed

    assert asyncio.run(scenario()) == ["rerun", "new", "newer"]


def test_a_new_request_behind_a_rerun_that_keeps_waiting_leaves_at_its_own_bound():
    room = Room(free=0)
    queue = KvWaitQueue(lambda: AdmissionLimits(kv_wait_s=0.05), retry_s=0.001)

    async def scenario() -> None:
        rerunning = asyncio.ensure_future(rerun(queue, room))
        await asyncio.sleep(0.01)
        with pytest.raises(Unavailable) as waited:
            await queue.admit(room.place("new"), never)
        assert waited.value.status == 503 and len(queue) == 0
        room.free = 1
        assert await rerunning == "rerun" and queue.num_reruns == 0

    asyncio.run(scenario())


def test_with_kv_room_keeps_the_choice_that_fits_else_the_least_loaded_that_does():
    loads = {0: MachineLoad(0, decode_tokens=10, free_kv_tokens=50),
             1: MachineLoad(1, decode_tokens=30, free_kv_tokens=200),
             2: MachineLoad(2, decode_tokens=20, free_kv_tokens=100)}  # fmt: skip
    assert with_kv_room(2, loads, loads, 80) == 2
    assert with_kv_room(0, loads, loads, 80) == 2  # 0 is full; 2 is less loaded than 1
    assert with_kv_room(0, loads, loads, 150) == 1
    assert with_kv_room(0, loads, loads, 500) is None
