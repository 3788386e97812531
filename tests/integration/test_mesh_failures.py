"""The mesh keeps its books straight under aborts and garbage: no leaks, no crashes."""

from __future__ import annotations

import asyncio
import ipaddress
import secrets

import msgspec
import psutil
import pytest
import torch
import zmq

from common.config import EngineConfig
from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.protocol import AbortRequest, KvPages, SamplingSpec, Shutdown, TokenOutput
from common.sampling_params import SamplingParams
from common.transport.service_stats import request_stats
from common.transport.tensor_frames import EnvelopeCodec
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import PushPool, connect
from services.launch.local_mesh import LocalMesh, Topology
from services.router.mesh_client import MeshEngineClient
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held
from tests.integration.mesh_test_client import MeshTestClient
from tests.integration.test_transport import send_rogue_hellos


@pytest.fixture(scope="module")
def mesh(tiny_model_path):
    mesh = LocalMesh.start(
        Topology(str(tiny_model_path), num_shards=2, options=MeshOptions(layer_wise_min_tokens=64))
    )
    yield mesh
    mesh.close()


def _finish_all(client: MeshTestClient, live: set[str]) -> dict[str, str]:
    reasons = {}
    while live:
        out = client.recv(timeout=120)
        if out.finish_reason and out.req_id in live:
            reasons[out.req_id] = out.finish_reason
            live.discard(out.req_id)
    return reasons


def test_aborts_mid_stream_leave_no_kv_anywhere(mesh):
    client = MeshTestClient(mesh)
    prompts = random_prompts([20, 150, 40, 90, 10, 200], 2048, seed=31)
    sampling = SamplingSpec(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        client.submit(f"a{i}", prompt, sampling)
    # Abort half of them at once (some may still be prefilling), half after a few tokens.
    client.abort("a0")
    client.abort("a1")
    seen: dict[str, int] = {}
    while len(seen) < 4 or min(seen.values()) < 3:
        out = client.recv(timeout=120)
        if out.req_id in ("a2", "a3", "a4", "a5"):
            seen[out.req_id] = seen.get(out.req_id, 0) + len(out.token_ids)
    for req_id in ("a2", "a3", "a4"):
        client.abort(req_id)
    reasons = _finish_all(client, {"a5"})
    assert reasons == {"a5": "length"}
    assert_no_kv_held(mesh)


def test_malformed_and_unknown_messages_are_dropped(mesh):
    ctx = zmq.Context.instance()
    garbage = [b"\x00\xff garbage", b"\x92\xa7unknown\x01", b""]
    endpoints = [mesh.prompt[0].command_endpoint, mesh.token[0].command_endpoint]
    endpoints += [mesh.token[0].kv_endpoint] + [s.kv_endpoint for s in mesh.shards]
    for endpoint in endpoints:  # from a member of the mesh (it holds the key) gone wrong
        sock = connect(ctx, zmq.PUSH, endpoint, auth=mesh.auth)
        for frames in (garbage[:1], garbage[1:2], [garbage[0], b"1234"], garbage[2:]):
            sock.send_multipart(frames)
        sock.close(linger=1000)
    for endpoint in mesh.control_endpoints():
        sock = connect(ctx, zmq.DEALER, endpoint, auth=mesh.auth)
        sock.send(b"\xc1 not msgpack")
        sock.close(linger=1000)
    # Well-formed on the wire, wrong inside: a message of another socket's type, a tensor message
    # cut short, KV pages whose tensors do not match their header, tensors of the wrong dtype.
    pool: PushPool[object] = PushPool(ctx, object, auth=mesh.auth)
    for endpoint in endpoints:
        push = pool.get(endpoint)
        push.send(TokenOutput("forged", [1], "stop"))
        codec: EnvelopeCodec[object] = EnvelopeCodec(object)
        kv = torch.zeros(1, 5, 1, 32)
        pages = KvPages("evil", 0, 1, 5, 0, 1, total_layers=4)
        push.sock.send_multipart([codec.encode(pages, [kv, kv]), b"\x00" * 7, b"\x00" * 7])
        push.send_tensors(pages, [torch.zeros(3), torch.zeros(3)])  # shapes the KV cannot take
        push.send_tensors(pages, [kv.to(torch.int64), kv.to(torch.int64)])
    pool.close(linger_s=1.0)
    for shard in mesh.shards:  # UCX: hellos that are not signed with the mesh's key
        send_rogue_hellos(shard.link_address)
    # Every service still serves: a request completes end to end with the single-process
    # engine's tokens, and stats still answer.
    prompt = random_prompts([70], 2048, seed=32)[0]
    reference = LLMEngine(EngineConfig(mesh.topology.model_path), with_tokenizer=False)
    [expected] = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))
    client = MeshTestClient(mesh)
    client.submit("after", prompt, SamplingSpec(max_tokens=8, temperature=0))
    tokens, out = client.finish("after")
    assert (tokens, out.finish_reason) == (expected, "length")
    assert_no_kv_held(mesh)
    assert all(proc.is_alive() for proc in mesh.procs)  # nothing died of it


def test_a_process_without_the_mesh_key_is_not_heard(mesh):
    """The control plane trusts no one outside the mesh: a bare `Shutdown` to every engine and
    shard, an `AbortRequest` for a live request and a `StatsRequest` to every control socket, sent
    without the mesh's key and with another mesh's, are never read (ZeroMQ CURVE); every service
    keeps serving and the live request finishes with the single-process engine's tokens."""
    prompt = random_prompts([30], 2048, seed=36)[0]
    params = SamplingSpec(max_tokens=24, temperature=0, ignore_eos=True)
    reference = LLMEngine(EngineConfig(mesh.topology.model_path), with_tokenizer=False)
    [expected] = reference.generate([prompt], SamplingParams.from_spec(params))
    client = MeshTestClient(mesh)
    client.submit("outsiders", prompt, params)
    commands = [w.command_endpoint for w in (*mesh.prompt, *mesh.token)]
    ctx = zmq.Context.instance()
    for outsider in (None, CurveKeys.from_mesh_key(secrets.token_hex(32))):
        pool: PushPool[object] = PushPool(ctx, object, auth=outsider)
        for endpoint in commands:
            pool.get(endpoint).send(AbortRequest("outsiders"))
            pool.get(endpoint).send(Shutdown())
        for shard in mesh.shards:
            pool.get(shard.kv_endpoint).send_tensors(Shutdown(), [])
        assert request_stats(mesh.control_endpoints(), 2.0, auth=outsider) == {}
        pool.close(linger_s=1.0)
    tokens, _ = client.finish("outsiders")
    assert tokens == expected
    assert len(mesh.stats()) == len(mesh.control_endpoints())  # every service still answers
    assert all(proc.is_alive() for proc in mesh.procs)


def test_every_mesh_socket_listens_on_loopback_only(mesh):
    """The mesh is configured for 127.0.0.1: no ZeroMQ or UCX socket of any worker listens on
    another address (before, UCX listened on every interface)."""
    listening = [
        (proc.pid, c.laddr)
        for proc in mesh.procs
        for c in psutil.Process(proc.pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    # ZeroMQ: 4 per engine and 2 per shard; UCX: at least one per shard and per link.
    assert len(listening) >= 4 * 2 + 2 * 2 + 2
    assert all(ipaddress.ip_address(addr.ip).is_loopback for _, addr in listening), listening


def test_shard_outlives_its_token_engine_and_frees_its_requests(tiny_model_path):
    """A token engine killed mid-decode leaves its requests' KV on the shards: the shards free it
    when the UCX link drops, and keep serving (a restarted token engine can connect again)."""
    import time

    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_shards=1))
    try:
        client = MeshTestClient(mesh)
        client.submit("dies", random_prompts([90], 2048, seed=33)[0],
                      SamplingSpec(max_tokens=400, temperature=0.0, ignore_eos=True))  # fmt: skip
        tokens = 0
        while tokens < 5:  # decoding through the shard: it holds this request's KV now
            tokens += len(client.recv(timeout=120).token_ids)
        shard = mesh.shards[0]
        shard_stats = next(s for s in mesh.stats() if s.service_id == shard.service_id)
        assert shard_stats.kv_blocks_used > 0
        token_proc = mesh.procs[mesh.topology.num_shards]  # shards start first, then token engines
        token_proc.kill()
        token_proc.join(timeout=10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            shard_stats = request_stats([shard.control_endpoint], 10.0, auth=mesh.auth)[
                shard.control_endpoint
            ]
            if shard_stats.kv_blocks_used == 0:
                break
            time.sleep(0.2)
        assert shard_stats.kv_blocks_used == 0 and shard_stats.num_requests == 0
        assert mesh.procs[0].is_alive(), "the shard process must outlive its token engine"
        client.close()
    finally:
        mesh.close()


def test_an_edge_value_request_does_not_harm_its_batch_mates(mesh, tiny_model_path):
    """A subnormal temperature passes validation and, before the sampler was made total, made the
    token engine's whole step raise (NaN probabilities), failing every batch-mate. Now the
    eight greedy requests batched with it produce exactly the reference tokens, and it finishes."""
    from common.engine.core import LLMEngine
    from common.sampling_params import SamplingParams

    prompts = random_prompts([12, 40, 25, 70, 9, 33, 50, 18, 27], 2048, seed=71)
    reference = LLMEngine.from_path(tiny_model_path, num_blocks=256).generate(
        prompts[:8], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    client = MeshTestClient(mesh)
    greedy = SamplingSpec(max_tokens=24, temperature=0.0, ignore_eos=True)
    edge = SamplingSpec(max_tokens=24, temperature=5e-324, seed=3, ignore_eos=True)
    for i, prompt in enumerate(prompts[:8]):
        client.submit(f"g{i}", prompt, greedy)
    client.submit("edge", prompts[8], edge)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while len(reasons) < 9:
        out = client.recv(timeout=120)
        tokens.setdefault(out.req_id, []).extend(out.token_ids)
        if out.finish_reason:
            reasons[out.req_id] = out.finish_reason
    assert set(reasons.values()) == {"length"}, reasons
    assert [tokens[f"g{i}"] for i in range(8)] == reference
    client.close()
    assert_no_kv_held(mesh)


def test_the_routers_inbox_drops_garbage_and_forgeries(mesh):
    """Random bytes, a message of another socket's type and a `TokenOutput` for a request the
    router never sent, pushed to a router's inbox: dropped; the router's own requests stream on
    with the single-process engine's tokens."""
    client = MeshEngineClient(
        mesh.topology.model_path, mesh.registry.live, auth=mesh.auth, refresh_s=0.1
    )
    prompt = random_prompts([40], 2048, seed=34)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = LLMEngine(EngineConfig(mesh.topology.model_path), with_tokenizer=False)
    [expected] = reference.generate([prompt], params)
    ctx = zmq.Context.instance()
    sock = connect(ctx, zmq.PUSH, client.reply_endpoint, auth=mesh.auth)
    sock.send(b"\x00\xff garbage")
    sock.send(msgspec.msgpack.encode(KvPages("x", 0, 1, 1, 0, 1, total_layers=1)))
    sock.send(msgspec.msgpack.encode(TokenOutput("not-a-request", [5], "stop")))
    sock.send(msgspec.msgpack.encode(TokenOutput("inbox~7", [5], "", index=10**9)))
    sock.close(linger=1000)

    async def run() -> list[int]:
        tokens: list[int] = []
        async for out in client.generate("inbox", prompt, params):
            tokens += out.new_token_ids
        return tokens

    try:
        assert asyncio.run(asyncio.wait_for(run(), 120)) == expected
        assert client.inbox.thread.is_alive()
        # Nothing kept for the forgeries, nor for the finished request.
        assert client._orderer._held == {} and client._orderer._next == {}
    finally:
        client.shutdown()
