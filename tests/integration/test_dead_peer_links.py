"""Sockets to peers that are gone are closed, queue and all; a peer that comes back at the same
endpoint gets a fresh socket.

Real ZeroMQ sockets over TCP with the mesh's CURVE keys: a peer "dies" by closing its bound socket
and "comes back" by binding the same endpoint again. Where a verdict takes time (the registry's
absence confirmation, `PeerWatch`'s grace), the clock is passed in or stood in for: no test waits
on those bounds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from secrets import token_hex
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from common.protocol import (
    AbortRequest,
    EngineCommand,
    GenerateRequest,
    SamplingSpec,
    ServiceReply,
    TokenBatch,
    TokenOutput,
)
from common.roles import Role
from common.token_stream import TokenStreamOrderer
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import PushPool, TypedSocket, bind_random
from services.engine.peer_watch import PeerWatch
from services.launch.local_mesh import LocalMesh, Topology
from services.mesh.absence import ABSENT_CONFIRM_S
from services.mesh.registry import ServiceEntry
from services.router import mesh_membership
from services.router.mesh_client import MeshEngineClient
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held
from tests.integration.mesh_test_client import MeshTestClient

pytestmark = pytest.mark.timeout(120)
MESH = CurveKeys.from_mesh_key(token_hex(16))


class Peer:
    """A peer's PULL socket (CURVE server) on a context of its own, bound to `endpoint` or to a
    free port. `close` returns once its port is free again (the context is terminated)."""

    started: list[Peer] = []  # closed after each test (the `ctx` fixture)

    def __init__(self, endpoint: str = "", auth: CurveKeys = MESH) -> None:
        self.ctx = zmq.Context()
        Peer.started.append(self)
        if not endpoint:
            sock, endpoint = bind_random(self.ctx, zmq.PULL, auth=auth)
        else:
            sock = self.ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            auth.serve(sock)
            sock.bind(endpoint)
        self.inbox: TypedSocket[Any] = TypedSocket(sock, EngineCommand)
        self.endpoint = endpoint

    def close(self) -> None:
        self.ctx.destroy(linger=0)  # closes its socket; returns once the port is free


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """The sending side's context. Whatever a test leaves open, its peers' included, is closed
    after it (a context collected with open sockets would wait for them forever)."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)
    while Peer.started:
        Peer.started.pop().close()


def req_ids(peer: Peer, first_timeout_s: float, then_s: float) -> list[str]:
    """The req_ids of what `peer` receives: waits up to `first_timeout_s` for the first message,
    then takes what else comes within `then_s` (where nothing more should)."""
    got: list[str] = []
    timeout = first_timeout_s
    while (item := peer.inbox.recv(timeout)) is not None:
        got.append(item[1].req_id)
        timeout = then_s
    return got


def queue_for_a_dead_peer(send: Any, n: int) -> None:
    """Sends while the peer is gone: they wait in the socket's queue (it reconnects meanwhile)."""
    for i in range(n):
        send(AbortRequest(f"queued-{i}"))


def test_a_dropped_socket_is_closed_with_its_queue_and_a_returning_peer_gets_a_fresh_one(
    ctx: zmq.Context,
) -> None:
    peer = Peer()
    endpoint = peer.endpoint
    pool: PushPool[EngineCommand] = PushPool(ctx, EngineCommand, auth=MESH)
    old = pool.get(endpoint)
    old.send(AbortRequest("first"))
    assert req_ids(peer, 10, 0) == ["first"]
    peer.close()  # the peer dies
    queue_for_a_dead_peer(old.send, 3)

    assert pool.drop(endpoint) and old.sock.closed
    assert endpoint not in pool.endpoints()
    assert not pool.drop(endpoint)

    back = Peer(endpoint)  # the peer comes back where it was
    fresh = pool.get(endpoint)
    assert fresh is not old and not fresh.sock.closed
    fresh.send(AbortRequest("fresh"))
    assert req_ids(back, 10, 1.0) == ["fresh"]  # the old queue went with the old socket
    back.close()
    pool.close()


def test_without_the_drop_the_queue_would_reach_a_returning_peer(ctx: zmq.Context) -> None:
    """The control for the test above: the queued messages do travel on an open socket, so
    their absence there means the drop discarded them."""
    peer = Peer()
    endpoint = peer.endpoint
    pool: PushPool[EngineCommand] = PushPool(ctx, EngineCommand, auth=MESH)
    pool.get(endpoint).send(AbortRequest("first"))
    assert req_ids(peer, 10, 0) == ["first"]
    peer.close()
    queue_for_a_dead_peer(pool.get(endpoint).send, 3)
    back = Peer(endpoint)
    assert req_ids(back, 10, 1.0) == ["queued-0", "queued-1", "queued-2"]
    back.close()
    pool.close()


def wait_until_down(watch: PeerWatch, endpoints: set[str], now: float) -> None:
    """Drain monitor events at `now` until `watch` has seen every one of `endpoints` go down,
    for up to 10 s of real time."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert watch.lost(now) == []
        if endpoints <= set(watch._down_since):
            return
        time.sleep(0.05)  # monitor events arrive on their own sockets
    raise AssertionError(f"not seen down: {endpoints - set(watch._down_since)}")


def test_an_engine_closes_the_sockets_of_peers_it_has_lost(ctx: zmq.Context) -> None:
    """As an engine's worker wires them (`services/engine/worker.py`): its PUSH pools watched by
    one `PeerWatch`; a peer lost there has its socket dropped, and the socket's monitor is let go
    with it. A peer it never reached (it died before the first message) is lost too."""
    watch = PeerWatch(grace_s=5.0)
    pool: PushPool[EngineCommand] = PushPool(ctx, EngineCommand, on_new=watch.watch, auth=MESH)
    router = Peer()
    endpoint = router.endpoint
    pool.get(endpoint).send(AbortRequest("first"))
    assert req_ids(router, 10, 0) == ["first"]
    never = Peer()
    never_endpoint = never.endpoint
    never.close()  # gone before anything was sent to it
    pool.get(never_endpoint).send(AbortRequest("never"))
    router.close()  # the router dies
    queue_for_a_dead_peer(pool.get(endpoint).send, 3)
    wait_until_down(watch, {endpoint, never_endpoint}, now=100.0)
    assert watch.lost(now=104.0) == []  # within the grace: maybe a blip

    lost = watch.lost(now=105.5)
    assert sorted(lost) == sorted([endpoint, never_endpoint])
    for gone in lost:
        assert pool.drop(gone)
    assert pool.endpoints() == set()
    deadline = time.monotonic() + 10
    while watch._monitors and time.monotonic() < deadline:
        watch.lost(now=106.0)  # a closed socket's monitor ends: the watch lets it go
        time.sleep(0.05)
    assert not watch._monitors

    back = Peer(endpoint)  # the router comes back: a fresh socket, watched again
    pool.get(endpoint).send(AbortRequest("fresh"))
    assert req_ids(back, 10, 1.0) == ["fresh"]
    assert len(watch._monitors) == 1
    back.close()
    pool.close()
    watch.close()


def engine_entry(endpoint: str) -> ServiceEntry:
    return ServiceEntry(role=Role.TOKEN, service_id="t0", state="ready", command_endpoint=endpoint)


def test_a_router_closes_its_socket_to_an_engine_the_registry_has_dropped(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, ctx: zmq.Context
) -> None:
    """The router's membership (a registry read) closes the command socket of an engine gone
    from the registry for `ABSENT_CONFIRM_S`, not one a restarted registry forgot for a read."""
    engine = Peer()
    endpoint = engine.endpoint
    entries = [engine_entry(endpoint)]
    client = MeshEngineClient(tiny_model_path, lambda: list(entries), auth=MESH, refresh_s=60)
    clock = SimpleNamespace(monotonic=lambda: 100.0)
    monkeypatch.setattr(mesh_membership, "time", clock)  # the membership's clock only
    try:
        client._send(endpoint, AbortRequest("first"))
        assert req_ids(engine, 10, 0) == ["first"]
        old = client._push.get(endpoint)
        engine.close()  # the engine dies; the registry drops it
        queue_for_a_dead_peer(lambda m: client._send(endpoint, m), 3)
        entries.clear()
        client.membership.refresh()
        assert endpoint in client._push.endpoints()  # missing from one read: not yet gone
        clock.monotonic = lambda: 100.0 + ABSENT_CONFIRM_S
        client.membership.refresh()
        assert endpoint not in client._push.endpoints() and old.sock.closed

        back = Peer(endpoint)  # a replica comes back at that endpoint
        entries.append(engine_entry(endpoint))
        client.membership.refresh()
        client._send(endpoint, AbortRequest("fresh"))
        assert client._push.get(endpoint) is not old
        assert req_ids(back, 10, 1.0) == ["fresh"]
        back.close()
    finally:
        client.shutdown()


def replies_for(sock: TypedSocket[Any], timeout_s: float) -> list[str]:
    """The req_ids of every token message that arrives on `sock` within `timeout_s` of the
    last one (waiting `timeout_s` for the first)."""
    got: list[str] = []
    while (item := sock.recv(timeout_s)) is not None:
        msg = item[1]
        if isinstance(msg, TokenBatch):
            got += msg.req_ids
        elif isinstance(msg, TokenOutput):
            got.append(msg.req_id)
    return got


def test_engines_close_their_socket_to_a_dead_router_and_a_new_one_there_gets_fresh_tokens(
    tiny_model_path: Path,
) -> None:
    """On a `LocalMesh` (real engine processes): a router dies mid-stream; its engines keep
    decoding into their PUSH queue to it until they lose it (`LOST_AFTER_S`), end its request,
    and close that socket, queue and all. A router bound at the same endpoint then hears
    nothing of the dead one's request (an open socket would deliver its queue on reconnecting),
    and gets its own request's tokens on a fresh socket."""
    mesh = LocalMesh.start(Topology(str(tiny_model_path)))
    client = MeshTestClient(mesh)
    try:
        endpoint = client.reply_endpoint
        prompt = random_prompts([12], 2048, seed=49)[0]
        client.submit("dead-1", prompt, SamplingSpec(max_tokens=3000, ignore_eos=True))
        assert client.recv(timeout=120).req_id == "dead-1"
        engines = client.placement["dead-1"]
        # Engines count the routers that place on them (`received_requests`) and forget one in
        # the same step as they close their socket to it: a request placed on the token engine
        # directly makes it count this router too, so its reports tell when it has let go.
        te = engines[1]
        direct = GenerateRequest(
            req_id="dead-2", prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=8),
            reply_to=endpoint, token_engine=te.command_endpoint,
            token_kv_endpoint=te.kv_endpoint, token_kv_address=te.kv_address,
        )  # fmt: skip
        client.push.get(te.command_endpoint).send(direct)

        def known(loads: Any, known: bool = True) -> bool:
            """Whether both engines count the router's requests (they forget it when lost)."""
            reports = [client.last_reports.get(e.service_id) for e in engines]
            return all(r is not None and (endpoint in r.received_requests) == known
                       for r in reports)  # fmt: skip

        client.wait_for_loads(known, timeout=60)
        client.replies.close()  # the router dies mid-stream
        client.wait_for_loads(lambda loads: known(loads, known=False), timeout=60)

        # A router at the same endpoint: the dead one's queue is gone.
        router = Peer(endpoint, auth=mesh.auth)
        client.replies = TypedSocket(router.inbox.sock, ServiceReply)
        # NOTE: a new router starts with nothing: what the dead one had read (outputs of its
        # request that came together with the one it returned) died with it.
        client.orderer = TokenStreamOrderer()
        assert replies_for(client.replies, 1.0) == []
        client.submit("back-1", prompt, SamplingSpec(max_tokens=4, temperature=0))
        tokens, last = client.finish("back-1")
        assert len(tokens) == 4 and last.finish_reason == "length"
        assert not {"dead-1", "dead-2"} & set(replies_for(client.replies, 1.0))
        assert_no_kv_held(mesh)
    finally:
        client.close()
        mesh.close()
