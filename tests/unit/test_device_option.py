"""`device: auto | cpu | cuda[:N]`: its spelling checked at the YAML edge, resolved once per
engine, and the CPU engine's path unchanged by it (the device-only parts are the identity or
refuse to run there). The CUDA paths themselves run in tests/gpu/ on a machine with a GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from common.device import HostStaging, resolve_device
from common.engine.core import LLMEngine
from common.mesh_options import mesh_options
from common.sampling_params import SamplingParams
from services.app_args import AppArgs
from tests.conftest import random_prompts

NO_CUDA = not torch.cuda.is_available()


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cpu" if NO_CUDA else "cuda")
    for bad in ("gpu", "cuda:", "cuda:x", "CPU", ""):
        with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
            resolve_device(bad)
    if NO_CUDA:
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_mesh_option_and_app_args() -> None:
    """One field with its bound: a bad spelling is refused naming `device`; GPUs go to engine
    replicas only when a CUDA device is asked (with `auto` Ray would give them none)."""
    assert mesh_options({}).device == "auto"
    assert mesh_options({}).engine_gpus == 0.0
    opts = mesh_options({"device": "cuda:1", "engine_num_gpus": 0.25})
    assert opts.device == "cuda:1" and opts.engine_gpus == 0.25
    with pytest.raises(ValueError, match="device"):
        mesh_options({"device": "tpu"})
    with pytest.raises(ValueError, match="engine_num_gpus"):
        mesh_options({"device": "cuda", "engine_num_gpus": 0})
    with pytest.raises(ValueError, match="device"):
        AppArgs.model_validate({"topology": "mesh", "mesh": {"device": "cuda:a"}})
    assert AppArgs.model_validate({"engine": {"device": "cpu"}}).engine.device == "cpu"
    with pytest.raises(ValueError, match="device"):
        AppArgs.model_validate({"engine": {"device": "gpu"}})


def test_host_staging_is_the_identity_on_cpu() -> None:
    staging = HostStaging(torch.device("cpu"))
    q, k = torch.randn(3, 4), torch.randn(3, 2)
    staged = staging.to_host(q, k)
    assert staged[0] is q and staged[1] is k  # no copy
    assert staging.to_device(q) is q
    buffer = staging.host_buffer((2, 3), torch.float32)
    assert buffer.shape == (2, 3) and not buffer.is_pinned()


def test_device_backend_and_graph_padding_keep_tokens(tiny_model_path: Path) -> None:
    """The device engines' decode path on the CPU: their attention backend, and decode steps
    through the graph path's padded buffers (eager here: what a CUDA graph captures), give the
    plain CPU engine's greedy tokens: padding rows write only the scratch block, padded
    block-table columns are masked, each batch size lands in its bucket."""
    plain = LLMEngine.from_path(tiny_model_path, num_blocks=64, device="cpu")
    config = dataclasses.replace(plain.config, attention_backend="device_paged")
    padded = LLMEngine(config, decode_graphs=True)
    assert padded.runner.backend.name == "device_paged" and not padded.runner.on_device
    graphs = padded.runner.graphs
    assert graphs is not None and graphs.scratch_block == 64
    assert padded.runner.kv_cache.key.shape[1] == 65  # one block past the manager's
    prompts = random_prompts([3, 17, 30, 9, 50], 256, seed=11)  # 5 rows: a bucket of 8
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert padded.generate(prompts, params) == plain.generate(prompts, params)
    assert graphs.num_replays >= 5 and (8, 4) in graphs.captured  # 5 rows, 4 blocks wide
    scratch = padded.runner.kv_cache.key[:, 64]
    assert scratch.abs().sum() > 0  # the padding rows wrote their k/v there


def test_the_gpu_numerics_on_cpu(tiny_model_path: Path) -> None:
    """A GPU engine's code path, run on the CPU: bfloat16 weights unpacked (`F.linear`), the torch
    layer ops, the indexed KV write and the device attention backend. Its prefill logits stay
    within transformers' own bfloat16 error, and an engine decoding through it gives
    transformers' float32 greedy tokens up to a bfloat16 tie (tests/gpu's checks, here)."""
    from common.attention import DevicePagedAttention
    from common.engine.runner import ModelRunner
    from common.kv_cache import KVCache
    from common.model.loader import load_for_device
    from tests.gpu.test_cuda_engine import assert_greedy_close, assert_prefill_within_bf16_error
    from tests.parity import hf_greedy, load_hf

    model = load_for_device(tiny_model_path, None, torch.device("cpu"))
    assert model.lm_head.dense is not None and model.lm_head.panels is None  # unpacked
    hf32, hf16 = load_hf(tiny_model_path), load_hf(tiny_model_path, torch.bfloat16)
    assert_prefill_within_bf16_error(model, hf32, hf16, lengths=(1, 40))
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=64, device="cpu")
    mc = model.config
    kv = KVCache(mc.num_hidden_layers, 64, 16, mc.num_key_value_heads, mc.head_dim, torch.bfloat16)
    engine.runner = ModelRunner(model, kv, engine.blocks, DevicePagedAttention())
    prompts = random_prompts([7, 33], mc.vocab_size, seed=9)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for prompt, ours in zip(prompts, engine.generate(prompts, params), strict=True):
        assert_greedy_close(hf32, hf16, prompt, ours, hf_greedy(hf32, prompt, 8))
