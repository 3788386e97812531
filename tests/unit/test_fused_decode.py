"""The fused decode layers (common/model/fused_decode.py, csrc/decoder_layer.cpp): a decode step
through them has the bits of the layers' stages called one by one (hidden states, logits and the
KV written), in every weight dtype and at every row count they take; they step aside where they
do not apply, follow a repack, and refuse bad inputs before writing anything."""

from __future__ import annotations

import pytest
import torch
from torch.utils.dlpack import to_dlpack

from common.attention.cpu_kernel import CpuKernelAttention
from common.attention.torch_ref import TorchPagedAttention
from common.engine.core import LLMEngine
from common.engine.runner import ModelRunner, StepInputs
from common.kv_cache import KVCache
from common.model import fused_decode
from common.model.fused_decode import FusedDecode
from common.model.linear import POST_ATTENTION_MAX_ROWS, pack_linears
from common.model.loader import load_model
from common.sampling_params import SamplingParams
from common.scheduling.batching import Phase
from tests.kernel_gate import kernel_gate

pytestmark = kernel_gate(
    "csrc extension without the fused decoder layer", built=fused_decode.available()
)

HEAD_BUILT = hasattr(fused_decode._EXT, "FusedLmHead")  # an older build: compute_logits after
BLOCK_SIZE = 16
MAX_CONTEXT = 70  # tokens per row, the new one included: a few blocks, a partial last one


def _cache(model, num_blocks: int, seed: int, dtype: torch.dtype = torch.float32) -> KVCache:  # type: ignore[no-untyped-def]
    """A cache of random contents (what earlier steps wrote)."""
    c = model.config
    kv = KVCache(
        c.num_hidden_layers, num_blocks, BLOCK_SIZE, c.num_key_value_heads, c.head_dim, dtype,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    kv.key.copy_(torch.randn(kv.key.shape, generator=gen))
    kv.value.copy_(torch.randn(kv.value.shape, generator=gen))
    return kv


def _decode_step(rows: int, vocab: int, seed: int) -> tuple[StepInputs, int]:
    """A decode step of `rows` sequences, each on its own blocks, and the blocks it needs."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, MAX_CONTEXT + 1, (rows,), generator=gen)
    width = -(-MAX_CONTEXT // BLOCK_SIZE)
    tables = torch.randperm(rows * width, generator=gen).view(rows, width).to(torch.int32)
    positions = lens - 1
    slots = tables[torch.arange(rows), positions // BLOCK_SIZE].long() * BLOCK_SIZE
    inputs = StepInputs(
        phase=Phase.DECODE,
        req_ids=[str(i) for i in range(rows)],
        input_ids=torch.randint(0, vocab, (rows,), generator=gen),
        positions=positions,
        slot_mapping=slots + positions % BLOCK_SIZE,
        seq_lens=[1] * rows,
        block_tables=tables,
        context_lens=lens.to(torch.int32),
        last_token_index=torch.arange(rows),
    )
    return inputs, rows * width


def _runner(
    model,
    num_blocks: int,
    seed: int,
    fuse: bool,
    threads: int | None = None,  # type: ignore[no-untyped-def]
    kv_dtype: torch.dtype = torch.float32,
):
    cache = _cache(model, num_blocks, seed, kv_dtype)
    runner = ModelRunner(model, cache, None, CpuKernelAttention(threads))  # type: ignore[arg-type]
    runner.fuse_decode = fuse
    return runner


@pytest.mark.parametrize(
    "weight_dtype, kv_dtype",
    [("float32", torch.float32), ("bfloat16", torch.float32), ("int8", torch.float32),
     ("float32", torch.bfloat16), ("int8", torch.bfloat16)],
)  # fmt: skip
def test_a_fused_step_has_the_stages_bits(tiny_model_path, weight_dtype, kv_dtype):
    """Rows 1, 2, 3 and the most the fused layers take: the hidden states, the logits and every
    layer's caches equal the stages' bit for bit (two threads: the GEMMs and attention split),
    on float32 caches and on bfloat16 ones (the new k/v rounded as `KVCache.write` rounds)."""
    model = load_model(tiny_model_path, weight_dtype=weight_dtype)
    with torch.inference_mode():
        for rows in (1, 2, 3, POST_ATTENTION_MAX_ROWS):
            inputs, num_blocks = _decode_step(rows, model.config.vocab_size, seed=rows)
            fused = _runner(model, num_blocks, seed=rows, fuse=True, threads=2, kv_dtype=kv_dtype)
            stages = _runner(model, num_blocks, seed=rows, fuse=False, threads=2,
                             kv_dtype=kv_dtype)  # fmt: skip
            got = fused.forward(inputs, keep_hidden=True)
            assert fused._fused is not None  # it did run fused
            want = stages.forward(inputs, keep_hidden=True)
            assert torch.equal(fused.hidden, stages.hidden), rows
            assert torch.equal(got, want), rows
            assert torch.equal(fused.kv_cache.key, stages.kv_cache.key), rows
            assert torch.equal(fused.kv_cache.value, stages.kv_cache.value), rows
            # Without the hidden states kept, the LM head runs in the same call (where this
            # build has it): same logits (the step again writes the same k/v at the same slots).
            assert (fused._fused.head is not None) == HEAD_BUILT
            assert torch.equal(fused.forward(inputs), want), rows
            assert fused.hidden is None


def test_the_engine_generates_the_stages_tokens(tiny_model_path):
    """Greedy generation through the fused layers (the engine's default) equals the stages'."""
    prompts = [list(range(5, 40)), list(range(7, 20)), list(range(3, 60))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)
    engines = [LLMEngine.from_path(tiny_model_path, num_blocks=64) for _ in range(2)]
    engines[1].runner.fuse_decode = False
    fused, stages = (engine.generate(prompts, params) for engine in engines)
    assert engines[0].runner._fused is not None
    assert fused == stages


def test_a_repack_rebuilds_the_fused_layers(tiny_model_path):
    """Weights packed in another dtype after the fused layers were built: the next step runs on
    the new panels (the stages' bits on them), never the stale ones."""
    model = load_model(tiny_model_path)
    inputs, num_blocks = _decode_step(2, model.config.vocab_size, seed=5)
    with torch.inference_mode():
        fused = _runner(model, num_blocks, seed=5, fuse=True)
        first = fused.forward(inputs)
        built = fused._fused
        pack_linears(model, weight_dtype="int8")
        fused.kv_cache = _cache(model, num_blocks, seed=5)
        assert built is not None and not built.current(built.kv_cache)
        got = fused.forward(inputs)
        want = _runner(model, num_blocks, seed=5, fuse=False).forward(inputs)
    assert fused._fused is not built
    assert torch.equal(got, want)
    assert not torch.equal(got, first)  # int8 panels' logits are not float32's


def test_steps_it_does_not_take_run_the_stages(tiny_model_path):
    """More rows than it takes, a prefill, the torch attention backend, float16 KV or weights
    off the kernel's panels: the stages run (and give their own results). bfloat16 KV it
    takes."""
    model = load_model(tiny_model_path)
    inputs, num_blocks = _decode_step(POST_ATTENTION_MAX_ROWS + 1, model.config.vocab_size, 0)
    runner = _runner(model, num_blocks, seed=0, fuse=True)
    x = model.embed(inputs.input_ids)
    assert runner.fused_decode(inputs, x) is None
    one, _ = _decode_step(1, model.config.vocab_size, 0)
    assert runner.fused_decode(one, x[:1]) is not None
    one.phase = Phase.PREFILL
    assert runner.fused_decode(one, x[:1]) is None
    assert FusedDecode.build(model, runner.kv_cache, TorchPagedAttention()) is None
    c = model.config
    caches = {
        dtype: KVCache(c.num_hidden_layers, 4, BLOCK_SIZE, c.num_key_value_heads, c.head_dim, dtype)
        for dtype in (torch.bfloat16, torch.float16)
    }
    assert FusedDecode.build(model, caches[torch.float16], runner.backend) is None
    assert FusedDecode.build(model, caches[torch.bfloat16], runner.backend) is not None
    pack_linears(model, backend="onednn")
    assert FusedDecode.build(model, runner.kv_cache, runner.backend) is None
    one.phase = Phase.DECODE
    for _ in range(2):  # refused on oneDNN's weights, and not built again for the same ones...
        assert runner.fused_decode(one, x[:1]) is None
    pack_linears(model)
    assert runner.fused_decode(one, x[:1]) is not None  # ...and built once they are panels again


def test_bad_slots_positions_and_block_ids_raise_before_any_write(tiny_model_path):
    """A slot outside the cache, a position outside the RoPE tables, a block id outside the
    cache: ValueError, as the separate calls raise; nothing is written for the first two (they
    are checked before the first layer runs)."""
    model = load_model(tiny_model_path)
    inputs, num_blocks = _decode_step(2, model.config.vocab_size, seed=3)
    runner = _runner(model, num_blocks, seed=3, fuse=True)
    fused = FusedDecode.build(model, runner.kv_cache, runner.backend)
    assert fused is not None
    key = runner.kv_cache.key.clone()
    x = model.embed(inputs.input_ids)
    bad_slot = inputs.slot_mapping.clone()
    bad_slot[1] = num_blocks * BLOCK_SIZE
    with pytest.raises(ValueError, match="slot"):
        fused.run(x.clone(), inputs.positions, bad_slot, inputs.block_tables, inputs.context_lens)
    bad_position = inputs.positions.clone()
    bad_position[0] = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="position"):
        fused.run(x.clone(), bad_position, inputs.slot_mapping, inputs.block_tables,
                  inputs.context_lens)  # fmt: skip
    assert torch.equal(runner.kv_cache.key, key)
    bad_table = inputs.block_tables.clone()
    bad_table[0, 0] = num_blocks
    with pytest.raises(ValueError, match="block id"):
        fused.run(x.clone(), inputs.positions, inputs.slot_mapping, bad_table,
                  inputs.context_lens)  # fmt: skip


def test_one_layer_call_refuses_mismatched_shapes(tiny_model_path):
    """The extension's own checks: x of another width, a step of other rows."""
    from common.attention.cpu_kernel import extension

    model = load_model(tiny_model_path)
    inputs, num_blocks = _decode_step(2, model.config.vocab_size, seed=4)
    runner = _runner(model, num_blocks, seed=4, fuse=True)
    fused = FusedDecode.build(model, runner.kv_cache, runner.backend)
    assert fused is not None
    rotary = model.model.rotary
    step = extension().DecodeStep(
        to_dlpack(inputs.positions), to_dlpack(rotary.cos), to_dlpack(rotary.sin),
        to_dlpack(inputs.slot_mapping), to_dlpack(inputs.block_tables),
        to_dlpack(inputs.context_lens), model.scale,
    )  # fmt: skip
    ws = runner.backend.workspace
    for x in (
        torch.zeros(2, model.config.hidden_size + 1),
        torch.zeros(3, model.config.hidden_size),
    ):
        with pytest.raises(ValueError, match="x has shape"):
            extension().decode_layers(
                ws, step, fused.layers[:1], to_dlpack(x), to_dlpack(x.clone()), 1, 1
            )


def test_a_layer_refuses_caches_of_two_dtypes_or_another(tiny_model_path):
    """K and V caches of different dtypes, or a dtype the kernel does not read: ValueError when
    the layer is built, not a misread cache later."""
    model = load_model(tiny_model_path)
    c = model.config
    caches = {dtype: KVCache(1, 4, BLOCK_SIZE, c.num_key_value_heads, c.head_dim, dtype)
              for dtype in (torch.float32, torch.bfloat16, torch.float16)}  # fmt: skip
    layer = model.layers[0]
    for key, value, match in (
        (torch.bfloat16, torch.float32, "differ in dtype"),
        (torch.float16, torch.float16, "float32 or bfloat16"),
    ):
        with pytest.raises(ValueError, match=match):
            fused_decode._fused_layer(layer, caches[key].key_layers[0],
                                      caches[value].value_layers[0], "auto")  # fmt: skip


@kernel_gate("csrc extension without the fused LM head", built=HEAD_BUILT)
def test_the_fused_lm_head_refuses_mismatched_shapes(tiny_model_path):
    """A head without logits (or logits without a head), logits of another width, a head built
    for another vocabulary: ValueError before anything runs."""
    from common.attention.cpu_kernel import extension

    ext = extension()
    model = load_model(tiny_model_path)
    inputs, num_blocks = _decode_step(2, model.config.vocab_size, seed=6)
    runner = _runner(model, num_blocks, seed=6, fuse=True)
    fused = FusedDecode.build(model, runner.kv_cache, runner.backend)
    assert fused is not None and fused.head is not None
    rotary, vocab = model.model.rotary, model.config.vocab_size
    step = ext.DecodeStep(
        to_dlpack(inputs.positions), to_dlpack(rotary.cos), to_dlpack(rotary.sin),
        to_dlpack(inputs.slot_mapping), to_dlpack(inputs.block_tables),
        to_dlpack(inputs.context_lens), model.scale,
    )  # fmt: skip
    x = model.embed(inputs.input_ids)
    key = runner.kv_cache.key.clone()
    ws, layers = runner.backend.workspace, fused.layers
    with pytest.raises(ValueError, match="head needs logits"):
        ext.decode_layers(ws, step, layers, to_dlpack(x), to_dlpack(x.clone()), 1, 1, fused.head)
    with pytest.raises(ValueError, match="head needs logits"):
        ext.decode_layers(ws, step, layers, to_dlpack(x), to_dlpack(x.clone()), 1, 1, None,
                          to_dlpack(torch.zeros(2, vocab)))  # fmt: skip
    with pytest.raises(ValueError, match="logits has shape"):
        ext.decode_layers(ws, step, layers, to_dlpack(x), to_dlpack(x.clone()), 1, 1, fused.head,
                          to_dlpack(torch.zeros(2, vocab + 1)))  # fmt: skip
    assert torch.equal(runner.kv_cache.key, key)
    head, norm = model.lm_head, model.model.norm
    with pytest.raises(ValueError, match="lm_head panels"):
        ext.FusedLmHead(to_dlpack(norm.weight.detach()), norm.eps, to_dlpack(head.panels), None,
                        vocab + 1000)  # fmt: skip
