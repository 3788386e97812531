"""The mesh client's requests and membership without sockets (`services/router/mesh_requests.py`,
`mesh_membership.py`): only the current attempt's outputs reach a request, an engine is lost once
per attempt, and only after the registry has missed it for `ABSENT_CONFIRM_S`; the registry's
long poll brings changes to the router's view as they are made."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

from common.protocol import SamplingSpec, TokenOutput
from common.roles import Role
from services.mesh.absence import ABSENT_CONFIRM_S
from services.mesh.registry import Registry, ServiceEntry
from services.router.cluster_scheduler import ClusterScheduler
from services.router.mesh_membership import MeshMembership
from services.router.mesh_requests import EngineLost, MeshRequests, MeshStream

PROMPT = ServiceEntry(role=Role.PROMPT, service_id="p0", state="ready", command_endpoint="tcp://p")
TOKEN = ServiceEntry(role=Role.TOKEN, service_id="t0", state="ready", command_endpoint="tcp://t")
SAMPLING = SamplingSpec(max_tokens=8, temperature=0.0)


def admit(requests: MeshRequests, req_id: str) -> MeshStream:
    def place() -> MeshStream:
        requests.open(req_id, [5, 6, 7], SAMPLING, (PROMPT, TOKEN))
        return MeshStream(req_id=req_id, num_prompt_tokens=3, prompt_engine=PROMPT,
                          token_engine=TOKEN)  # fmt: skip

    return requests.streams.admit(req_id, 3, place)


async def drained(stream: MeshStream) -> list[Any]:
    await asyncio.sleep(0)  # deliveries land by `call_soon_threadsafe`
    items = []
    while not stream.outputs.empty():
        items.append(stream.outputs.get_nowait())
    return items


def test_only_the_current_attempts_outputs_reach_the_request() -> None:
    async def run() -> None:
        requests = MeshRequests(None, max_migrations=2)
        stream = admit(requests, "r1")
        assert requests.by_engine == {"p0": 1, "t0": 1}
        requests.deliver_outputs([TokenOutput("r1", [10])])
        assert [o.token_ids for o in await drained(stream)] == [[10]]
        old, replay = requests.next_attempt("r1", [10])
        assert (old, requests.wire_id("r1")) == ("r1", "r1~1")
        assert replay is not None and replay.output_token_ids == [10]
        requests.deliver_outputs([TokenOutput("r1", [11]), TokenOutput("r1~1", [12])])
        requests.deliver("r1", TokenOutput("r1", [13]))  # the dead attempt, late: dropped
        assert [o.token_ids for o in await drained(stream)] == [[12]]
        assert stream.num_attempt_tokens == 2  # counted over attempts until the client resets
        assert requests.release("r1") == (stream, "r1~1")
        assert requests.release("r1") == (None, "r1")
        assert not requests.book.ledgers and len(requests.streams) == 0

    asyncio.run(run())


def test_an_attempt_is_lost_once_and_its_prompt_engine_only_before_the_hand_off() -> None:
    async def run() -> None:
        requests = MeshRequests(None, max_migrations=2)
        stream = admit(requests, "r1")
        assert requests.engine_ids() == {"p0", "t0"}
        assert requests.lose_attempts({"p0"}) == [("r1", "p0", "")]
        assert requests.lose_attempts({"p0", "t0"}) == []  # an EngineLost is on its way
        stream.lost, stream.num_attempt_tokens = False, 2  # the token engine has it now
        assert requests.lose_attempts({"p0"}) == []
        assert requests.lose_attempts({"t0"}) == [("r1", "t0", "")]

    asyncio.run(run())


def test_a_re_run_waiting_in_the_router_is_not_lost_with_its_last_attempts_engines() -> None:
    """A re-run (here after a retryable error: no loss told) waits for room or engines; the
    lost attempt's engines leaving the registry meanwhile is no loss of the re-run, which would
    otherwise be re-run again as soon as it is sent."""

    async def run() -> None:
        requests = MeshRequests(None, max_migrations=2)
        stream = admit(requests, "r1")
        assert not stream.lost
        requests.next_attempt("r1", [10])
        assert requests.lose_attempts({"p0", "t0"}) == []
        stream.lost = False  # sent (`MeshEngineClient._migrate`), on the same engines
        assert requests.lose_attempts({"t0"}) == [("r1", "t0", "")]

    asyncio.run(run())


def membership(
    requests: MeshRequests, view: Any, scheduler: ClusterScheduler | None = None
) -> MeshMembership:
    inbox: Any = SimpleNamespace(load_endpoints=frozenset())
    return MeshMembership(
        view, requests, scheduler or ClusterScheduler(16), inbox, lambda: None, refresh_s=60
    )


def test_an_engine_is_gone_only_once_the_registry_has_missed_it_long_enough() -> None:
    async def run() -> None:
        requests = MeshRequests(None, max_migrations=2)
        admit(requests, "r1")
        watch = membership(requests, lambda: [PROMPT, TOKEN])
        assert watch._confirmed_gone({"p0", "t0"}, now=100.0) == set()
        assert watch._confirmed_gone(set(), now=101.0) == set()  # a restarted registry, say
        assert watch._confirmed_gone({"p0", "t0"}, now=101.0 + ABSENT_CONFIRM_S) == set()
        assert watch._confirmed_gone({"p0"}, now=200.0) == set()
        assert watch._confirmed_gone({"p0"}, now=200.0 + ABSENT_CONFIRM_S) == {"t0"}
        requests.release("r1")  # no request of ours on it: forgotten
        assert watch._confirmed_gone({"p0"}, now=300.0) == set()
        assert not watch._absences.missing_since

    asyncio.run(run())


def test_a_refresh_keeps_the_last_view_when_the_registry_read_fails_and_fails_orphans() -> None:
    async def run() -> None:
        requests = MeshRequests(None, max_migrations=2)
        stream = admit(requests, "r1")
        views: list[Any] = [[PROMPT, TOKEN], RuntimeError("registry restarting")]
        scheduler = ClusterScheduler(16)

        def view() -> list[ServiceEntry]:
            current = views.pop(0)
            if isinstance(current, Exception):
                raise current
            return list(current)

        watch = membership(requests, view, scheduler)
        watch.refresh()
        assert watch.live_ids() == {"p0", "t0"} and scheduler.can_place()
        watch.refresh()  # the read fails: nothing changes
        assert watch.live_ids() == {"p0", "t0"} and scheduler.can_place()
        watch._fail_orphans({"t0"})
        [lost] = await drained(stream)
        assert isinstance(lost, EngineLost) and lost.wire_id == "r1" and stream.lost

    asyncio.run(run())


def test_a_refresh_that_fails_leaves_the_watch_thread_running() -> None:
    """Whatever one refresh raises past the registry read, the next one runs (a dead watch
    thread fails the router's health check: Serve would replace it, and its streams)."""
    failures = [RuntimeError("a role change that cannot be sent")]
    refreshed = threading.Event()

    def send_role_changes() -> None:
        if failures:
            raise failures.pop()
        refreshed.set()

    inbox: Any = SimpleNamespace(load_endpoints=frozenset())
    requests = MeshRequests(None, max_migrations=2)
    watch = MeshMembership(
        lambda: [PROMPT, TOKEN], requests, ClusterScheduler(16), inbox, send_role_changes,
        refresh_s=0.01,
    )  # fmt: skip
    watch.thread.start()
    try:
        assert refreshed.wait(timeout=10) and watch.thread.is_alive() and not failures
    finally:
        watch.close()
        watch.thread.join(timeout=5)


def test_membership_on_the_long_poll_hears_a_change_at_once_with_no_timer() -> None:
    """With the registry's long poll (`wait_change`, a real `Registry` on real threads), every
    change reaches the router's view while each of its timers is at a minute: an engine that
    joins, one that leaves. Its requests' attempts are lost only once the absence is confirmed
    (a restarted registry forgets live replicas for a heartbeat)."""
    registry = Registry()
    registry.register(PROMPT)

    async def run() -> None:
        requests = MeshRequests(None, max_migrations=2)
        inbox: Any = SimpleNamespace(load_endpoints=frozenset())
        watch = MeshMembership(
            registry.live, requests, ClusterScheduler(16), inbox, lambda: None, refresh_s=60,
            wait_change=registry.wait_change,
        )  # fmt: skip
        watch._watch.idle_s = 60.0  # type: ignore[attr-defined]  # no timer may notice it

        async def view_is(ids: set[str]) -> None:
            deadline = time.monotonic() + 30  # a hang guard, far below the timers' minute
            while watch.live_ids() != ids and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert watch.live_ids() == ids

        watch.thread.start()
        try:
            await view_is({"p0"})
            registry.register(TOKEN)
            await view_is({"p0", "t0"})
            stream = admit(requests, "r1")
            registry.unregister("t0")
            await view_is({"p0"})
            assert not stream.lost  # not yet: the absence is confirmed first
            assert watch._absences.missing_since.keys() == {"t0"}
        finally:
            watch.close()
            registry.register(TOKEN)  # a change: the wait ends, the thread sees it stopped
            watch.thread.join(timeout=30)
        assert not watch.thread.is_alive()

    asyncio.run(run())
