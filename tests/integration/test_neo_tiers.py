"""Neo's two KV tiers on a token engine (a bounded local tier beside its shard group), against
the single-process engine: greedy tokens equal while requests live locally, on the shards, both
at once, and while they are swapped out and back in mid-generation (real processes, UCX).

Offload off (no shards) and all-offloaded (no local tier) are test_mesh_parity.py's cases."""

from __future__ import annotations

import pytest

from common.engine.core import LLMEngine
from common.protocol import SamplingSpec
from common.sampling import SamplingParams
from services.launch.local_mesh import LocalMesh, Topology
from services.launch.test_client import MeshTestClient
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held, run_staggered
from tests.parity import assert_greedy_close, load_hf

NUM_TOKENS = 24
LENGTHS = [5, 90, 17, 200, 33, 64, 128, 9]
GREEDY = SamplingSpec(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, 2048, seed=22)


@pytest.fixture(scope="module")
def reference(tiny_model_path, prompts) -> list[list[int]]:
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=512)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    return engine.generate(prompts, params)


# (policy, local budget in blocks): every request changes tier every 4 of its tokens (swaps both
# ways mid-generation, local and offloaded at once); a local tier that holds ~2 requests (mixed).
CASES = [("alternate:4", 512), ("fill_local", 24)]


@pytest.mark.parametrize("policy, budget", CASES, ids=[c[0] for c in CASES])
def test_two_tiers_match_single_process_engine(tiny_model_path, prompts, reference, policy, budget):
    topology = Topology(
        str(tiny_model_path), num_prompt=1, num_token=1, num_shards=2,
        layer_wise_min_tokens=128, local_kv_blocks=budget, tier_policy=policy,
    )  # fmt: skip
    mesh = LocalMesh.start(topology)
    try:
        outputs = run_staggered(MeshTestClient(mesh), prompts, GREEDY)
        mismatched = [i for i in range(len(prompts)) if outputs[f"req-{i}"] != reference[i]]
        if mismatched:  # float ties across a different attention split may flip a token
            hf = load_hf(tiny_model_path)
            for i in mismatched:
                assert_greedy_close(hf, prompts[i], outputs[f"req-{i}"], reference[i])
        assert_no_kv_held(mesh)
        events = [e for s in mesh.stats() for e in s.kv_events]
        swapped_in = {e.req_id for e in events if e.what == "swapped_in"}
        swapped_out = {e.req_id for e in events if e.what == "swapped_out"}
        assert swapped_in, "no request moved to the local tier"
        if policy.startswith("alternate"):  # out and back in, mid-generation, every request
            assert swapped_out == swapped_in == {f"req-{i}" for i in range(len(prompts))}
        else:  # the budget holds some, never all at once: the others stay offloaded
            assert 0 < len(swapped_in) and not swapped_out
    finally:
        mesh.close()
