"""Neo's two KV tiers on a token engine (a bounded local tier beside its shard group), against
the single-process engine: greedy tokens equal while requests live locally, on the shards, both
at once (decoded as two sub-batches interleaved per layer, §3.1), and while they are swapped out
and back in mid-generation (real processes, UCX).

Offload off (no shards) and all-offloaded (no local tier) are test_mesh_parity.py's cases; the
policies and the swap failures are unit-tested (test_kv_tiers.py, test_engine_tiers.py,
test_neo_tier_policy.py). The second case runs Neo's load-aware policy (`tier_policy: neo`, its
cost tables probed at the token engine's start): greedy tokens equal, swap-ins mid-generation,
and a predicted and a measured time for each of its decode steps."""

from __future__ import annotations

from common.engine.core import LLMEngine
from common.protocol import SamplingSpec
from common.sampling import SamplingParams
from services.launch.local_mesh import LocalMesh, Topology
from services.launch.test_client import MeshTestClient
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held, run_staggered
from tests.parity import assert_greedy_close, load_hf

NUM_TOKENS = 16
LENGTHS = [5, 90, 140, 33]
GREEDY = SamplingSpec(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def test_two_tiers_and_swaps_mid_generation_match_single_process_engine(tiny_model_path):
    prompts = random_prompts(LENGTHS, 2048, seed=22)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    reference = LLMEngine.from_path(tiny_model_path, num_blocks=512).generate(prompts, params)
    # Every request changes tier every 3 of its tokens (it arrives offloaded), as far as a local
    # tier of 20 blocks (~2 requests' whole length) allows: local, offloaded, both at once.
    topology = Topology(
        str(tiny_model_path), num_prompt=1, num_token=1, num_shards=2,
        layer_wise_min_tokens=128, local_kv_blocks=20, tier_policy="alternate:3",
    )  # fmt: skip
    mesh = LocalMesh.start(topology)
    try:
        outputs = run_staggered(MeshTestClient(mesh), prompts, GREEDY)
        mismatched = [i for i in range(len(prompts)) if outputs[f"req-{i}"] != reference[i]]
        if mismatched:  # float ties across a different batch split may flip a token
            hf = load_hf(tiny_model_path)
            for i in mismatched:
                assert_greedy_close(hf, prompts[i], outputs[f"req-{i}"], reference[i])
        assert_no_kv_held(mesh)
        stats = mesh.stats()
        events = [e for s in stats for e in s.kv_events]
        swapped_in = [e.req_id for e in events if e.what == "swapped_in"]
        swapped_out = [e.req_id for e in events if e.what == "swapped_out"]
        assert swapped_out and swapped_in, "no request moved between the tiers"
        # Out and back in again: a request swapped in after its own swap-out, mid-generation.
        assert set(swapped_in) & set(swapped_out)
        [token] = [s for s in stats if s.service_id.startswith("token")]
        assert 0 < token.num_two_batch_steps < token.num_decode_steps
    finally:
        mesh.close()


def test_neo_policy_matches_single_process_engine(tiny_model_path):
    prompts = random_prompts(LENGTHS[:3], 2048, seed=23)
    greedy = SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = LLMEngine.from_path(tiny_model_path, num_blocks=512).generate(prompts, params)
    # A local tier of ~1 request's whole length: the rest decode on the shards until it frees.
    topology = Topology(
        str(tiny_model_path), num_prompt=1, num_token=1, num_shards=2,
        layer_wise_min_tokens=128, local_kv_blocks=10, tier_policy="neo",
    )  # fmt: skip
    mesh = LocalMesh.start(topology)
    try:
        outputs = run_staggered(MeshTestClient(mesh), prompts, greedy)
        mismatched = [i for i in range(len(prompts)) if outputs[f"req-{i}"] != reference[i]]
        if mismatched:  # float ties across a different batch split may flip a token
            hf = load_hf(tiny_model_path)
            for i in mismatched:
                assert_greedy_close(hf, prompts[i], outputs[f"req-{i}"], reference[i])
        assert_no_kv_held(mesh)
        [token] = [s for s in mesh.stats() if s.service_id.startswith("token")]
        assert any(e.what == "swapped_in" for e in token.kv_events)
        assert len(token.step_times_s) == token.num_decode_steps > 0
        assert all(predicted > 0 and measured > 0 for predicted, measured, _ in token.step_times_s)
    finally:
        mesh.close()
