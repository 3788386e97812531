"""`MeshInbox` (services/router/mesh_inbox.py): token replies drained on the requests' event loop,
over real ZeroMQ sockets; what happens when that loop closes, stops, or another thread closes it."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from secrets import token_hex

import msgspec
import pytest
import zmq

from common.protocol import LoadReport, OutputsDropped, TokenBatch, TokenOutput
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import connect
from services.router.mesh_inbox import MeshInbox
from services.router.streams import Stream, StreamTable
from tests.thread_wakeups import thread_wakeups

AUTH = CurveKeys.from_mesh_key(token_hex(32))


class Recorder:
    """The inbox's callbacks: what it handed over, and on which thread."""

    def __init__(self) -> None:
        self.outputs: list[TokenOutput] = []
        self.threads: set[int] = set()
        self.arrived = threading.Event()

    def on_outputs(self, outputs: list[TokenOutput]) -> None:
        self.outputs += outputs
        self.threads.add(threading.get_ident())
        self.arrived.set()

    def on_load(self, report: LoadReport) -> None:
        pass


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@contextmanager
def wired(
    ctx: zmq.Context, on_outputs: Callable[[list[TokenOutput]], None]
) -> Iterator[tuple[MeshInbox, zmq.Socket]]:
    """A started inbox expecting request "a", and an engine's PUSH socket connected to it."""
    inbox = MeshInbox(ctx, "127.0.0.1", on_outputs, Recorder().on_load, auth=AUTH)
    inbox.orderer.expect("a", 0)
    inbox.start()
    engine = connect(ctx, zmq.PUSH, inbox.reply_endpoint, auth=AUTH)
    try:
        yield inbox, engine
    finally:
        engine.close()
        inbox.close()


@contextmanager
def loop_in_thread() -> Iterator[tuple[asyncio.AbstractEventLoop, threading.Thread]]:
    """An event loop running forever on a thread of its own (as Serve's user-code loop does)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop, thread
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def batch(index: int) -> bytes:
    return msgspec.msgpack.encode(TokenBatch(["a"], [100 + index], [index], [""], [3]))


async def wait_outputs(recorder: Recorder, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(recorder.outputs) < count:
        assert time.monotonic() < deadline, f"{len(recorder.outputs)} of {count} outputs came"
        await asyncio.sleep(0.005)


def test_replies_are_drained_on_the_loop_that_attached_in_token_order(ctx: zmq.Context) -> None:
    recorder = Recorder()
    with wired(ctx, recorder.on_outputs) as (inbox, engine):

        async def run() -> int:
            inbox.attach()
            for index in (1, 0, 2):  # the second token overtakes the first (two engines)
                engine.send(batch(index))
            engine.send(b"not a message")  # dropped, the next one still arrives
            engine.send(batch(3))
            await wait_outputs(recorder, 4)
            return threading.get_ident()

        loop_thread = asyncio.run(run())
        assert [o.token_ids[0] for o in recorder.outputs] == [100, 101, 102, 103]
        assert recorder.threads == {loop_thread}  # not the inbox's thread: no hop per step
        assert inbox.thread.is_alive()


def test_an_engines_dropped_outputs_notice_ends_the_attempt_retryably(ctx: zmq.Context) -> None:
    """An engine that gave request "a" up (its outputs found no room here) says so: the held
    token behind the lost one is let go and "a" gets a retryable error (its stream re-runs it,
    `mesh_client.py`), not a wait for tokens that never come."""
    recorder = Recorder()
    with wired(ctx, recorder.on_outputs) as (inbox, engine):

        async def run() -> None:
            inbox.attach()
            engine.send(batch(0))
            engine.send(batch(2))  # held: index 1 was dropped at the engine
            await wait_outputs(recorder, 1)
            notice = OutputsDropped(["a"], notice_error())
            engine.send(msgspec.msgpack.encode(notice))
            await wait_outputs(recorder, 2)

        asyncio.run(run())
        first, lost = recorder.outputs
        assert first.token_ids == [100]
        assert (lost.req_id, lost.retryable, lost.error) == ("a", True, notice_error())


def notice_error() -> str:
    return "engine e could not queue its outputs"


def test_a_closed_loop_hands_the_replies_to_the_next(ctx: zmq.Context) -> None:
    recorder = Recorder()
    with wired(ctx, recorder.on_outputs) as (inbox, engine):

        async def one(index: int) -> None:
            inbox.attach()
            engine.send(batch(index))
            await wait_outputs(recorder, index + 1)

        asyncio.run(one(0))
        engine.send(batch(1))  # between loops: waits in the socket
        asyncio.run(one(2))  # a new loop drains what waited, then what comes
        assert [o.token_ids[0] for o in recorder.outputs] == [100, 101, 102]


def test_a_stopped_loop_hands_over_and_never_drains_again(ctx: zmq.Context) -> None:
    recorder = Recorder()
    with wired(ctx, recorder.on_outputs) as (inbox, engine):
        first = asyncio.new_event_loop()
        try:

            async def attach_only() -> None:
                inbox.attach()

            first.run_until_complete(attach_only())  # stopped, not closed

            async def one() -> None:
                inbox.attach()
                engine.send(batch(0))
                await wait_outputs(recorder, 1)

            asyncio.run(one())
            engine.send(batch(1))
            first.run_until_complete(asyncio.sleep(0.2))  # it runs again: it no longer drains
            assert [o.token_ids[0] for o in recorder.outputs] == [100]
        finally:
            first.close()


def test_a_running_loop_keeps_draining_for_requests_on_another(ctx: zmq.Context) -> None:
    """Two loops in two threads: the first to attach drains; outputs of streams on the second
    reach them through the second loop (as a router's outputs reach a stream)."""
    table: StreamTable[Stream] = StreamTable()
    recorder = Recorder()

    def on_outputs(outputs: list[TokenOutput]) -> None:
        recorder.on_outputs(outputs)
        table.deliver_many([(o.req_id, o, len(o.token_ids), False) for o in outputs])

    with wired(ctx, on_outputs) as (inbox, engine), loop_in_thread() as (drainer, drainer_thread):
        asyncio.run_coroutine_threadsafe(_attach(inbox), drainer).result(10)

        async def consume() -> list[int]:
            stream = table.admit("a", 3, lambda: Stream(req_id="a", num_prompt_tokens=3))
            inbox.attach()  # another loop drains: this one does not take over
            for index in range(3):
                engine.send(batch(index))
            got = [await asyncio.wait_for(stream.outputs.get(), 10) for _ in range(3)]
            return [o.token_ids[0] for o in got]

        assert asyncio.run(consume()) == [100, 101, 102]
        assert recorder.threads == {drainer_thread.ident}


def test_close_from_another_thread_while_the_loop_runs(ctx: zmq.Context) -> None:
    recorder = Recorder()
    with wired(ctx, recorder.on_outputs) as (inbox, engine), loop_in_thread() as (loop, _):
        asyncio.run_coroutine_threadsafe(_attach(inbox), loop).result(10)
        engine.send(batch(0))
        assert recorder.arrived.wait(10)
        inbox.close()  # the loop lets go of the socket before it closes
        assert not inbox.thread.is_alive()
        engine.send(batch(1))
        assert asyncio.run_coroutine_threadsafe(asyncio.sleep(0.2, "alive"), loop).result(10)
        assert [o.token_ids[0] for o in recorder.outputs] == [100]


def test_outputs_delivered_on_their_own_loop_need_no_wake_up() -> None:
    """`deliver_many` on the stream's loop puts at once; from a thread, through the loop."""

    async def run() -> None:
        table: StreamTable[Stream] = StreamTable()
        stream = table.admit("a", 1, lambda: Stream(req_id="a", num_prompt_tokens=1))
        table.deliver_many([("a", "on the loop", 1, False)])
        assert stream.outputs.get_nowait() == "on the loop"
        other = threading.Thread(
            target=table.deliver_many, args=([("a", "from a thread", 1, False)],)
        )
        other.start()
        other.join()
        assert stream.outputs.empty()  # not yet: the loop runs the put
        assert await asyncio.wait_for(stream.outputs.get(), 10) == "from a thread"

    asyncio.run(run())


async def _attach(inbox: MeshInbox) -> None:
    inbox.attach()


def test_a_failed_drain_makes_the_inbox_unhealthy_and_spares_the_loop(ctx: zmq.Context) -> None:
    """A drain that raises may have lost outputs a stream waits for: the router must say so in
    its health check (Serve then replaces it) instead of leaving that stream hanging."""

    def broken(outputs: list[TokenOutput]) -> None:
        raise RuntimeError("a bug in delivery")

    with wired(ctx, broken) as (inbox, engine):

        async def run() -> str:
            inbox.attach()
            assert inbox.healthy()
            engine.send(batch(0))
            deadline = time.monotonic() + 10
            while inbox.healthy():
                assert time.monotonic() < deadline, "the failed drain went unnoticed"
                await asyncio.sleep(0.005)
            return await asyncio.sleep(0.01, "the loop still runs")

        assert asyncio.run(run()) == "the loop still runs"
        assert isinstance(inbox.drain_error, RuntimeError)


def test_a_load_report_that_fails_to_apply_is_dropped_and_the_next_applied(
    ctx: zmq.Context,
) -> None:
    """Whatever applying one report raises, the load thread lives on (the inbox stays healthy,
    so Serve does not replace the router and its streams) and applies the next report."""
    applied: list[str] = []
    second = threading.Event()

    def on_load(report: LoadReport) -> None:
        if report.engine_id == "bad":
            raise RuntimeError("a report the scheduler cannot take")
        applied.append(report.engine_id)
        second.set()

    inbox = MeshInbox(ctx, "127.0.0.1", Recorder().on_outputs, on_load, auth=AUTH)
    pub = ctx.socket(zmq.PUB)
    AUTH.serve(pub)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    inbox.load_endpoints = frozenset([f"tcp://127.0.0.1:{port}"])
    inbox.start()
    try:
        report = LoadReport("bad", "token", 0, 0, 0, 0, 10)
        deadline = time.monotonic() + 10
        while not second.is_set():  # PUB drops until the subscription lands: send until heard
            assert time.monotonic() < deadline, "no report applied"
            pub.send(msgspec.msgpack.encode(report))
            pub.send(msgspec.msgpack.encode(msgspec.structs.replace(report, engine_id="good")))
            second.wait(0.1)
        assert applied and set(applied) == {"good"} and inbox.healthy()
    finally:
        pub.close(linger=0)
        inbox.close()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_load_thread_sleeps_while_idle_and_subscribes_to_a_new_engine_at_once(
    ctx: zmq.Context,
) -> None:
    """No engine, no report: the load thread blocks (it used to wake ten times a second to look
    for subscription changes). An engine that joins is subscribed to at once: the membership
    thread's change wakes it, and that engine's reports are applied."""
    heard = threading.Event()
    inbox = MeshInbox(ctx, "127.0.0.1", Recorder().on_outputs, lambda r: heard.set(), auth=AUTH)
    inbox.start()
    pub = ctx.socket(zmq.PUB)
    AUTH.serve(pub)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        time.sleep(0.2)  # the thread is in its wait
        before = thread_wakeups(inbox.thread)
        time.sleep(1.0)
        assert thread_wakeups(inbox.thread) - before <= 1
        inbox.load_endpoints = frozenset([f"tcp://127.0.0.1:{port}"])
        deadline = time.monotonic() + 10  # a hang guard: the subscription lands in milliseconds
        while not heard.is_set():  # PUB drops until the subscription lands: send until heard
            assert time.monotonic() < deadline, "the new engine's reports were never applied"
            pub.send(msgspec.msgpack.encode(LoadReport("new", "token", 0, 0, 0, 0, 10)))
            heard.wait(0.05)
    finally:
        pub.close(linger=0)
        inbox.close()
    assert not inbox.thread.is_alive()
