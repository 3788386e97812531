"""KV pages travel over UCX links, ZeroMQ carries only their control, and a receiver that dies
mid-transfer costs only its own requests (real processes, SIGKILL)."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from common.config import ModelConfig
from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.protocol import FreeRequest, KvPages, SamplingSpec
from common.sampling_params import SamplingParams
from common.transport.kv_links import KvSender
from common.transport.service_stats import request_stats
from common.transport.zmq_sockets import PushPool
from services.launch.local_mesh import LocalMesh, Topology
from services.mesh.registry import ServiceEntry
from tests.conftest import random_prompts
from tests.integration.mesh_test_client import MeshTestClient

GREEDY = SamplingSpec(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mesh(tiny_model_path):
    """One prompt engine shipping to two token engines (local KV); no supervisor, so a killed
    engine stays dead."""
    topology = Topology(
        str(tiny_model_path), num_token=2, options=MeshOptions(layer_wise_min_tokens=64)
    )
    mesh = LocalMesh.start(topology, supervise=False)
    yield mesh
    mesh.close()


def _blocks_used(mesh: LocalMesh, entry: ServiceEntry) -> int:
    replies = request_stats([entry.control_endpoint], 10.0, auth=mesh.auth)
    return replies[entry.control_endpoint].kv_blocks_used


def _await_blocks(mesh: LocalMesh, entry: ServiceEntry, held: bool) -> int:
    """Blocks in use at `entry`, once some are (`held`) or none are, or at a 20 s deadline."""
    deadline = time.monotonic() + 20
    while (_blocks_used(mesh, entry) > 0) != held and time.monotonic() < deadline:
        time.sleep(0.1)  # polling another process's state
    return _blocks_used(mesh, entry)


def test_kv_pages_land_over_ucx_and_not_over_zeromq(mesh, tiny_model_path):
    token = mesh.token[0]
    assert all(t.kv_address for t in mesh.token), "every token engine publishes its KV listener"
    mc = ModelConfig.from_folder(str(tiny_model_path))
    layers, heads = mc.num_hidden_layers, mc.num_key_value_heads
    k = torch.randn(layers, 40, heads, mc.head_dim)
    pool: PushPool[object] = PushPool(zmq.Context.instance(), object, auth=mesh.auth)
    sender = KvSender("127.0.0.1", bytes.fromhex(mesh.mesh_key))
    try:
        # KV pages on the ZeroMQ KV-ingress socket: it takes control only, so they are dropped.
        zmq_kv = pool.get(token.kv_endpoint)
        zmq_kv.send_tensors(KvPages("zmq-kv", 0, layers, 40, 0, heads, layers), [k, k.clone()])
        # The same pages over the UCX link land (held under their lease until a free) ...
        sender.send(token.kv_address, KvPages("ucx-kv", 0, layers, 40, 0, heads, layers),
                    k, k.clone())  # fmt: skip
        assert _await_blocks(mesh, token, held=True) > 0
        assert sender.take_failed() == []
        # ... and a free on the ZeroMQ socket frees them. It queued behind the ZeroMQ pages, so
        # those were handled first: had they landed, their blocks would still be held.
        zmq_kv.send_tensors(FreeRequest("ucx-kv"), [])
        assert _await_blocks(mesh, token, held=False) == 0
    finally:
        sender.close()
        pool.close(linger_s=1.0)


def test_a_receiver_killed_mid_transfer_costs_only_its_requests(mesh, tiny_model_path):
    """Long prompts ship layer-wise to both token engines; one is SIGKILLed while they prefill.
    The other's requests finish with the single-process engine's tokens, and the prompt engine
    keeps serving: a request whose KV is for the dead engine does not stall the next ones."""
    prompts = random_prompts([200, 180, 220, 160, 190, 210, 150, 170], 2048, seed=45)
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True)
    reference = LLMEngine.from_path(tiny_model_path, num_blocks=256).generate(prompts, params)
    live, doomed = mesh.token
    client = MeshTestClient(mesh)
    for i, prompt in enumerate(prompts[:6]):
        client.submit(f"k{i}", prompt, GREEDY, token_engine=live if i % 2 == 0 else doomed)
    victim = mesh.workers[doomed.service_id].proc
    victim.kill()  # SIGKILL: its KV links drop mid-transfer
    victim.join(timeout=10)
    # After the kill: one more for the dead engine (its transfer fails), then two for the live one.
    client.submit("after-dead", prompts[6], GREEDY, token_engine=doomed)
    client.submit("after-0", prompts[6], GREEDY, token_engine=live)
    client.submit("after-1", prompts[7], GREEDY, token_engine=live)
    expected = {f"k{i}": reference[i] for i in (0, 2, 4)}
    expected |= {"after-0": reference[6], "after-1": reference[7]}
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    while not set(expected) <= finished:
        out = client.recv(timeout=120)
        if out.req_id in expected:
            assert not out.error, out.error
            tokens.setdefault(out.req_id, []).extend(out.token_ids)
            if out.finish_reason:
                finished.add(out.req_id)
    assert {r: tokens[r] for r in expected} == expected
    prompt_proc = mesh.workers[mesh.prompt[0].service_id].proc
    assert prompt_proc.is_alive(), "the sender must outlive its receiver"
    client.close()
