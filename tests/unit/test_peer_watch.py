"""`PeerWatch`: an endpoint whose connection stays down for the grace period is lost (once); one
that comes back in time is not. Real ZeroMQ sockets and their monitor events; the clock is passed
in, so no test waits on the grace period itself."""

from __future__ import annotations

import time

import zmq

from services.engine.peer_watch import PeerWatch


def wait_for_events(watch: PeerWatch, now: float) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        watch.lost(now)  # drains the monitor events
        if watch._down_since or not watch._monitors:
            return
        time.sleep(0.05)  # monitor events arrive on their own socket


def test_a_router_that_goes_away_is_lost_once_after_the_grace() -> None:
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    watch = PeerWatch(grace_s=5.0)
    push = ctx.socket(zmq.PUSH)
    watch.watch(push)
    push.connect(endpoint)
    push.send(b"token")
    assert inbox.recv() == b"token"
    assert watch.lost(now=100.0) == []
    inbox.close(linger=0)  # the router dies
    wait_for_events(watch, now=100.0)
    assert watch.lost(now=104.0) == []  # within the grace: maybe a blip
    assert watch.lost(now=105.5) == [endpoint]
    assert watch.lost(now=200.0) == []  # reported once
    watch.close()
    push.close(linger=0)
    ctx.term()


def test_a_connection_back_within_the_grace_is_not_lost() -> None:
    watch = PeerWatch(grace_s=5.0)
    watch.on_event("tcp://r:1", connected=False, now=10.0)
    watch.on_event("tcp://r:1", connected=True, now=12.0)
    assert watch.lost(now=30.0) == []
