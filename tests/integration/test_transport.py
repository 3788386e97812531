"""Transport across real OS processes over tcp://127.0.0.1 and UCX (tcp).

Each test starts one peer process running the other end with the real wrappers; messages are a
sample tagged union defined here (the project's own protocol is tested with the services). Peers
are forked by multiprocessing's fork server, as `LocalMesh` workers are: a fresh interpreter
would spend seconds importing torch and ucxx for each.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import msgspec
import numpy as np
import pytest
import torch
import zmq

from common.protocol import EngineStats, ServiceReply, StatsRequest, TokenOutput
from common.transport.service_stats import request_stats
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import PushPool, TypedSocket, bind_random
from common.transport.zmq_tensor import ZmqTensorChannel

pytestmark = pytest.mark.timeout(60)
PEERS = mp.get_context("forkserver")
T = TypeVar("T")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


class Ping(msgspec.Struct, tag="ping", tag_field="kind", array_like=True, gc=False):
    seq: int
    note: str = ""


class Load(msgspec.Struct, tag="load", tag_field="kind", array_like=True, gc=False):
    seq: int
    free_blocks: int = 0


class Stop(msgspec.Struct, tag="stop", tag_field="kind", array_like=True, gc=False):
    pass


Message = Ping | Load | Stop
UCX_KEY = b"the mesh's key in these tests"


class Unknown(msgspec.Struct, tag="unknown", tag_field="kind", array_like=True):
    seq: int


GARBAGE = b"\xc1 not msgpack"
UNKNOWN = msgspec.msgpack.encode(Unknown(7))
# Every socket here is a CURVE server or client, as in a mesh; a fixed key, so that the spawned
# peer processes derive the same pairs.
MESH = CurveKeys.from_mesh_key("5a" * 32)


# ---- peer processes (module-level so that the forked peers can import them) ----


def bound(kind: int, message_type: Any = Message) -> tuple[TypedSocket[Any], str]:
    """A typed socket bound to a free port (as the services bind theirs), and its endpoint."""
    sock, endpoint = bind_random(zmq.Context.instance(), kind, auth=MESH)
    return TypedSocket(sock, message_type), endpoint


def connected(kind: int, endpoint: str) -> TypedSocket[Message]:
    """A typed socket connected to `endpoint` (a SUB subscribes to everything)."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    MESH.join(sock)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return TypedSocket(sock, Message)


def received(sock: TypedSocket[T], timeout_s: float) -> tuple[list[bytes], T]:
    item = sock.recv(timeout_s)
    assert item is not None, f"no message in {timeout_s} s"
    return item


def router_echo(queue: Any) -> None:
    """ROUTER: answer every Ping with Load(seq); stop on Stop."""
    router, endpoint = bound(zmq.ROUTER)
    queue.put(endpoint)
    while True:
        identity, msg = received(router, 30)
        if isinstance(msg, Stop):
            break
        router.send(Load(msg.seq, free_blocks=msg.seq * 2), prefix=identity)
    router.close()


def pusher(endpoint: str, count: int) -> None:
    """PUSH `count` Pings with a malformed and an unknown message in the middle."""
    pool: PushPool[Message] = PushPool(zmq.Context.instance(), Message, auth=MESH)
    push = pool.get(endpoint)
    for seq in range(count):
        if seq == count // 2:
            push.sock.send(GARBAGE)
            push.sock.send(UNKNOWN)
        push.send(Ping(seq))
    push.send(Stop())
    pool.close(linger_s=1.0)


def publisher(ack_endpoint: str, count: int, queue: Any) -> None:
    """PUB: say hello until the subscriber acks (slow joiner), then `count` reports + junk."""
    pub, endpoint = bound(zmq.PUB)
    queue.put(endpoint)
    ack = connected(zmq.PULL, ack_endpoint)
    while ack.recv(0.02) is None:  # blocks in zmq poll; hellos until the SUB is live
        pub.send(Load(-1))
    for seq in range(count):  # the subscriber said "subscribed"
        if seq == 1:
            pub.sock.send(GARBAGE)
        pub.send(Load(seq, free_blocks=100 - seq))
    received(ack, 30)  # the subscriber's "done"
    pub.close(linger_s=1.0)
    ack.close()


STATS = EngineStats("stand-in", "shard", kv_blocks_used=3, kv_blocks_total=8, num_requests=1)


def stats_service(queue: Any) -> None:
    """Two control sockets, typed as engine/worker.py types its own: the first answers a
    StatsRequest with EngineStats, the second with a message that is not stats; one request each.
    """
    answers: list[ServiceReply] = [STATS, TokenOutput("not-stats", [1])]
    sockets = [bound(zmq.ROUTER, StatsRequest) for _ in answers]
    queue.put([endpoint for _, endpoint in sockets])
    for (requests, _), answer in zip(sockets, answers, strict=True):
        identity, request = received(requests, 30)
        assert request == StatsRequest()
        replies: TypedSocket[ServiceReply] = TypedSocket(requests.sock, ServiceReply)
        replies.send(answer, prefix=identity)
        replies.close(linger_s=1.0)


def tensor_echo(transport: str, queue: Any) -> None:
    """Tensor channel server: send every (header, tensors) back; stop on Stop."""
    if transport == "ucx":
        from common.transport.ucx_listener import UcxListener

        listener = UcxListener(Message, key=UCX_KEY)
        queue.put(listener.address)
        channel: Any = listener.accept(timeout=30)
    else:
        channel = ZmqTensorChannel("tcp://127.0.0.1:*", Message, bind=True)
        queue.put(channel.endpoint)
    while True:
        header, tensors = channel.recv(timeout=30)
        channel.send(header, tensors)
        if isinstance(header, Stop):
            break
    channel.close()


def run_peer(target: Callable[..., None], *args: Any) -> None:
    """A peer's whole life: `target`, then its ZeroMQ context ended, which waits out what its
    closed sockets still hold (linger). NOTE: a forked process ends in `os._exit`, with no
    interpreter exit to do that."""
    try:
        target(*args)
    finally:
        zmq.Context.instance().term()


# ---- helpers ----


@pytest.fixture
def spawn() -> Iterator[Callable[..., Any]]:
    """Start peer processes; on teardown they must have exited 0 (killed if still alive)."""
    # If no fork server runs in this process yet (`LocalMesh` starts one that imported its
    # workers' code), the one started now imports this module and its dependencies, once.
    PEERS.set_forkserver_preload([__name__])
    procs: list[Any] = []

    def start(target: Callable[..., None], *args: Any) -> Any:
        proc = PEERS.Process(target=run_peer, args=(target, *args), daemon=True)
        proc.start()
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
        assert proc.exitcode == 0, f"{proc.name} exited with {proc.exitcode}"


def started_endpoint(spawn: Callable[..., Any], target: Callable[..., None], *args: Any) -> str:
    queue = PEERS.Queue()
    spawn(target, *args, queue)
    return str(queue.get(timeout=30))


def sample_tensors(seed: int) -> list[torch.Tensor]:
    """float32 and bfloat16 of several shapes: empty, tiny, per-layer sized, and 1 MiB (which
    takes the UCX zero-copy path)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(32, 2, 64, generator=gen),
        torch.randn(32, 2, generator=gen).to(torch.bfloat16),
        torch.randn(3, generator=gen),
        torch.empty(0, 4),
        torch.randn(512, 8, 64, generator=gen).to(torch.bfloat16),
        torch.randn(256, 1024, generator=gen),
    ]


def assert_bit_exact(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))  # bit-exact, NaN-safe


# ---- control-plane sockets ----


def test_router_dealer_round_trips_in_order(spawn: Callable[..., Any]) -> None:
    dealer = connected(zmq.DEALER, started_endpoint(spawn, router_echo))
    for seq in range(50):
        dealer.send(Ping(seq))
        assert received(dealer, 20) == ([], Load(seq, free_blocks=2 * seq))
    dealer.send(Stop())
    dealer.close(linger_s=1.0)


def test_router_drops_malformed_and_unknown_then_serves(spawn: Callable[..., Any]) -> None:
    dealer = connected(zmq.DEALER, started_endpoint(spawn, router_echo))
    dealer.sock.send(GARBAGE)
    dealer.sock.send(UNKNOWN)
    dealer.send(Ping(41))
    assert received(dealer, 20)[1] == Load(41, free_blocks=82)
    assert dealer.recv_nowait() is None  # nothing answered the junk
    dealer.send(Stop())
    dealer.close(linger_s=1.0)


def test_push_pull_many_messages_drops_junk(spawn: Callable[..., Any]) -> None:
    pull, endpoint = bound(zmq.PULL)
    spawn(pusher, endpoint, 500)
    pings = []
    while not isinstance(msg := received(pull, 20)[1], Stop):
        pings.append(msg)
    assert pings == [Ping(seq) for seq in range(500)]
    pull.close()


def test_pub_sub_load_reports(spawn: Callable[..., Any]) -> None:
    ack, ack_endpoint = bound(zmq.PUSH)
    sub = connected(zmq.SUB, started_endpoint(spawn, publisher, ack_endpoint, 20))
    assert received(sub, 20)[1] == Load(-1)
    ack.send(Stop())  # "subscribed": the publisher stops saying hello
    reports = []
    while len(reports) < 20:
        msg = received(sub, 20)[1]
        if msg != Load(-1):
            reports.append(msg)
    assert reports == [Load(seq, free_blocks=100 - seq) for seq in range(20)]
    ack.send(Stop())
    sub.close()
    ack.close(linger_s=1.0)


def test_recv_times_out_without_busy_waiting() -> None:
    pull, _ = bound(zmq.PULL)
    cpu_start = time.process_time()
    assert pull.recv(0.3) is None
    # NOTE: CPU time, not wall time: a busy loop would burn most of the 0.3 s however loaded
    # the machine is, a wait in zmq poll next to nothing.
    assert time.process_time() - cpu_start < 0.1
    assert pull.recv_nowait() is None
    assert not pull.sock.poll(0)
    pull.close()


def test_request_stats_asks_every_endpoint_at_once(spawn: Callable[..., Any]) -> None:
    """Stats from the endpoint that answers with them; the one answering something else and two
    silent ones are left out, and the silent ones share one timeout instead of one each."""
    queue = PEERS.Queue()
    spawn(stats_service, queue)
    answers, not_stats = queue.get(timeout=30)
    silent = [bound(zmq.ROUTER) for _ in range(2)]  # bound, never read
    start = time.monotonic()
    replies = request_stats([answers, not_stats, *(e for _, e in silent)], timeout_s=3.0, auth=MESH)
    assert time.monotonic() - start < 5.0  # one 3 s wait for both, not two
    assert replies == {answers: STATS}
    assert request_stats([], timeout_s=3.0, auth=MESH) == {}
    for sock, _ in silent:
        sock.close()


# ---- tensor channels ----


def connect_tensor_channel(transport: str, address: str) -> Any:
    if transport == "ucx":
        from common.transport.ucx_channel import UcxTensorChannel

        return UcxTensorChannel.connect(address, Message, key=UCX_KEY)
    return ZmqTensorChannel(address, Message, bind=False)


@pytest.mark.parametrize("transport", ["ucx", "zmq"])
def test_tensor_channel_bit_exact_many_in_a_row(transport: str, spawn: Callable[..., Any]) -> None:
    channel = connect_tensor_channel(transport, started_endpoint(spawn, tensor_echo, transport))
    for seq in range(30):
        sent = sample_tensors(seq)[: 1 + seq % 6]
        channel.send(Ping(seq, note="x" * seq), sent)
        header, got = channel.recv(timeout=20)
        assert header == Ping(seq, note="x" * seq)
        assert_bit_exact(got, sent)
    sent = sample_tensors(99)
    out = [torch.empty_like(t) for t in sent]
    channel.send(Load(99), sent)
    header, got = channel.recv(out=lambda header, specs: out, timeout=20)
    assert header == Load(99) and all(g is o for g, o in zip(got, out, strict=True))
    assert_bit_exact(out, sent)
    channel.send(Stop())
    assert channel.recv(timeout=20)[0] == Stop()
    channel.close()


@pytest.mark.parametrize("transport", ["ucx", "zmq"])
def test_tensor_channel_sends_and_receives_strided_slices(
    transport: str, spawn: Callable[..., Any]
) -> None:
    """Slices of larger tensors travel without `.contiguous()` and land in place in slices of a
    larger tensor (how a token engine sends a shard its heads and takes its output back), on the
    inline path and the zero-copy path (1 MiB) alike; the rest of the target stays untouched."""
    channel = connect_tensor_channel(transport, started_endpoint(spawn, tensor_echo, transport))
    gen = torch.Generator().manual_seed(7)
    for rows, dtype in ((8, torch.float32), (8, torch.bfloat16), (4096, torch.float32)):
        full = torch.randn(rows, 12, 64, generator=gen).to(dtype)
        sent = [full[1:, 3:9], full[:, 6:8].transpose(0, 1)]  # neither is contiguous
        assert not any(t.is_contiguous() for t in sent)
        channel.send(Ping(rows), sent)
        target = torch.full((rows, 12, 64), -1.0, dtype=dtype)
        lse_target = torch.full((2, rows + 3, 64), -1.0, dtype=dtype)
        out = [target[1:, 3:9], lse_target[:, 3:]]
        header, got = channel.recv(out=out, timeout=20)
        assert header == Ping(rows) and all(g is o for g, o in zip(got, out, strict=True))
        assert_bit_exact([g.contiguous() for g in got], [t.contiguous() for t in sent])
        assert (
            (target[0] == -1).all() and (target[:, :3] == -1).all() and (target[:, 9:] == -1).all()
        )
        assert (lse_target[:, :3] == -1).all()
    channel.send(Stop())
    channel.recv(timeout=20)
    channel.close()


class InFlightSendStandIn:
    """Stands in for a UCX send request that has not completed yet (which a real one does only
    when the socket is full, and not on demand)."""

    completed = False


def test_ucx_sends_in_flight_back_to_back_keep_their_bytes(spawn: Callable[..., Any]) -> None:
    """Inline messages reuse one send buffer only once its last send is done: while that send is
    in flight a message gets a buffer of its own, and a burst of sends keeps every message's bytes
    intact and in order."""
    channel = connect_tensor_channel("ucx", started_endpoint(spawn, tensor_echo, "ucx"))
    try:
        sent = [torch.full((150 * 1024 // 4,), float(i)) for i in range(60)]  # inline, ~9 MiB
        handles = [channel.send_async(Ping(i), [t]) for i, t in enumerate(sent)]
        for handle in handles:
            channel.wait(handle)
        for i, tensor in enumerate(sent):
            header, got = channel.recv(timeout=20)
            assert header == Ping(i)
            assert_bit_exact(got, [tensor])

        outbox = channel._outbox.copy()
        channel._outbox_request = InFlightSendStandIn()
        handle = channel.send_async(Ping(99), [torch.ones(8)])
        assert handle.buffers, "a send while the shared buffer is in flight must own its buffer"
        assert np.array_equal(channel._outbox, outbox), "the in-flight buffer was overwritten"
        channel.wait(handle)
        header, got = channel.recv(timeout=20)
        assert header == Ping(99)
        assert_bit_exact(got, [torch.ones(8)])
    finally:
        channel.send(Stop())
        channel.recv(timeout=20)
        channel.close()


@pytest.mark.parametrize("transport", ["ucx", "zmq"])
def test_tensor_channel_timeout_then_still_works(transport: str, spawn: Callable[..., Any]) -> None:
    channel = connect_tensor_channel(transport, started_endpoint(spawn, tensor_echo, transport))
    with pytest.raises(TimeoutError):
        channel.recv(timeout=0.05)
    channel.send(Ping(1), [torch.arange(10, dtype=torch.float32)])
    header, (got,) = channel.recv(timeout=20)
    assert header == Ping(1) and torch.equal(got, torch.arange(10, dtype=torch.float32))
    channel.send(Stop())
    channel.recv(timeout=20)
    channel.close()


def test_zmq_tensor_channel_drops_malformed(spawn: Callable[..., Any]) -> None:
    channel = connect_tensor_channel("zmq", started_endpoint(spawn, tensor_echo, "zmq"))
    channel.sock.send_multipart([GARBAGE, b"1234"])
    channel.sock.send_multipart([UNKNOWN])
    bad_sizes = msgspec.msgpack.encode(([["float32", [4]]], Ping(5)))
    channel.sock.send_multipart([bad_sizes, b"12"])  # 2 bytes where the spec says 16
    channel.send(Ping(6), [torch.ones(4)])
    header, (got,) = channel.recv(timeout=20)
    assert header == Ping(6) and torch.equal(got, torch.ones(4))
    channel.send(Stop())
    channel.recv(timeout=20)
    channel.close()


def test_ucx_rejects_wrong_receive_buffer(spawn: Callable[..., Any]) -> None:
    channel = connect_tensor_channel("ucx", started_endpoint(spawn, tensor_echo, "ucx"))
    channel.send(Ping(1), [torch.ones(4)])
    with pytest.raises(ValueError, match="does not match"):
        channel.recv(out=[torch.empty(5)], timeout=20)
    channel.send(Stop())
    channel.recv(timeout=20)
    channel.close()


def test_zmq_socket_closes_cleanly() -> None:
    ctx = zmq.Context()
    sock, endpoint = bind_random(ctx, zmq.PULL, auth=MESH)
    pull: TypedSocket[Message] = TypedSocket(sock, Message)
    pool: PushPool[Message] = PushPool(ctx, Message, auth=MESH)
    pool.get(endpoint).send(Ping(1))
    assert received(pull, 5)[1] == Ping(1)
    pool.close()
    pull.close()
    ctx.term()  # returns only when every socket is closed


# ---- closed by default ----


def test_zmq_sockets_hear_only_peers_with_the_mesh_key() -> None:
    """A CURVE server socket reads nothing from a plain peer nor from one with another mesh's
    key (libzmq drops the connection at the handshake); a peer with the key gets through, and so
    does the reply on a ROUTER/DEALER pair."""
    ctx = zmq.Context.instance()
    sock, endpoint = bind_random(ctx, zmq.PULL, auth=MESH)
    pull: TypedSocket[Message] = TypedSocket(sock, Message)
    for outsider in (None, CurveKeys.from_mesh_key("a5" * 32)):
        pool: PushPool[Message] = PushPool(ctx, Message, auth=outsider)
        # libzmq's I/O thread may fail the handshake (and drop the pipe) before this send runs,
        # and a PUSH with no pipe refuses at once (CI, 2026-11-27): nothing got through either way.
        with contextlib.suppress(zmq.Again):
            pool.get(endpoint).send(Ping(1))
        assert pull.recv(1.0) is None
        pool.close()
    pool = PushPool(ctx, Message, auth=MESH)
    pool.get(endpoint).send(Ping(2))
    assert received(pull, 5)[1] == Ping(2)
    pool.close()
    pull.close()
    router, endpoint = bound(zmq.ROUTER)
    dealer = connected(zmq.DEALER, endpoint)
    dealer.send(Ping(3))
    identity, ping = received(router, 5)
    router.send(Load(ping.seq, free_blocks=1), prefix=identity)
    assert received(dealer, 5)[1] == Load(3, free_blocks=1)
    router.close()
    dealer.close()
    with pytest.raises(ValueError, match="16 bytes"):
        CurveKeys.from_mesh_key("")


def send_rogue_hellos(address: str) -> None:
    """What a hostile or broken peer could send to a listener's hello tag: random bytes, a hello
    announcing a peer address longer than any, one larger than the hello buffer, and well-formed
    hellos with a garbage peer address (which would abort the listener inside UCX), unsigned and
    signed with the wrong key."""
    import hashlib
    import hmac

    from common.transport import ucx_channel as ucx
    from common.transport import ucx_handshake as handshake

    worker = ucx.UcxWorker("127.0.0.1")
    remote = ucx.ucx_api.UCXAddress.create_from_buffer(bytes.fromhex(address))
    endpoint = ucx.ucx_api.UCXEndpoint.create_from_worker_address(worker.worker, remote, True)
    rng = np.random.default_rng(0)
    hellos = [
        rng.integers(0, 256, 7, dtype=np.uint8).tobytes(),
        handshake.HELLO.pack(1, time.time(), 1 << 30),
        rng.integers(0, 256, 10_000, dtype=np.uint8).tobytes(),
        handshake.HELLO.pack(2, time.time(), 40)
        + rng.integers(0, 256, 40, dtype=np.uint8).tobytes(),
    ]
    forged = (
        handshake.HELLO.pack(3, time.time(), 40)
        + rng.integers(0, 256, 40, dtype=np.uint8).tobytes()
    )
    hellos.append(forged + hmac.digest(b"not the mesh key", forged, hashlib.sha256))
    tag = ucx.ucx_api.UCXXTag(handshake.HELLO_TAG)
    buffers = [np.frombuffer(h, dtype=np.uint8).copy() for h in hellos]
    worker.wait([endpoint.tag_send(ucx.Array(b), tag) for b in buffers], timeout=10)


def random_bytes(rng: np.random.Generator, n: int) -> bytes:
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def test_ucx_listener_drops_rogue_hellos_and_serves_the_next_peer(
    spawn: Callable[..., Any],
) -> None:
    from common.transport.ucx_channel import ChannelClosed, UcxTensorChannel

    address = started_endpoint(spawn, tensor_echo, "ucx")
    send_rogue_hellos(address)
    with pytest.raises(ChannelClosed, match="did not accept"):  # another mesh's key: told so
        UcxTensorChannel.connect(address, Message, timeout=3, key=b"another mesh's key")
    channel = connect_tensor_channel("ucx", address)  # accepted after every rogue hello
    tensors = [torch.arange(12, dtype=torch.float32).reshape(3, 4)]
    channel.send(Ping(seq=1), tensors)
    header, echoed = channel.recv(timeout=30)
    assert header == Ping(seq=1) and torch.equal(echoed[0], tensors[0])
    channel.send(Stop())
    channel.recv(timeout=30)
    channel.close()


def has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        pytest.param(
            "::1",
            marks=pytest.mark.skipif(
                not has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)"
            ),
        ),
    ],
)
def test_ucx_workers_listen_on_the_mesh_host_only(host: str) -> None:
    """Both ends of a link listen on the mesh host's loopback alone, in its address family (an
    IPv6 host: ::1, not the device's IPv4 address), and a message goes through."""
    import ipaddress

    import psutil

    from common.transport.ucx_channel import UcxTensorChannel
    from common.transport.ucx_listener import UcxListener

    def listening() -> set[Any]:
        connections = psutil.Process().net_connections(kind="inet")
        return {c.laddr for c in connections if c.status == psutil.CONN_LISTEN}

    before = listening()
    listener = UcxListener(Message, host=host)
    accepted: list[Any] = []
    accepting = threading.Thread(target=lambda: accepted.append(listener.accept(timeout=30)))
    accepting.start()  # the listener's worker must progress for the hello to complete
    client = UcxTensorChannel.connect(listener.address, Message, host=host)
    accepting.join(timeout=30)
    assert accepted
    client.send(Ping(7), [torch.arange(4.0)])
    header, tensors = accepted[0].recv(timeout=30)
    assert header == Ping(7) and torch.equal(tensors[0], torch.arange(4.0))
    new = listening() - before
    assert len(new) >= 2  # both workers listen (each side connects back to the other)
    assert all(ipaddress.ip_address(addr.ip) == ipaddress.ip_address(host) for addr in new), new
    client.close()
    accepted[0].close()


@pytest.mark.parametrize(
    "host", ["203.0.113.7", "2001:db8::7", "no-such-host.invalid"]
)  # documentation addresses (on no machine's interface) and a name that resolves nowhere
def test_a_ucx_worker_refuses_a_mesh_host_on_no_device_of_this_machine(host: str) -> None:
    """Instead of listening on every device (UCX's default), a worker whose mesh host is on no
    network interface here refuses to start, naming the host (and the interfaces found), for a
    listener and a connecting end alike."""
    from common.transport.ucx_channel import UcxTensorChannel
    from common.transport.ucx_handshake import MeshHostError
    from common.transport.ucx_listener import UcxListener

    with pytest.raises(MeshHostError, match=re.escape(repr(host))) as refused:
        UcxListener(Message, host=host)
    if not host.endswith(".invalid"):
        assert "interfaces: " in str(refused.value) and "127.0.0.1" in str(refused.value)
    listener = UcxListener(Message, host="127.0.0.1")
    with pytest.raises(MeshHostError, match=re.escape(repr(host))):
        UcxTensorChannel.connect(listener.address, Message, timeout=5, host=host)


def test_each_local_address_maps_to_the_device_that_holds_it() -> None:
    """What a worker listens on, for every address of this machine's interfaces, IPv6 included
    (psutil's view of them is the reference), and for loopback names and an unspecified host."""
    import socket

    import psutil

    from common.transport.ucx_handshake import net_device_for

    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = address.address.split("%")[0]
            if ip.startswith("fe80:"):
                continue  # link-local: the same address may sit on several devices
            expected = "lo" if ipaddress_is_loopback(ip) else name
            assert net_device_for(ip) == expected, (name, ip)
    assert net_device_for("localhost") == "lo"
    assert net_device_for("[::1]") == "lo"
    assert net_device_for("0.0.0.0") is None and net_device_for("::") is None  # asked for


def ipaddress_is_loopback(ip: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(ip).is_loopback


def test_a_hello_captured_and_sent_again_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signed hello replayed from another worker (captured on the wire) steals no link: the
    listener accepted its channel id once, and refuses it again; a stale hello is refused too.
    Before, the listener connected back to the hello's peer again (a forced relink)."""
    import threading

    from common.transport import ucx_channel as ucx
    from common.transport import ucx_handshake as handshake
    from common.transport.ucx_channel import UcxTensorChannel
    from common.transport.ucx_listener import UcxListener

    listener = UcxListener(Message, "127.0.0.1", UCX_KEY)
    sent: list[bytes] = []
    signed = ucx.signed_hello

    def captured(*args: Any, **kwargs: Any) -> bytes:
        sent.append(signed(*args, **kwargs))
        return sent[-1]

    monkeypatch.setattr(ucx, "signed_hello", captured)
    links: list[Any] = []
    peer = threading.Thread(target=lambda: links.append(
        UcxTensorChannel.connect(listener.address, Message, timeout=10, key=UCX_KEY)
    ))  # fmt: skip
    peer.start()
    accepted = listener.accept(timeout=10)
    peer.join(timeout=10)
    assert links and sent

    def refused(hello: bytes) -> bool:
        """Whether the listener, progressing in `accept`, refuses `hello` sent to it now."""
        worker = ucx.UcxWorker("127.0.0.1")
        remote = ucx.ucx_api.UCXAddress.create_from_buffer(bytes.fromhex(listener.address))
        endpoint = ucx.ucx_api.UCXEndpoint.create_from_worker_address(worker.worker, remote, True)
        buffer = np.frombuffer(hello, dtype=np.uint8).copy()
        tag = ucx.ucx_api.UCXXTag(handshake.HELLO_TAG)
        send = endpoint.tag_send(ucx.Array(buffer), tag)
        sender = threading.Thread(target=lambda: worker.wait([send], timeout=10), daemon=True)
        sender.start()
        try:
            listener.accept(timeout=3)
        except TimeoutError:
            return True
        finally:
            sender.join(timeout=10)
        return False

    # The first peer keeps progressing its worker (as a live engine does): an accepted replay
    # would reach it and be acknowledged.
    def progress_peer() -> None:
        with contextlib.suppress(Exception):
            links[0].recv(timeout=8)

    threading.Thread(target=progress_peer, daemon=True).start()
    assert refused(sent[0])  # the very hello the peer sent
    _, _, address = handshake.verified_hello(sent[0], UCX_KEY)  # the peer's own address
    stale = signed(7, address, UCX_KEY, now=time.time() - 2 * handshake.HELLO_MAX_AGE_S)
    assert refused(stale)
    accepted.close()
    links[0].close()
    listener.close()


def test_replay_guard_accepts_a_fresh_hello_once() -> None:
    from common.transport.ucx_handshake import ReplayGuard

    guard = ReplayGuard(max_age_s=60)
    guard.check(1, sent_at=1000.0, now=1001.0)
    guard.check(2, sent_at=1000.0, now=1001.0)  # another channel: fine
    for channel_id, sent_at, now in ((1, 1000.0, 1002.0), (3, 900.0, 1001.0), (4, 1100.0, 1001.0)):
        with pytest.raises(ValueError):  # again, stale, from the future
            guard.check(channel_id, sent_at, now)
    guard.check(1, sent_at=1100.0, now=1100.0)  # a minute on, the id may come again
