"""KV-aware routing on a real mesh (separate OS processes, 2 prompt engines): a router that joins
after the engines cached two different prefixes learns them from the engines' load reports alone,
and sends each request sharing a prefix to the engine that holds it, named by its prefix-hit
count; greedy tokens equal the single-process engine's without a cache."""

from __future__ import annotations

import asyncio
import time

from common.engine.core import LLMEngine
from common.protocol import SamplingSpec
from common.sampling_params import SamplingParams
from services.launch.local_mesh import LocalMesh, Topology
from services.router.mesh_client import MeshEngineClient
from tests.conftest import random_prompts
from tests.integration.mesh_test_client import MeshTestClient

NUM_TOKENS = 4
SHARED = 96  # 6 full blocks of 16
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def _warm(mesh: LocalMesh, prompts: list[list[int]]) -> None:
    """One prompt per prompt engine, in order (the test client places round-robin)."""
    client = MeshTestClient(mesh)
    spec = SamplingSpec(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        client.submit(f"warm-{i}", prompt, spec)
    done = 0
    while done < len(prompts):
        out = client.recv(timeout=120)
        assert not out.error, out
        done += bool(out.finish_reason)


def _wait_synced(client: MeshEngineClient, service_ids: list[str], timeout: float = 60) -> None:
    # NOTE: a deadline, not a speed assumption: snapshots go out every second.
    deadline = time.monotonic() + timeout
    while min(client.scheduler.cached_blocks().get(s, 0) for s in service_ids) < SHARED // 16:
        assert time.monotonic() < deadline, client.scheduler.cached_blocks()
        time.sleep(0.05)


def test_requests_sharing_a_prefix_go_to_the_engine_that_caches_it(tiny_model_path):
    base_a, base_u, *tails = random_prompts([SHARED, SHARED, 8, 8, 5, 11], 2048, seed=9)
    warm = [base_a + tails[0], base_u + tails[1]]
    # The engines are idle when each sharer is placed: plain JSQ would send both to one engine.
    sharers = [base_u + tails[2], base_a + tails[3]]
    plain = LLMEngine.from_path(tiny_model_path, num_blocks=512, enable_prefix_caching=False)
    reference = [plain.generate([p], GREEDY)[0] for p in sharers]
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_prompt=2, num_token=1))
    try:
        _warm(mesh, warm)
        holder_a, holder_u = (e.service_id for e in mesh.prompt)
        client = MeshEngineClient(
            tiny_model_path, mesh.registry.live, auth=mesh.auth, refresh_s=0.1
        )
        try:
            _wait_synced(client, [holder_a, holder_u])
            hits_before = {s.service_id: s.num_prefix_hit_tokens for s in mesh.stats()}

            async def run(prompt: list[int], req_id: str) -> list[int]:
                return [t async for out in client.generate(req_id, prompt, GREEDY)
                        for t in out.new_token_ids]  # fmt: skip

            tokens = [asyncio.run(run(p, f"share-{i}")) for i, p in enumerate(sharers)]
        finally:
            client.shutdown()
        assert tokens == reference
        hits = {s.service_id: s.num_prefix_hit_tokens - hits_before[s.service_id]
                for s in mesh.stats()}  # fmt: skip
        assert hits[holder_u] == SHARED and hits[holder_a] == SHARED
    finally:
        mesh.close()
