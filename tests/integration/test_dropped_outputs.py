"""A router that stops reading its inbox: its token engine, whose queue to it fills, gives the
requests up and says so (`OutputsDropped`, services/engine/dropped_outputs.py) on a socket of
its own, so the notice is among the first things the router reads when it reads again (not
behind the token backlog, not at its progress deadline). The router turns it into a retryable
error of each request's current attempt: it re-runs them from their tokens at once.

A real `LocalMesh`; the router's inbox here is a PULL socket with small buffers (a router whose
process or loop stopped: nothing reads it), so the token engine's queue fills in a few hundred
steps; requests ask for top logprobs, which makes every output its own, larger message.
"""

from __future__ import annotations

import time

import zmq

from common.protocol import OutputsDropped, SamplingSpec, ServiceReply, TokenBatch, TokenOutput
from common.transport.zmq_sockets import TypedSocket
from services.launch.local_mesh import LocalMesh, Topology
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held
from tests.integration.mesh_test_client import MeshTestClient


def small_inbox(mesh: LocalMesh) -> tuple[TypedSocket[ServiceReply], str]:
    """A router inbox that holds little: one message queued, a 4 KiB kernel buffer."""
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    mesh.auth.serve(sock)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return TypedSocket(sock, ServiceReply), f"tcp://127.0.0.1:{port}"


def test_an_engine_that_drops_a_routers_outputs_tells_it_ahead_of_the_backlog(
    tiny_model_path,
) -> None:
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_shards=0))
    try:
        client = MeshTestClient(mesh)
        client.replies, client.reply_endpoint = small_inbox(mesh)
        sampling = SamplingSpec(max_tokens=3000, temperature=0.0, ignore_eos=True, logprobs=20)
        req_ids = [f"r{i}" for i in range(4)]
        for req_id, prompt in zip(req_ids, random_prompts([20] * 4, 2048, seed=71), strict=True):
            client.submit(req_id, prompt, sampling, token_engine=mesh.token[0])
        # The router reads nothing: the token engine's queue to it fills and it gives up.
        deadline = time.monotonic() + 120
        while any(s.num_requests for s in mesh.stats()):
            assert time.monotonic() < deadline, "the engines still hold the requests"
            time.sleep(0.2)  # polling other processes' state
        # It reads again: the notice comes among the first messages, not after the backlog.
        num_read, told, finished = 0, set(), set()
        while told | finished != set(req_ids):
            item = client.replies.recv(timeout_s=30)
            assert item is not None, f"no word of {set(req_ids) - told - finished}"
            num_read += 1
            if isinstance(item[1], OutputsDropped):
                assert "could not queue" in item[1].error
                assert num_read < 100, num_read  # the backlog is hundreds of messages long
                told |= set(item[1].req_ids)
            elif isinstance(item[1], TokenOutput | TokenBatch):
                outs = item[1].outputs() if isinstance(item[1], TokenBatch) else [item[1]]
                finished |= {o.req_id for o in outs if o.finish_reason}
        assert told and not told & finished
        assert_no_kv_held(mesh)
    finally:
        mesh.close()
