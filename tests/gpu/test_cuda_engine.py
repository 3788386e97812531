"""Engines on a CUDA device against `transformers` on the same GPU, and a mesh whose prompt and
token engines run on the GPU beside 2 attention shards in host memory.

Collected everywhere, run where `torch.cuda.is_available()` (bench/device_check.sh runs them on
a GPU machine); skipped with that reason on CPU CI. bfloat16 runs round differently from any
other implementation, so logits are held to transformers' own bfloat16 error (both against its
float32 logits), and greedy tokens must equal its float32 ones up to a first difference where
our token is within bfloat16's error of the float32 top (`assert_greedy_close`): from there the
contexts differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.model.loader import load_model
from common.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.parity import load_hf

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/device_check.sh runs these)"
)

# The least float32 margin a bfloat16 run may miss (8 bits of mantissa: ~0.4% of a logit of a
# few units); where transformers' own bfloat16 errs more at that position, twice its error.
BF16_GAP = 0.125
NUM_TOKENS = 32
LENGTHS = [3, 17, 40, 96, 150, 7, 64, 33]


@pytest.fixture(scope="module", params=["tiny", "small"])
def model_path(request: pytest.FixtureRequest) -> Path:
    return default_model_path(request.param)


def hf_on_cuda(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    return load_hf(path, dtype).to("cuda")


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len(tokens), vocab] (wherever `hf` is)."""
    with torch.inference_mode():
        return hf(torch.tensor([tokens], device=hf.device)).logits[0].float()


def assert_prefill_within_bf16_error(
    ours: torch.nn.Module,
    hf32: torch.nn.Module,
    hf16: torch.nn.Module,
    lengths: tuple[int, ...] = (1, 9, 33, 120),
) -> None:
    """Our bfloat16 prefill logits (prompts of `lengths`, packed) err from transformers' float32
    ones at most twice as much as transformers' own bfloat16 logits do."""
    lengths = list(lengths)
    prompts = random_prompts(lengths, ours.config.vocab_size, seed=1)
    with torch.inference_mode():
        packed = ours.forward_prefill(torch.tensor(sum(prompts, []), device=hf32.device), lengths)
    exact = torch.cat([hf_logits(hf32, p) for p in prompts])
    theirs = torch.cat([hf_logits(hf16, p) for p in prompts])
    our_err = float((packed - exact).abs().max())
    their_err = float((theirs - exact).abs().max())
    assert our_err <= 2 * their_err + 1e-3, (our_err, their_err)


def assert_greedy_close(
    hf32: torch.nn.Module, hf16: torch.nn.Module, prompt: list[int], ours: list[int],
    ref: list[int],
) -> None:  # fmt: skip
    """`ours` equals `ref` (transformers' float32 greedy tokens) up to its first difference,
    where our token must be within bfloat16's error of the float32 top: its float32 logit below
    the top's by less than twice transformers' own bfloat16 error there (at least `BF16_GAP`).
    The rest is not compared: the contexts differ from there."""
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            exact = hf_logits(hf32, prompt + ref[:i])[-1]
            bf16_err = float((hf_logits(hf16, prompt + ref[:i])[-1] - exact).abs().max())
            margin = float(exact[b] - exact[a])
            tol = max(BF16_GAP, 2 * bf16_err)
            assert margin < tol, f"token {i}: ours {a}, float32's {b}, margin {margin:.3g}"
            return


def test_prefill_logits_within_transformers_bf16_error(model_path: Path) -> None:
    ours = load_model(model_path, device=torch.device("cuda"))
    assert next(ours.parameters()).dtype == torch.bfloat16
    hf32, hf16 = hf_on_cuda(model_path, torch.float32), hf_on_cuda(model_path, torch.bfloat16)
    assert_prefill_within_bf16_error(ours, hf32, hf16)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_greedy_matches_transformers(model_path: Path, graphs: bool) -> None:
    """Continuous batching on the GPU (CUDA graphs for decode, or eager) against transformers'
    float32 greedy tokens on the same GPU."""
    engine = LLMEngine(
        LLMEngine.from_path(model_path, num_blocks=512, device="cuda", max_num_seqs=8).config,
        decode_graphs=graphs,
    )
    assert engine.runner.on_device and (engine.runner.graphs is not None) == graphs
    hf32, hf16 = hf_on_cuda(model_path, torch.float32), hf_on_cuda(model_path, torch.bfloat16)
    prompts = random_prompts(LENGTHS, engine.model_config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    for prompt, ours in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            ref = hf32.generate(torch.tensor([prompt], device="cuda"),
                                max_new_tokens=NUM_TOKENS, do_sample=False)  # fmt: skip
        assert_greedy_close(hf32, hf16, prompt, ours, ref[0, len(prompt) :].tolist())
    if graphs:
        assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0


def test_sampling_runs_on_the_device(model_path: Path) -> None:
    """Penalties, logit bias, min_p, logprobs and seeded draws on GPU logits: a seeded batch
    draws the same tokens when run again, and each token comes with its logprobs."""
    engine = LLMEngine.from_path(model_path, num_blocks=256, device="cuda")
    prompts = random_prompts([5, 20], engine.model_config.vocab_size, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=7, repetition_penalty=1.2,
                            frequency_penalty=0.5, logit_bias=((5, 3.0),), min_p=0.05,
                            logprobs=2)  # fmt: skip
    first = engine.generate(prompts, params)
    assert first == engine.generate(prompts, params) and all(len(t) == 8 for t in first)
    engine.add_request("lp", prompts[0], params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert len(outputs) == 8 and not any(o.error for o in outputs)
    assert all(len(o.logprobs) == 1 and len(o.logprobs[0].top_ids) == 2 for o in outputs)


@pytest.mark.parametrize("local_tier", [False, True], ids=["shards", "neo_local_tier"])
def test_mesh_with_gpu_engines_and_host_shards(local_tier: bool) -> None:
    """A LocalMesh: GPU prompt and token engines, 2 attention shards in host memory (q/k/v and
    shipped KV through pinned buffers), against the single-process engine on the same GPU. With
    `local_tier`, Neo as written: the token engine's local KV tier is GPU memory and requests
    swap between it and the shards every few tokens (`alternate:4`), both ways."""
    try:
        import common.transport.ucx_channel  # noqa: F401 - the shards' links
    except Exception as exc:  # noqa: BLE001 - ImportError, or a UCX library that fails to load
        pytest.skip(f"the shards' links need UCX (make device-wheels DEVICE_UCX=1): {exc!r}")
    from common.mesh_options import MeshOptions
    from services.launch.local_mesh import LocalMesh, Topology
    from tests.integration.mesh_helpers import run_staggered
    from tests.integration.mesh_test_client import MeshTestClient

    path = default_model_path("tiny")
    prompts = random_prompts(LENGTHS, 256, seed=21)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    reference = LLMEngine.from_path(path, num_blocks=512, device="cuda").generate(prompts, params)
    hf32, hf16 = hf_on_cuda(path, torch.float32), hf_on_cuda(path, torch.bfloat16)
    options = MeshOptions(device="cuda", layer_wise_min_tokens=64)
    if local_tier:
        options = MeshOptions(device="cuda", layer_wise_min_tokens=64, local_kv_blocks=64,
                              tier_policy="alternate:4")  # fmt: skip
    topology = Topology(str(path), num_prompt=1, num_token=1, num_shards=2, options=options)
    mesh = LocalMesh.start(topology)
    try:
        from common.protocol import SamplingSpec

        spec = SamplingSpec(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = run_staggered(MeshTestClient(mesh), prompts, spec)
        for i, prompt in enumerate(prompts):
            ours = outputs[f"req-{i}"]
            assert len(ours) == NUM_TOKENS
            if ours != reference[i]:
                assert_greedy_close(hf32, hf16, prompt, ours, reference[i])
        if local_tier:
            [token] = [s for s in mesh.stats() if s.role == "token"]
            moves = {e.what for e in token.kv_events}
            assert {"swapped_in", "swapped_out"} <= moves, moves
    finally:
        mesh.close()
