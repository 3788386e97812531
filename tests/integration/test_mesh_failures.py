"""The mesh keeps its books straight under aborts and garbage: no leaks, no crashes."""

from __future__ import annotations

import pytest
import zmq

from common.protocol import SamplingSpec
from services.launch import Mesh, MeshClient, Topology
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held


@pytest.fixture(scope="module")
def mesh(tiny_model_path):
    mesh = Mesh.start(Topology(str(tiny_model_path), num_shards=2, layer_wise_min_tokens=64))
    yield mesh
    mesh.close()


def _finish_all(client: MeshClient, live: set[str]) -> dict[str, str]:
    reasons = {}
    while live:
        out = client.recv(timeout=120)
        if out.finish_reason and out.req_id in live:
            reasons[out.req_id] = out.finish_reason
            live.discard(out.req_id)
    return reasons


def test_aborts_mid_stream_leave_no_kv_anywhere(mesh):
    client = MeshClient(mesh)
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
    _drain_until_idle(mesh)


def _drain_until_idle(mesh: Mesh) -> None:
    # Frees and aborts are asynchronous messages: give them a moment to land, then insist.
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(s.kv_blocks_used == 0 and s.num_requests == 0 for s in mesh.stats()):
            break
        time.sleep(0.2)
    assert_no_kv_held(mesh)


def test_malformed_and_unknown_messages_are_dropped(mesh):
    ctx = zmq.Context.instance()
    garbage = [b"\x00\xff garbage", b"\x92\xa7unknown\x01", b""]
    endpoints = [mesh.prompt[0].command_endpoint, mesh.token[0].ready.command_endpoint]
    endpoints += [mesh.token[0].ready.kv_endpoint] + [s.kv_endpoint for s in mesh.shards]
    for endpoint in endpoints:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(endpoint)
        for frames in (garbage[:1], garbage[1:2], [garbage[0], b"1234"], garbage[2:]):
            sock.send_multipart(frames)
        sock.close()
    for endpoint in mesh.control_endpoints():
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send(b"\xc1 not msgpack")
        sock.close(linger=1000)
    # Every service still serves: a request completes end to end, and stats still answer.
    client = MeshClient(mesh)
    client.submit(
        "after", random_prompts([70], 2048, seed=32)[0], SamplingSpec(max_tokens=8, temperature=0)
    )
    assert _finish_all(client, {"after"}) == {"after": "length"}
    _drain_until_idle(mesh)
