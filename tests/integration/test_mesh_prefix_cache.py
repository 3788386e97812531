"""Prefix caching on the mesh (separate OS processes): a prompt sharing an earlier one's prefix
prefills only its uncached suffix, still ships its whole prompt's KV (serialized and layer-wise,
to a token engine's shard), and decodes the same greedy tokens as the engine without a cache."""

from __future__ import annotations

from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.protocol import EngineStats, SamplingSpec
from common.sampling_params import SamplingParams
from services.launch.local_mesh import LocalMesh, Topology
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held
from tests.integration.mesh_test_client import MeshTestClient

NUM_TOKENS = 8
BLOCK = 16
GREEDY = SamplingSpec(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def _prompt_engine(mesh: LocalMesh) -> EngineStats:
    (stats,) = [s for s in mesh.stats() if s.role == "prompt"]
    return stats


def _run_one(client: MeshTestClient, req_id: str, prompt: list[int]) -> list[int]:
    client.submit(req_id, prompt, GREEDY)
    tokens, last = client.finish(req_id)
    assert not last.error, last
    return tokens


def test_a_shared_prefix_is_prefilled_once(tiny_model_path):
    base, *tails = random_prompts([100, 9, 5, 3], 2048, seed=5)
    # The first prompt warms the cache; the second shares 96 tokens (6 full blocks) and ships
    # layer-wise; the third ends mid-block inside the prefix (2 blocks reused, serialized).
    prompts = [base + tails[0], base + tails[1], base[:40] + tails[2]]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    plain = LLMEngine.from_path(tiny_model_path, num_blocks=512, enable_prefix_caching=False)
    reference = [plain.generate([p], params)[0] for p in prompts]
    topology = Topology(
        str(tiny_model_path), num_prompt=1, num_token=1, num_shards=1,
        options=MeshOptions(layer_wise_min_tokens=100),
    )  # fmt: skip
    mesh = LocalMesh.start(topology)
    try:
        client = MeshTestClient(mesh)
        computed, hits = [], []
        for i, prompt in enumerate(prompts):
            assert _run_one(client, f"req-{i}", prompt) == reference[i]
            stats = _prompt_engine(mesh)
            computed.append(stats.num_prefill_tokens)
            hits.append(stats.num_prefix_hit_tokens)
        assert computed[0] == len(prompts[0]) and hits[0] == 0
        assert computed[1] - computed[0] == len(prompts[1]) - 96 and hits[1] == 96
        assert computed[2] - computed[1] == len(prompts[2]) - 32 and hits[2] == 96 + 32
        assert_no_kv_held(mesh)  # cached blocks are not held: evictable counts as free
    finally:
        mesh.close()
