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

from pathlib import Path

from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.protocol import EngineStats, SamplingSpec
from common.sampling_params import SamplingParams
from services.launch.local_mesh import LocalMesh, Topology
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held, run_staggered
from tests.integration.mesh_test_client import MeshTestClient
from tests.parity import assert_outputs_greedy_close

NUM_TOKENS = 16
LENGTHS = [5, 90, 140, 33]


def run_tiered(
    model_path: Path, prompts: list[list[int]], max_tokens: int, local_kv_blocks: int,
    tier_policy: str,
) -> list[EngineStats]:  # fmt: skip
    """Decode `prompts` on one token engine with two shards and a local tier of
    `local_kv_blocks`; assert greedy parity with the single-process engine and that no KV is
    left anywhere; return every service's stats."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reference = LLMEngine.from_path(model_path, num_blocks=512).generate(prompts, params)
    topology = Topology(
        str(model_path), num_prompt=1, num_token=1, num_shards=2,
        options=MeshOptions(
            layer_wise_min_tokens=128, local_kv_blocks=local_kv_blocks, tier_policy=tier_policy
        ),
    )  # fmt: skip
    mesh = LocalMesh.start(topology)
    try:
        greedy = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = run_staggered(MeshTestClient(mesh), prompts, greedy)
        ours = [outputs[f"req-{i}"] for i in range(len(prompts))]
        assert_outputs_greedy_close(model_path, prompts, ours, reference)
        assert_no_kv_held(mesh)
        return mesh.stats()
    finally:
        mesh.close()


def test_two_tiers_and_swaps_mid_generation_match_single_process_engine(tiny_model_path):
    # Every request changes tier every 3 of its tokens (it arrives offloaded), as far as a local
    # tier of 20 blocks (~2 requests' whole length) allows: local, offloaded, both at once.
    prompts = random_prompts(LENGTHS, 2048, seed=22)
    stats = run_tiered(tiny_model_path, prompts, NUM_TOKENS, 20, "alternate:3")
    events = [e for s in stats for e in s.kv_events]
    swapped_in = [e.req_id for e in events if e.what == "swapped_in"]
    swapped_out = [e.req_id for e in events if e.what == "swapped_out"]
    assert swapped_out and swapped_in, "no request moved between the tiers"
    # Out and back in again: a request swapped in after its own swap-out, mid-generation.
    assert set(swapped_in) & set(swapped_out)
    [token] = [s for s in stats if s.service_id.startswith("token")]
    assert 0 < token.num_two_batch_steps < token.num_decode_steps


def test_neo_policy_matches_single_process_engine(tiny_model_path):
    # A local tier of ~1 request's whole length: the rest decode on the shards until it frees.
    prompts = random_prompts(LENGTHS[:3], 2048, seed=23)
    stats = run_tiered(tiny_model_path, prompts, 8, 10, "neo")
    [token] = [s for s in stats if s.service_id.startswith("token")]
    assert any(e.what == "swapped_in" for e in token.kv_events)
    assert len(token.step_times_s) == token.num_decode_steps > 0
    assert all(predicted > 0 and measured > 0 for predicted, measured, _ in token.step_times_s)
